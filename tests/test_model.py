"""Model properties: causality, GQA, padding, recompute, scan, RoPE scaling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from megajax.config import load_config
from megajax.models import Transformer
from megajax.models.attention import xla_attention
from megajax.models.layers import rope_inv_freq, softmax, softmax_lse


def tiny(family="llama", *overrides):
    return load_config(overrides=["model.num_layers=2", "model.hidden_size=32", "model.num_heads=4",
                                  "model.num_kv_heads=2", "model.ffn_hidden_size=64", "model.vocab_size=100",
                                  "train.seq_len=16", f"model.family={family}", *overrides]).model


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_causal_and_jit_consistent(family):
    model = Transformer(tiny(family), rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 100)
    logits = model(tokens)
    changed = model(tokens.at[:, 10].set((tokens[:, 10] + 1) % 100))
    np.testing.assert_array_equal(logits[:, :10], changed[:, :10])  # the past does not see the future
    assert not np.allclose(logits[:, 10:], changed[:, 10:])
    jitted = nnx.jit(lambda m, t: m(t))(model, tokens)
    np.testing.assert_allclose(jitted, logits, rtol=1e-5, atol=1e-5)


def test_segment_ids_block_attention_across_documents():
    model = Transformer(tiny(), rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 16), 0, 100)
    seg = jnp.asarray([[0] * 8 + [1] * 8])
    pos = jnp.asarray([list(range(8)) * 2])
    packed = model(tokens, pos, seg)
    alone = model(tokens[:, 8:], pos[:, 8:])
    np.testing.assert_allclose(packed[:, 8:], alone, rtol=1e-5, atol=1e-5)


def test_grouped_query_attention_equals_repeated_kv():
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (2, 12, 6, 8))
    k = jax.random.normal(kk, (2, 12, 2, 8))
    v = jax.random.normal(kv, (2, 12, 2, 8))
    got = xla_attention(q, k, v, causal=True)
    k_rep, v_rep = jnp.repeat(k, 3, axis=2), jnp.repeat(v, 3, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k_rep) / np.sqrt(8)
    s = jnp.where(jnp.tril(jnp.ones((12, 12), bool)), s, -jnp.inf)
    want = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v_rep)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_vocab_padding_is_masked_and_does_not_change_weights():
    cfg = tiny()
    a = Transformer(cfg, padded_vocab_size=128, rngs=nnx.Rngs(0))
    b = Transformer(cfg, padded_vocab_size=512, rngs=nnx.Rngs(0))
    tokens = jnp.arange(16)[None]
    la, lb = a(tokens), b(tokens)
    np.testing.assert_allclose(la[..., :100], lb[..., :100], rtol=1e-6, atol=1e-6)
    assert float(lb[..., 100:].max()) < -1e30
    np.testing.assert_array_equal(b.embed.embedding[...][100:], 0)


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_recompute_gives_same_gradients(policy):
    cfg = tiny()
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 100)

    def grads(recompute):
        model = Transformer(cfg, recompute=recompute, rngs=nnx.Rngs(0))
        return nnx.grad(lambda m: jnp.mean(m(tokens)[..., :100] ** 2))(model)

    for x, y in zip(jax.tree.leaves(grads("none")), jax.tree.leaves(grads(policy))):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_layers_are_scanned_so_program_size_does_not_grow_with_depth():
    def num_dots(layers):
        cfg = tiny("llama", f"model.num_layers={layers}")
        model = Transformer(cfg, rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(model)
        hlo = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)).lower(state, jnp.zeros((1, 16), jnp.int32)).as_text()
        return hlo.count("dot_general")
    assert num_dots(2) == num_dots(8)


def test_unrolled_layers_equal_scanned_layers():
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 100)

    def run(scan):
        model = Transformer(tiny("llama", f"model.scan_layers={str(scan).lower()}"), rngs=nnx.Rngs(0))
        return nnx.value_and_grad(lambda m: jnp.mean(m(tokens)[..., :100] ** 2))(model)

    (a, ga), (b, gb) = run(True), run(False)
    np.testing.assert_allclose(a, b, rtol=1e-6)
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)


def test_dropout_changes_training_forward_only():
    cfg = tiny("gpt", "model.hidden_dropout=0.5", "model.attention_dropout=0.5")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.arange(16)[None]
    plain = model(tokens)
    np.testing.assert_array_equal(plain, model(tokens))
    dropped = model(tokens, dropout_rng=jax.random.key(0))
    assert not np.allclose(plain, dropped)


def test_llama3_rope_scaling_matches_transformers():
    rope = pytest.importorskip("transformers.modeling_rope_utils")
    from transformers import LlamaConfig
    hf = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0,
                     max_position_embeddings=131072,
                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    inv_freq, _ = rope.ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    ours = rope_inv_freq(128, 500000.0, "llama3", 8.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(ours, inv_freq.numpy(), rtol=1e-6)


def test_softmax_keeps_only_its_output_for_the_backward_pass(capsys):
    x = jax.random.normal(jax.random.key(0), (3, 5, 7)) * 4
    x = x.at[0, 0].set(jnp.finfo(jnp.float32).min)  # a masked row, as attention's where() writes it
    cot = jax.random.normal(jax.random.key(1), x.shape)
    np.testing.assert_array_equal(softmax(x), jax.nn.softmax(x, axis=-1))
    y, lse = softmax_lse(x)
    np.testing.assert_array_equal(y, jax.nn.softmax(x, axis=-1))
    np.testing.assert_allclose(lse, jax.nn.logsumexp(x, axis=-1), rtol=1e-6)
    for axis in (-1, 1):
        np.testing.assert_allclose(jax.vjp(lambda a: softmax(a, axis), x)[1](cot)[0],
                                   jax.vjp(lambda a: jax.nn.softmax(a, axis=axis), x)[1](cot)[0], rtol=1e-5, atol=1e-6)
    ours = jax.grad(lambda a: jnp.sum(softmax_lse(a)[0] * cot) + jnp.sum(jnp.square(softmax_lse(a)[1])))(x)
    jaxs = jax.grad(lambda a: jnp.sum(jax.nn.softmax(a) * cot) + jnp.sum(jnp.square(jax.nn.logsumexp(a, axis=-1))))(x)
    np.testing.assert_allclose(ours, jaxs, rtol=1e-5, atol=1e-5)
    capsys.readouterr()

    def both(a):
        y, lse = softmax_lse(a)
        return y + lse[..., None]

    for f in (softmax, both):  # saved: the softmax, and sin's cosine
        print_saved_residuals(lambda a: jnp.sum(jnp.sin(f(a))), x)
        saved = [line for line in capsys.readouterr().out.splitlines() if "from the argument" not in line]
        assert len(saved) == 2 and sum("f32[3,5,7] output of custom_jvp_call" in line for line in saved) == 1, saved
