"""Generation for hybrid Mamba-2 models: a Mamba layer's decode state skips padding (left, right, a
finished row) exactly; cached greedy tokens equal full forward passes (per-layer and stacked caches, a
hybrid and a pure Mamba model) and a batched prompt's equal its own; the continuous engine (paged KV for
attention, one state per row for Mamba, chunked prefill, reused rows) equals the Generator; both on data
4 x tensor 2 equal one device, with the chunked and the Pallas prefill scan; `megajax generate` on a
trained hybrid checkpoint; a pure Mamba model's decode memory is flat in the length."""

import importlib
import json
import queue

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from random_model import VOCAB, random_model
from test_hybrid import HYBRID
from megajax.cli import main
from megajax.config import load_config
from megajax.inference.batcher import Job
from megajax.inference.engine import Engine, pool_bytes_per_device
from megajax.inference.generate import Generator
from megajax.inference.sampling import Sampling
from megajax.models.layers import LinearOps
from megajax.models.mamba import Mamba2Mixer, MambaState, empty_state
from megajax.models.transformer import NoCache, StateCache, layer_caches

CONTEXT = 48
# Every layer a Mamba-2 mixer (the sizes of HYBRID's).
MAMBA = [o for o in HYBRID if "pattern" not in o and "expert" not in o and "moe" not in o
         and "activation" not in o] + ["model.hybrid_layer_pattern=MMM"]
MODELS = {"hybrid": HYBRID, "mamba": MAMBA}
# ragged: 1 token (less than the conv window), 2, 6 and 13
PROMPTS = ([65], [66, 67], [104, 101, 108, 108, 111, 33], list(range(70, 83)))


def model(name):
    """(config, spec, params): the shared small random model (tests/random_model.py) with the hybrid's
    layers; N(0, 0.08) weights. Cached: do not mutate."""
    return random_model("llama", *MODELS[name], std=0.08, seq_len=CONTEXT)


def full_forward_greedy(spec, params, prompt, n):
    """Reference: the whole window through the model for every new token (no cache). Returns (tokens,
    smallest margin between the best and second-best logit)."""
    apply = jax.jit(spec.apply)
    ids, margin = list(prompt), np.inf
    for _ in range(n):
        buf = np.zeros((1, CONTEXT), np.int32)
        buf[0, :len(ids)] = ids
        logits = np.asarray(apply(params, buf))[0, len(ids) - 1, :VOCAB]
        top2 = np.sort(logits)[-2:]
        margin = min(margin, top2[1] - top2[0])
        ids.append(int(np.argmax(logits)))
    return ids[len(prompt):], margin


def close(a, b, tol=2e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=tol, atol=tol)


# ------------------------------------------------------------------ the mixer's decode state


@pytest.fixture(scope="module")
def mixer():
    cfg = load_config(overrides=["model.hidden_size=32", *HYBRID]).model
    mix = Mamba2Mixer(cfg, dtype=jnp.float32, ops=LinearOps(), rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 10, 32))
    return cfg, mix, x


def test_mamba_extend_in_pieces_equals_the_whole_sequence(mixer):
    """A prefill in one call, in chunks (4 + 3) then one-token decode steps: the outputs of the whole
    sequence's mixer and one final state."""
    cfg, mix, x = mixer
    full = mix(x)
    y, state = mix.extend(x, empty_state(cfg, 2))
    close(y, full)
    outs, s = [], empty_state(cfg, 2)
    for a, b in ((0, 4), (4, 7), (7, 8), (8, 9), (9, 10)):
        y, s = mix.extend(x[:, a:b], s)
        outs.append(y)
    close(jnp.concatenate(outs, axis=1), full)
    close(s, state)


def test_mamba_extend_with_unmerged_adapters_equals_the_whole_sequence():
    """model.lora's in_proj and out_proj adapters (B nonzero) unmerged: generation's five products plus
    the adapter's delta split as in_proj's give the fused training product's outputs."""
    cfg = load_config(overrides=["model.hidden_size=32", *HYBRID, "model.lora.rank=4",
                                 "model.lora.targets=[in_proj,out_proj]"]).model
    mix = Mamba2Mixer(cfg, dtype=jnp.float32, ops=LinearOps(), rngs=nnx.Rngs(0))
    for lora in (mix.in_proj_lora, mix.out.lora):
        lora.b[...] = jax.random.normal(jax.random.key(2), lora.b.shape)
    x = jax.random.normal(jax.random.key(1), (2, 10, 32))
    full = mix(x)
    mix.in_proj_lora.b[...] = jnp.zeros(mix.in_proj_lora.b.shape)
    assert np.abs(np.asarray(full - mix(x))).max() > 0.1  # the in_proj adapter matters
    mix.in_proj_lora.b[...] = jax.random.normal(jax.random.key(2), mix.in_proj_lora.b.shape)
    y, _ = mix.extend(x, empty_state(cfg, 2))
    close(y, full)


