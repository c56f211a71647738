#!/usr/bin/env python3
"""Serving under load: `megajax serve` driven by concurrent streaming clients over HTTP, one server
per batching mode, the modes side by side in the same run.

    PYTHONPATH=. python scripts/bench_serve.py [--config model/tiny] [--checkpoint DIR]
        [--batching static continuous] [--clients 1 4 16] [--requests 2] [--prompt-len 32]
        [--new-tokens 64] [--long-tokens 256] [--short 8] [--stagger 0.02] [--max-batch 16] [--json FILE]
        [--serve-arg=--block-size=16 ...]
    PYTHONPATH=. python scripts/bench_serve.py --scenario prefix [--context-tokens 512] [--questions 16]
        [--rounds 3] [--choice-tokens 8] [--clients 2] [--chat-turns 6] [--turn-tokens 48]
        [--override train.seq_len=1024]

Without --checkpoint the model config's own random initialisation (train.seed) is written to a
temporary checkpoint, so every mode serves the same weights. Requests are OpenAI completions with
token-id prompts (random ids, fixed seed), greedy, streamed with `logprobs: 0` (each chunk names
its tokens, so progress is counted in tokens) and `stream_options.include_usage`.

Scenarios, for each mode:
  concurrency  C clients (--clients), each sending --requests requests one after another:
               aggregate new tokens/s (all completion tokens / wall time), time to first token
               (TTFT) and whole-request latency, p50 and p99 over all requests.
  staggered    one request of --long-tokens new tokens; once its first token arrives, --short
               requests of 16 new tokens, --stagger seconds apart, each with a prompt length not used before
               (a static server compiles a new length bucket while everyone waits). Reported: how
               many short requests finished before the long one was half done (its token
               --long-tokens/2 arrived), and the longest gap between two chunks of the long stream
               (a stall).
Time to ready: from starting the process until GET /health answers 200.

--scenario prefix: two continuous servers, --enable-prefix-caching and --no-enable-prefix-caching, both started
(and warmed) first, then taking turns (only one works at a time), each with
  choices      --rounds rounds (the servers alternating round by round, on the same questions; new ones each
               round) of --questions multiple-choice questions of 4 choices, each a --context-tokens context (its own,
               random) plus --choice-tokens tokens, scored as an evaluation harness scores them (echo,
               logprobs 1, max_tokens 0; one request of 4 prompts per question, --clients clients at once,
               the first --clients value): requests (questions) per second, and the prompt tokens computed
               (GET /metrics: prompt tokens minus prefix cache hits).
  chat         one conversation of --chat-turns turns, each resending the whole history plus --turn-tokens
               new tokens (16 random ids standing in for the previous answer, then the user's): time to
               first token per turn.

Each mode's numbers and the continuous/static ratios are printed as a table (and written with --json).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def write_checkpoint(config: str, overrides: list[str], out: Path) -> int:
    """A random-weight checkpoint of `config` in `out`; returns the vocabulary size."""
    import jax

    from megajax.checkpoint.manager import write_params_checkpoint
    from megajax.config import load_config
    from megajax.train.state import build_model_spec
    cfg = load_config([config], ["model.hidden_dropout=0", "model.attention_dropout=0", *overrides])
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = 257  # the byte tokenizer's
    _, init = build_model_spec(cfg, cfg.model.padded_vocab_size())
    write_params_checkpoint(jax.jit(init)(), cfg, out)
    return cfg.model.vocab_size


class Server:
    """`megajax serve` in a subprocess; its stderr goes to a log file."""

    def __init__(self, checkpoint: Path, mode: str, max_batch: int, extra: list[str], log: Path):
        cmd = [sys.executable, "-m", "megajax.cli", "serve", "--checkpoint", str(checkpoint), "--port", "0",
               "--max-batch", str(max_batch), *(["--batching", mode] if mode else []), *extra]
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.log = log
        self.t0 = time.perf_counter()
        self._log = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self.url = self._wait_url()
        self.ready_s = self._wait_ready()

    def _wait_url(self, timeout: float = 600) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(r"listening on (http://\S+)", self.log.read_text())
            if m:
                return m.group(1).rstrip(" (")
            if self.proc.poll() is not None:
                raise RuntimeError(f"megajax serve exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)
        raise RuntimeError(f"megajax serve printed no address in {timeout} s:\n{self.log.read_text()[-3000:]}")

    def _wait_ready(self, timeout: float = 900) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=10) as r:
                    if r.status == 200:
                        return time.perf_counter() - self.t0
            except (urllib.error.URLError, OSError):
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"megajax serve exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)
        raise RuntimeError(f"megajax serve was not ready in {timeout} s")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def stream(url: str, prompt: list[int], new_tokens: int, first: threading.Event | None = None) -> dict:
    """One streamed completion: {"ttft", "latency", "tokens", "times" (arrival of each chunk, seconds
    from the request), "counts" (tokens so far at each chunk)}."""
    u = urlparse(url)
    body = json.dumps({"model": "megajax", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
                       "stream": True, "logprobs": 0, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=900)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
    times, counts, tokens, usage = [], [], 0, None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if event.get("usage"):
            usage = event["usage"]["completion_tokens"]
        for choice in event.get("choices", []):
            got = len((choice.get("logprobs") or {}).get("tokens") or [])
            if got:
                tokens += got
                if first is not None:
                    first.set()
                times.append(time.perf_counter() - t0)
                counts.append(tokens)
    conn.close()
    latency = time.perf_counter() - t0
    return {"ttft": times[0] if times else latency, "latency": latency, "tokens": usage if usage is not None else tokens,
            "times": times, "counts": counts}


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(round(q / 100 * (len(xs) - 1))), len(xs) - 1)]


def run_clients(calls: list[tuple], errors: list[str]) -> float:
    """Runs each (function, args) in its own thread at once; their wall time in seconds (a
    RuntimeError naming the first of `errors` the clients recorded, if any)."""
    t0 = time.perf_counter()
    threads = [threading.Thread(target=f, args=a) for f, a in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
    return wall


def concurrency(url: str, clients: int, requests: int, prompts: list[list[int]], new_tokens: int) -> dict:
    results: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for r in range(requests):
            try:
                out = stream(url, prompts[(c * requests + r) % len(prompts)], new_tokens)
            except Exception as e:  # reported, not hidden
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
                return
            with lock:
                results.append(out)

    wall = run_clients([(client, (c,)) for c in range(clients)], errors)
    ttft, lat = [r["ttft"] for r in results], [r["latency"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {"clients": clients, "requests": len(results), "tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 2), "ttft_p50_s": round(percentile(ttft, 50), 4),
            "ttft_p99_s": round(percentile(ttft, 99), 4), "latency_p50_s": round(percentile(lat, 50), 4),
            "latency_p99_s": round(percentile(lat, 99), 4)}


def staggered(url: str, vocab: int, long_tokens: int, short: int, prompt_len: int, stagger: float, rng) -> dict:
    """One long stream, then `short` short requests of unseen prompt lengths once it has started."""
    long_prompt = [int(x) for x in rng.integers(1, vocab, prompt_len)]
    holder: dict = {}
    first = threading.Event()

    def run_long() -> None:
        holder["t0"] = time.perf_counter()
        holder["out"] = stream(url, long_prompt, long_tokens, first)

    long_thread = threading.Thread(target=run_long)
    long_thread.start()
    first.wait(timeout=900)
    lengths = [prompt_len + 3 + 7 * (i + 1) for i in range(short)]  # not used before: new length buckets
    shorts = [[int(x) for x in rng.integers(1, vocab, n)] for n in lengths]
    finishes: list[float] = []
    lock = threading.Lock()

    def run_short(i: int) -> None:
        stream(url, shorts[i], 16)
        with lock:
            finishes.append(time.perf_counter() - holder["t0"])

    threads = []
    for i in range(short):
        t = threading.Thread(target=run_short, args=(i,))
        t.start()
        threads.append(t)
        time.sleep(stagger)
    for t in threads:
        t.join()
    long_thread.join()
    out = holder["out"]
    half = next((t for t, c in zip(out["times"], out["counts"]) if c >= long_tokens // 2), out["latency"])
    gaps = [b - a for a, b in zip(out["times"], out["times"][1:])]
    return {"long_tokens": out["tokens"], "long_latency_s": round(out["latency"], 3),
            "long_half_done_s": round(half, 3), "short_finished_before_half": sum(f <= half for f in finishes),
            "short": short, "short_finish_p50_s": round(percentile(finishes, 50), 3) if finishes else None,
            "long_max_gap_s": round(max(gaps), 3) if gaps else None}


def metric(url: str, name: str) -> float:
    """A counter's value in GET /metrics (0 when absent)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        m = re.search(rf"^{name} (\S+)$", r.read().decode(), re.M)
    return float(m.group(1)) if m else 0.0


