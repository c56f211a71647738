"""Sigmoid routing and aux-loss-free balancing (DeepSeek-V3, Megatron-Core's
`moe_router_score_function=sigmoid` and `moe_router_enable_expert_bias`): the routing, the
balancing loss's inputs and the per-step bias update against numpy, and the keys' checks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from megajax.config import load_config
from megajax.models.moe import MoE, route, router_losses, updated_expert_bias

E, K, D = 4, 2, 16


def numpy_sigmoid_routing(logits, bias, topk, scaling=None):
    """Megatron-Core's topk_routing_with_score_function for sigmoid, in numpy (float64): (ids, weights)."""
    scores = 1.0 / (1.0 + np.exp(-np.asarray(logits, np.float64)))
    ids = np.argsort(-(scores + bias), axis=-1, kind="stable")[:, :topk]
    weights = np.take_along_axis(scores, ids, axis=-1)
    if topk > 1:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return ids, weights * (scaling or 1.0)


# 4 tokens x 4 experts. Unbiased, token 0 picks experts 0, 1; token 1 picks 2, 3; ... The bias
# (+0.5 on expert 3, -0.5 on expert 0) moves expert 3 into tokens 0 and 2 and expert 0 out.
LOGITS = np.array([[2.0, 1.0, -1.0, -2.0],
                   [-2.0, -1.0, 1.5, 0.5],
                   [1.0, 0.5, 3.0, -0.3],
                   [0.2, 2.5, -0.7, 1.2]], np.float32)
BIAS = np.array([-0.5, 0.0, 0.1, 0.5], np.float32)


@pytest.mark.parametrize("scaling", [None, 2.5])
def test_sigmoid_topk_with_bias_equals_numpy(scaling):
    ids, weights = jax.jit(lambda l, b: route(l, K, "sigmoid", b, scaling))(LOGITS, BIAS)
    want_ids, want_weights = numpy_sigmoid_routing(LOGITS, BIAS, K, scaling)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(weights), want_weights, rtol=1e-6)
    # The bias changed the choice: without it the top-2 differ for tokens 0 and 2 ...
    plain_ids, plain_weights = route(jnp.asarray(LOGITS), K, "sigmoid", None, scaling)
    assert [set(r) for r in np.asarray(plain_ids)] == [{0, 1}, {2, 3}, {0, 2}, {1, 3}]
    assert [set(r) for r in np.asarray(ids)] == [{1, 3}, {2, 3}, {2, 3}, {1, 3}]
    # ... but not the weights of a choice: an expert's weight is its unbiased sigmoid score, normalised.
    scores = 1.0 / (1.0 + np.exp(-LOGITS.astype(np.float64)))
    chosen = np.take_along_axis(scores, np.asarray(ids), axis=-1)
    np.testing.assert_allclose(np.asarray(weights), chosen / chosen.sum(-1, keepdims=True) * (scaling or 1.0),
                               rtol=1e-6)
    np.testing.assert_allclose(np.asarray(weights).sum(-1), scaling or 1.0, rtol=1e-6)


def test_softmax_routing_unchanged_by_the_new_arguments():
    ids, weights = route(jnp.asarray(LOGITS), K)
    top = np.sort(LOGITS, axis=-1)[:, ::-1][:, :K]
    np.testing.assert_array_equal(np.asarray(ids), np.argsort(-LOGITS, axis=-1, kind="stable")[:, :K])
    np.testing.assert_allclose(np.asarray(weights), np.exp(top) / np.exp(top).sum(-1, keepdims=True), rtol=1e-6)


def moe_config(**changes):
    m = load_config(overrides=["model.hidden_size=16", "model.num_heads=2", f"model.num_experts={E}",
                               f"model.moe_router_topk={K}", "model.moe_ffn_hidden_size=24",
                               "model.moe_router_score_function=sigmoid", "model.moe_router_bias_update_rate=0.01",
                               "model.moe_aux_loss_coeff=0.01"]).model
    return dataclasses.replace(m, **changes)


