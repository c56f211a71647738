"""Generation with multi-latent attention (tiny-deepseek-v3: a dense first layer, then MoE layers, one
MTP depth): the latent cache's shapes, cached greedy tokens and log-probabilities equal to full forward
passes (prefill expanded, decode in the absorbed form), the continuous engine's tokens equal to the
Generator's, the MTP depth unused, and the cache replicated over `tensor` on data=2 x tensor=4."""

import queue

import jax
import numpy as np
import pytest

from random_model import random_model
from test_deepseek_v3 import YARN_OVERRIDES, random_model as random_deepseek
from megajax.checkpoint.source import flatten, unflatten
from megajax.config import load_config
from megajax.inference.batcher import Job
from megajax.inference.engine import Engine
from megajax.inference.generate import MAX_TOP_LOGPROBS, Generator
from megajax.inference.sampling import Sampling
from megajax.mesh import make_mesh, make_rules
from megajax.models.layout import split_expert_bias
from megajax.models.transformer import layer_caches

VOCAB = 257
CONTEXT = 48
NEW = 10
PROMPTS = ([65], [104, 101, 108, 108, 111, 33], list(range(70, 83)))  # ragged: 1, 6 and 13 tokens


@pytest.fixture(scope="module")
def model():
    """(config, spec, params, expert bias [MoE layers, E]): tiny-deepseek-v3 with random weights
    (N(0, 0.08): clear argmax margins), a CONTEXT-token window, and DeepSeek-V3's YaRN rope scaling at toy
    sizes (mscale != mscale_all_dim: the rope and softmax gains both differ from 1)."""
    cfg = load_config(["model/tiny-deepseek-v3"],
                      [f"model.vocab_size={VOCAB}", f"train.seq_len={CONTEXT}", *YARN_OVERRIDES])
    cfg, spec, params = random_deepseek(cfg, std=0.08)
    weights, bias = split_expert_bias(params)
    return cfg, spec, weights, bias


@pytest.fixture(scope="module")
def generator(model):
    cfg, _, params, bias = model
    return Generator(cfg.model, params, eod_id=None, expert_bias=bias)


def full_log_probs(spec, params, bias, ids):
    """log_softmax of the full forward's logits [len(ids), VOCAB] over the CONTEXT window (fp64 on the host)."""
    buf = np.zeros((1, CONTEXT), np.int32)
    buf[0, :len(ids)] = ids
    logits = np.asarray(jax.jit(spec.apply)(params, buf, expert_bias=bias))[0, :len(ids), :VOCAB].astype(np.float64)
    return logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True), logits


def test_the_cache_holds_the_latent_and_the_rope_key_per_token(model, generator):
    m = model[0].model
    assert m.multi_latent_attention and m.dense_first_layers() == 1 and m.mtp_num_layers == 1
    layers = layer_caches(m)
    assert len(layers) == m.num_layers  # the MTP depth has no cache: generation runs the main head only
    assert all(layer.numbers_per_token() == m.kv_lora_rank + m.qk_pos_emb_head_dim for layer in layers)
    state = generator.start(PROMPTS, [Sampling()] * 3, [4] * 3)
    b, t = 4, 16 + 16  # the batch and length buckets
    assert [c.shape for c in state.cache_k] == [(b, t, m.kv_lora_rank)] * m.num_layers
    assert [c.shape for c in state.cache_v] == [(b, t, m.qk_pos_emb_head_dim)] * m.num_layers
    full = load_config(["model/deepseek-v3"]).model  # bf16: 2 bytes a number (docs/moe.md's figures)
    assert sum(layer.numbers_per_token() for layer in layer_caches(full)) * 2 == 61 * (512 + 64) * 2 == 70_272
    stacked = Generator(m, model[2], eod_id=None, expert_bias=model[3], layer_buffers=False)
    state = stacked.start(PROMPTS, [Sampling()] * 3, [4] * 3)
    assert (state.cache_k.shape, state.cache_v.shape) == ((m.num_layers, b, t, m.kv_lora_rank),
                                                          (m.num_layers, b, t, m.qk_pos_emb_head_dim))