@pytest.mark.parametrize("length", [1, 2, 6])  # shorter than the conv window (K - 1 = 3), and longer
def test_mamba_left_padding_leaves_the_state_of_the_prompt_alone(mixer, length):
    """A prompt left-padded with arbitrary (nonzero) inputs: its outputs and its state after the prefill
    equal those of the prompt alone, unpadded (the padding enters neither the conv window nor the scan)."""
    cfg, mix, x = mixer
    alone, state = mix.extend(x[:, -length:], empty_state(cfg, 2))
    valid = jnp.broadcast_to(jnp.arange(10) >= 10 - length, (2, 10))
    y, padded = mix.extend(x, empty_state(cfg, 2), valid_BxL=valid)
    close(y[:, -length:], alone)
    close(padded, state)
    nxt = jax.random.normal(jax.random.key(2), (2, 1, 32))
    close(mix.extend(nxt, padded), mix.extend(nxt, state))  # the next step sees the same window


def test_mamba_right_padding_and_idle_rows_keep_the_state_of_the_real_tokens(mixer):
    """A chunk whose rows end early (row 0 after 6 tokens, row 1 has none: a finished row) leaves each
    row's state as its real tokens make it, the window ending at its last real token."""
    cfg, mix, x = mixer
    _, s0 = mix.extend(x[:, :3], empty_state(cfg, 2))
    valid = jnp.stack([jnp.arange(7) < 6, jnp.zeros(7, bool)])
    _, got = mix.extend(x[:, 3:], s0, valid_BxL=valid)
    _, want0 = mix.extend(x[:1, 3:9], jax.tree.map(lambda a: a[:1], s0))
    close(jax.tree.map(lambda a: a[:1], got), want0)
    close(jax.tree.map(lambda a: a[1:], got), jax.tree.map(lambda a: a[1:], s0))
    y, _ = mix.extend(x[:1, 9:], jax.tree.map(lambda a: a[:1], got))
    close(y, mix(x[:1])[:, 9:])  # continuing after the padded chunk: the whole sequence's output


# ------------------------------------------------------------------ the Generator


@pytest.mark.parametrize("name,layer_buffers", [("hybrid", True), ("hybrid", False), ("mamba", True)])
def test_cached_greedy_equals_full_forward_on_a_ragged_batch(name, layer_buffers):
    cfg, spec, params = model(name)
    gen = Generator(cfg.model, params, eod_id=None, layer_buffers=layer_buffers)
    done, _ = gen.generate(PROMPTS, Sampling(), 8)
    for prompt, c in zip(PROMPTS, done):
        want, margin = full_forward_greedy(spec, params, prompt, 8)
        assert margin > 1e-4  # the reference's choices are not ties
        assert c.completion_ids == want, prompt


def test_a_batched_prompt_gets_what_it_gets_alone():
    """Prompts of 1, 2, 6, 13 and 16 tokens (the last unpadded in the 16-token bucket) batched together:
    each one's greedy tokens, log-probabilities and Mamba states after the prefill equal its own."""
    cfg, _, params = model("hybrid")
    gen = Generator(cfg.model, params, eod_id=None)
    prompts = [*PROMPTS, list(range(150, 166))]
    mamba = [i for i, layer in enumerate(gen.layers) if isinstance(layer, StateCache)]
    batch = gen.start(prompts, [Sampling()] * len(prompts), [8] * len(prompts))
    prefilled = [jax.tree.map(np.asarray, batch.cache_k[i]) for i in mamba]
    tokens, _, _ = gen.read(gen.advance(batch))
    for row, prompt in enumerate(prompts):
        alone = gen.start([prompt], [Sampling()], [8])
        for i, got in zip(mamba, prefilled):
            close(jax.tree.map(lambda a: a[row:row + 1], got), alone.cache_k[i], tol=1e-5)
        state = gen.advance(alone)
        assert list(gen.read(state)[0][0, :8]) == list(tokens[row, :8])


# ------------------------------------------------------------------ the continuous engine


def run(engine, prompts, n, stagger=False):
    """Completion ids of `prompts` (n new tokens each); `stagger`: each job submitted once the previous
    one has streamed its first token (so it joins a running batch)."""
    events = queue.Queue()
    jobs = [Job(list(p), Sampling(), n, i, events, stream=stagger) for i, p in enumerate(prompts)]
    done = {}
    for job in jobs:
        engine.submit([job])
        while stagger and job.sent == 0 and job.index not in done:
            kind, i, payload = events.get(timeout=300)
            assert kind != "error", payload
            if kind == "done":
                done[i] = payload
    while len(done) < len(jobs):
        kind, i, payload = events.get(timeout=300)
        assert kind != "error", payload
        if kind == "done":
            done[i] = payload
    return [done[i].completion_ids for i in range(len(jobs))]


