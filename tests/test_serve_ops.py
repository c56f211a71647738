"""Operating `megajax serve`: Prometheus metrics that move by what the requests did, request ids and
log lines, readiness vs liveness, and draining on SIGTERM (a real `megajax serve` process)."""

import http.client
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import jax
import numpy as np
import pytest

from megajax.checkpoint.manager import write_params_checkpoint
from megajax.config import load_config
from megajax.inference import serve_metrics
from megajax.inference.batcher import Batcher, Job
from megajax.inference.load import find_source, generation_config, load_model
from megajax.inference.observer import Observer
from megajax.inference.sampling import Sampling
from megajax.inference.server import CompletionServer, RequestContext, _stop_on_signals
from conftest import xla_flags

prometheus_parser = pytest.importorskip("prometheus_client.parser")

CONTEXT = 64
TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}[assistant]"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A small random model on one device, served with request logs on."""
    cfg = load_config(overrides=["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
                                 "model.num_kv_heads=2", "model.ffn_hidden_size=128", "model.vocab_size=257",
                                 f"train.seq_len={CONTEXT}", "model.init_std=0.1"])
    _, init = build_model_spec(cfg)
    out = tmp_path_factory.mktemp("serve-ops") / "run"
    write_params_checkpoint(jax.jit(init)(), cfg, out)
    source = find_source(str(out), None)
    loaded = load_model(generation_config(source, []), source, devices=jax.devices()[:1])
    srv = CompletionServer(loaded, port=0, max_batch=4, quiet=False).start()
    yield srv
    srv.close()


def build_model_spec(cfg):
    from megajax.train.state import build_model_spec as build
    return build(cfg, cfg.model.padded_vocab_size())


def call(srv, method, path, body=None, headers=None):
    """(status, headers, text) of one request."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(srv.url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.headers, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read().decode()


def scrape(srv) -> dict:
    """{(sample name, sorted labels): value} of GET /metrics, parsed by prometheus_client's own parser."""
    status, headers, text = call(srv, "GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain"), text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in prometheus_parser.text_string_to_metric_families(text) for s in family.samples}


