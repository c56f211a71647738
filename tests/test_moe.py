"""Mixture of experts: router losses against Megatron-Core's formulas, the dropless dispatch's
gradients against a dense every-expert reference, capacity mode, and the keys' checks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from megajax.config import load_config
from megajax.errors import ConfigError, MeshError
from megajax.models.moe import MoE, router_losses
from megajax.plan import make_plan

E, K, D, F = 4, 2, 16, 24


def moe_config(**changes):
    m = load_config(overrides=["model.hidden_size=16", "model.num_heads=2", f"model.num_experts={E}",
                               f"model.moe_router_topk={K}", f"model.moe_ffn_hidden_size={F}",
                               "model.moe_aux_loss_coeff=0.01", "model.moe_z_loss_coeff=0.001"]).model
    return dataclasses.replace(m, **changes)


def make_moe(cfg, seed=0):
    layer = MoE(cfg, dtype=jnp.float32, dispatch=None, rngs=nnx.Rngs(params=seed))
    # A router this strong makes routing decisive (no near-ties between the k-th and next expert).
    layer.router[...] = layer.router[...] * 50
    return layer


def forward(layer, x):
    """layer.forward under jit (op-by-op execution compiles every small op)."""
    graphdef, params = nnx.split(layer)
    return jax.jit(lambda p, x: nnx.merge(graphdef, p).forward(x))(params, x)


def crafted_batch(seed=1, b=2, l=8):
    return jax.random.normal(jax.random.key(seed), (b, l, D), jnp.float32)


def numpy_megatron_losses(logits, topk, coeff, z_coeff):
    """Megatron-Core's switch_load_balancing_loss_func and z_loss_func, in numpy (float64)."""
    logits = np.asarray(logits, np.float64)
    t, e = logits.shape
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    routing_map = np.zeros((t, e))
    np.put_along_axis(routing_map, np.argsort(-logits, axis=-1)[:, :topk], 1.0, axis=-1)
    tokens_per_expert = routing_map.sum(0)
    aux = np.sum(probs.sum(0) * tokens_per_expert) * (e * coeff / (topk * t * t))
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return aux, np.mean(lse ** 2) * z_coeff


def test_router_losses_equal_megatron_formulas():
    cfg = moe_config()
    layer = make_moe(cfg)
    x = crafted_batch()
    _, stats = forward(layer, x)
    aux, z = router_losses(jax.tree.map(lambda s: s[None], stats), stats.tokens[None], stats.count[None], cfg)
    logits = x.reshape(-1, D) @ layer.router[...]
    want_aux, want_z = numpy_megatron_losses(logits, K, 0.01, 0.001)
    np.testing.assert_allclose(aux[0], want_aux, rtol=1e-5)
    np.testing.assert_allclose(z[0], want_z, rtol=1e-5)
    # A batch split in two: each half's share (its probabilities, the whole batch's counts) sums to it.
    halves = [forward(layer, x[i:i + 1])[1] for i in range(2)]
    shares = [router_losses(jax.tree.map(lambda s: s[None], h), stats.tokens[None], stats.count[None], cfg)
              for h in halves]
    np.testing.assert_allclose(sum(s[0][0] for s in shares), want_aux, rtol=1e-5)
    np.testing.assert_allclose(sum(s[1][0] for s in shares), want_z, rtol=1e-5)


