"""What a batcher reports about the sequences it runs, for the server's metrics and request log.

Both batchers (the static `Batcher`, megajax/inference/batcher.py, and the continuous engine)
take an `observer` and call it from their thread as a sequence (a `Job`) moves along:

    admitted(job)                    the job left the queue: its prefill starts
    first_token(job, seconds)        its first new token exists; `seconds` since it was submitted (TTFT)
    tokens(job, count, seconds)      `count` more new tokens, `seconds` after the previous ones
                                     (inter-token latency: seconds / count)
    finished(job, reason, tokens)    it ended: reason "stop", "length", "cancelled" or "error";
                                     `tokens` new tokens in all

and answer `stats()` with the numbers a scrape reads at any moment: {"running", "waiting",
"kv_blocks_used", "kv_blocks_total"} (the static batcher holds no block pool: 0 and 0).
Observers must be quick and must not raise: they run inside the decode loop.
"""

from __future__ import annotations


class Observer:
    """Reports nothing (the default); subclasses override what they record."""

    def admitted(self, job) -> None:
        pass

    def first_token(self, job, seconds: float) -> None:
        pass

    def tokens(self, job, count: int, seconds: float) -> None:
        pass

    def finished(self, job, reason: str, tokens: int) -> None:
        pass
