"""What `megajax serve` measures: the Prometheus metrics of GET /metrics and each request's log line.

`ServeMetrics` is the batcher's `Observer` (megajax/inference/observer.py): the batcher thread
reports each sequence's admission, first token, later tokens and end; the HTTP handler reports
each response's status and each generation request's duration. The gauges are read from the
batcher's `stats()` when a scrape asks. A request's jobs are `watch`ed when submitted and
`release`d when its answer is complete, giving the numbers of its log line (`Tally`).

The metrics (Prometheus conventions: base units in the names, counters end in `_total`):

    megajax_serve_requests_running            gauge      sequences being decoded now
    megajax_serve_requests_waiting            gauge      sequences queued, not admitted yet
    megajax_serve_kv_blocks_used              gauge      KV cache blocks in use (paged cache; 0 without one)
    megajax_serve_kv_blocks_capacity          gauge      KV cache blocks in the pool (0 without one)
    megajax_serve_time_to_first_token_seconds histogram  submission to first new token, per sequence
    megajax_serve_inter_token_latency_seconds histogram  between consecutive new tokens, per token
    megajax_serve_request_duration_seconds    histogram  arrival to last byte, per generation request
    megajax_serve_prompt_tokens_total         counter    prompt tokens of the sequences admitted
    megajax_serve_generation_tokens_total     counter    new tokens generated
    megajax_serve_requests_finished_total     counter    sequences ended, by reason (stop, length,
                                                         cancelled, error)
    megajax_serve_http_errors_total           counter    HTTP answers with status >= 400, by status
    megajax_serve_prefix_cache_queries_total  counter    prompt tokens looked up in the prefix cache
    megajax_serve_prefix_cache_hits_total     counter    prompt tokens found there (their KV not computed)

A request asking for several prompts or n > 1 choices is several sequences (jobs); a prompt asked
for n times counts n times in the prompt tokens. The metrics need the prometheus-client package
(`pip install 'megajax[ops]'`); without it the request log still works and GET /metrics says
what to install.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from megajax.inference.observer import Observer

PREFIX = "megajax_serve_"
REQUESTS_RUNNING = PREFIX + "requests_running"
REQUESTS_WAITING = PREFIX + "requests_waiting"
KV_BLOCKS_USED = PREFIX + "kv_blocks_used"
KV_BLOCKS_CAPACITY = PREFIX + "kv_blocks_capacity"
TIME_TO_FIRST_TOKEN = PREFIX + "time_to_first_token_seconds"
INTER_TOKEN_LATENCY = PREFIX + "inter_token_latency_seconds"
REQUEST_DURATION = PREFIX + "request_duration_seconds"
PROMPT_TOKENS = PREFIX + "prompt_tokens_total"
GENERATION_TOKENS = PREFIX + "generation_tokens_total"
REQUESTS_FINISHED = PREFIX + "requests_finished_total"
HTTP_ERRORS = PREFIX + "http_errors_total"
PREFIX_CACHE_QUERIES = PREFIX + "prefix_cache_queries_total"
PREFIX_CACHE_HITS = PREFIX + "prefix_cache_hits_total"

FINISH_REASONS = ("stop", "length", "cancelled", "error")

# gauge name -> (the batcher's stats() key, help)
GAUGES = {
    REQUESTS_RUNNING: ("running", "sequences being decoded now (a request of n choices counts n)"),
    REQUESTS_WAITING: ("waiting", "sequences queued, not admitted yet (queue depth)"),
    KV_BLOCKS_USED: ("kv_blocks_used", "KV cache blocks in use (0 without a paged cache)"),
    KV_BLOCKS_CAPACITY: ("kv_blocks_total", "KV cache blocks in the pool (0 without a paged cache)"),
}

# counter name -> (the batcher's stats() key, help): counted by the engine, read at scrape time
STATS_COUNTERS = {
    PREFIX_CACHE_QUERIES: ("prefix_cache_queries", "prompt tokens looked up in the prefix cache (0 without one)"),
    PREFIX_CACHE_HITS: ("prefix_cache_hits", "prompt tokens found in the prefix cache: their KV not computed"),
}

# Seconds, from a GPU's milliseconds to a CPU's (or a first request's compile) tens of seconds.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)

MISSING_CLIENT = ("GET /metrics needs the prometheus-client package, which is not installed here: "
                  "pip install 'megajax[ops]' (or prometheus-client) and restart the server.")


def metric_names() -> set[str]:
    """Every metric name GET /metrics exports, as a scrape spells its samples' family (counters with _total)."""
    return {REQUESTS_RUNNING, REQUESTS_WAITING, KV_BLOCKS_USED, KV_BLOCKS_CAPACITY, TIME_TO_FIRST_TOKEN,
            INTER_TOKEN_LATENCY, REQUEST_DURATION, PROMPT_TOKENS, GENERATION_TOKENS, REQUESTS_FINISHED, HTTP_ERRORS,
            PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS}