@pytest.mark.parametrize("name", ["hybrid", "mamba"])
def test_engine_equals_the_generator(name):
    """3 rows for 5 jobs (rows reused: a new sequence's Mamba state starts afresh), 8-token prefill
    chunks (the 30-token prompt: 4 chunks carrying the state), together and staggered."""
    cfg, _, params = model(name)
    gen = Generator(cfg.model, params, eod_id=None)
    prompts = [*PROMPTS, list(range(100, 130))]
    want = [c.completion_ids for c in gen.generate(prompts, Sampling(), 10)[0]]
    engine = Engine(gen, 3, block_size=4, num_blocks=16, prefill_chunk=8)
    try:
        assert run(engine, prompts, 10) == want
        assert run(engine, prompts[::-1], 10, stagger=True)[::-1] == want
        # a Mamba layer's state after a prefix is per row, not per block: no prefix caching
        assert not engine.prefix_caching and engine.stats()["prefix_cache_queries"] == 0
        assert "prefix caching off: the model has Mamba layers" in engine._caching_text()
    finally:
        engine.close()


def test_generation_and_the_engine_on_data_4_tensor_2_equal_one_device(tmp_path, monkeypatch):
    """The hybrid's checkpoint saved with mesh.tensor=2 and loaded as `megajax generate` loads it: on
    data 4 x tensor 2 (each Mamba state's heads and groups split over `tensor` like the mixer's
    weights) the Generator's greedy tokens and the continuous engine's (paged attention KV, per-row
    Mamba states, chunked prefill) equal one device's; so do they with model.mamba_ssd_impl=pallas,
    whose prefills (and prefill chunks, from the carried state) run the Pallas scan per shard (taken
    here as on a GPU, the kernels interpreted on CPU)."""
    from functools import partial
    from megajax.checkpoint.manager import write_params_checkpoint
    from megajax.inference import generate as generate_module
    from megajax.inference.load import find_source, generation_config, load_model
    cfg, _, params = model("hybrid")
    out = tmp_path / "run"
    write_params_checkpoint(params, load_config(base=cfg.to_dict(), overrides=["mesh.tensor=2"]), out)
    source = find_source(str(out), None)
    one = load_model(generation_config(source, []), source, devices=jax.devices()[:1])
    sharded = load_model(generation_config(source, ["mesh.data=4", "mesh.tensor=2"]), source, user_mesh=True)
    assert sharded.mesh_text == "data=4 x tensor=2"
    want = [c.completion_ids for c in one.generator.generate(PROMPTS, Sampling(), 10)[0]]
    assert [c.completion_ids for c in sharded.generator.generate(PROMPTS, Sampling(), 10)[0]] == want
    state = sharded.generator.start(PROMPTS, [Sampling()] * 4, [4] * 4)
    mamba = state.cache_k[0]
    assert isinstance(mamba, MambaState)
    for leaf, dim in zip(mamba, (2, 2, 2, 1)):  # conv_x [B, K-1, heads, p], conv_B/C [.., groups, n], ssm [B, heads, ..]
        assert leaf.sharding.spec[dim] == "tensor", leaf.sharding.spec
    engine = Engine(sharded.generator, 3, block_size=4, num_blocks=16, prefill_chunk=8)
    try:
        assert run(engine, list(PROMPTS), 10) == want
    finally:
        engine.close()
    kernels = importlib.import_module("pallas_kernels.ssd")  # the module (the package exports its ssd)
    calls = []

    def counted(*args, **kwargs):  # the kernels' scan, counting the prefills it traces from a carried state
        calls.append(kwargs["initial_state"].shape)
        return kernel_ssd(*args, **kwargs)
    kernel_ssd = kernels.ssd
    monkeypatch.setattr(kernels, "ssd", counted)
    monkeypatch.setattr(generate_module, "generation_ssd", partial(generate_module.generation_ssd, platform="gpu"))
    pallas = load_model(generation_config(source, ["mesh.data=4", "mesh.tensor=2", "model.mamba_ssd_impl=pallas",
                                                   "model.mamba_chunk_size=16"]), source, user_mesh=True)
    assert pallas.generator.graphdef != sharded.generator.graphdef  # the model holds the kernels' scan
    assert [c.completion_ids for c in pallas.generator.generate(PROMPTS, Sampling(), 10)[0]] == want
    # per shard: 1 of the 4 rows (data 4) and 8 of the 16 heads, in each of the 2 Mamba layers
    assert calls == [(1, 8, 8, 8)] * 2, calls
    engine = Engine(pallas.generator, 3, block_size=4, num_blocks=16, prefill_chunk=8)
    try:
        assert run(engine, list(PROMPTS), 10) == want
    finally:
        engine.close()