def dense_reference(layer, cfg, x_BxLxD):
    """Every expert on every token, outputs masked to the top-k and weighted (no sorting, no ragged
    products), plus the router losses from plain formulas."""
    t = x_BxLxD.reshape(-1, D)
    logits = t @ layer.router[...]
    top, ids = jax.lax.top_k(logits, K)
    weights = jnp.zeros_like(logits).at[jnp.arange(t.shape[0])[:, None], ids].set(jax.nn.softmax(top, -1))
    if cfg.activation == "swiglu":
        h = jax.nn.silu(jnp.einsum("td,edf->etf", t, layer.gate[...])) * jnp.einsum("td,edf->etf", t, layer.up[...])
    else:
        h = jax.nn.gelu(jnp.einsum("td,edf->etf", t, layer.fc1[...]), approximate=False)
    out = jnp.einsum("etf,efd->etd", h, layer.fc2[...])
    y = jnp.einsum("te,etd->td", weights, out)
    probs = jax.nn.softmax(logits, -1)
    counts = jax.lax.stop_gradient(jnp.sum(weights > 0, axis=0).astype(jnp.float32))
    n = t.shape[0]
    aux = cfg.moe_aux_loss_coeff * E / (K * n * n) * jnp.sum(probs.sum(0) * counts)
    z = cfg.moe_z_loss_coeff * jnp.mean(jax.nn.logsumexp(logits, -1) ** 2)
    return y.reshape(x_BxLxD.shape), aux + z


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_gradients_equal_dense_every_expert_reference(activation):
    cfg = moe_config(activation=activation)
    layer = make_moe(cfg)
    x = crafted_batch()
    cotangent = jax.random.normal(jax.random.key(2), x.shape)
    graphdef, params = nnx.split(layer)

    def moe_loss(params, x):
        y, stats = nnx.merge(graphdef, params).forward(x)
        aux, z = router_losses(jax.tree.map(lambda s: s[None], stats), stats.tokens[None], stats.count[None], cfg)
        return jnp.sum(y * cotangent) + aux[0] + z[0]

    def reference_loss(params, x):
        y, losses = dense_reference(nnx.merge(graphdef, params), cfg, x)
        return jnp.sum(y * cotangent) + losses

    want_v, (want_p, want_x) = jax.jit(jax.value_and_grad(reference_loss, argnums=(0, 1)))(params, x)
    for fn in (lambda f: f, jax.jit):
        got_v, (got_p, got_x) = fn(jax.value_and_grad(moe_loss, argnums=(0, 1)))(params, x)
        np.testing.assert_allclose(got_v, want_v, rtol=1e-5)
        np.testing.assert_allclose(got_x, want_x, rtol=1e-4, atol=1e-6)
        got, want = nnx.to_pure_dict(got_p), nnx.to_pure_dict(want_p)
        assert set(got) == {"router", *(["gate", "up", "fc2"] if activation == "swiglu" else ["fc1", "fc2"])}
        for name in got:
            assert np.abs(np.asarray(want[name])).max() > 0, name
            np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_capacity_drops_counted_by_hand_and_large_capacity_is_dropless():
    cfg = moe_config(moe_expert_capacity_factor=1.0)
    layer = make_moe(cfg)
    x = crafted_batch(b=1, l=8)
    ids = np.asarray(jax.lax.top_k(x.reshape(-1, D) @ layer.router[...], K)[1])
    capacity = int(np.ceil(8 * K / E * 1.0))  # 4 assignments per expert
    # By hand: walk the tokens in order; an expert keeps its first `capacity` assignments.
    taken, dropped, kept = np.zeros(E, int), 0, np.ones_like(ids, bool)
    for t in range(ids.shape[0]):
        for j in range(K):
            if taken[ids[t, j]] >= capacity:
                dropped += 1
                kept[t, j] = False
            taken[ids[t, j]] += 1
    assert 0 < dropped < ids.size  # the crafted batch overflows some expert
    y, stats = forward(layer, x)
    assert float(stats.dropped) == dropped
    # The kept assignments equal the dense reference with the dropped ones' weights zeroed.
    dropless_cfg = moe_config()
    dropless = make_moe(dropless_cfg)
    y_dropless, _ = forward(dropless, x)
    big = make_moe(moe_config(moe_expert_capacity_factor=float(E)))
    y_big, big_stats = forward(big, x)
    assert float(big_stats.dropped) == 0
    np.testing.assert_allclose(y_big, y_dropless, rtol=1e-6, atol=1e-7)
    assert not np.allclose(y, y_dropless)
    tokens_fully_kept = kept.all(axis=1)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, D)[tokens_fully_kept],
                               np.asarray(y_dropless).reshape(-1, D)[tokens_fully_kept], rtol=1e-6, atol=1e-7)
    tokens_all_dropped = ~kept.any(axis=1)
    assert np.all(np.asarray(y).reshape(-1, D)[tokens_all_dropped] == 0)