def test_moe_layer_routes_with_the_bias_and_balances_without_it():
    """The layer's output is the biased top-k weighted by unbiased scores; its balancing-loss inputs
    are the scores normalised over experts and the counts of the unbiased top-k (Megatron-Core's
    compute_routing_scores_for_aux_loss), while `tokens` counts the routed assignments."""
    cfg = moe_config()
    layer = MoE(cfg, dtype=jnp.float32, dispatch=None, rngs=nnx.Rngs(params=0))
    layer.router[...] = layer.router[...] * 50  # decisive scores
    x = jax.random.normal(jax.random.key(1), (2, 8, D), jnp.float32)
    graphdef, params = nnx.split(layer)
    fwd = jax.jit(lambda p, x, b: nnx.merge(graphdef, p).forward(x, b))
    logits = np.asarray(x.reshape(-1, D) @ layer.router[...], np.float64)
    bias = np.array([0.3, -0.3, 0.2, -0.1], np.float32)
    y, stats = fwd(params, x, bias)
    y0, stats0 = fwd(params, x, np.zeros(E, np.float32))

    ids, weights = numpy_sigmoid_routing(logits, bias, K)
    plain_ids, _ = numpy_sigmoid_routing(logits, 0.0, K)
    assert (np.sort(ids, -1) != np.sort(plain_ids, -1)).any()  # the bias moves some tokens
    np.testing.assert_array_equal(np.asarray(stats.tokens), np.bincount(ids.ravel(), minlength=E))
    np.testing.assert_array_equal(np.asarray(stats.balance_tokens), np.bincount(plain_ids.ravel(), minlength=E))
    np.testing.assert_array_equal(np.asarray(stats0.tokens), np.asarray(stats.balance_tokens))
    scores = 1.0 / (1.0 + np.exp(-logits))
    np.testing.assert_allclose(np.asarray(stats.probs), (scores / scores.sum(-1, keepdims=True)).sum(0), rtol=1e-5)
    # The output: every expert on every token, mixed with the numpy weights.
    t = np.asarray(x.reshape(-1, D), np.float64)
    g, u, w2 = (np.asarray(layer.gate[...]), np.asarray(layer.up[...]), np.asarray(layer.fc2[...]))
    silu = lambda a: a / (1 + np.exp(-a))
    outs = np.einsum("etf,efd->etd", silu(np.einsum("td,edf->etf", t, g)) * np.einsum("td,edf->etf", t, u), w2)
    want = sum(weights[:, j, None] * outs[ids[:, j], np.arange(t.shape[0])] for j in range(K))
    np.testing.assert_allclose(np.asarray(y).reshape(-1, D), want, rtol=1e-4, atol=1e-5)
    assert not np.allclose(np.asarray(y), np.asarray(y0))
    # The balancing loss of Megatron-Core's formula from those inputs.
    aux, _ = router_losses(jax.tree.map(lambda s: s[None], stats), stats.balance_tokens[None], stats.count[None], cfg)
    n = t.shape[0]
    want_aux = 0.01 * E / (K * n * n) * np.sum((scores / scores.sum(-1, keepdims=True)).sum(0)
                                               * np.bincount(plain_ids.ravel(), minlength=E))
    np.testing.assert_allclose(aux[0], want_aux, rtol=1e-5)


def test_bias_update_equals_numpy_formula():
    """bias += rate * sign(mean_e(tokens) - tokens_e) per layer; an expert at the mean keeps its bias."""
    tokens = np.array([[10.0, 2.0, 4.0, 8.0],    # mean 6: busy experts 0 and 3 go down
                       [5.0, 5.0, 5.0, 5.0],     # balanced: no change
                       [0.0, 12.0, 6.0, 6.0]], np.float32)  # mean 6: experts 2 and 3 stay
    bias = np.array([[0.1, -0.2, 0.0, 0.3], [1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]], np.float32)
    got = jax.jit(updated_expert_bias, static_argnums=2)(bias, tokens, 0.01)
    want = bias + 0.01 * np.sign(tokens.mean(-1, keepdims=True) - tokens)
    np.testing.assert_array_equal(np.asarray(got), want.astype(np.float32))
    np.testing.assert_allclose(np.asarray(got) - bias, [[-0.01, 0.01, 0.01, -0.01], [0, 0, 0, 0],
                                                        [0.01, -0.01, 0, 0]], atol=1e-7)


