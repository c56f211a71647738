"""Concurrent requests decoded together: a queue of sequences and one thread that runs batches.

Each sequence (one prompt of one request) is a `Job`. The batcher thread takes the waiting
jobs, up to `max_batch` (after a short gathering window, so requests that arrive together run
together), prefills them in one pass and decodes them in one loop, in chunks of `chunk` tokens
when some job streams (tokens are handed out after each chunk) or has stop sequences (checked
after each chunk: the batch ends once every sequence has ended or stopped), to the end otherwise.
Jobs that arrive meanwhile wait for the next batch. Every job reports through its request's event
queue: while streaming ("prompt", index, TokenScores) when it scores its prompt, then ("tokens",
index, Piece) per chunk; finally ("done", index, Completion) or ("error", index, text).
The batcher reports each job's admission, tokens and end to its `Observer` (the server's metrics
and request log) as soon as it reads them; a job marked `cancelled` counts as ended.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from megajax.inference.generate import MAX_TOP_LOGPROBS, Generator, TokenScores
from megajax.inference.observer import Observer
from megajax.inference.sampling import Sampling


@dataclass
class Job:
    prompt_ids: list[int]
    sampling: Sampling
    max_new_tokens: int
    index: int  # the choice index within its request
    events: queue.Queue  # shared by the jobs of one request
    stream: bool = False
    top_logprobs: int = 0  # the most likely tokens each step reports (> 0: the batch computes MAX_TOP_LOGPROBS)
    score_prompt: bool = False  # the prompt's log-probabilities too (echo)
    stopped: Callable[[list[int]], bool] | None = None  # the new tokens so far hold a stop sequence
    request_id: str = ""  # the request's id (request logs), shared by its jobs
    images: Any = None  # a vision-language model's images [N, H, W, 3] for the prompt's placeholders, or None
    submitted: float = field(default_factory=time.monotonic)  # when it was made (time to first token)
    cancelled: bool = field(default=False, init=False)  # its client is gone: drop it at the next step
    sent: int = field(default=0, init=False)  # tokens already handed out
    ended: bool = field(default=False, init=False)  # the end-of-document token was handed out
    halted: bool = field(default=False, init=False)  # `stopped` said so


@dataclass
class Piece:
    """A streamed chunk of one sequence: its new token ids and their scores."""
    ids: list[int]
    scores: TokenScores | None


class _Progress:
    """What the observer has been told of one batch's jobs: new tokens so far, when, and which ended."""

    def __init__(self, jobs: list[Job]):
        self.seen = [0] * len(jobs)
        self.last = [job.submitted for job in jobs]
        self.ended = [False] * len(jobs)