@pytest.mark.parametrize("overrides, words", [
    (["model.num_experts=4", "model.moe_router_topk=5"], ["model.moe_router_topk = 5", "1..4"]),
    (["model.num_experts=4", "model.moe_expert_capacity_factor=0"], ["moe_expert_capacity_factor = 0", "> 0"]),
    (["model.num_experts=4", "model.moe_expert_capacity_factor=-1.5"], ["-1.5", "> 0"]),
    (["model.num_experts=4", "model.num_layers=4", "model.moe_layer_freq=3"],
     ["model.moe_layer_freq = 3 does not divide model.num_layers = 4", "Accepted for 4 layers: 1, 2, 4"]),
    (["model.num_experts=4", "model.moe_layer_freq=0"], ["model.moe_layer_freq = 0", "> 0"]),
    (["mesh.expert=2"], ["mesh.expert = 2", "model.num_experts"]),
    (["model.num_experts=4", "model.family=gpt"], ["model.use_bias", "false"]),
    (["model.num_experts=4", "model.moe_shared_expert_ffn_size=-8"],
     ["model.moe_shared_expert_ffn_size = -8", ">= 0"]),
    (["model.moe_shared_expert_ffn_size=64"], ["model.moe_shared_expert_ffn_size = 64", "model.num_experts is 0"]),
    (["model.num_experts=4", "model.moe_shared_expert_gate=true"],
     ["model.moe_shared_expert_gate = true", "model.moe_shared_expert_ffn_size is 0"]),
    # The router's score function, scaling and aux-loss-free bias (tests/test_moe_router_bias.py).
    (["model.num_experts=4", "model.moe_router_bias_update_rate=0.001"],
     ["model.moe_router_bias_update_rate = 0.001", "model.moe_router_score_function=sigmoid", "'softmax'"]),
    (["model.num_experts=4", "model.moe_router_score_function=sigmoid", "model.moe_router_bias_update_rate=-0.001"],
     ["model.moe_router_bias_update_rate = -0.001", ">= 0"]),
    (["model.num_experts=4", "model.moe_router_topk_scaling_factor=0"],
     ["model.moe_router_topk_scaling_factor = 0", "> 0"]),
    (["model.num_experts=4", "model.moe_router_score_function=tanh"], ["moe_router_score_function", "tanh", "sigmoid"]),
])
def test_bad_moe_keys_name_key_value_and_accepted(overrides, words):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=overrides)
    for w in words:
        assert w in str(e.value)


def test_experts_not_divisible_by_mesh_expert():
    cfg = load_config(overrides=["model.num_experts=6", "mesh.expert=4", "mesh.data=2"])
    with pytest.raises(MeshError) as e:
        make_plan(cfg, num_devices=8)
    assert "model.num_experts=6 is not divisible by mesh.expert=4" in str(e.value)