def biased_model():
    """(config, spec, params, bias [layers, E]): a small sigmoid-routed model with a nonzero expert bias."""
    from megajax.checkpoint.source import flatten, unflatten
    from megajax.train.state import build_model_spec
    cfg = load_config(overrides=["model.num_layers=2", "model.hidden_size=32", "model.num_heads=4",
                                 "model.ffn_hidden_size=32", "model.vocab_size=257", "train.seq_len=32",
                                 "model.num_experts=4", "model.moe_router_topk=2",
                                 "model.moe_router_score_function=sigmoid", "model.moe_router_bias_update_rate=0.01"])
    spec, _ = build_model_spec(cfg, cfg.model.padded_vocab_size())
    rng = np.random.default_rng(0)
    params = unflatten({name: (rng.normal(0.0, 0.1, x.shape) + name.endswith("/scale")).astype(np.float32)
                        for name, x in flatten(spec.abstract_params)})
    bias = rng.normal(0.0, 0.3, (2, E)).astype(np.float32)
    return cfg, spec, params, bias


def greedy_by_full_forward(spec, params, bias, prompt, n, vocab=257, length=32):
    """(prompt + n greedy tokens, the jitted full forward, the last input buffer): each token from
    re-running the whole model on the sequence so far (the reference of cached generation)."""
    apply = jax.jit(lambda p, t, b: spec.apply(p, t, expert_bias=b))
    ids = list(prompt)
    for _ in range(n):
        buf = np.zeros((1, length), np.int32)
        buf[0, :len(ids)] = ids
        ids.append(int(np.argmax(np.asarray(apply(params, buf, bias))[0, len(ids) - 1, :vocab])))
    return ids, apply, buf


@pytest.mark.parametrize("layer_buffers", [True, False])
def test_cached_generation_routes_with_the_expert_bias(layer_buffers):
    from megajax.inference.generate import Generator
    from megajax.inference.sampling import Sampling
    cfg, spec, params, bias = biased_model()
    prompt, n = [65, 66, 67, 68, 69], 6
    ids, apply, buf = greedy_by_full_forward(spec, params, bias, prompt, n)
    buf[0, :len(ids) - 1] = ids[:-1]
    assert not np.allclose(apply(params, buf, bias), apply(params, buf, np.zeros_like(bias)))  # the bias matters
    gen = Generator(cfg.model, params, eod_id=None, layer_buffers=layer_buffers, expert_bias=bias)
    [done], _ = gen.generate([prompt], Sampling(), n)
    assert done.completion_ids == ids[len(prompt):]


def test_imported_bias_is_stored_and_loaded_for_generation(tmp_path):
    """An import's expert bias goes into the parameters checkpoint as the train state's, and
    generation (and checkpoint.load) read it back."""
    from megajax.checkpoint.manager import restore_expert_bias, write_params_checkpoint
    from megajax.checkpoint.source import flatten, unflatten
    from megajax.inference.load import Source, load_model
    cfg, _, params, bias = biased_model()
    with_bias = unflatten({**dict(flatten(params)), "layers/mlp/expert_bias": bias})
    step_dir = write_params_checkpoint(with_bias, cfg, tmp_path / "imported")
    np.testing.assert_array_equal(restore_expert_bias(step_dir, cfg), bias)
    loaded = load_model(cfg, Source(step_dir=step_dir), devices=jax.devices()[:1])
    np.testing.assert_array_equal(loaded.generator.expert_bias, bias)
    # Fine-tuning from it (checkpoint.load): the parameters and the bias, a fresh optimizer.
    from megajax.plan import make_plan
    from megajax.train.setup import build_setup, initial_state
    tuned = load_config(base=cfg.to_dict(), overrides=[f"checkpoint.load={step_dir}", "train.global_batch=1",
                                                       f"train.run_dir={tmp_path / 'ft'}", "mesh.data=1"])
    state, _, origin, _ = initial_state(build_setup(make_plan(tuned, 1), jax.devices()[:1]))
    assert "parameters from" in origin
    np.testing.assert_array_equal(np.asarray(state.moe_expert_bias), bias)