def test_cached_greedy_tokens_and_log_probs_equal_the_full_forward(model, generator):
    """Every new token (prefill: kv_up and the core; decode: the absorbed form over the latent cache) and
    the prompt's scores: the same tokens, and log-probabilities (the top 20 too) within 2e-5."""
    _, spec, params, bias = model
    state = generator.start(PROMPTS, [Sampling()] * 3, [NEW] * 3, top_n=MAX_TOP_LOGPROBS, score_prompt=True)
    state = generator.advance(state)
    tokens, _, count = generator.read(state)
    scores = generator.read_scores(state)
    assert count == NEW
    p = scores["prompt_logprobs"].shape[1]
    worst = 0.0
    for row, prompt in enumerate(PROMPTS):
        new = [int(x) for x in tokens[row, :NEW]]
        logp, logits = full_log_probs(spec, params, bias, list(prompt) + new)
        margins = np.sort(logits[len(prompt) - 1:-1], -1)
        assert (margins[:, -1] - margins[:, -2]).min() > 1e-4  # no ties among the reference's choices
        assert new == [int(x) for x in logits[len(prompt) - 1:-1].argmax(-1)]  # greedy = full forward's argmax
        at = np.arange(len(prompt) - 1, len(prompt) - 1 + NEW)
        want = logp[at, new]
        np.testing.assert_allclose(scores["logprobs"][row, :NEW], want, atol=2e-5)
        top = np.sort(logp[at], -1)[:, ::-1][:, :MAX_TOP_LOGPROBS]
        np.testing.assert_allclose(scores["top_logprobs"][row, :NEW], top, atol=2e-5)
        if len(prompt) > 1:  # prompt token j (j >= 1) scored by position j - 1
            got = scores["prompt_logprobs"][row, p - len(prompt) + 1:]
            np.testing.assert_allclose(got, logp[np.arange(len(prompt) - 1), prompt[1:]], atol=2e-5)
        worst = max(worst, float(np.abs(scores["logprobs"][row, :NEW] - want).max()))
    print(f"max |cached - full forward| log p = {worst:.1e}")


def test_the_mtp_depth_does_not_change_generation(model, generator):
    cfg, _, params, bias = model
    want, _ = generator.generate(PROMPTS, Sampling(), 6)
    changed = jax.tree.map(lambda x: x, params)
    changed["mtp"] = jax.tree.map(lambda x: np.full_like(x, 3.0), params["mtp"])
    got, _ = Generator(cfg.model, changed, eod_id=None, expert_bias=bias).generate(PROMPTS, Sampling(), 6)
    assert [c.completion_ids for c in got] == [c.completion_ids for c in want]