class Batcher:
    """Runs the jobs of every request on one Generator, up to `max_batch` sequences at a time."""

    ready = True  # nothing to compile before serving: a new shape compiles when it first comes

    def __init__(self, generator: Generator, max_batch: int = 8, chunk: int = 16, gather_s: float = 0.01,
                 observer: Observer | None = None):
        self.generator, self.max_batch, self.chunk, self.gather_s = generator, max_batch, chunk, gather_s
        self.observer = observer if observer is not None else Observer()
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self.batches = 0  # batches run so far
        self.sequences = 0  # sequences completed so far
        self._progress: tuple[list[Job], _Progress] | None = None  # the batch running now
        self._thread = threading.Thread(target=self._run, name="megajax-batcher", daemon=True)
        self._thread.start()

    def submit(self, jobs: list[Job]) -> None:
        for job in jobs:
            self._queue.put(job)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)

    def stats(self) -> dict:
        """Sequences running (in the batch, not ended) and waiting; no block pool (observer.py's contract)."""
        current = self._progress
        running = 0 if current is None else current[1].ended.count(False)
        return {"running": running, "waiting": self._queue.qsize(), "kv_blocks_used": 0, "kv_blocks_total": 0}

    def _take(self) -> list[Job] | None:
        first = self._queue.get()
        if first is None:
            return None
        jobs = [first]
        deadline = time.monotonic() + self.gather_s
        while len(jobs) < self.max_batch:
            try:
                job = self._queue.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                break
            if job is None:
                self._queue.put(None)  # stop after this batch
                break
            jobs.append(job)
        return jobs

    def _run(self) -> None:
        while (jobs := self._take()) is not None:
            progress = _Progress(jobs)
            self._progress = jobs, progress
            try:
                self._run_batch(jobs, progress)
            except Exception as e:  # the server keeps serving; the requests of this batch fail
                traceback.print_exc()
                for i, job in enumerate(jobs):
                    self._end(job, i, progress, "error")
                    job.events.put(("error", job.index, f"{type(e).__name__}: {e}"))
            self._progress = None
            self.batches += 1

    def _end(self, job: Job, i: int, progress: _Progress, reason: str) -> None:
        if not progress.ended[i]:
            progress.ended[i] = True
            self.observer.finished(job, "cancelled" if job.cancelled else reason, progress.seen[i])

    def _observe(self, jobs: list[Job], tokens, done, count: int, progress: _Progress) -> None:
        """Reports each job's new tokens since the last read (through its end-of-document token, up to its
        budget), and its end: at end-of-document or a stop sequence ("stop"), its budget ("length"), or
        its client gone ("cancelled")."""
        now, eod = time.monotonic(), self.generator.eod_id
        for i, job in enumerate(jobs):
            if progress.ended[i]:
                continue
            n = min(count, job.max_new_tokens)
            hits = np.flatnonzero(np.asarray(tokens[i, :n]) == eod) if eod is not None else ()
            n = int(hits[0]) + 1 if len(hits) else n
            new = n - progress.seen[i]
            if new > 0:
                if progress.seen[i] == 0:
                    self.observer.first_token(job, now - job.submitted)
                    new -= 1
                if new:
                    self.observer.tokens(job, new, now - progress.last[i])
                progress.seen[i], progress.last[i] = n, now
            if len(hits) or job.halted:
                self._end(job, i, progress, "stop")
            elif job.cancelled:
                self._end(job, i, progress, "cancelled")
            elif done[i] or n >= job.max_new_tokens:
                self._end(job, i, progress, "length")

    def _emit(self, jobs: list[Job], tokens, count: int, scores: dict | None) -> None:
        """Hands each streaming job its tokens from `sent` to `count` (up to its end-of-document)."""
        eod = self.generator.eod_id
        for i, job in enumerate(jobs):
            if not job.stream or job.ended or job.cancelled:
                continue
            end = min(count, job.max_new_tokens)
            new = [int(t) for t in tokens[i, job.sent:end]]
            if eod is not None and eod in new:
                new, job.ended = new[:new.index(eod) + 1], True
            if new:
                part = slice(job.sent, job.sent + len(new))
                piece = Piece(new, None if scores is None else TokenScores.of(scores, i, part))
                job.events.put(("tokens", job.index, piece))
                job.sent += len(new)

    def _emit_prompt_scores(self, jobs: list[Job], tokens, scores: dict | None) -> None:
        """Streaming jobs that score their prompt get its scores before their first tokens."""
        wanted = [j.stream and j.score_prompt for j in jobs]
        if scores is None or not any(wanted):
            return
        prompts = [j.prompt_ids for j in jobs]
        for job, c, want in zip(jobs, self.generator.completions(prompts, [0] * len(jobs), tokens, 0, scores), wanted):
            if want:
                job.events.put(("prompt", job.index, c.prompt_scores))

    def _check_stops(self, jobs: list[Job], tokens, done, count: int) -> None:
        eod = self.generator.eod_id
        for i, job in enumerate(jobs):
            if job.stopped is not None and not job.halted and not done[i]:
                new = [int(t) for t in tokens[i, :min(count, job.max_new_tokens)] if t != eod]
                job.halted = job.stopped(new)

    def _run_batch(self, jobs: list[Job], progress: _Progress) -> None:
        g = self.generator
        for job in jobs:
            self.observer.admitted(job)
        prompts = [j.prompt_ids for j in jobs]
        budgets = [j.max_new_tokens for j in jobs]
        images = {"images": [j.images for j in jobs]} if any(j.images is not None for j in jobs) else {}
        state = g.start(prompts, [j.sampling for j in jobs], budgets,
                        top_n=MAX_TOP_LOGPROBS if any(j.top_logprobs for j in jobs) else 0,
                        score_prompt=any(j.score_prompt for j in jobs), **images)
        chunked = any(j.stream or j.stopped is not None for j in jobs)
        streamed_scores = any(j.stream for j in jobs)
        first = True
        while True:
            tokens, done, count = g.read(state)
            scores = g.read_scores(state) if streamed_scores else None
            if first:
                self._emit_prompt_scores(jobs, tokens, scores)
                first = False
            self._emit(jobs, tokens, count, scores)
            self._check_stops(jobs, tokens, done, count)
            self._observe(jobs, tokens, done, count, progress)
            finished = [bool(d) or j.halted or j.cancelled for d, j in zip(done, jobs)]
            if all(finished) or count >= max(budgets):
                break
            state = g.advance(state, count + self.chunk if chunked else None)
        for i, job in enumerate(jobs):  # every job has ended by now; those not reported ran to their budget
            self._end(job, i, progress, "length")
        scores = g.read_scores(state)
        for job, c in zip(jobs, g.completions(prompts, budgets, tokens, count, scores)):
            job.events.put(("done", job.index, c))
        self.sequences += len(jobs)
