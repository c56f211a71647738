"""`megajax serve` over loopback with a real HTTP client: OpenAI and Megatron endpoints, streaming,
concurrent requests batched together, malformed requests answered with 400 while serving goes on."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import jax
import pytest

from megajax.checkpoint.manager import write_params_checkpoint
from megajax.config import load_config
from megajax.inference.load import find_source, generation_config, load_model
from megajax.inference.observer import Observer
from megajax.inference.sampling import Sampling
from megajax.inference.server import CompletionServer
from megajax.inference.text import completion_text
from megajax.train.state import build_model_spec
from conftest import xla_flags

CONTEXT = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cfg = load_config(overrides=["model.num_layers=2", "model.hidden_size=64", "model.num_heads=8",
                                 "model.num_kv_heads=4", "model.ffn_hidden_size=128", "model.vocab_size=257",
                                 f"train.seq_len={CONTEXT}", "model.init_std=0.1"])
    _, init = build_model_spec(cfg, cfg.model.padded_vocab_size())
    out = tmp_path_factory.mktemp("serve") / "run"
    write_params_checkpoint(jax.jit(init)(), cfg, out)
    source = find_source(str(out), None)
    loaded = load_model(generation_config(source, ["mesh.data=2", "mesh.tensor=4"]), source, user_mesh=True)
    srv = CompletionServer(loaded, port=0, max_batch=4, quiet=True).start()
    yield srv
    srv.close()


def call(srv, method, path, body=None, raw=None):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(srv.url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.headers.get("Content-Type"), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type"), e.read().decode()


def ok(srv, method, path, body=None):
    status, kind, text = call(srv, method, path, body)
    assert status == 200, text
    return json.loads(text) if kind == "application/json" else text


def direct(srv, prompt, n):
    """The greedy completion the generator gives alone."""
    service = srv.service
    [c], _ = service.generator.generate([service.tokenizer.encode(prompt)], Sampling(), n)
    return completion_text(service.tokenizer, c), c


def ready_health(url: str) -> dict:
    """/health once it answers 200: 503 "compiling" until the continuous engine has compiled its programs."""
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=60) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            assert e.code == 503 and json.loads(e.read())["status"] == "compiling"
            assert time.monotonic() < deadline, "not ready after 120 s"
            time.sleep(0.1)


def test_health_and_models(server):
    health = ready_health(server.url)
    assert health["status"] == "ok" and health["context_length"] == CONTEXT and health["max_batch"] == 4
    assert health["mesh"] == "data=2 x tensor=4"
    assert ok(server, "GET", "/v1/models")["data"][0]["id"] == health["model"]


def test_openai_completion_is_the_greedy_completion(server):
    answer = ok(server, "POST", "/v1/completions", {"prompt": "def f(", "max_tokens": 9, "temperature": 0})
    text, c = direct(server, "def f(", 9)
    assert answer["object"] == "text_completion" and answer["id"].startswith("cmpl-")
    assert answer["choices"] == [{"index": 0, "text": text, "logprobs": None, "finish_reason": c.finish_reason}]
    assert answer["usage"] == {"prompt_tokens": 6, "completion_tokens": len(c.completion_ids),
                               "total_tokens": 6 + len(c.completion_ids)}


def test_prompt_lists_n_and_seeds(server):
    body = {"prompt": ["ab", "cd"], "max_tokens": 6, "temperature": 1.0, "top_k": 50, "n": 2, "seed": 11}
    first = ok(server, "POST", "/v1/completions", body)
    assert [c["index"] for c in first["choices"]] == [0, 1, 2, 3]
    again = ok(server, "POST", "/v1/completions", body)
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in first["choices"]]  # seeded
    ids = ok(server, "POST", "/v1/completions", {"prompt": [97, 98], "max_tokens": 6, "temperature": 0})
    assert ids["choices"][0]["text"] == direct(server, "ab", 6)[0]  # token ids as the prompt


def test_streaming_sends_the_same_text_as_events(server):
    body = {"prompt": ["x = ", "while "], "max_tokens": 40, "temperature": 0, "stream": True}
    status, kind, text = call(server, "POST", "/v1/completions", body)
    assert status == 200 and kind == "text/event-stream"
    frames = [f for f in text.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames) and frames[-1] == "data: [DONE]"
    events = [json.loads(f[len("data: "):]) for f in frames[:-1]]
    assert len(events) > 4  # the 40 tokens arrive in several chunks
    for index, prompt in enumerate(body["prompt"]):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == index]
        want, c = direct(server, prompt, 40)
        assert "".join(m["text"] for m in mine) == want
        assert [m["finish_reason"] for m in mine][-1] == c.finish_reason
        assert all(m["finish_reason"] is None for m in mine[:-1])


def test_megatron_api(server):
    answer = ok(server, "PUT", "/api", {"prompts": ["import ", "class "], "tokens_to_generate": 7, "temperature": 0})
    assert answer["text"] == [p + direct(server, p, 7)[0] for p in ("import ", "class ")]
    assert "".join(answer["segments"][0]).startswith("import ")
    sampled = ok(server, "PUT", "/api", {"prompts": ["a"], "tokens_to_generate": 5, "top_k": 5, "random_seed": 3})
    assert sampled == ok(server, "PUT", "/api", {"prompts": ["a"], "tokens_to_generate": 5, "top_k": 5,
                                                 "random_seed": 3})


def test_concurrent_requests_are_decoded_together(server):
    prompts = [f"item {i}: " for i in range(6)]
    want = [direct(server, p, 12)[0] for p in prompts]
    server.service.batcher.observer = together = Together()
    barrier, answers = threading.Barrier(len(prompts)), {}

    def client(i):
        barrier.wait()
        answers[i] = ok(server, "POST", "/v1/completions", {"prompt": prompts[i], "max_tokens": 12,
                                                            "temperature": 0})["choices"][0]["text"]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert [answers[i] for i in range(len(prompts))] == want
    server.service.batcher.observer = Observer()
    assert together.most > 1 and together.running == 0  # several sequences decoded together


class Together(Observer):
    """The most sequences running at once (between admitted and finished)."""

    def __init__(self):
        self.running = self.most = 0

    def admitted(self, job):
        self.running += 1
        self.most = max(self.most, self.running)

    def finished(self, job, reason, tokens):
        self.running -= 1


@pytest.mark.parametrize("method,path,body,raw,status,words", [
    ("POST", "/v1/completions", None, b"{not json", 400, "not valid JSON"),
    ("POST", "/v1/completions", {"max_tokens": 3}, None, 400, "'prompt'"),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": "hot"}, None, 400, "'temperature'"),
    # The ranges are the sampling module's (one table for the flags and both dialects).
    ("POST", "/v1/completions", {"prompt": "x", "top_p": 0}, None, 400, "'top_p'=0.0: must be in (0, 1]"),
    ("POST", "/v1/completions", {"prompt": "x", "top_k": -2}, None, 400, "'top_k'=-2: must be >= 0"),
    ("PUT", "/api", {"prompts": ["x"], "temperature": -1}, None, 400, "'temperature'=-1.0: must be a finite"),
    ("PUT", "/api", {"prompts": ["x"], "random_seed": -2}, None, 400, "'random_seed'=-2: must be an integer in"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 64}, None, 400, f"context length is {CONTEXT}"),
    ("POST", "/v1/completions", {"prompt": "x", "suffix": "y"}, None, 400, "'suffix'"),
    ("POST", "/v1/completions", {"prompt": [[1, 999]]}, None, 400, "token ids outside"),
    ("PUT", "/api", {"prompts": "x"}, None, 400, "'prompts'"),
    ("PUT", "/api", {"prompts": ["x"], "tokens_to_generate": 0}, None, 400, "'tokens_to_generate'"),
    ("GET", "/v1/completions", None, None, 405, "not allowed"),
    ("POST", "/nowhere", {}, None, 404, "no endpoint"),
])
def test_malformed_requests_get_an_error_and_serving_goes_on(server, method, path, body, raw, status, words):
    got, kind, text = call(server, method, path, body, raw)
    assert got == status and kind == "application/json"
    assert words in json.loads(text)["error"]["message"]
    answer = ok(server, "POST", "/v1/completions", {"prompt": "ok", "max_tokens": 2, "temperature": 0})
    assert answer["choices"][0]["finish_reason"] in ("stop", "length")


def test_serve_command_listens_and_stops_on_interrupt(server, tmp_path):
    """`megajax serve` as a user starts it: the address on stderr, /health answers, Ctrl-C stops it."""
    with _serving(server, "-m", "megajax.cli") as (p, url):
        assert ready_health(url)["status"] == "ok"
        assert _status_after(p, signal.SIGINT) == 0


# SIGINT ignored, then exec'd into `megajax serve` (an ignored signal stays ignored across exec).
IGNORING_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                   "os.execv(sys.executable, [sys.executable, '-m', 'megajax.cli', *sys.argv[1:]])")


def test_serve_stops_on_sigterm_also_when_started_with_sigint_ignored(server):
    """A scheduler's SIGTERM stops `megajax serve` with status 0, and so does SIGINT when the server
    was started as a shell's background job is (SIGINT ignored)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        with _serving(server, "-c", IGNORING_SIGINT) as (p, _):
            assert _status_after(p, sig) == 0, sig.name