def post(url: str, body: dict) -> dict:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=900)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.read()
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {out[:500]!r}")
    return json.loads(out)


def choices(url: str, questions: list[list[list[int]]], clients: int) -> dict:
    """Each question's 4 prompts scored in one request (echo, logprobs 1, max_tokens 0), `clients` at once."""
    before = metric(url, "megajax_serve_prompt_tokens_total"), metric(url, "megajax_serve_prefix_cache_hits_total")
    todo = list(range(len(questions)))
    lock = threading.Lock()
    errors: list[str] = []

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                q = todo.pop(0)
            try:
                post(url, {"model": "megajax", "prompt": questions[q], "max_tokens": 0, "echo": True, "logprobs": 1,
                           "temperature": 0})
            except Exception as e:  # reported, not hidden
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
                return

    wall = run_clients([(client, ())] * clients, errors)
    prompt = metric(url, "megajax_serve_prompt_tokens_total") - before[0]
    hits = metric(url, "megajax_serve_prefix_cache_hits_total") - before[1]
    return {"questions": len(questions), "wall_s": round(wall, 3), "requests_per_s": round(len(questions) / wall, 3),
            "prompt_tokens": int(prompt), "prompt_tokens_computed": int(prompt - hits)}


def chat(url: str, first: list[int], turns: int, turn_tokens: int, vocab: int, rng) -> list[float]:
    """Time to first token of each turn of one conversation that resends its history."""
    history, ttft = list(first), []
    for _ in range(turns):
        ttft.append(round(stream(url, history, 16)["ttft"], 4))
        history += [int(x) for x in rng.integers(1, vocab, turn_tokens)]
    return ttft


