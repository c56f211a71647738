"""The continuous engine (megajax/inference/engine.py): interleaved arrivals give the sequential
tokens, long prompts are prefilled in chunks while others decode, a full KV pool queues requests,
a disconnect frees its blocks, everything is compiled before `ready`; and the same over HTTP on
data=2 x tensor=4."""

import http.client
import json
import queue
import socket
import threading
import time

import jax
import pytest

from random_model import random_model
from megajax.checkpoint.manager import write_params_checkpoint
from megajax.cli import main
from megajax.config import load_config
from megajax.inference.batcher import Job
from megajax.inference.engine import Engine
from megajax.inference.generate import Generator
from megajax.inference.load import find_source, generation_config, load_model
from megajax.inference.observer import Observer
from megajax.inference.sampling import Sampling
from megajax.inference.server import CompletionServer

CONTEXT = 48
PROMPTS = ([65], [104, 101, 108, 108, 111, 33], list(range(70, 83)), list(range(100, 130)))  # 1, 6, 13, 30 tokens


class Log(Observer):
    """Every observer call, in order: (what, job index, ...)."""

    def __init__(self):
        self.calls = []

    def admitted(self, job):
        self.calls.append(("admitted", job.index))

    def first_token(self, job, seconds):
        self.calls.append(("first", job.index))

    def tokens(self, job, count, seconds):
        self.calls.append(("tokens", job.index, count))

    def finished(self, job, reason, tokens):
        self.calls.append(("finished", job.index, reason, tokens))


@pytest.fixture(scope="module")
def setup():
    """(generator, engine, the static generator's greedy completions of PROMPTS (10 tokens)): the shared
    random llama model, an engine of 3 rows over 16 blocks of 4 positions with 8-token prefill chunks;
    `ready` checked right after it was made, and a job submitted before it runs once it is."""
    cfg, _, params = random_model("llama", std=0.08, seq_len=CONTEXT)
    gen = Generator(cfg.model, params, eod_id=None)
    engine = Engine(gen, 3, block_size=4, num_blocks=16, prefill_chunk=8)
    assert not engine.ready and engine.compile_s is None  # compiling in its thread
    early = run(engine, [PROMPTS[1]], 10)  # submitted before ready: waits, then runs
    assert engine.ready and engine.compile_s > 0
    static, _ = gen.generate(PROMPTS, Sampling(), 10)
    assert early[0].completion_ids == static[1].completion_ids
    yield gen, engine, static
    engine.close()


def run(engine, prompts, n, samplings=None, stagger=False, **job):
    """Completions of `prompts` (n new tokens each); `stagger`: each job submitted once the previous
    one has streamed its first token (so it joins a running batch)."""
    events = queue.Queue()
    samplings = samplings or [Sampling()] * len(prompts)
    jobs = [Job(list(p), s, n, i, events, stream=stagger, **job) for i, (p, s) in enumerate(zip(prompts, samplings))]
    done = {}
    for job in jobs:
        engine.submit([job])
        while stagger and job.sent == 0 and job.index not in done:
            kind, i, payload = events.get(timeout=120)
            if kind == "done":
                done[i] = payload
            assert kind != "error", payload
    while len(done) < len(jobs):
        kind, i, payload = events.get(timeout=120)
        assert kind != "error", payload
        if kind == "done":
            done[i] = payload
    return [done[i] for i in range(len(jobs))]


def ids(completions):
    return [c.completion_ids for c in completions]


