"""Automatic prefix caching in the continuous engine (megajax/inference/engine.py): requests that
share a prompt prefix map its cached KV blocks and prefill only the rest, with the tokens, log
probabilities and prompt scores of the engine without caching, bit for bit (one device, data=2 x
tensor=4, tensor=2; a pool small enough to evict; prefill calls of several shapes); reference counts
return to zero and a block is shared only once fully written; a chat turn does not map its previous
reply's blocks."""

import queue

import numpy as np
import pytest

from random_model import random_model
from megajax.config import load_config
from megajax.inference.batcher import Job
from megajax.inference.engine import BlockPool, Engine, prefix_hashes
from megajax.inference.generate import Generator
from megajax.inference.sampling import Sampling
from megajax.mesh import make_mesh, make_rules

CONTEXT = 64
CONTEXT_TOKENS = list(range(60, 81))  # 21 shared tokens: 5 full blocks of 4
CHOICES = ([33, 34, 35], [40, 41, 42, 43, 44, 45], [50], [90, 91, 92, 93, 94, 95, 96])


def run(engine, prompts, n, **job):
    """Completions of `prompts` submitted together (n new tokens each)."""
    events = queue.Queue()
    jobs = [Job(list(p), Sampling(), n, i, events, **job) for i, p in enumerate(prompts)]
    engine.submit(jobs)
    done = {}
    while len(done) < len(jobs):
        kind, i, payload = events.get(timeout=120)
        assert kind != "error", payload
        if kind == "done":
            done[i] = payload
    return [done[i] for i in range(len(jobs))]


def workload(engine):
    """What the completions of a shared-prefix workload hold, as plain numbers: a 4-choice question
    scored (echo with top alternatives, as an evaluation harness asks) twice, the choices generated, and
    a 3-turn chat whose every turn resends the conversation."""
    out = []
    prompts = [CONTEXT_TOKENS + c for c in CHOICES]
    for _ in range(2):
        for c in run(engine, prompts, 1, score_prompt=True, top_logprobs=3):
            out.append((c.completion_ids, c.scores.logprobs, c.prompt_scores.logprobs, c.prompt_scores.top))
    for c in run(engine, prompts, 5):
        out.append((c.completion_ids, c.scores.logprobs))
    for c in run(engine, prompts + [[t + 1 for t in p] for p in prompts], 2):  # 8 at once: short pieces share calls
        out.append((c.completion_ids, c.scores.logprobs))
    chat = list(CONTEXT_TOKENS[:9])
    for turn in range(3):
        [c] = run(engine, [chat], 4)
        out.append((c.completion_ids, c.scores.logprobs))
        chat = chat + c.completion_ids + [100 + turn, 101, 102]
    return out


def check_idle(engine):
    """Every block unreferenced once nothing runs; the cached ones are free for new sequences."""
    assert engine.pool.refs == [0] * engine.num_blocks
    assert engine.stats()["kv_blocks_used"] == 0 and engine.pool.free == engine.num_blocks