def test_shared_expert_not_divisible_by_mesh_tensor():
    cfg = load_config(overrides=["model.num_experts=4", "model.moe_shared_expert_ffn_size=36", "mesh.tensor=8",
                                 "model.num_heads=8", "model.num_kv_heads=8"])
    with pytest.raises(MeshError) as e:
        make_plan(cfg, num_devices=8)
    assert "model.moe_shared_expert_ffn_size=36 is not divisible by mesh.tensor=8" in str(e.value)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_shared_expert_adds_a_dense_mlp_to_the_routed_output(activation):
    """y = the routed experts' output (the same layer without the shared expert, same router and
    experts) + a dense MLP of hidden size S on every token, computed by hand from the shared weights."""
    s = 40
    cfg = moe_config(activation=activation, moe_shared_expert_ffn_size=s)
    layer, routed = make_moe(cfg), make_moe(moe_config(activation=activation))
    got = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
    shared = got.pop("shared_experts")
    assert got.keys() == nnx.to_pure_dict(nnx.state(routed, nnx.Param)).keys()
    for name, w in got.items():  # the routed part initialises as the model without a shared expert
        np.testing.assert_array_equal(w, nnx.state(routed, nnx.Param)[name][...], err_msg=name)
    names = ["gate", "up", "fc2"] if activation == "swiglu" else ["fc1", "fc2"]
    assert set(shared) == set(names) and all(set(shared[n]) == {"kernel"} for n in names)
    w = {n: np.asarray(shared[n]["kernel"], np.float64) for n in names}
    assert w["fc2"].shape == (s, D) and w[names[0]].shape == (D, s)
    axes = {n: getattr(layer.shared_experts, n).kernel.get_metadata()["axes"] for n in names}
    assert axes == {n: ("mlp", "embed") if n == "fc2" else ("embed", "mlp") for n in names}

    x = crafted_batch()
    t = np.asarray(x, np.float64).reshape(-1, D)
    if activation == "swiglu":
        g = t @ w["gate"]
        h = g / (1 + np.exp(-g)) * (t @ w["up"])
    else:
        import math
        a = t @ w["fc1"]
        h = 0.5 * a * (1 + np.vectorize(math.erf)(a / np.sqrt(2)))
    by_hand = (h @ w["fc2"]).reshape(x.shape)
    y, stats = forward(layer, x)
    y_routed, stats_routed = forward(routed, x)
    assert np.abs(by_hand).max() > 0.1 * np.abs(np.asarray(y_routed)).max()  # both parts matter
    np.testing.assert_allclose(y, np.asarray(y_routed) + by_hand, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(stats.tokens, stats_routed.tokens)  # routing is unchanged
    # Generation's path (gate and up as two products) gives the same output.
    graphdef, params = nnx.split(layer)
    np.testing.assert_allclose(jax.jit(lambda p, x: nnx.merge(graphdef, p)(x, fused=False))(params, x), y,
                               rtol=1e-6, atol=1e-7)


def test_presets():
    mixtral = load_config(["model/mixtral-8x7b"]).model
    assert (mixtral.num_layers, mixtral.hidden_size, mixtral.num_heads, mixtral.num_kv_heads, mixtral.num_experts,
            mixtral.moe_router_topk, mixtral.moe_ffn_hidden_size, mixtral.vocab_size) == \
        (32, 4096, 32, 8, 8, 2, 14336, 32000)
    tiny = load_config(["model/tiny-moe"]).model
    assert tiny.num_experts == 8 and tiny.moe_router_topk == 2


def test_flops_count_active_parameters():
    """Mixtral 8x7B: per layer attention (q, o: D x D; k, v: D x 1024), router D x 8 and 2 of the 8
    experts (3 x D x F each); plus the output layer: 12.75B, its published ~12.9B active parameters
    less the input embedding table (a lookup, no FLOPs)."""
    from megajax.train.flops import matmul_params
    m = load_config(["model/mixtral-8x7b"]).model
    d, f = 4096, 14336
    per_layer = 2 * d * d + 2 * d * 1024 + d * 8 + 2 * 3 * d * f
    assert matmul_params(m, m.padded_vocab_size()) == 32 * per_layer + d * 32000


def test_flops_count_the_shared_expert():
    """A shared expert of hidden size S adds 3 x D x S (SwiGLU) per layer, every token: the routed
    experts still count top-k of E."""
    from megajax.train.flops import matmul_params
    m = load_config(["model/mixtral-8x7b"]).model
    with_shared = dataclasses.replace(m, moe_shared_expert_ffn_size=2048)
    assert matmul_params(with_shared, m.padded_vocab_size()) - matmul_params(m, m.padded_vocab_size()) == \
        32 * 3 * 4096 * 2048


def test_shared_expert_gate_scales_it_per_token_by_a_sigmoid():
    """moe_shared_expert_gate: y = routed + sigmoid(x . w) * shared(x), w [D] per layer, by hand from
    the same layer without the gate (same router, experts and shared weights)."""
    cfg = moe_config(moe_shared_expert_ffn_size=40, moe_shared_expert_gate=True)
    gated, plain = make_moe(cfg), make_moe(moe_config(moe_shared_expert_ffn_size=40))
    params = nnx.to_pure_dict(nnx.state(gated, nnx.Param))
    w = np.asarray(params.pop("shared_expert_gate"), np.float64)
    assert w.shape == (D,) and gated.shared_expert_gate.get_metadata()["axes"] == ("embed",)
    nnx.update(plain, params)
    nnx.update(gated, {**params, "shared_expert_gate": w.astype(np.float32) * 20})  # scores far from 1/2
    routed = make_moe(moe_config())
    nnx.update(routed, {k: v for k, v in params.items() if k != "shared_experts"})
    x = crafted_batch()
    y_gated, _ = forward(gated, x)
    y_plain, _ = forward(plain, x)
    y_routed, _ = forward(routed, x)
    shared = np.asarray(y_plain, np.float64) - np.asarray(y_routed, np.float64)
    score = 1 / (1 + np.exp(-(np.asarray(x, np.float64) @ (w * 20))))
    assert score.min() < 0.2 and score.max() > 0.8
    np.testing.assert_allclose(y_gated, np.asarray(y_routed) + score[..., None] * shared, rtol=1e-5, atol=1e-6)


def test_qwen3_30b_a3b_counts_its_published_parameters():
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B active (8 of the 128 experts per token); the FLOP count's
    active products are those less the input embedding table and the norms' scales."""
    import math
    from megajax.models.layout import param_shapes
    from megajax.train.flops import matmul_params
    m = load_config(["model/qwen3-30b-a3b"]).model
    shapes = param_shapes(m)
    total = sum(math.prod(s) for s in shapes.values())
    experts = sum(math.prod(shapes[f"layers/mlp/{k}"]) for k in ("gate", "up", "fc2"))
    active = total - experts * (m.num_experts - m.moe_router_topk) // m.num_experts
    assert (total, active) == (30_532_122_624, 3_353_032_704)  # 30.5B, 3.3B published
    norms = 48 * (2 * 2048 + 2 * 128) + 2048  # attn, mlp, q, k norms per layer; the final norm
    assert matmul_params(m, m.padded_vocab_size()) == active - 151936 * 2048 - norms


def test_pre_softmax_routing_takes_the_top_k_of_all_experts_probabilities():
    """moe_router_pre_softmax: softmax over all experts, the top-k of it, not renormalised; without it the
    top-k weights are the same probabilities renormalised over the k."""
    from megajax.models.moe import route
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(5, 8)), jnp.float32)
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    want_ids = np.argsort(-probs, axis=-1)[:, :2]
    want = np.take_along_axis(probs, want_ids, axis=-1)
    ids, weights = route(logits, 2, pre_softmax=True)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want, rtol=1e-6)
    ids, weights = route(logits, 2)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want / want.sum(-1, keepdims=True), rtol=1e-6)