def prefix_scenario(args, checkpoint: Path, vocab: int, tmp: Path) -> dict:
    import numpy as np
    rng = np.random.default_rng(0)

    def question() -> list[list[int]]:
        context = [int(x) for x in rng.integers(1, vocab, args.context_tokens)]
        return [context + [int(x) for x in rng.integers(1, vocab, args.choice_tokens)] for _ in range(4)]

    warm = question()
    rounds = [[question() for _ in range(args.questions)] for _ in range(args.rounds)]  # new contexts each round
    opening = [int(x) for x in rng.integers(1, vocab, args.turn_tokens)]
    report: dict = {"context_tokens": args.context_tokens, "choice_tokens": args.choice_tokens,
                    "questions": args.questions, "rounds": args.rounds, "clients": args.clients[0],
                    "chat_turns": args.chat_turns, "turn_tokens": args.turn_tokens, "max_batch": args.max_batch,
                    "modes": {}}
    modes = (("no_caching", "--no-enable-prefix-caching"), ("caching", "--enable-prefix-caching"))
    servers: dict[str, Server] = {}
    try:
        for name, flag in modes:  # both up and warm; only one works at a time
            servers[name] = Server(checkpoint, "continuous", args.max_batch, [*args.serve_arg, flag],
                                   tmp / f"serve-{name}.log")
            post(servers[name].url, {"model": "megajax", "prompt": warm, "max_tokens": 0, "echo": True, "logprobs": 1})
            stream(servers[name].url, warm[0][:64], 4)
            report["modes"][name] = {"choices": []}
        for k, questions in enumerate(rounds):  # the modes alternate, round by round, on the same questions
            for name, _ in modes:
                r = choices(servers[name].url, questions, args.clients[0])
                report["modes"][name]["choices"].append(r)
                print(f"round {k + 1} {name}: {r['requests_per_s']:.2f} questions/s, {r['prompt_tokens_computed']} of "
                      f"{r['prompt_tokens']} prompt tokens computed", flush=True)
        for name, _ in modes:
            ttft = chat(servers[name].url, opening, args.chat_turns, args.turn_tokens, vocab, np.random.default_rng(1))
            report["modes"][name]["chat_ttft_s"] = ttft
            print(f"{name}: chat TTFT per turn (s): {ttft}", flush=True)
    finally:
        for server in servers.values():
            server.close()
    on, off = report["modes"]["caching"]["choices"], report["modes"]["no_caching"]["choices"]
    ratios = [round(a["requests_per_s"] / b["requests_per_s"], 2) for a, b in zip(on, off)]
    report["caching_over_no_caching_requests_per_s"] = ratios
    report["median_ratio"] = round(statistics.median(ratios), 2)
    print(json.dumps({k: v for k, v in report.items() if k != "modes"}, indent=1))
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="model/tiny")
    ap.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for the model")
    ap.add_argument("--checkpoint", help="serve this checkpoint (default: random weights of --config)")
    ap.add_argument("--batching", nargs="+", default=["static", "continuous"])
    ap.add_argument("--clients", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--long-tokens", type=int, default=256)
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--stagger", type=float, default=0.02, help="seconds between the short requests' arrivals")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--serve-arg", action="append", default=[], help="an extra `megajax serve` argument (repeat)")
    ap.add_argument("--skip-staggered", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--scenario", choices=("load", "prefix"), default="load",
                    help="load: the batching modes under concurrent clients (default); prefix: prefix caching on "
                         "and off, a 4-choice workload with a shared context and a multi-turn chat")
    ap.add_argument("--context-tokens", type=int, default=512, help="prefix: each question's shared context")
    ap.add_argument("--choice-tokens", type=int, default=8, help="prefix: tokens of each choice")
    ap.add_argument("--questions", type=int, default=16, help="prefix: questions of 4 choices per round")
    ap.add_argument("--rounds", type=int, default=3, help="prefix: rounds of questions, the two servers alternating")
    ap.add_argument("--chat-turns", type=int, default=6, help="prefix: turns of the conversation")
    ap.add_argument("--turn-tokens", type=int, default=48, help="prefix: new tokens each turn")
    args = ap.parse_args()

    import numpy as np
    tmp = Path(tempfile.mkdtemp(prefix="megajax-bench-serve-"))
    if args.checkpoint:
        checkpoint, vocab = Path(args.checkpoint), None
    else:
        checkpoint = tmp / "model"
        vocab = write_checkpoint(args.config, args.override, checkpoint)
    if vocab is None:
        from megajax.inference.load import find_source, generation_config
        vocab = generation_config(find_source(str(checkpoint), None)).model.vocab_size
    if args.scenario == "prefix":
        report = prefix_scenario(args, checkpoint, vocab, tmp)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        return 0
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(1, vocab, args.prompt_len)] for _ in range(64)]

    report: dict = {"config": args.config, "checkpoint": str(checkpoint) if args.checkpoint else None,
                    "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "max_batch": args.max_batch,
                    "modes": {}}
    for mode in args.batching:
        print(f"--- {mode} ---", flush=True)
        server = Server(checkpoint, mode, args.max_batch, args.serve_arg, tmp / f"serve-{mode}.log")
        try:
            row: dict = {"ready_s": round(server.ready_s, 2), "concurrency": []}
            print(f"ready after {server.ready_s:.1f} s", flush=True)
            stream(server.url, prompts[0], 4)  # the common shapes, before anything is timed
            for c in args.clients:
                r = concurrency(server.url, c, args.requests, prompts, args.new_tokens)
                row["concurrency"].append(r)
                print(f"{c:>3} clients: {r['tokens_per_s']:8.1f} tok/s, TTFT p50 {r['ttft_p50_s']:.3f} s "
                      f"p99 {r['ttft_p99_s']:.3f} s, latency p50 {r['latency_p50_s']:.2f} s "
                      f"p99 {r['latency_p99_s']:.2f} s", flush=True)
            if not args.skip_staggered:
                s = staggered(server.url, vocab, args.long_tokens, args.short, args.prompt_len, args.stagger, rng)
                row["staggered"] = s
                print(f"staggered: {s['short_finished_before_half']}/{s['short']} short requests done before the "
                      f"long one was half done ({s['long_half_done_s']:.2f} s); longest stall of the long stream "
                      f"{s['long_max_gap_s']} s", flush=True)
        finally:
            server.close()
        report["modes"][mode] = row
    if {"static", "continuous"} <= set(report["modes"]):
        st, co = report["modes"]["static"], report["modes"]["continuous"]
        report["continuous_over_static"] = {
            f"{a['clients']}_clients_tokens_per_s": round(b["tokens_per_s"] / a["tokens_per_s"], 2)
            for a, b in zip(st["concurrency"], co["concurrency"])}
    single = {m: r["concurrency"][0]["tokens_per_s"] for m, r in report["modes"].items()
              if r["concurrency"] and r["concurrency"][0]["clients"] == 1}
    for m, r in report["modes"].items():
        if m in single:
            r["over_sequential"] = {f"{c['clients']}_clients": round(c["tokens_per_s"] / single[m], 2)
                                    for c in r["concurrency"]}
    print(json.dumps({k: v for k, v in report.items() if k != "modes"}, indent=1))
    for m, r in report["modes"].items():
        if "over_sequential" in r:
            print(f"{m}: tokens/s over 1 client: {r['over_sequential']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