def compare(gen, **sizes):
    """(the workload with caching, without, the caching engine's stats)."""
    results = {}
    for caching in (True, False):
        engine = Engine(gen, 8, block_size=4, prefill_chunk=8, prefill_rows=1, prefix_caching=caching, **sizes)
        try:
            # prefill programs of 1 x 8 ... 8 x 1 tokens (data=2: 2 x 8 ... 8 x 2; data=4: 4 x 8, 8 x 4): short
            # pieces share calls
            assert [r * c for r, c in engine.shapes] == [8 * gen.data_parallel] * (4 - gen.data_parallel // 2)
            results[caching] = workload(engine)
            check_idle(engine)
            results[caching, "stats"] = engine.stats()
            results[caching, "evicted"] = engine.pool.evicted
            results[caching, "shapes"] = set(engine.prefill_calls)
        finally:
            engine.close()
    return results


@pytest.fixture(scope="module")
def model():
    cfg, _, params = random_model("llama", std=0.08, seq_len=CONTEXT)
    return cfg, params


def _assert_same_results(got, want):
    """The same tokens (ids, top alternatives' ids) and the same scores: bit for bit where XLA:CPU's
    programs round alike at every prefill shape (as on an AVX-512 host), else to 2e-6 relative (on an
    AVX2 host a cached prefix's shorter prefill call rounds a few scores differently in the last bits)."""
    if got == want:
        return

    def split(x, ids, scores):
        if isinstance(x, (list, tuple)):
            if len(x) == 2 and isinstance(x[0], int) and isinstance(x[1], float):  # (token, logprob)
                ids.append(x[0])
                scores.append(x[1])
            else:
                for y in x:
                    split(y, ids, scores)
        elif isinstance(x, float):
            scores.append(x)
        else:
            ids.append(x)
        return ids, scores

    (gi, gs), (wi, ws) = split(got, [], []), split(want, [], [])
    assert gi == wi
    np.testing.assert_allclose(gs, ws, rtol=2e-6, atol=1e-6)


def test_cached_prefixes_give_the_uncached_tokens_and_scores_bit_for_bit(model):
    cfg, params = model
    r = compare(Generator(cfg.model, params, eod_id=None), num_blocks=40)
    _assert_same_results(r[True], r[False])
    assert len(r[True, "shapes"]) > 1 and len(r[False, "shapes"]) > 1  # the smaller chunks were used
    on, off = r[True, "stats"], r[False, "stats"]
    # 4 + 4 + 4 choices share 5 blocks (20 tokens) of context: after the first, the rest of each
    # question's choices hit them (they wait for the first one's blocks); chat turns hit their history
    assert on["prefix_cache_hits"] >= 11 * 20 and on["prefix_cache_queries"] == off["prefill_tokens"]
    # a scored prompt recomputes its cached prefix's last position (the score of the token after it): 3 + 4 hits
    assert on["prefill_tokens"] == off["prefill_tokens"] - on["prefix_cache_hits"] + 7
    assert off["prefix_cache_hits"] == off["prefix_cache_queries"] == off["kv_blocks_cached"] == 0
    assert on["kv_blocks_cached"] > 0


def test_eviction_under_pressure_gives_the_same_outputs(model):
    """A pool of 10 blocks (a sequence needs up to 9): cached blocks are taken back for new sequences,
    least recently used first, and every output is unchanged."""
    cfg, params = model
    r = compare(Generator(cfg.model, params, eod_id=None), num_blocks=10)
    assert r[True] == r[False]
    assert r[True, "evicted"] > 0 and r[True, "stats"]["prefix_cache_hits"] > 0


@pytest.mark.parametrize("mesh", [["mesh.data=2", "mesh.tensor=4"], ["mesh.tensor=2"]])
def test_on_the_mesh_cached_prefixes_give_the_uncached_outputs_bit_for_bit(model, mesh):
    cfg, params = model
    sharded = load_config(base=cfg.to_dict(), overrides=mesh)
    gen = Generator(cfg.model, params, eod_id=None, mesh=make_mesh(sharded), rules=make_rules(sharded).activations)
    r = compare(gen, num_blocks=40)
    assert r[True] == r[False] and r[True, "stats"]["prefix_cache_hits"] > 0
    assert len(r[True, "shapes"]) > 1  # with caching, the tails took smaller chunks than without


def test_a_block_is_shared_only_once_written_and_identical_prompts_wait_for_it(model):
    """Three identical 30-token prompts at once: the first prefills 4 chunks; the others wait until its
    blocks are written and cached, then map all 7 full blocks (28 tokens) and prefill 2. Every block a
    sequence maps is cached and fully written by its writer."""
    cfg, params = model
    engine = Engine(Generator(cfg.model, params, eod_id=None), 3, block_size=4, num_blocks=30, prefill_chunk=8)
    take = engine.pool.take

    def checked_take(blocks):
        for b in blocks:
            assert b in engine.pool._hash_of
            for s in engine._running.values():
                if b in s.blocks:
                    assert (s.blocks.index(b) + 1) * engine.block_size <= max(s.prefilled, s.write_from)
        take(blocks)

    engine.pool.take = checked_take
    prompt = list(range(100, 130))
    try:
        a, b, c = run(engine, [prompt] * 3, 3)
        stats = engine.stats()
        check_idle(engine)
    finally:
        engine.close()
    assert a.completion_ids == b.completion_ids == c.completion_ids and a.scores.logprobs == c.scores.logprobs
    assert stats["prefix_cache_hits"] == 2 * 28 and stats["prefill_tokens"] == 30 + 2 * 2


def test_block_pool_counts_references_and_evicts_the_least_recently_used():
    pool = BlockPool(4, 2)
    hashes = prefix_hashes([1, 2, 3, 4, 5], 2)
    assert len(hashes) == 2 and hashes != prefix_hashes([1, 2, 3, 9], 2)[:2] and hashes[0] == prefix_hashes([1, 2], 2)[0]
    a = pool.allocate(3)
    pool.cache(a[0], hashes[0], None)
    pool.cache(a[1], hashes[1], None)
    assert pool.lookup(hashes) == a[:2] and pool.lookup(hashes, scores=True) == []
    pool.take(a[:2])
    assert pool.refs[a[0]] == 2
    pool.release(a)  # a[0], a[1] still held once; a[2] free
    pool.release(a[:2])  # cached, unreferenced: a[1] released last
    assert pool.free == 4 and pool.cached == 2
    pool.take([a[1]])
    pool.release([a[1]])  # a[1] now most recently used
    fresh = pool.allocate(2)  # the free list (2 blocks), nothing evicted
    assert pool.evicted == 0 and pool.cached == 2
    more = pool.allocate(1)  # the least recently used cached block: a[0]
    assert more == [a[0]] and pool.evicted == 1 and pool.lookup(hashes) == []
    assert pool.allocate(2) is None
    pool.release(fresh + more)
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(more)


def test_serve_flag_turns_prefix_caching_on_and_off():
    """Not given, the option is None (so that --batching static refuses it only when given) and serve takes
    it as on (cmd_serve: `is not False`); its help says so."""
    import inspect
    from megajax.cli import cmd_serve, parse_args
    assert parse_args(["serve", "--checkpoint", "x"]).enable_prefix_caching is None  # not given: on
    assert "args.enable_prefix_caching = args.enable_prefix_caching is not False" in inspect.getsource(cmd_serve)
    assert parse_args(["serve", "--checkpoint", "x", "--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert parse_args(["serve", "--checkpoint", "x", "--enable-prefix-caching"]).enable_prefix_caching is True


def test_a_chat_turn_maps_its_history_up_to_the_previous_reply(model):
    """Each turn resends the conversation (prompt + reply + 3 tokens): it maps the blocks of the previous
    prompt, not those of the reply (the decode steps wrote their k/v: a prefill of the same tokens gives other
    last bits), and its tokens and log probabilities equal those without caching bit for bit (decode
    programs of 3 rows, prefill programs of 3 x 16 tokens and smaller chunks; on tensor=2, where the numbers
    are the most sensitive to the shapes)."""
    cfg, params = model
    sharded = load_config(base=cfg.to_dict(), overrides=["mesh.tensor=2"])
    gen = Generator(cfg.model, params, eod_id=None, mesh=make_mesh(sharded), rules=make_rules(sharded).activations)
    out = {}
    for caching in (True, False):
        engine = Engine(gen, 3, block_size=4, num_blocks=30, prefill_chunk=16, prefix_caching=caching)
        try:
            chat, turns = list(range(20, 30)), []
            for turn in range(3):
                [c] = run(engine, [chat], 7)
                turns.append((c.completion_ids, c.scores.logprobs, engine.stats()["prefix_cache_hits"]))
                chat = chat + c.completion_ids + [5, 6, 7]
            check_idle(engine)
        finally:
            engine.close()
        out[caching] = turns
    assert [t[:2] for t in out[True]] == [t[:2] for t in out[False]]
    # turn 2 (20 tokens) maps the 2 full blocks of turn 1's 10-token prompt; turn 3 (30 tokens) turn 2's 5
    assert [t[2] for t in out[True]] == [0, 8, 8 + 20]