def test_interleaved_arrivals_equal_sequential_and_the_static_generator(setup):
    gen, engine, static = setup
    prompts = PROMPTS  # the 30-token prompt: 4 prefill chunks
    alone = [run(engine, [p], 10)[0] for p in prompts]
    together = run(engine, prompts, 10)  # 4 jobs on 3 rows, 13 + 4 + 6 + 10 blocks > 16: some wait
    staggered = run(engine, prompts[::-1], 10, stagger=True)[::-1]
    assert ids(alone) == ids(together) == ids(staggered) == ids(static)
    logprobs = [[c.scores.logprobs for c in run] for run in (alone, together, staggered)]
    assert logprobs[0] == logprobs[1] == logprobs[2]  # bit for bit: a row's arithmetic ignores the other rows
    hot = [Sampling(temperature=1.2, top_p=0.9, seed=s, frequency_penalty=0.5) for s in (1, 2, 3, 4)]
    sampled_alone = [run(engine, [p], 10, [s])[0] for p, s in zip(prompts, hot)]
    sampled = run(engine, prompts, 10, hot, stagger=True)
    assert ids(sampled) == ids(sampled_alone)
    stats = engine.stats()
    assert {k: stats[k] for k in ("running", "waiting", "kv_blocks_used", "kv_blocks_total")} == {
        "running": 0, "waiting": 0, "kv_blocks_used": 0, "kv_blocks_total": 16}  # cached blocks are free ones
    assert stats["prefix_cache_hits"] > 0 and stats["prefix_cache_queries"] > stats["prefix_cache_hits"]


def test_scores_and_score_only_jobs(setup):
    gen, engine, _ = setup
    [c] = run(engine, [PROMPTS[2]], 4, top_logprobs=5, score_prompt=True)
    [ref] = gen.completions([PROMPTS[2]], [4], *_read(gen, gen.start([PROMPTS[2]], [Sampling()], [4], top_n=20,
                                                                      score_prompt=True)))
    assert len(c.prompt_scores.logprobs) == len(PROMPTS[2]) - 1  # the first token has none
    assert max(abs(a - b) for a, b in zip(c.prompt_scores.logprobs, ref.prompt_scores.logprobs)) < 1e-4
    assert c.completion_ids[0] == ref.completion_ids[0] and abs(c.scores.logprobs[0] - ref.scores.logprobs[0]) < 1e-4
    assert [t for t, _ in c.prompt_scores.top[3]] == [t for t, _ in ref.prompt_scores.top[3]]
    [scored] = run(engine, [PROMPTS[2]], 0, score_prompt=True)  # max_tokens 0: the prompt scored only
    assert scored.completion_ids == [] and scored.prompt_scores.logprobs == c.prompt_scores.logprobs


def _read(gen, state):
    tokens, _, count = gen.read(state)
    return tokens, count, gen.read_scores(state)


def test_a_long_prompt_is_prefilled_in_chunks_while_another_sequence_decodes(setup):
    gen, engine, _ = setup
    engine.observer = log = Log()
    try:
        events = queue.Queue()
        short = Job(list(PROMPTS[1]), Sampling(), 30, 0, events, stream=True)  # 9 blocks
        long = Job(list(range(100, 124)), Sampling(), 2, 1, events)  # 24 tokens, 3 chunks of 8: 7 blocks
        engine.submit([short])
        while events.get(timeout=120)[0] != "tokens":
            pass
        engine.submit([long])
        done = 0
        while done < 2:
            done += events.get(timeout=120)[0] == "done"
    finally:
        engine.observer = Observer()
    calls = log.calls
    between = calls[calls.index(("admitted", 1)):calls.index(("first", 1))]
    assert sum(c[:2] == ("tokens", 0) for c in between) >= 2  # decode steps between each two chunks
    assert ("finished", 0, "length", 30) in calls and ("finished", 1, "length", 2) in calls