@dataclass
class Tally:
    """One request's sequences, for its log line."""
    prompt_tokens: int = 0
    new_tokens: int = 0
    first_token_s: float | None = None  # the earliest of its sequences' times to first token
    reasons: list[str] = field(default_factory=list)

    def finish_text(self) -> str:
        counts = Counter(self.reasons)
        if len(counts) <= 1:
            return next(iter(counts), "-")
        return ",".join(f"{r}:{c}" for r, c in counts.items())


class ServeMetrics(Observer):
    """The Prometheus metrics of one server (its own registry) and the tallies of its open requests."""

    def __init__(self):
        self._lock = threading.Lock()
        self._tallies: dict[int, Tally] = {}  # id(job) -> its request's tally, while the request is open
        self._stats: Callable[[], dict] | None = None
        try:
            import prometheus_client as prom
        except ImportError:
            self.registry = None
            return
        self._prom = prom
        self.registry = prom.CollectorRegistry()
        r = self.registry
        # prometheus_client adds _total to a counter's name itself.
        self.ttft = prom.Histogram(TIME_TO_FIRST_TOKEN, "seconds from a sequence's submission to its first new "
                                   "token", buckets=TTFT_BUCKETS, registry=r)
        self.itl = _RepeatHistogram(INTER_TOKEN_LATENCY, "seconds between consecutive new tokens of a sequence",
                                    ITL_BUCKETS)
        self.duration = prom.Histogram(REQUEST_DURATION, "seconds from a generation request's arrival to the end "
                                       "of its answer (streams included)", buckets=DURATION_BUCKETS, registry=r)
        self.prompt_tokens = prom.Counter(PROMPT_TOKENS.removesuffix("_total"), "prompt tokens of the sequences "
                                          "admitted (a prompt asked for n choices counts n times)", registry=r)
        self.generation_tokens = prom.Counter(GENERATION_TOKENS.removesuffix("_total"), "new tokens generated",
                                              registry=r)
        self.finished_by = prom.Counter(REQUESTS_FINISHED.removesuffix("_total"), "sequences ended, by reason",
                                        ["reason"], registry=r)
        for reason in FINISH_REASONS:  # every reason present from the start (rates need the zero)
            self.finished_by.labels(reason=reason)
        self.http_errors = prom.Counter(HTTP_ERRORS.removesuffix("_total"), "HTTP answers with status >= 400, "
                                        "by status", ["status"], registry=r)
        r.register(_StatsCollector(self))

    def bind(self, stats: Callable[[], dict]) -> None:
        """Where the gauges come from: the batcher's `stats()`, called at each scrape."""
        self._stats = stats

    # ------------------------------------------------------------ the batcher's reports

    def _tally(self, job) -> Tally | None:
        return self._tallies.get(id(job))

    def admitted(self, job) -> None:
        if self.registry is not None:
            self.prompt_tokens.inc(len(job.prompt_ids))

    def first_token(self, job, seconds: float) -> None:
        if self.registry is not None:
            self.ttft.observe(seconds)
            self.generation_tokens.inc()
        with self._lock:
            t = self._tally(job)
            if t is not None and (t.first_token_s is None or seconds < t.first_token_s):
                t.first_token_s = seconds

    def tokens(self, job, count: int, seconds: float) -> None:
        if count <= 0:
            return
        if self.registry is not None:
            self.generation_tokens.inc(count)
            self.itl.observe(seconds / count, count)

    def finished(self, job, reason: str, tokens: int) -> None:
        if self.registry is not None:
            self.finished_by.labels(reason=reason).inc()
        with self._lock:
            t = self._tally(job)
            if t is not None:
                t.new_tokens += tokens
                t.reasons.append(reason)

    # ------------------------------------------------------------ the handler's reports

    def http_status(self, status: int) -> None:
        if self.registry is not None and status >= 400:
            self.http_errors.labels(status=str(int(status))).inc()

    def request_done(self, seconds: float) -> None:
        if self.registry is not None:
            self.duration.observe(seconds)

    def watch(self, jobs: list, tally: Tally) -> None:
        """Records `jobs`' reports into `tally` (one request's) until `release`."""
        with self._lock:
            for job in jobs:
                self._tallies[id(job)] = tally
                tally.prompt_tokens += len(job.prompt_ids)

    def release(self, jobs: list) -> None:
        with self._lock:
            for job in jobs:
                self._tallies.pop(id(job), None)

    # ------------------------------------------------------------ scrapes

    def exposition(self) -> tuple[bytes, str]:
        """(body, content type) of a scrape; RuntimeError(MISSING_CLIENT) without prometheus-client."""
        if self.registry is None:
            raise RuntimeError(MISSING_CLIENT)
        return self._prom.generate_latest(self.registry), self._prom.CONTENT_TYPE_LATEST