def run_engine(engine, samplings, n):
    """The engine's completions of PROMPTS (n new tokens each), in order."""
    events = queue.Queue()
    engine.submit([Job(list(p), s, n, i, events) for i, (p, s) in enumerate(zip(PROMPTS, samplings))])
    done = {}
    while len(done) < len(PROMPTS):
        kind, i, payload = events.get(timeout=300)
        if kind == "error":
            raise AssertionError(payload)
        if kind == "done":
            done[i] = payload
    return [done[i] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("attention_blocks", [4, None])
def test_engine_runs_multi_latent_attention_with_the_generators_tokens(model, generator, attention_blocks):
    """The continuous engine's latent pools ([slots, kv_lora_rank] and [slots, qk_pos_emb_head_dim] per
    layer), chunked prefill and the absorbed attention (over the blocks in use, or over each row's whole
    table gathered: attention_blocks=None) give the Generator's greedy tokens."""
    m = model[0].model
    engine = Engine(generator, 2, block_size=4, num_blocks=16, prefill_chunk=8, decode_steps=4,
                    attention_blocks=attention_blocks)
    try:
        done = run_engine(engine, [Sampling()] * 3, NEW)
        assert [p.shape for p in engine._pools_k] == [(64, m.kv_lora_rank)] * m.num_layers
        assert [p.shape for p in engine._pools_v] == [(64, m.qk_pos_emb_head_dim)] * m.num_layers
    finally:
        engine.close()
    want, _ = generator.generate(PROMPTS, Sampling(), NEW)
    assert [c.completion_ids for c in done] == [c.completion_ids for c in want]


def test_generation_on_data_2_tensor_4_equals_one_device_with_the_latent_replicated(model, generator):
    """The Generator and the continuous engine on data 2 x tensor 4 (heads split, latent replicated):
    one device's tokens, greedy and seeded sampling."""
    cfg, _, params, bias = model
    sharded_cfg = load_config(base=cfg.to_dict(), overrides=["mesh.data=2", "mesh.tensor=4"])
    mesh = make_mesh(sharded_cfg)
    rules = make_rules(sharded_cfg)
    gen = Generator(cfg.model, params, eod_id=None, expert_bias=bias, mesh=mesh, rules=rules.activations)
    samplings = [Sampling(), Sampling(temperature=1.0, top_k=20, seed=1), Sampling(temperature=0.7, seed=2)]
    got, _ = gen.generate(PROMPTS, samplings, 6)
    want, _ = generator.generate(PROMPTS, samplings, 6)
    assert [c.completion_ids for c in got] == [c.completion_ids for c in want]
    state = gen.start(PROMPTS, samplings, [4] * 3)
    for cache in state.cache_k + state.cache_v:  # the batch over the data axes; slots and features whole
        assert cache.sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp", "expert"), None, None)
    engine = Engine(gen, 2, block_size=4, num_blocks=16, prefill_chunk=8, decode_steps=4)
    try:  # the engine's pools replicated (every data shard reads any block; the latent over tensor too)
        assert [c.completion_ids for c in run_engine(engine, samplings, 6)] == [c.completion_ids for c in want]
        assert all(p.sharding.spec == jax.sharding.PartitionSpec(None, None) for p in engine._pools_k + engine._pools_v)
    finally:
        engine.close()


def test_dense_first_layers_generate_without_multi_latent_attention():
    """moe_layer_freq's list form with grouped-query attention: the dense layer's cache first, then the
    MoE layer's, per-layer buffers and stacked alike, the full forward's greedy tokens."""
    cfg, spec, params = random_model("llama", "model.num_experts=4", "model.moe_router_topk=2",
                                     "model.moe_ffn_hidden_size=32", "model.moe_layer_freq=[0,1]",
                                     std=0.08, seq_len=CONTEXT)
    assert cfg.model.dense_first_layers() == 1
    apply = jax.jit(spec.apply)
    want = []
    for prompt in PROMPTS:
        ids = list(prompt)
        for _ in range(6):
            buf = np.zeros((1, CONTEXT), np.int32)
            buf[0, :len(ids)] = ids
            logits = np.asarray(apply(params, buf))[0, len(ids) - 1, :VOCAB]
            top2 = np.sort(logits)[-2:]
            assert top2[1] - top2[0] > 1e-4  # no ties
            ids.append(int(logits.argmax()))
        want.append(ids[len(prompt):])
    for layer_buffers in (True, False):
        gen = Generator(cfg.model, params, eod_id=None, layer_buffers=layer_buffers)
        assert [c.completion_ids for c in gen.generate(PROMPTS, Sampling(), 6)[0]] == want


def test_generate_from_the_hugging_face_export_equals_transformers_generate(model, tmp_path):
    """`megajax generate --hf` / `serve --hf` of the DeepseekV3ForCausalLM export (its expert bias imported
    beside the parameters; its MTP depth kept, and not run) gives transformers' greedy tokens."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from megajax.checkpoint.hf import export_hf
    from megajax.checkpoint.source import DictSource
    from megajax.inference.load import find_source, generation_config, load_model
    from megajax.models.layout import expert_bias_rows
    cfg, _, params, bias = model
    biases = {name: bias[rows.start:rows.stop] for name, rows in expert_bias_rows(cfg.model).items()}
    out = export_hf(DictSource(unflatten(dict(flatten(params)) | biases), cfg.model), tmp_path / "hf",
                    tokenizer_spec="byte", dtype="fp32")
    source = find_source(None, str(out))
    loaded = load_model(generation_config(source, ["train.precision=fp32"]), source, devices=jax.devices()[:1])
    assert loaded.cfg.model.mtp_num_layers == 1 and loaded.generator.expert_bias is not None
    got, _ = loaded.generator.generate(PROMPTS, Sampling(), 8)
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    for prompt, c in zip(PROMPTS, got):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                                 pad_token_id=0)[0, len(prompt):].tolist()
        assert c.completion_ids == theirs