def test_a_full_pool_queues_requests_and_every_one_finishes(setup):
    gen, engine, _ = setup
    prompts = [list(range(10 + i, 20 + i)) for i in range(3)]  # 10 + 14 new: 6 blocks each, 18 > 16
    seen = []
    stop = threading.Event()

    class Watching(Log):  # the stats at every decode step too, which a polling thread can miss under load
        def tokens(self, job, count, seconds):
            super().tokens(job, count, seconds)
            seen.append(engine.stats())

    engine.observer = log = Watching()

    def watch():
        while not stop.is_set():
            seen.append(engine.stats())
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        together = run(engine, prompts, 14)
    finally:
        stop.set()
        watcher.join()
        engine.observer = Observer()
    assert ids(together) == [run(engine, [p], 14)[0].completion_ids for p in prompts]
    assert any(s["running"] == 2 and s["waiting"] == 1 and s["kv_blocks_used"] == 12 for s in seen)
    assert all(s["kv_blocks_used"] <= 16 for s in seen)
    assert [c[2] for c in log.calls if c[0] == "finished"] == ["length"] * 3  # nothing failed
    first = log.calls.index(("first", 0))
    assert log.calls[first + 1] == ("first", 1)  # the two admitted prompts were prefilled in the same calls
    third = log.calls.index(("admitted", 2))
    assert third > min(i for i, c in enumerate(log.calls) if c[0] == "finished")  # admitted after one ended


def test_a_cancelled_job_is_dropped_and_its_blocks_freed(setup):
    gen, engine, _ = setup
    engine.observer = log = Log()
    try:
        events = queue.Queue()
        job = Job(list(PROMPTS[2]), Sampling(), 30, 0, events, stream=True)
        engine.submit([job])
        while events.get(timeout=120)[0] != "tokens":
            pass
        assert engine.stats()["kv_blocks_used"] == 11  # 13 + 30 positions
        job.cancelled = True
        deadline = time.monotonic() + 60
        while engine.stats()["kv_blocks_used"] and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine.observer = Observer()
    assert engine.pool.free == engine.num_blocks == 16
    [(_, _, reason, tokens)] = [c for c in log.calls if c[0] == "finished"]
    assert reason == "cancelled" and tokens < 30


def test_serve_flags_are_checked_naming_the_flag(capsys):
    for flags, words in ((["--block-size", "0"], "--block-size 0: must be in [1,"),
                         (["--num-kv-blocks", "-3"], "--num-kv-blocks -3: must be >= 1"),
                         (["--prefill-chunk", "0"], "--prefill-chunk 0: must be >= 1"),
                         (["--max-batch", "4", "--prefill-rows", "5"], "--prefill-rows 5: must be in [1, 4]")):
        assert main(["serve", "--checkpoint", "nowhere", *flags]) == 2
        assert words in capsys.readouterr().err


# ---------------------------------------------------------------- over HTTP, data=2 x tensor=4

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cfg = load_config(overrides=["model.num_layers=2", "model.hidden_size=64", "model.num_heads=8",
                                 "model.num_kv_heads=4", "model.ffn_hidden_size=128", "model.vocab_size=257",
                                 "train.seq_len=64", "model.init_std=0.1"])
    from megajax.train.state import build_model_spec
    _, init = build_model_spec(cfg, cfg.model.padded_vocab_size())
    out = tmp_path_factory.mktemp("engine") / "run"
    write_params_checkpoint(jax.jit(init)(), cfg, out)
    source = find_source(str(out), None)
    loaded = load_model(generation_config(source, ["mesh.data=2", "mesh.tensor=4"]), source, user_mesh=True)
    srv = CompletionServer(loaded, port=0, max_batch=4, quiet=True, block_size=8, num_kv_blocks=6,
                           prefill_chunk=16).start()
    yield srv
    srv.close()


