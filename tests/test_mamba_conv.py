"""The Mamba mixer's pieces with written gradients: the causal conv against autodiff of the conv tap
by tap, the one conv over x, B and C laid out per group against a conv of each (values, windows,
gradients), with and without document boundaries and a carried window; the gated group norm against
autodiff of its formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megajax.models.mamba import MambaState, _conv_xbc, causal_conv, gated_group_norm

K = 4


def tap_by_tap(x, w, bias, window=None, segment_ids=None):
    """The conv written tap by tap, differentiated by autodiff (the reference)."""
    b, l = x.shape[:2]
    if window is None:
        window = jnp.zeros((b, K - 1) + x.shape[2:], x.dtype)
    xp = jnp.concatenate([window, x], axis=1)
    taps = jnp.moveaxis(w, -1, 0)
    if segment_ids is None:
        return sum(xp[:, i:i + l] * taps[i] for i in range(K)) + bias
    seg = jnp.concatenate([jnp.repeat(segment_ids[:, :1], K - 1, axis=1), segment_ids], axis=1)
    same = lambda i: (seg[:, i:i + l] == segment_ids).reshape((b, l) + (1,) * (x.ndim - 2))
    return sum(jnp.where(same(i), xp[:, i:i + l], 0.0) * taps[i] for i in range(K)) + bias


def inputs(seed=0, b=2, l=11, h=6, p=3):
    ks = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(ks[0], (b, l, h, p)), jax.random.normal(ks[1], (h, p, K)),
            jax.random.normal(ks[2], (h, p)), jax.random.normal(ks[3], (b, K - 1, h, p)))


SEGMENTS = jnp.array([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5, 7, 7, 7]])


@pytest.mark.parametrize("case", ["plain", "window", "segments"])
def test_the_conv_and_its_gradient_equal_the_conv_tap_by_tap(case):
    x, w, bias, window = inputs()
    win = window if case == "window" else None
    seg = SEGMENTS if case == "segments" else None
    cot = jax.random.normal(jax.random.key(9), x.shape)
    ours = lambda x, w, bias, win: jnp.sum(cot * jnp.tanh(causal_conv(x, w, bias, win, segment_ids_BxL=seg)[0]))
    ref = lambda x, w, bias, win: jnp.sum(cot * jnp.tanh(tap_by_tap(x, w, bias, win, seg)))
    argnums = (0, 1, 2, 3) if case == "window" else (0, 1, 2)
    np.testing.assert_allclose(ours(x, w, bias, win), ref(x, w, bias, win), rtol=1e-6)
    for got, want in zip(jax.grad(ours, argnums)(x, w, bias, win), jax.grad(ref, argnums)(x, w, bias, win)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # the segment mask blocks gradient flow across a boundary, too
    if seg is not None:
        dx = jax.grad(lambda x: causal_conv(x, w, bias, segment_ids_BxL=seg)[0][0, 3].sum())(x)
        assert not np.any(np.asarray(dx[0, :3])) and np.any(np.asarray(dx[0, 3]))


@pytest.mark.parametrize("case", ["fresh", "state", "segments"])
def test_one_conv_over_x_b_c_equals_a_conv_of_each(case):
    b, l, h, p, g, n = 2, 11, 6, 3, 2, 5
    ks = jax.random.split(jax.random.key(3), 12)
    xs, bm, cm = (jax.random.normal(ks[0], (b, l, h, p)), jax.random.normal(ks[1], (b, l, g, n)),
                  jax.random.normal(ks[2], (b, l, g, n)))
    w = {"conv_x": jax.random.normal(ks[3], (h, p, K)), "conv_x_bias": jax.random.normal(ks[4], (h, p)),
         "conv_B": jax.random.normal(ks[5], (g, n, K)), "conv_B_bias": jax.random.normal(ks[6], (g, n)),
         "conv_C": jax.random.normal(ks[7], (g, n, K)), "conv_C_bias": jax.random.normal(ks[8], (g, n))}
    state = end = seg = None
    if case == "state":
        state = MambaState(jax.random.normal(ks[9], (b, K - 1, h, p)), jax.random.normal(ks[10], (b, K - 1, g, n)),
                           jax.random.normal(ks[11], (b, K - 1, g, n)), None)
        end = jnp.array([l, 6])
    if case == "segments":
        seg = SEGMENTS

    def fused(xs, bm, cm, w):
        return _conv_xbc(xs, bm, cm, w, state, end, seg)

    def each(xs, bm, cm, w):
        outs, wins = [], []
        for v, name, win in zip((xs, bm, cm), ("x", "B", "C"), (None, None, None) if state is None else state[:3]):
            out, window = causal_conv(v, w[f"conv_{name}"], w[f"conv_{name}_bias"], win, end, seg)
            outs.append(jax.nn.silu(out))
            wins.append(window)
        return tuple(outs), tuple(wins)

    (got, got_win), (want, want_win) = fused(xs, bm, cm, w), each(xs, bm, cm, w)
    for a, e in zip(got + got_win, want + want_win):
        assert a.shape == e.shape
        np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-6)
    loss = lambda f: lambda *args: sum(jnp.sum(jnp.sin(o) * (i + 1)) for i, o in enumerate(f(*args)[0]))
    for a, e in zip(jax.tree.leaves(jax.grad(loss(fused), (0, 1, 2, 3))(xs, bm, cm, w)),
                    jax.tree.leaves(jax.grad(loss(each), (0, 1, 2, 3))(xs, bm, cm, w))):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("groups", [1, 2])
def test_the_gated_norm_and_its_gradient_equal_autodiff_of_its_formula(groups):
    ks = jax.random.split(jax.random.key(4), 4)
    y, z, cot = (jax.random.normal(k, (2, 5, 6, 3)) for k in ks[:3])
    weight = jax.random.normal(ks[3], (6, 3))

    def formula(y, z, weight):
        b, l, h, p = y.shape
        g = (y * jax.nn.silu(z)).reshape(b, l, groups, h // groups * p)
        g = g * jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + 1e-5)
        return g.reshape(b, l, h, p) * weight

    ours = lambda *a: jnp.sum(cot * gated_group_norm(*a, groups, 1e-5))
    ref = lambda *a: jnp.sum(cot * formula(*a))
    np.testing.assert_allclose(gated_group_norm(y, z, weight, groups, 1e-5), formula(y, z, weight), rtol=1e-6)
    for got, want in zip(jax.grad(ours, (0, 1, 2))(y, z, weight), jax.grad(ref, (0, 1, 2))(y, z, weight)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