def test_pre_softmax_needs_softmax_scores():
    with pytest.raises(ConfigError, match="moe_router_pre_softmax = true is softmax routing"):
        load_config(overrides=["model.num_experts=4", "model.moe_router_pre_softmax=true",
                               "model.moe_router_score_function=sigmoid"])


@pytest.mark.parametrize("activation, sizes, rows", [
    ("swiglu", [3, 0, 9, 1], 13),   # uneven, an empty group
    ("swiglu", [0, 20, 0, 0], 20),  # one group holds every row
    ("gelu", [0, 5, 0, 2], 13),     # rows past the groups (the expert-parallel receive buffer): 0
])
def test_tiled_grouped_products_equal_ragged_dot(activation, sizes, rows):
    """model.moe_grouped_gemm_impl=tiled (the rows padded per expert to tiles, a loop of batched
    products, a custom vjp) against jax.lax.ragged_dot: outputs and gradients for rows and kernels."""
    from megajax.models.moe import EXPERT_KERNELS, expert_ffn, expert_ffn_tiled
    g, d, f = len(sizes), 16, 24
    keys = iter(jax.random.split(jax.random.key(0), 5))
    x = jax.random.normal(next(keys), (rows, d))
    kernels = {n: 0.3 * jax.random.normal(next(keys), (g, f, d) if n == "fc2" else (g, d, f))
               for n in EXPERT_KERNELS[activation]}
    group_sizes = jnp.asarray(sizes, jnp.int32)
    cotangent = jax.random.normal(next(keys), (rows, d))

    def loss(ffn):
        return jax.jit(jax.value_and_grad(lambda x, k: jnp.sum(ffn(x, k) * cotangent), argnums=(0, 1)))

    want_v, (want_x, want_k) = loss(lambda x, k: expert_ffn(x, group_sizes, k, activation, impl="ragged_dot"))(x, kernels)
    got_v, (got_x, got_k) = loss(lambda x, k: expert_ffn_tiled(x, group_sizes, k, activation, tile=8))(x, kernels)
    np.testing.assert_allclose(got_v, want_v, rtol=1e-5)
    np.testing.assert_allclose(got_x, want_x, rtol=1e-5, atol=1e-5)
    for name in kernels:
        np.testing.assert_allclose(got_k[name], want_k[name], rtol=1e-5, atol=1e-5, err_msg=name)
    if sum(sizes) < rows:
        assert not np.asarray(got_x[sum(sizes):]).any()


