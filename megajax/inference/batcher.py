"""Concurrent requests decoded together: a queue of sequences and one thread that runs batches.

Each sequence (one prompt of one request) is a `Job`. The batcher thread takes the waiting
jobs, up to `max_batch` (after a short gathering window, so requests that arrive together run
together), prefills them in one pass and decodes them in one loop, in chunks of `chunk` tokens
when some job streams (tokens are handed out after each chunk) or has stop sequences (checked
after each chunk: the batch ends once every sequence has ended or stopped), to the end otherwise.
Jobs that arrive meanwhile wait for the next batch. Every job reports through its request's event
queue: while streaming ("prompt", index, TokenScores) when it scores its prompt, then ("tokens",
index, Piece) per chunk; finally ("done", index, Completion) or ("error", index, text).
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

from megajax.inference.generate import MAX_TOP_LOGPROBS, Generator, TokenScores
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


class Batcher:
    """Runs the jobs of every request on one Generator, up to `max_batch` sequences at a time."""

    def __init__(self, generator: Generator, max_batch: int = 8, chunk: int = 16, gather_s: float = 0.01):
        self.generator, self.max_batch, self.chunk, self.gather_s = generator, max_batch, chunk, gather_s
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self.batches = 0  # batches run so far
        self.sequences = 0  # sequences completed so far
        self._thread = threading.Thread(target=self._run, name="megajax-batcher", daemon=True)
        self._thread.start()

    def submit(self, jobs: list[Job]) -> None:
        for job in jobs:
            self._queue.put(job)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)

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
            try:
                self._run_batch(jobs)
            except Exception as e:  # the server keeps serving; the requests of this batch fail
                traceback.print_exc()
                for job in jobs:
                    job.events.put(("error", job.index, f"{type(e).__name__}: {e}"))
            self.batches += 1

    def _emit(self, jobs: list[Job], tokens, count: int, scores: dict | None) -> None:
        """Hands each streaming job its tokens from `sent` to `count` (up to its end-of-document)."""
        eod = self.generator.eod_id
        for i, job in enumerate(jobs):
            if not job.stream or job.ended:
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

    def _run_batch(self, jobs: list[Job]) -> None:
        g = self.generator
        prompts = [j.prompt_ids for j in jobs]
        budgets = [j.max_new_tokens for j in jobs]
        state = g.start(prompts, [j.sampling for j in jobs], budgets,
                        top_n=MAX_TOP_LOGPROBS if any(j.top_logprobs for j in jobs) else 0,
                        score_prompt=any(j.score_prompt for j in jobs))
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
            finished = [bool(d) or j.halted for d, j in zip(done, jobs)]
            if all(finished) or count >= max(budgets):
                break
            state = g.advance(state, count + self.chunk if chunked else None)
        scores = g.read_scores(state)
        for job, c in zip(jobs, g.completions(prompts, budgets, tokens, count, scores)):
            job.events.put(("done", job.index, c))
        self.sequences += len(jobs)
