"""Gradients of the hand-written backward passes against autodiff of plain jnp references:
the CPU projection (`flat_dot_general`, also inside shard_map where it sums cotangents over manual
axes), ring (and all-gather) context-parallel attention, the sequence-parallel projections, and the
cross entropy (vocab-split logits never gathered)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from megajax.models.attention import xla_attention_with_lse
from megajax.models.layers import flat_dot_general
from megajax.train.loss import cross_entropy
from megajax.mesh import load_balanced_order
from megajax.parallel.context import context_parallel_attention
from megajax.parallel.tensor import tensor_parallel_ops

TOL = dict(rtol=2e-5, atol=2e-6)


def _normal(key, *shapes):
    return [jax.random.normal(k, s, jnp.float32) for k, s in zip(jax.random.split(jax.random.key(key), len(shapes)), shapes)]


def assert_same_value_and_grads(f, ref, args, argnums, jit=True):
    """f(*args) == ref(*args), and the gradients of <f, r> for a random cotangent r (one compiled
    program each for f and ref, unless `jit` is off)."""
    [r] = _normal(99, jax.eval_shape(ref, *args).shape)

    def value_and_grads(fn):
        def go(*a):
            out, pullback = jax.vjp(fn, *a)
            grads = pullback(r)
            return out, [grads[i] for i in argnums]
        return jax.jit(go) if jit else go

    (out_f, grads_f), (out_r, grads_r) = value_and_grads(f)(*args), value_and_grads(ref)(*args)
    np.testing.assert_allclose(out_f, out_r, **TOL)
    for i, gf, gr in zip(argnums, grads_f, grads_r):
        np.testing.assert_allclose(gf, gr, err_msg=f"gradient of argument {i}", **TOL)


# (x shape, kernel shape, dimension numbers): the projections of the model
PROJECTIONS = {
    "dense": ((2, 8, 16), (16, 24), (((2,), (0,)), ((), ()))),
    "qkv_heads_out": ((2, 8, 16), (16, 4, 6), (((2,), (0,)), ((), ()))),
    "o_two_contracting": ((2, 8, 4, 6), (4, 6, 16), (((2, 3), (0, 1)), ((), ()))),
    "tied_output_kernel_transposed": ((2, 8, 16), (40, 16), (((2,), (1,)), ((), ()))),
    "fc2_wide_input": ((2, 8, 64), (64, 8), (((2,), (0,)), ((), ()))),  # dW via the transposed product
}


@pytest.mark.parametrize("case", list(PROJECTIONS))
def test_flat_dot_general_matches_dot_general(case):
    x_shape, w_shape, dn = PROJECTIONS[case]
    x, w = _normal(0, x_shape, w_shape)
    dot = flat_dot_general()
    f = lambda x, w: dot(x, w, dn)
    ref = lambda x, w: jax.lax.dot_general(x, w, dn)
    assert_same_value_and_grads(f, ref, (x, w), (0, 1))
    if case == "dense":  # and without jit
        assert_same_value_and_grads(f, ref, (x, w), (0, 1), jit=False)


def _cross_entropy_reference(logits, labels):
    logits = logits.astype(jnp.float32)
    return jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]


def test_cross_entropy_matches_autodiff_of_logsumexp():
    """Value and gradient against logsumexp minus the label's logit (gathered), with logits far
    from zero (the max is subtracted) and a label at each end of the vocabulary."""
    [logits] = _normal(3, (2, 8, 40))
    logits = logits * 6.0 + 30.0
    labels = jax.random.randint(jax.random.key(4), (2, 8), 0, 40).at[0, 0].set(0).at[1, 7].set(39)
    f = lambda x: cross_entropy(x, labels)
    assert_same_value_and_grads(f, lambda x: _cross_entropy_reference(x, labels), (logits,), (0,))
    assert_same_value_and_grads(f, lambda x: _cross_entropy_reference(x, labels), (logits,), (0,), jit=False)
    # bf16 logits: the loss in fp32, the gradient in the logits' dtype
    low = logits.astype(jnp.bfloat16)
    out, pullback = jax.vjp(f, low)
    assert out.dtype == jnp.float32 and pullback(jnp.ones_like(out))[0].dtype == jnp.bfloat16


def test_cross_entropy_of_vocab_split_logits_gathers_nothing(mesh_data_tensor):
    """Logits split over the vocabulary (tensor) and batch (data): the same values and gradient, and
    the compiled program moves only [B, L] sums, never the logits."""
    [logits] = _normal(5, (4, 8, 64))
    labels = jax.random.randint(jax.random.key(6), (4, 8), 0, 64)
    split = jax.sharding.NamedSharding(mesh_data_tensor, P("data", None, "tensor"))
    rows = jax.sharding.NamedSharding(mesh_data_tensor, P("data"))
    logits, labels = jax.device_put(logits, split), jax.device_put(labels, rows)
    f = lambda x, y: cross_entropy(x, y)
    assert_same_value_and_grads(f, _cross_entropy_reference, (logits, labels), (0,))
    hlo = jax.jit(jax.grad(lambda x, y: jnp.sum(f(x, y)))).lower(logits, labels).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo


@pytest.fixture(scope="module")
def mesh_data_tensor():
    return jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)


@pytest.mark.parametrize("w_spec", [P(), P(None, "tensor")], ids=["kernel_replicated", "kernel_split_over_tensor"])
def test_flat_dot_general_in_shard_map_sums_the_kernel_gradient_over_manual_axes(mesh_data_tensor, w_spec):
    """x[B_data, S, K] . W[K, M]: each device's dW is a partial sum over its batch rows; the custom
    backward must add them up across `data` (and, for a replicated W, across `tensor`, where x is split)."""
    x, w = _normal(1, (4, 8, 16), (16, 8))
    dot = flat_dot_general()
    x_spec = P("data", "tensor") if w_spec == P() else P("data")
    out_spec = P("data", "tensor") if w_spec == P() else P("data", None, "tensor")
    f = jax.shard_map(lambda x, w: dot(x, w, (((2,), (0,)), ((), ()))), mesh=mesh_data_tensor,
                      in_specs=(x_spec, w_spec), out_specs=out_spec)
    ref = lambda x, w: jnp.einsum("bsk,km->bsm", x, w)
    assert_same_value_and_grads(f, ref, (x, w), (0, 1))


# ---------------------------------------------------------------------------------------------
# Context parallelism


def plain_attention(q, k, v, seg):
    """Causal softmax attention with grouped k/v heads and optional segment ids, in natural order."""
    b, s, h, d = q.shape
    rep = h // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
    mask = jnp.tril(jnp.ones((s, s), bool))[None, None]
    if seg is not None:
        mask = mask & (seg[:, None, :, None] == seg[:, None, None, :])
    p = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.parametrize("documents", [False, True], ids=["one_document", "segment_ids"])
@pytest.mark.parametrize("impl", ["ring", "allgather"])
def test_context_parallel_attention_gradients(impl, documents):
    """q/k/v in the load-balanced chunk order, sequence over context=2 (x data=2): value and dq, dk, dv
    equal plain attention's on the natural order. Two ring devices take both branches of a ring step
    (visiting k/v from an earlier and from a later device)."""
    mesh = jax.make_mesh((2, 2), ("data", "context"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4])
    rules = {"batch": ("data",), "length": ("context",), "heads": (), "kv_heads": (), "head_dim": ()}
    s = 16
    q, k, v = _normal(2, (2, s, 4, 8), (2, s, 2, 8), (2, s, 2, 8))
    seg = jnp.asarray(np.cumsum(np.random.default_rng(0).random((2, s)) < 0.2, axis=1)) if documents else None
    order = jnp.asarray(load_balanced_order(s, 2))
    attend = context_parallel_attention(xla_attention_with_lse, mesh, rules, impl)

    def f(q, k, v):  # natural order in and out, load-balanced order inside
        seg_p = None if seg is None else seg[:, order]
        out = attend(q[:, order], k[:, order], v[:, order], segment_ids=seg_p)
        return jnp.zeros_like(out).at[:, order].set(out)

    assert_same_value_and_grads(f, lambda q, k, v: plain_attention(q, k, v, seg), (q, k, v), (0, 1, 2))


# ---------------------------------------------------------------------------------------------
# Sequence parallelism


@pytest.mark.parametrize("dot", ["lax", "flat"])
def test_sequence_parallel_projections_and_embedding_gradients(mesh_data_tensor, dot):
    rules = {"batch": ("data",), "length": (), "residual_length": ("tensor",), "heads": ("tensor",),
             "vocab": ("tensor",), "embed": ()}
    ops = tensor_parallel_ops(mesh_data_tensor, rules, flat_dot_general() if dot == "flat" else jax.lax.dot_general,
                              sequence_parallel=True)
    x, w_col, h, w_row, table = _normal(3, (4, 16, 12), (12, 8), (4, 16, 8), (8, 12), (40, 12))
    dn = (((2,), (0,)), ((), ()))
    plain = lambda a, b: jnp.einsum("bsk,km->bsm", a, b)
    assert_same_value_and_grads(lambda a, b: ops.column(a, b, dn), plain, (x, w_col), (0, 1))
    assert_same_value_and_grads(lambda a, b: ops.row(a, b, dn), plain, (h, w_row), (0, 1))
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 40, (4, 16)))
    assert_same_value_and_grads(lambda t: ops.embed(t, ids), lambda t: jnp.take(t, ids, axis=0),
                                (table,), (0,))