# ------------------------------------------------------------------ the generate command


def test_generate_command_on_a_trained_hybrid(small_config, tmp_path):
    """Train 2 steps of the hybrid; its end-of-training sample (greedy, the stacked cache on the training
    mesh) is what `megajax generate` prints (per-layer caches on the checkpoint's mesh)."""
    from megajax.cli import run_training
    cfg = small_config(*HYBRID, "train.sample_tokens=8", "train.sample_temperature=0", steps=2)
    result = run_training(cfg)
    out = tmp_path / "out.json"
    assert main(["generate", "--checkpoint", cfg.train.run_dir, "--prompt", result.sample_prompt,
                 "--max-new-tokens", "8", "--json", str(out)]) == 0
    [got] = json.loads(out.read_text())
    assert got["completion_ids"]
    assert result.sample == result.sample_prompt + got["text"]


# ------------------------------------------------------------------ memory


def test_layer_caches_know_mamba_layers_keep_a_fixed_state():
    cfg = model("hybrid")[0].model
    caches = layer_caches(cfg)
    assert [type(c).__name__ for c in caches] == ["StateCache", "LayerCache", "NoCache", "NoCache"] * 2
    assert [c.numbers_per_token() for c in caches[:4]] == [0, 2 * cfg.num_kv_heads * cfg.head_dim, 0, 0]
    state = empty_state(cfg, 1, jnp.bfloat16)
    assert caches[0].bytes_per_sequence(jnp.bfloat16) == sum(x.nbytes for x in jax.tree.leaves(state))
    assert isinstance(caches[2], NoCache) and caches[2].bytes_per_sequence(jnp.float32) == 0


def test_pure_mamba_decode_memory_is_flat_in_the_generated_length():
    """A pure Mamba model's decode state after 16 and 256 tokens of room: the same Mamba state bytes (3
    layers x 6,016 fp32: conv windows 3 x (128 + 2 x 16) and SSM state 16 x 8 x 8 numbers), the same
    compiled temporaries of the decode program; only the token bookkeeping (ids, log p: 8 bytes a
    token) grows. The engine's pool for the same model: the states of its rows, nothing per position."""
    cfg, _, params = random_model("llama", *MAMBA, std=0.08, seq_len=512)
    gen = Generator(cfg.model, params, eod_id=None)
    per_sequence = sum(c.bytes_per_sequence(jnp.float32) for c in gen.layers)
    assert per_sequence == 3 * 6016
    measured = {}
    for room in (16, 256):
        state = gen.start([[65, 66, 67]], [Sampling()], [room])
        states = [c for c in state.cache_k if isinstance(c, MambaState)]
        assert len(states) == 3 and all(v is None for v in state.cache_v)
        state_bytes = sum(x.nbytes for x in jax.tree.leaves(states))
        state = gen.advance(state, 4)
        key = [k for k in gen._compiled if k[0] == "advance"][-1]
        memory = gen._compiled[key].memory_analysis()
        measured[room] = (state_bytes, memory.temp_size_in_bytes, memory.argument_size_in_bytes)
    assert measured[16][0] == measured[256][0] == per_sequence  # batch bucket 1
    assert measured[16][1] == measured[256][1]
    assert measured[256][2] - measured[16][2] < 10 * 240  # ids, log p (and the like) of 240 more tokens
    assert pool_bytes_per_device(gen, 10**6, rows=4) == 4 * per_sequence


def test_a_decode_step_is_the_scan_of_one_token(mixer):
    """The one-token path of a decode step (the recurrence, ssd_step) equals the chunked scan's."""
    from megajax.models.mamba import ssd_step
    from pallas_kernels.ssd import ssd_chunked
    cfg = mixer[0]
    k = jax.random.split(jax.random.key(3), 6)
    h, p, g, n = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_num_groups, cfg.mamba_state_dim
    x, b, c = (jax.random.normal(k[0], (2, 1, h, p)), jax.random.normal(k[1], (2, 1, g, n)),
               jax.random.normal(k[2], (2, 1, g, n)))
    dt, a = jax.nn.softplus(jax.random.normal(k[3], (2, 1, h))), -jnp.exp(jax.random.normal(k[4], (h,)))
    s0 = jax.random.normal(k[5], (2, h, p, n))
    close(ssd_step(x, dt, a, b, c, s0),
          ssd_chunked(x, dt, a, b, c, chunk_size=cfg.mamba_chunk_size, initial_state=s0, return_final_state=True),
          tol=1e-5)