def post(srv, body):
    host, port = srv.httpd.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def test_on_the_mesh_concurrent_answers_equal_the_generator_and_a_disconnect_frees_blocks(server):
    engine = server.service.batcher
    while not engine.ready:
        time.sleep(0.05)
    assert engine.rows == 4 and engine.prefill_rows == 4  # rows split over data=2; default 4 per shard, capped
    spec = engine._pools_k[0].sharding.spec
    assert tuple(spec) == (None, "tensor", None) or tuple(spec) == (None, "tensor")  # kv heads over tensor
    prompts = ["def f(x):", "hello there, general", "a"]
    answers = {}

    def client(i):
        conn, r = post(server, {"prompt": prompts[i], "max_tokens": 8, "temperature": 0})
        answers[i] = json.loads(r.read())["choices"][0]["text"]
        conn.close()

    for i in range(len(prompts)):  # one at a time (tests/test_serve.py compares these with the generator)
        client(i)
    want = [answers[i] for i in range(len(prompts))]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [answers[i] for i in range(len(prompts))] == want

    engine.observer = log = Log()
    try:
        body = json.dumps({"prompt": "stream me", "max_tokens": 38, "temperature": 0, "stream": True}).encode()
        sock = socket.create_connection(server.httpd.server_address[:2], timeout=120)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        received = b""
        while b"data: " not in received:
            received += sock.recv(4096)
        sock.close()  # the client goes away mid-stream
        deadline = time.monotonic() + 60
        while not any(c[0] == "finished" for c in log.calls) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine.observer = Observer()
    [(_, _, reason, tokens)] = [c for c in log.calls if c[0] == "finished"]
    assert reason == "cancelled" and tokens < 38
    assert engine.pool.free == engine.num_blocks == 6 and engine.stats()["kv_blocks_used"] == 0

    conn, r = post(server, {"prompt": "x" * 40, "max_tokens": 16})  # 56 positions: 7 blocks of 8 > 6
    body = json.loads(r.read())
    conn.close()
    assert r.status == 400 and body["error"]["param"] == "max_tokens"
    message = body["error"]["message"]
    assert "needs 7 KV blocks of 8 positions" in message and "--num-kv-blocks" in message


def test_paged_attention_reads_the_blocks_in_use_and_a_row_ignores_the_trip_count():
    """The online softmax over blocks equals the whole-table gather (within fp32 rounding), and extra
    trips over blocks a row cannot see leave its output bit for bit unchanged."""
    import jax.numpy as jnp
    from megajax.models.attention import PagedCache, cached_attention, paged_attention
    paged_attention = jax.jit(paged_attention)  # one program for any trip count (blocks_used is traced)
    bs, g, r, d, b, l, m = 4, 2, 2, 8, 3, 2, 6
    keys = jax.random.split(jax.random.key(0), 3)
    pool_k, pool_v = (jax.random.normal(k, (20 * bs, g, d)) for k in keys[:2])
    q = jax.random.normal(keys[2], (b, l, g * r, d))
    table = jnp.array([[3, 7, 1, 0, 0, 0], [5, 2, 9, 11, 4, 0], [8, 0, 0, 0, 0, 0]], jnp.int32)
    last = jnp.array([10, 18, 2])  # the rows' last positions: 3, 5 and 1 blocks in use
    mask = jnp.arange(m * bs)[None, None, :] <= (last[:, None] - jnp.arange(l)[::-1])[:, :, None]
    gathered = PagedCache(pool_k, jnp.zeros((b, l), jnp.int32), table, bs)
    ref = cached_attention(q, gathered.view(), gathered.replace(pool_NxGxK=pool_v).view(), mask)
    outs = {}
    for used in (5, 6):
        for step in (1, 4):
            ck = PagedCache(pool_k, jnp.zeros((b, l), jnp.int32), table, bs, jnp.int32(used), step)
            outs[used, step] = paged_attention(q, ck, ck.replace(pool_NxGxK=pool_v), mask)
            assert float(jnp.max(jnp.abs(outs[used, step] - ref))) < 1e-5
    assert (outs[5, 1] == outs[6, 1]).all()  # one more trip, over a block no row sees
    short = PagedCache(pool_k, jnp.zeros((1, l), jnp.int32), table[2:], bs, jnp.int32(1), 1)
    alone = paged_attention(q[2:], short, short.replace(pool_NxGxK=pool_v), mask[2:])
    assert (alone == outs[5, 1][2:]).all()  # the 1-block row alone (1 trip) = with the others (5 trips)