class _RepeatHistogram:
    """A histogram that records `n` equal observations in one call (the gaps of `n` tokens read together; one
    prometheus_client Histogram.observe per token would cost the decode thread a lock per token)."""

    def __init__(self, name: str, doc: str, bounds: tuple[float, ...]):
        self.name, self.doc, self.bounds = name, doc, bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket (value <= bound), the last one +Inf
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float, n: int = 1) -> None:
        i = bisect.bisect_left(self.bounds, value)
        with self._lock:
            self.counts[i] += n
            self.sum += value * n

    def family(self):
        from prometheus_client.core import HistogramMetricFamily
        from prometheus_client.utils import floatToGoString
        with self._lock:
            counts, total = list(self.counts), self.sum
        cumulative, buckets = 0, []
        for bound, c in zip((*self.bounds, float("inf")), counts):
            cumulative += c
            buckets.append((floatToGoString(bound), cumulative))
        return HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=total)


class _StatsCollector:
    """The gauges and the engine's counters, read from the batcher's stats() at scrape time (and the
    inter-token latency histogram)."""

    def __init__(self, metrics: ServeMetrics):
        self.metrics = metrics

    def _families(self, stats: dict):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        for kind, metrics in ((GaugeMetricFamily, GAUGES), (CounterMetricFamily, STATS_COUNTERS)):
            for name, (key, doc) in metrics.items():
                family = kind(name, doc)
                if stats is not None:
                    family.add_metric([], float(stats.get(key, 0)))
                yield family

    def describe(self):
        return [*self._families(None), self.metrics.itl.family()]

    def collect(self):
        source = self.metrics._stats
        return [*self._families(source() if source is not None else {}), self.metrics.itl.family()]


def request_line(request_id: str, method: str, path: str, status: int, tally: Tally | None, seconds: float) -> str:
    """The log line of one finished request (key=value fields after the id, method, path and status)."""
    words = [f"megajax serve: {request_id} {method} {path} {status}"]
    generated = tally is not None and tally.prompt_tokens > 0  # it submitted sequences
    if generated:
        ttft = "-" if tally.first_token_s is None else f"{tally.first_token_s:.3f}"
        words.append(f"prompt_tokens={tally.prompt_tokens} new_tokens={tally.new_tokens} ttft_s={ttft}")
    words.append(f"total_s={seconds:.3f}")
    if generated:
        words.append(f"finish={tally.finish_text()}")
    return " ".join(words)