@contextlib.contextmanager
def _serving(server, *launch: str):
    """(process, url) of `megajax serve` on the fixture's checkpoint, started by `python *launch`,
    once it says it listens; killed afterwards."""
    run = Path(server.service.loaded.path).parent.parent
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent),
               XLA_FLAGS=xla_flags())
    p = subprocess.Popen([sys.executable, *launch, "serve", "--checkpoint", str(run), "--port", "0"],
                         stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = ""
        while "listening on" not in line:
            line = p.stderr.readline()
            assert line, "the server exited before listening"
        yield p, re.search(r"listening on (http://\S+)", line).group(1)
    finally:
        p.kill()


def _status_after(p: subprocess.Popen, sig: signal.Signals):
    """The exit status within 60 s of `sig`, or what the process's signal masks were if it still runs."""
    p.send_signal(sig)
    try:
        return p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        return f"still running 60 s after {sig.name} ({_signal_state(p.pid)})"


def _signal_state(pid: int) -> str:
    """The ignored, blocked and caught signal masks of a running process (for a failure message)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return "no /proc entry"
    return ", ".join(x for x in lines if x.startswith(("SigIgn", "SigBlk", "SigCgt")))


def test_scores_on_the_sharded_mesh_agree_between_prefill_and_decode(server):
    """On data=2 x tensor=4 (the vocabulary split over tensor): the log-probabilities of generated tokens
    (decode steps) equal those of the same tokens scored as a prompt (the prefill's every position), and
    penalties and stop sequences run there too."""
    prompt = list(b"def main():")
    gen = ok(server, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 2})
    lp = gen["choices"][0]["logprobs"]
    new = direct(server, "def main():", 5)[1].completion_ids[:3]  # the same greedy tokens, as ids
    scored = ok(server, "POST", "/v1/completions", {"prompt": prompt + new, "max_tokens": 0, "echo": True,
                                                    "logprobs": 2, "temperature": 0})
    slp = scored["choices"][0]["logprobs"]
    assert slp["token_logprobs"][0] is None and len(slp["tokens"]) == len(prompt) + 3
    assert abs(sum(slp["token_logprobs"][len(prompt):]) - sum(lp["token_logprobs"][:3])) < 1e-4
    top, want = slp["top_logprobs"][len(prompt)], lp["top_logprobs"][0]
    assert top.keys() == want.keys() and all(abs(top[k] - want[k]) < 1e-4 for k in top)
    penalised = ok(server, "POST", "/v1/completions", {"prompt": "ab", "max_tokens": 12, "temperature": 0,
                                                       "frequency_penalty": 2.0, "stop": ["zz"], "n": 2})
    assert len(penalised["choices"]) == 2