def numpy_group_limited(scores, topk, groups, pick):
    """Megatron-Core's group_limited_topk in numpy: groups scored by the sum of their topk / pick best
    scores, the pick best groups kept, the top-k of the rest (ids best first)."""
    t, e = scores.shape
    grouped = np.sort(scores.reshape(t, groups, e // groups), axis=-1)[..., ::-1]
    group_scores = grouped[..., :topk // pick].sum(-1)
    kept = np.argsort(-group_scores, axis=-1, kind="stable")[:, :pick]
    mask = np.zeros((t, groups), bool)
    np.put_along_axis(mask, kept, True, axis=-1)
    masked = np.where(np.repeat(mask, e // groups, axis=-1), scores, -np.inf)
    return np.argsort(-masked, axis=-1, kind="stable")[:, :topk]


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_group_limited_routing_equals_numpy(score_function):
    """16 experts in 4 groups, top-4 within each token's 2 best groups (DeepSeek-V3's node-limited
    routing); sigmoid with an expert bias, which joins the group scores as Megatron-Core adds it."""
    from megajax.models.moe import router_stats
    rng = np.random.default_rng(0)
    logits = rng.normal(0.0, 2.0, (64, 16)).astype(np.float32)
    bias = rng.normal(0.0, 0.3, 16).astype(np.float32) if score_function == "sigmoid" else None
    ids, weights = jax.jit(lambda l, b: route(l, 4, score_function, b, None, (4, 2)))(logits, bias)
    x = logits.astype(np.float64)
    scores = x if score_function == "softmax" else 1 / (1 + np.exp(-x))
    want = numpy_group_limited(scores + (0 if bias is None else bias), 4, 4, 2)
    np.testing.assert_array_equal(np.asarray(ids), want)
    plain, _ = route(jnp.asarray(logits), 4, score_function, None if bias is None else jnp.asarray(bias))
    assert (np.sort(np.asarray(plain), -1) != np.sort(want, -1)).any(axis=-1).mean() > 0.2  # the groups matter
    assert all(len(set(r // 4)) <= 2 for r in np.asarray(ids))  # at most 2 groups per token
    chosen = np.take_along_axis(scores if score_function == "sigmoid" else x, want, axis=-1)
    want_w = chosen / chosen.sum(-1, keepdims=True) if score_function == "sigmoid" else \
        np.exp(chosen) / np.exp(chosen).sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(weights), want_w, rtol=1e-5)
    # The balancing loss counts the plain top-k of the scores, not the group-limited choice.
    stats = router_stats(jnp.asarray(logits), ids, jnp.float32(0), score_function, biased=True)
    plain_scores = scores if score_function == "sigmoid" else np.exp(x)
    counts = np.bincount(np.argsort(-plain_scores, axis=-1, kind="stable")[:, :4].reshape(-1), minlength=16)
    np.testing.assert_array_equal(np.asarray(stats.balance_tokens), counts)
    np.testing.assert_array_equal(np.asarray(stats.tokens), np.bincount(want.reshape(-1), minlength=16))


@pytest.mark.parametrize("overrides, words", [
    (["model.moe_router_num_groups=2"], ["model.moe_router_group_topk = None", "needs both"]),
    (["model.moe_router_num_groups=3", "model.moe_router_group_topk=1"], ["does not divide model.num_experts = 8",
                                                                          "1, 2, 4, 8"]),
    (["model.moe_router_num_groups=4", "model.moe_router_group_topk=3"], ["model.moe_router_group_topk = 3",
                                                                          "accepted: 1, 2"]),
])
def test_router_group_keys_are_checked(overrides, words):
    from megajax.errors import ConfigError
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["model.num_experts=8", "model.moe_router_topk=2", *overrides])
    for w in words:
        assert w in str(e.value)

