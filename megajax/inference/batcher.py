"""Concurrent requests decoded together: a queue of sequences and one thread that runs batches.

Each sequence (one prompt of one request) is a `Job`. The batcher thread takes the waiting
jobs, up to `max_batch` (after a short gathering window, so requests that arrive together run
together), prefills them in one pass and decodes them in one loop, in chunks of `chunk` tokens
when some job streams (tokens are handed out after each chunk) or to the end otherwise. Jobs that
arrive meanwhile wait for the next batch. Every job reports through its request's event queue:
("tokens", index, ids) while streaming, then ("done", index, Completion) or ("error", index, text).
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from dataclasses import dataclass, field

from megajax.inference.generate import Generator
from megajax.inference.sampling import Sampling


@dataclass
class Job:
    prompt_ids: list[int]
    sampling: Sampling
    max_new_tokens: int
    index: int  # the choice index within its request
    events: queue.Queue  # shared by the jobs of one request
    stream: bool = False
    sent: int = field(default=0, init=False)  # tokens already handed out
    ended: bool = field(default=False, init=False)  # the end-of-document token was handed out


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

    def _emit(self, jobs: list[Job], tokens, count: int) -> None:
        """Hands each streaming job its tokens from `sent` to `count` (up to its end-of-document)."""
        eod = self.generator.eod_id
        for i, job in enumerate(jobs):
            if not job.stream or job.ended:
                continue
            new = [int(t) for t in tokens[i, job.sent:min(count, job.max_new_tokens)]]
            if eod is not None and eod in new:
                new, job.ended = new[:new.index(eod) + 1], True
            if new:
                job.events.put(("tokens", job.index, new))
                job.sent += len(new)

    def _run_batch(self, jobs: list[Job]) -> None:
        g = self.generator
        prompts = [j.prompt_ids for j in jobs]
        budgets = [j.max_new_tokens for j in jobs]
        state = g.start(prompts, [j.sampling for j in jobs], budgets)
        streaming = any(j.stream for j in jobs)
        while True:
            tokens, done, count = g.read(state)
            self._emit(jobs, tokens, count)
            if done[:len(jobs)].all() or count >= max(budgets):
                break
            state = g.advance(state, count + self.chunk if streaming else None)
        for job, c in zip(jobs, g.completions(prompts, budgets, tokens, count)):
            job.events.put(("done", job.index, c))
        self.sequences += len(jobs)