@pytest.mark.parametrize("activation, first, held, experts", [
    ("swiglu", 0, 4, 4),  # every expert here (one device)
    ("gelu", 2, 3, 8),    # experts 2..4 of 8 here: the other assignments add nothing
    ("swiglu", 5, 3, 8),  # the last experts
])
def test_routed_tiles_equal_sorted_rows(activation, first, held, experts, capsys):
    """The tiled routed sum (each tile gathers its rows and weights and adds its weighted outputs
    into their tokens; a custom vjp) against the sorted rows through ragged_dot: outputs and
    gradients for tokens, routing weights and kernels. For the backward pass it keeps, besides its
    arguments, the slots' assignments and the tiles' experts and count alone."""
    from jax.ad_checkpoint import print_saved_residuals
    from megajax.models.moe import EXPERT_KERNELS, routed_expert_sum
    t, d, f = 13, 16, 24
    keys = iter(jax.random.split(jax.random.key(1), 8))
    x = jax.random.normal(next(keys), (t, d))
    ids = jnp.argsort(jax.random.uniform(next(keys), (t, experts)), axis=1)[:, :K].astype(jnp.int32)
    weights = jax.random.uniform(next(keys), (t, K))
    kernels = {n: 0.3 * jax.random.normal(next(keys), (held, f, d) if n == "fc2" else (held, d, f))
               for n in EXPERT_KERNELS[activation]}
    cotangent = jax.random.normal(next(keys), (t, d))
    here = (ids >= first) & (ids < first + held)
    assert here.any() and (~here).any() if held < experts else here.all()

    def loss(impl):
        return jax.jit(jax.value_and_grad(lambda x, w, k: jnp.sum(cotangent * routed_expert_sum(
            x, ids, w, k, activation=activation, first=first, grouped_impl=impl, tile=4)), argnums=(0, 1, 2)))

    want_v, want_g = loss("ragged_dot")(x, weights, kernels)
    got_v, got_g = loss("tiled")(x, weights, kernels)
    np.testing.assert_allclose(got_v, want_v, rtol=1e-5)
    for want, got in zip(jax.tree.leaves(want_g), jax.tree.leaves(got_g)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # An assignment to another device's expert gets no gradient for its weight.
    assert not np.asarray(got_g[1])[~np.asarray(here)].any()
    print_saved_residuals(lambda x, w, k: jnp.sum(routed_expert_sum(
        x, ids, w, k, activation=activation, first=first, grouped_impl="tiled", tile=4)), x, weights, kernels)
    saved = [line.split(" ")[0] for line in capsys.readouterr().out.splitlines() if "from the argument" not in line]
    tiles = -(-t * K // 4) + held  # N = ceil(assignments / tile) + G tiles of 4 slots
    assert sorted(saved) == sorted([f"i32[{4 * tiles}]", f"i32[{tiles}]", "i32[]"]), saved


def test_token_dispatcher_resolution_and_errors():
    from megajax.config import moe_token_dispatcher
    moe = ["model.num_experts=8"]
    assert moe_token_dispatcher(load_config(overrides=moe), "cpu") == "allgather"
    assert moe_token_dispatcher(load_config(overrides=moe), "gpu") == "alltoall"
    for extra in (["model.moe_expert_capacity_factor=1.0"], ["parallel.moe_all_to_all=ragged"]):
        assert moe_token_dispatcher(load_config(overrides=moe + extra), "cpu") == "alltoall"
    assert moe_token_dispatcher(load_config(overrides=moe + ["parallel.moe_token_dispatcher=allgather"]),
                                "gpu") == "allgather"
    with pytest.raises(ConfigError, match=r"moe_token_dispatcher = allgather with model.moe_expert_capacity_factor "
                                          r"= 1.0.*moe_token_dispatcher=alltoall"):
        load_config(overrides=moe + ["parallel.moe_token_dispatcher=allgather", "model.moe_expert_capacity_factor=1.0"])
    with pytest.raises(ConfigError, match=r"moe_all_to_all = ragged.*moe_token_dispatcher = allgather"):
        load_config(overrides=moe + ["parallel.moe_token_dispatcher=allgather", "parallel.moe_all_to_all=ragged"])
    with pytest.raises(ConfigError, match="moe_token_dispatcher"):
        load_config(overrides=moe + ["parallel.moe_token_dispatcher=flex"])