def delta(after: dict, before: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


# ---------------------------------------------------------------- metrics


def test_metrics_move_by_what_the_requests_did(server):
    before = scrape(server)
    # One shape for both requests (one batch size, one budget bucket): the test compiles once.
    plain = json.loads(call(server, "POST", "/v1/completions", {"prompt": "xyz", "max_tokens": 20,
                                                               "temperature": 0})[2])
    status, _, text = call(server, "POST", "/v1/completions", {"prompt": "hello", "max_tokens": 20, "temperature": 0,
                                                               "stream": True,
                                                               "stream_options": {"include_usage": True}})
    assert status == 200
    events = [json.loads(f[len("data: "):]) for f in text.split("\n\n") if f and f != "data: [DONE]"]
    streamed_usage = events[-1]["usage"]
    streamed_reason = [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1]
    assert call(server, "POST", "/v1/completions", {"prompt": "x", "temperature": "hot"})[0] == 400
    assert call(server, "GET", "/nowhere")[0] == 404
    after = scrape(server)

    generated = plain["usage"]["completion_tokens"] + streamed_usage["completion_tokens"]
    sequences = 2
    assert delta(after, before, "megajax_serve_generation_tokens_total") == generated
    assert delta(after, before, "megajax_serve_prompt_tokens_total") == 3 + 5  # bytes of each prompt
    assert delta(after, before, "megajax_serve_time_to_first_token_seconds_count") == sequences
    # Each sequence's tokens after its first are inter-token gaps.
    assert delta(after, before, "megajax_serve_inter_token_latency_seconds_count") == generated - sequences
    assert delta(after, before, "megajax_serve_request_duration_seconds_count") == 2
    assert delta(after, before, "megajax_serve_request_duration_seconds_bucket", le="+Inf") == 2
    reasons = [c["finish_reason"] for c in plain["choices"]] + [streamed_reason]
    for reason in serve_metrics.FINISH_REASONS:
        assert delta(after, before, "megajax_serve_requests_finished_total", reason=reason) == reasons.count(reason)
    assert delta(after, before, "megajax_serve_http_errors_total", status="400") == 1
    assert delta(after, before, "megajax_serve_http_errors_total", status="404") == 1
    for name in ("requests_running", "requests_waiting", "kv_blocks_used"):
        assert after[(f"megajax_serve_{name}", ())] == 0  # idle now: every block back in the pool
    pool = server.service.batcher.stats()["kv_blocks_total"]  # the continuous engine's (the static batcher: 0)
    assert after[("megajax_serve_kv_blocks_capacity", ())] == pool == server.service.batcher.num_blocks > 0
    # Every name the module lists is exported (the Kubernetes autoscaler's metric among them).
    families = {n for n, _ in after} | {n.rsplit("_", 1)[0] for n, _ in after}
    assert serve_metrics.metric_names() <= families | {n + "_total" for n in families}


def test_gauges_read_the_batchers_stats_at_scrape_time(server):
    metrics = server.service.metrics
    try:
        metrics.bind(lambda: {"running": 3, "waiting": 5, "kv_blocks_used": 7, "kv_blocks_total": 16,
                              "prefix_cache_queries": 900, "prefix_cache_hits": 640})
        got = scrape(server)
    finally:
        metrics.bind(server.service.batcher.stats)
    assert [got[(f"megajax_serve_{n}", ())] for n in ("requests_running", "requests_waiting", "kv_blocks_used",
                                                      "kv_blocks_capacity", "prefix_cache_queries_total",
                                                      "prefix_cache_hits_total")] == [3, 5, 7, 16, 900, 640]


def test_without_prometheus_client_metrics_says_what_to_install(server, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails as if not installed
    bare = serve_metrics.ServeMetrics()
    assert bare.registry is None
    monkeypatch.setattr(server.service, "metrics", bare)
    status, _, text = call(server, "GET", "/metrics")
    assert status == 501 and "pip install 'megajax[ops]'" in json.loads(text)["error"]["message"]
    # serving goes on (a shape compiled before)
    assert call(server, "POST", "/v1/completions", {"prompt": "hello", "max_tokens": 20, "temperature": 0})[0] == 200


def test_repeated_observations_bucket_as_prometheus_clients_histogram_does():
    """The inter-token histogram takes n equal gaps at once; its exposition equals n observe() calls of
    prometheus_client's own Histogram (bounds inclusive: a gap equal to a bound is in that bucket)."""
    import prometheus_client as prom
    registry = prom.CollectorRegistry()
    reference = prom.Histogram("h_seconds", "h", buckets=serve_metrics.ITL_BUCKETS, registry=registry)
    mine = serve_metrics.ServeMetrics()
    for gap, n in [(0.005, 3), (0.0051, 2), (0.0, 1), (7.0, 4), (0.25, 1)]:
        mine.itl.observe(gap, n)
        for _ in range(n):
            reference.observe(gap)

    def samples(text, name):
        return {(s.name.rsplit("_", 1)[-1], s.labels.get("le")): s.value
                for f in prometheus_parser.text_string_to_metric_families(text) if f.name == name for s in f.samples
                if not s.name.endswith("_created")}

    want = samples(prom.generate_latest(registry).decode(), "h_seconds")
    got = samples(mine.exposition()[0].decode(), serve_metrics.INTER_TOKEN_LATENCY)
    assert got.pop(("sum", None)) == pytest.approx(want.pop(("sum", None)), rel=1e-12)
    assert got == want and got[("count", None)] == 11 and got[("bucket", "0.005")] == 4


class Scripted:
    """A generator stand-in: each prompt's tokens are scripted (keyed by its first id); `start` waits for `gate`."""
    eod_id = 9

    def __init__(self, rows: dict, gate: threading.Event):
        self.rows, self.gate = rows, gate

    def start(self, prompts, samplings, budgets, top_n=0, score_prompt=False):
        assert self.gate.wait(60)
        return {"rows": [self.rows[p[0]] for p in prompts], "budgets": list(budgets), "count": 1}

    def read(self, state):
        rows, count = state["rows"], state["count"]
        tokens = np.zeros((len(rows), 32), np.int32)
        for i, r in enumerate(rows):
            tokens[i, :len(r)] = r
        done = np.array([count >= min(b, r.index(9) + 1 if 9 in r else b) for r, b in zip(rows, state["budgets"])])
        return tokens, done, count

    def advance(self, state, stop=None):
        state["count"] = min(stop or 32, 32)
        return state

    def read_scores(self, state):
        return None

    def completions(self, prompts, budgets, tokens, count, scores=None):
        return [None] * len(prompts)


class Recorder(Observer):
    def __init__(self):
        self.calls = []

    def admitted(self, job):
        self.calls.append(("admitted", job.prompt_ids[0]))

    def first_token(self, job, seconds):
        assert seconds >= 0
        self.calls.append(("first", job.prompt_ids[0]))

    def tokens(self, job, count, seconds):
        assert count > 0 and seconds >= 0
        self.calls.append(("tokens", job.prompt_ids[0], count))

    def finished(self, job, reason, tokens):
        self.calls.append(("finished", job.prompt_ids[0], reason, tokens))


def test_static_batcher_reports_each_sequence_to_its_observer():
    """Through a scripted generator: stats while a batch runs and one job waits; first token once, the
    later tokens counted, each end with its reason and token count (end-of-document, budget, cancelled)."""
    gate, seen = threading.Event(), Recorder()
    rows = {1: [5, 6, 7, 9, 4, 4], 2: [1, 2, 3, 4, 5, 6, 7, 8], 3: [3, 3, 3, 3, 3, 3, 3, 3]}
    batcher = Batcher(Scripted(rows, gate), max_batch=2, chunk=2, gather_s=0.5, observer=seen)
    events: queue.Queue = queue.Queue()
    jobs = [Job([k], Sampling(), budget, i, events, stream=True) for i, (k, budget) in enumerate([(1, 8), (2, 5),
                                                                                                 (3, 8)])]
    try:
        assert batcher.ready and batcher.stats() == {"running": 0, "waiting": 0, "kv_blocks_used": 0,
                                                     "kv_blocks_total": 0}
        batcher.submit(jobs)
        for _ in range(200):
            if batcher.stats()["running"] == 2:
                break
            threading.Event().wait(0.01)
        assert batcher.stats() == {"running": 2, "waiting": 1, "kv_blocks_used": 0, "kv_blocks_total": 0}
        jobs[2].cancelled = True  # its client left while it waited
        gate.set()
        ends = []
        while len(ends) < len(jobs):
            kind, index, _ = events.get(timeout=60)
            assert kind in ("tokens", "done"), kind
            ends += [index] * (kind == "done")
    finally:
        gate.set()
        batcher.close()
    assert sorted(ends) == [0, 1, 2]
    for key, reason, count in [(1, "stop", 4), (2, "length", 5), (3, "cancelled", 1)]:
        mine = [c for c in seen.calls if c[1] == key]
        assert mine[0] == ("admitted", key) and mine[1] == ("first", key) and mine[-1] == ("finished", key, reason,
                                                                                           count)
        assert 1 + sum(c[2] for c in mine if c[0] == "tokens") == count
    assert batcher.stats()["running"] == 0


# ---------------------------------------------------------------- request ids and logs


def test_request_ids_come_back_reach_the_jobs_and_start_the_log_line(server, capfd, monkeypatch):
    submitted = []
    submit = server.service.batcher.submit
    monkeypatch.setattr(server.service.batcher, "submit", lambda jobs: (submitted.extend(jobs), submit(jobs)))
    capfd.readouterr()
    status, headers, text = call(server, "POST", "/v1/completions", {"prompt": "ab", "max_tokens": 20,
                                                                     "temperature": 0, "n": 1})
    answer = json.loads(text)
    assert status == 200 and headers["X-Request-Id"] == answer["id"] and answer["id"].startswith("cmpl-")
    status, headers, text = call(server, "POST", "/v1/completions", {"prompt": "abc", "max_tokens": 20},
                                 headers={"X-Request-Id": "client-42"})
    assert status == 200 and headers["X-Request-Id"] == "client-42"
    assert [j.request_id for j in submitted] == [answer["id"], "client-42"]
    mine = json.loads(text)
    assert call(server, "GET", "/v1/models")[1]["X-Request-Id"].startswith("req-")
    err = call(server, "POST", "/v1/completions", {"prompt": "x", "n": 0}, headers={"X-Request-Id": "bad-1"})
    assert err[0] == 400 and err[1]["X-Request-Id"] == "bad-1"

    lines = log_lines(capfd, "megajax serve: bad-1 ")
    first = next(x for x in lines if answer["id"] in x)
    pattern = (r"megajax serve: (\S+) POST /v1/completions 200 prompt_tokens=(\d+) new_tokens=(\d+) "
               r"ttft_s=([\d.]+) total_s=([\d.]+) finish=(\S+)$")
    rid, prompt_tokens, new_tokens, ttft, total, finish = re.match(pattern, first).groups()
    assert rid == answer["id"] and int(prompt_tokens) == 2
    assert int(new_tokens) == answer["usage"]["completion_tokens"]
    assert 0 < float(ttft) <= float(total)
    reasons = {c["finish_reason"] for c in answer["choices"]}
    assert finish == (reasons.pop() if len(reasons) == 1 else finish)
    client = next(x for x in lines if x.startswith("megajax serve: client-42 "))
    assert f"new_tokens={mine['usage']['completion_tokens']} " in client
    assert any(x.startswith("megajax serve: bad-1 POST /v1/completions 400 ") for x in lines)
    assert not any("/metrics" in x or "/health" in x for x in lines)  # probes and scrapes are not logged

    monkeypatch.setattr(server.httpd.RequestHandlerClass, "log_requests", False)  # --disable-log-requests
    call(server, "POST", "/v1/completions", {"prompt": "q", "max_tokens": 20}, headers={"X-Request-Id": "quiet-1"})
    call(server, "GET", "/v1/models", headers={"X-Request-Id": "after-quiet"})
    monkeypatch.undo()
    call(server, "GET", "/v1/models", headers={"X-Request-Id": "loud-again"})
    assert not any("quiet-1" in x or "after-quiet" in x for x in log_lines(capfd, "megajax serve: loud-again "))


def log_lines(capfd, last: str) -> list[str]:
    """The request log's lines on stderr up to the one starting with `last` (written just after its answer)."""
    lines: list[str] = []
    # capfd's read-then-truncate drops a line written between the two: let the handler's thread write
    # its line (just after the answer) before the first read.
    threading.Event().wait(0.5)
    for _ in range(100):
        lines += [x for x in capfd.readouterr().err.splitlines() if x.startswith("megajax serve: ")]
        if any(x.startswith(last) for x in lines):
            return lines
        threading.Event().wait(0.05)
    raise AssertionError(f"no log line {last!r} in {lines}")


@pytest.mark.parametrize("given", ["has space", "x" * 129, "caf\u00e9"])
def test_a_malformed_request_id_is_refused_naming_the_header(server, given):
    conn = http.client.HTTPConnection(*server.httpd.server_address[:2], timeout=60)
    conn.putrequest("GET", "/v1/models")
    conn.putheader("X-Request-Id", given.encode("utf-8"))
    conn.endheaders()
    r = conn.getresponse()
    body = json.loads(r.read())
    assert r.status == 400 and body["error"]["code"] == "invalid_request_id"
    assert "X-Request-Id" in body["error"]["message"] and "visible ASCII" in body["error"]["message"]
    conn.close()


# ---------------------------------------------------------------- probes


def test_readiness_and_liveness(server, monkeypatch):
    status, _, text = call(server, "GET", "/health")
    assert status == 200 and json.loads(text)["status"] == "ok"
    monkeypatch.setattr(server.service.batcher, "ready", False, raising=False)  # as an engine compiling
    status, _, text = call(server, "GET", "/health")
    assert status == 503 and json.loads(text)["status"] == "compiling"
    assert call(server, "GET", "/health/live")[0] == 200
    monkeypatch.undo()

    monkeypatch.setattr(server.service, "draining", True)
    status, _, text = call(server, "GET", "/health")
    assert status == 503 and json.loads(text)["status"] == "draining"
    assert call(server, "GET", "/health/live")[0] == 200 and call(server, "GET", "/metrics")[0] == 200
    status, headers, text = call(server, "POST", "/v1/completions", {"prompt": "a", "max_tokens": 2})
    error = json.loads(text)["error"]
    assert status == 503 and headers["Retry-After"] == "1" and error["code"] == "server_shutting_down"
    assert error["type"] == "server_error" and headers["Connection"] == "close"


# ---------------------------------------------------------------- SIGTERM


def test_drain_timeout_cuts_what_is_still_running(server, capfd):
    """A request that outlasts the drain timeout is cut: reported by id, its jobs marked cancelled."""
    service = server.service
    stuck = RequestContext("stuck-1", "req-stuck", 0.0, False)
    stuck.jobs.append(Job([1, 2], Sampling(), 4, 0, queue.Queue()))
    assert service.enter(stuck)
    try:
        capfd.readouterr()
        assert server.drain(0.2) == [stuck]
        assert stuck.jobs[0].cancelled and not service.enter(RequestContext("late", "req-late", 0.0, False))
        err = capfd.readouterr().err
        assert "draining: 1 request in progress stuck-1" in err
        assert re.search(r"drained after [\d.]+ s: 0 finished, 1 cut stuck-1", err)
    finally:
        service.leave(stuck)
        service.draining = False


def test_a_second_signal_stops_at_once(server):
    stopping = threading.Event()
    previous = _stop_on_signals(server.service, stopping)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stopping.wait(10) and stopping.why == "SIGTERM" and server.service.draining
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            threading.Event().wait(10)  # the handler runs here, in the main thread
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.service.draining = False


def test_sigterm_drains_a_stream_refuses_new_work_and_exits_0(server, tmp_path):
    """`megajax serve` as Kubernetes stops it: a streaming chat request in flight (its first chunk read, its
    tokens not yet computed), SIGTERM: new requests get 503, the stream still ends with [DONE], exit 0."""
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    run = Path(server.service.loaded.path).parent.parent
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent),
               XLA_FLAGS=xla_flags())
    p = subprocess.Popen([sys.executable, "-m", "megajax.cli", "serve", "--checkpoint", str(run), "--port", "0",
                          "--chat-template", str(template), "--drain-timeout", "120"],
                         stderr=subprocess.PIPE, text=True, env=env)
    try:
        log = []

        def wait_for(words):
            while True:
                line = p.stderr.readline()
                assert line, f"the server exited before saying {words!r}: {''.join(log)}"
                log.append(line)
                if words in line:
                    return line

        url = re.search(r"listening on http://(\S+)", wait_for("listening on")).group(1)
        host, port = url.rsplit(":", 1)
        stream = http.client.HTTPConnection(host, int(port), timeout=120)
        stream.request("POST", "/v1/chat/completions", json.dumps({
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "temperature": 0, "stream": True}),
            {"Content-Type": "application/json", "X-Request-Id": "long-stream"})
        answer = stream.getresponse()
        assert answer.status == 200
        assert answer.fp.readline().startswith(b"data: ")  # the role chunk; the tokens wait for the compile

        p.send_signal(signal.SIGTERM)
        assert "1 request in progress long-stream" in wait_for("draining:")
        late = http.client.HTTPConnection(host, int(port), timeout=60)
        late.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 2}),
                     {"Content-Type": "application/json"})
        refused = late.getresponse()
        assert refused.status == 503 and refused.getheader("Retry-After")
        assert json.loads(refused.read())["error"]["code"] == "server_shutting_down"

        rest = answer.read().decode()
        frames = [f for f in rest.split("\n\n") if f]
        assert frames[-1] == "data: [DONE]" and len(frames) > 2
        assert json.loads(frames[-2][len("data: "):])["choices"][0]["finish_reason"] in ("stop", "length")
        assert p.wait(timeout=60) == 0
        tail = "".join(log) + p.stderr.read()
        assert re.search(r"drained after [\d.]+ s: 1 finished, 0 cut", tail)
        assert re.search(r"megajax serve: long-stream POST /v1/chat/completions 200 prompt_tokens=\d+ new_tokens=\d+",
                         tail)
    finally:
        p.kill()
