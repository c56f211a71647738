"""FP8 matmul kernel (interpret mode on CPU) against a float64 reference built from the same
float8 values; the XLA (cuBLASLt-pattern) path against the kernel; the FP8 linear's custom
VJP against exact and bf16 gradients within a derived quantization bound; saturation and
scale helpers; the Triton lowering for CUDA and ROCm."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    HYBRID, HYBRID_FNUZ, Fp8Scales, compute_scale, fp8_expert_product, fp8_linear, fp8_linear_amax, fp8_matmul,
    fp8_matmul_reference, fp8_matmul_xla, fp8_max, quantize)
from pallas_kernels.fp8_matmul import (
    E4M3, E4M3_FNUZ, E5M2, E5M2_FNUZ, _widen, default_block_sizes)

U32 = 2.0 ** -24                                   # fp32 unit roundoff
U_OUT = {jnp.dtype(jnp.float32): U32, jnp.dtype(jnp.bfloat16): 2.0 ** -8,
         jnp.dtype(jnp.float16): 2.0 ** -11}       # unit roundoff of the output cast


def _fp8(rng, shape, dtype, scale=1.0):
    """Random float8 values spread over the type's binades (normal data, saturating cast)."""
    return quantize(jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32), 1.0, dtype)


def _f64(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def _accumulation_bound(a, b, scale, k, out_dtype, transpose_a=False, transpose_b=False):
    """Elementwise bound on |kernel - exact| for float8 operands: every product of two float8
    values is exact in fp32, the K-term fp32 sum errs by at most gamma_K * sum|a||b|
    (gamma_K = K u / (1 - K u), u = 2^-24), the epilogue's scale multiply by u relative, and
    the cast to out_dtype by its unit roundoff relative."""
    a64, b64 = np.abs(_f64(a)), np.abs(_f64(b))
    a64 = a64.T if transpose_a else a64
    b64 = b64.T if transpose_b else b64
    s = abs(scale) * (a64 @ b64)
    gamma = (k + 1) * U32 / (1 - (k + 1) * U32)
    u_out = U_OUT[jnp.dtype(out_dtype)]
    return (gamma * s) * (1 + u_out) + u_out * s


# (a dtype, b dtype, M, N, K, transpose_a, transpose_b, out dtype, explicit blocks)
KERNEL_CASES = [
    (E4M3, E4M3, 100, 72, 200, False, False, jnp.float32, dict(block_m=32, block_n=32, block_k=64)),
    (E5M2, E4M3, 50, 70, 130, False, True, jnp.bfloat16, dict(block_m=16, block_n=32, block_k=32)),
    (E4M3, E5M2, 40, 33, 90, True, False, jnp.float32, dict(block_m=16, block_n=16, block_k=32)),
    (E4M3_FNUZ, E4M3_FNUZ, 48, 40, 72, False, True, jnp.bfloat16, dict(block_m=32, block_n=16,
                                                                      block_k=32)),
    (E5M2_FNUZ, E4M3_FNUZ, 36, 20, 100, True, True, jnp.float16, dict(block_m=16, block_n=16,
                                                                     block_k=32)),
    (E4M3, E4M3, 70, 45, 77, False, False, jnp.bfloat16, {}),            # default blocks
]


@pytest.mark.parametrize("case", KERNEL_CASES,
                         ids=lambda c: f"{jnp.dtype(c[0]).name}x{jnp.dtype(c[1]).name}-"
                                       f"{c[2]}x{c[3]}x{c[4]}-{jnp.dtype(c[7]).name}")
def test_kernel_matches_float64_reference(case):
    """Ragged M, N, K (not block multiples), several tiles and tile groups, both layouts of
    each operand, same and mixed float8 types of both families, all output dtypes."""
    a_dt, b_dt, m, n, k, ta, tb, out_dt, blocks = case
    rng = np.random.default_rng(m * n + k)
    a = _fp8(rng, (k, m) if ta else (m, k), a_dt, 8.0)
    b = _fp8(rng, (n, k) if tb else (k, n), b_dt, 8.0)
    a_scale, b_scale = 0.37, 1.0 / 48
    out, amax = jax.jit(lambda a, b: fp8_matmul(
        a, b, a_scale, b_scale, out_dtype=out_dt, return_amax=True, transpose_a=ta,
        transpose_b=tb, group_m=2, **blocks))(a, b)
    assert out.shape == (m, n) and out.dtype == jnp.dtype(out_dt)
    want = fp8_matmul_reference(a, b, a_scale, b_scale, transpose_a=ta, transpose_b=tb)
    bound = _accumulation_bound(a, b, a_scale * b_scale, k, out_dt, ta, tb)
    err = np.abs(np.asarray(out, np.float64) - want)
    assert np.all(err <= bound), float(np.max(err - bound))
    # The amax is that of the values stored (no padding, no tile missed).
    assert float(amax) == float(np.max(np.abs(np.asarray(out, np.float32))))


def test_kernel_without_jit_and_tiny_shapes():
    rng = np.random.default_rng(1)
    a, b = _fp8(rng, (1, 5), E4M3), _fp8(rng, (5, 3), E4M3)
    out = fp8_matmul(a, b, jnp.float32(2.0), jnp.array([0.5]), out_dtype=jnp.float32)
    np.testing.assert_allclose(out, fp8_matmul_reference(a, b, 2.0, 0.5), rtol=1e-6)


def test_e4m3fnuz_bit_widening_is_exact():
    """Every e4m3fnuz value but NaN (0x80) widens to float16 as value * 2^-7, exactly."""
    bits = np.arange(256, dtype=np.uint8)
    bits = bits[bits != 0x80]
    x = jax.lax.bitcast_convert_type(jnp.asarray(bits), E4M3_FNUZ)
    got = np.asarray(_widen(x, "bits"), np.float64) * 2.0 ** 7
    np.testing.assert_array_equal(got, _f64(x))


def test_default_block_sizes_follow_the_table_and_fit_the_problem():
    assert default_block_sizes(8192, 8192, 8192) == dict(
        block_m=128, block_n=256, block_k=128, num_warps=8, num_stages=3, group_m=8)
    medium = default_block_sizes(1024, 1024, 4096)
    assert (medium["block_m"], medium["block_n"]) == (128, 128)
    small = default_block_sizes(16, 4096, 4096)
    assert (small["block_m"], small["block_n"]) == (16, 128)
    assert default_block_sizes(8192, 8192, 8192, E5M2, E4M3)["block_k"] == 64
    # sm_89's 99 KiB: one stage of 48 KiB tiles, two of 32 KiB.
    assert default_block_sizes(8192, 8192, 8192, shared_memory=99 * 1024)["num_stages"] == 1
    assert default_block_sizes(1024, 1024, 4096, shared_memory=99 * 1024)["num_stages"] == 2
    tiny = default_block_sizes(3, 20, 5)
    assert (tiny["block_m"], tiny["block_n"], tiny["block_k"]) == (16, 32, 32)
    for m, n, k in [(1, 1, 1), (77, 300, 1000), (4096, 28672, 4096), (8192, 4096, 14336)]:
        p = default_block_sizes(m, n, k)
        assert all(p[x] & (p[x] - 1) == 0 for x in ("block_m", "block_n", "block_k"))


@pytest.mark.parametrize("kwargs,match", [
    (dict(a=jnp.zeros((4, 8), jnp.bfloat16)), "not a float8 type"),
    (dict(b=jnp.zeros((9, 4), E4M3)), "contracting dimensions differ"),
    (dict(out_dtype=jnp.int8), "out_dtype"),
    (dict(a_scale=jnp.ones((2,))), "per-tensor"),
    (dict(block_k=48), "block_k=48"),
])
def test_kernel_rejects_bad_arguments(kwargs, match):
    args = dict(a=jnp.zeros((4, 8), E4M3), b=jnp.zeros((8, 4), E4M3), a_scale=1.0,
                b_scale=1.0, out_dtype=jnp.float32)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        fp8_matmul(args.pop("a"), args.pop("b"), args.pop("a_scale"), args.pop("b_scale"), **args)


# --------------------------------------------------------------------------- quantize, scales


@pytest.mark.parametrize("dtype", [E4M3, E5M2, E4M3_FNUZ, E5M2_FNUZ],
                         ids=lambda t: jnp.dtype(t).name)
def test_quantize_saturates_instead_of_overflowing(dtype):
    top = fp8_max(dtype)
    assert top == {E4M3: 448.0, E5M2: 57344.0, E4M3_FNUZ: 240.0, E5M2_FNUZ: 57344.0}[dtype]
    x = jnp.array([2 * top, -2 * top, jnp.inf, -jnp.inf, 1.01 * top, 1.5, -0.75], jnp.float32)
    q = _f64(quantize(x, 1.0, dtype))
    np.testing.assert_array_equal(q, [top, -top, top, -top, top, 1.5, -0.75])
    assert not np.all(np.isfinite(_f64(x.astype(dtype))))   # a plain cast overflows
    assert np.isnan(_f64(quantize(jnp.array([jnp.nan]), 1.0, dtype)))[0]
    # The scale multiplies before the cast: 2.56 * 100 = 256 saturates in e4m3fnuz only.
    assert _f64(quantize(jnp.array([2.56]), 100.0, dtype))[0] == min(256.0, top)


@pytest.mark.parametrize("dtype", [E4M3, E5M2, E4M3_FNUZ, E5M2_FNUZ],
                         ids=lambda t: jnp.dtype(t).name)
def test_quantize_rounds_as_ml_dtypes_bit_for_bit(dtype):
    """Within the range, quantize is the round-to-nearest-even cast of ml_dtypes (numpy), over
    every binade down to values that round to zero: a negative one of those becomes the fnuz types'
    only zero, +0, not 0x80 (their NaN, which XLA:CPU's elemental emitter, the one these tests
    compile with, would give)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(50_000) * np.exp2(rng.uniform(-30, 10, 50_000))
    smallest = float(jnp.finfo(dtype).smallest_subnormal)
    edges = [0.0, -0.0, smallest / 2, -smallest / 2, -smallest / 2 * 1.001, -smallest * 0.75, -1e-30]
    x = np.concatenate([x, edges]).astype(np.float32)
    top = fp8_max(dtype)
    got = np.asarray(jax.jit(lambda v: quantize(v, 1.0, dtype))(x)).view(np.uint8)
    want = np.clip(x, -top, top).astype(dtype).view(np.uint8)
    np.testing.assert_array_equal(got, want)


def test_compute_scale_is_transformer_engine_rule_with_fallback():
    amax = jnp.array([2.0, 0.0, jnp.inf, jnp.nan, 1e-45], jnp.float32)
    got = np.asarray(compute_scale(amax, 448.0, margin=1, fallback=7.0))
    np.testing.assert_allclose(got[0], 448.0 / 2.0 / 2.0)
    np.testing.assert_array_equal(got[1:], [7.0, 7.0, 7.0, 7.0])  # last: quotient overflows


# --------------------------------------------------------------------------- XLA path


@pytest.mark.parametrize("out_dt,ta,tb", [(jnp.float32, False, True), (jnp.bfloat16, True, False)])
def test_xla_path_equals_pallas_path(out_dt, ta, tb):
    """Both compute (a * sa) @ (b * sb); the XLA path rounds each scale to out_dtype (the
    dtype XLA's FP8 pattern computes in): 2^-8 relative each for bfloat16."""
    rng = np.random.default_rng(3)
    m, n, k = 40, 24, 96
    a = _fp8(rng, (k, m) if ta else (m, k), E4M3, 4.0)
    b = _fp8(rng, (n, k) if tb else (k, n), E5M2, 4.0)
    sa, sb = 0.013, 3.1
    kw = dict(out_dtype=out_dt, transpose_a=ta, transpose_b=tb, return_amax=True)
    got, amax = jax.jit(lambda a, b: fp8_matmul(a, b, sa, sb, **kw))(a, b)
    xla, xla_amax = jax.jit(lambda a, b: fp8_matmul_xla(a, b, sa, sb, **kw))(a, b)
    assert xla.dtype == got.dtype == jnp.dtype(out_dt)
    bound = 2 * _accumulation_bound(a, b, sa * sb, k, out_dt, ta, tb)
    if out_dt == jnp.bfloat16:
        bound += 2.0 ** -7 * 1.01 * abs(sa * sb) * (np.abs(_f64(a).T if ta else _f64(a)) @
                                                    np.abs(_f64(b).T if tb else _f64(b)))
    err = np.abs(np.asarray(got, np.float64) - np.asarray(xla, np.float64))
    assert np.all(err <= bound)
    assert abs(float(amax) - float(xla_amax)) <= float(np.max(bound))


# --------------------------------------------------------------------------- FP8 linear


def _linear_inputs(seed=0, batch=(4, 32), k=96, n=80):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((*batch, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32)
    ct = jnp.asarray(rng.standard_normal((*batch, n)) * 1e-3, jnp.bfloat16)
    return x, w, ct


def _value_and_grads(f, x, w, scales, ct):
    """y and (dx, dw, d scales) for output cotangent ct, as one compiled program."""
    def run(x, w, scales):
        y, vjp = jax.vjp(f, x, w, scales)
        return (y, *vjp(ct))
    return jax.jit(run)(x, w, scales)


def _quant_error(t, scale, dtype):
    """Bound on |dequantize(quantize(t)) - t| per element, for a scale that saturates nothing:
    u|t| + eta/scale, u = 2^-(mantissa bits + 1) the float8 unit roundoff, eta half the
    smallest subnormal; the fp32 product t * scale adds 2^-24 relative."""
    u = float(jnp.finfo(dtype).eps) / 2 + U32
    eta = float(jnp.finfo(dtype).smallest_subnormal) / 2
    return u * np.abs(t) + eta / scale


def _product_error(a, ea, b, eb):
    """Bound on |A^ B^ - A B| when |A^ - A| <= ea and |B^ - B| <= eb elementwise."""
    return ea @ np.abs(b) + np.abs(a) @ eb + ea @ eb


@pytest.mark.parametrize("impl,delayed", [("pallas", False), ("xla", False), ("xla", True)])
def test_fp8_linear_gradients_within_derived_quantization_bound(impl, delayed):
    """The custom VJP's y, dx, dw against the exact products (float64 from the same bf16 x,
    fp32 w and bf16 output gradient g) and against bf16 autodiff.

    Derivation. A float8 format with m mantissa bits rounds to nearest with unit roundoff
    u = 2^-(m+1): e4m3 (x, w) u = 2^-4, e5m2 (g) u = 2^-3. With a scale s that saturates
    nothing (current scaling maps amax to fp8_max; the delayed scales below leave headroom),
    the dequantized t^ = fl8(t s) / s obeys |t^ - t| <= e(t) = u|t| + eta/s, eta = half the
    format's smallest subnormal (2^-10 for e4m3, 2^-17 for e5m2). For a product,
        |A^ B^ - A B| <= e(A) |B| + |A| e(B) + e(A) e(B)      (elementwise, |.| entrywise),
    i.e. about (u_A + u_B) sum|a||b|: 2^-3 for y = x w, 3 * 2^-4 for dx = g w^T and
    dw = x^T g. The fp32 accumulation adds gamma_K sum|a^||b^| (gamma_K ~ K 2^-24) and the
    cast of the result to bf16 (y, dx) 2^-8 relative (bf16 has 8 significant bits); the
    XLA path rounds both scales to bf16: 2^-7 relative. bf16 autodiff itself is within
    2^-8-level errors of the exact products,
    so the same bound plus its measured deviation holds against it (triangle inequality).
    """
    x, w, ct = _linear_inputs()
    k, n = w.shape
    x2, g2 = _f64(x).reshape(-1, k), _f64(ct).reshape(-1, n)
    w64 = _f64(w)
    amax = {"x": np.max(np.abs(x2)), "w": np.max(np.abs(w64)), "g": np.max(np.abs(g2))}
    if delayed:  # a previous step's scales: amaxes 2x and 3x larger than this step's
        scales = Fp8Scales(*(compute_scale(2.0 * amax[t], fp8_max(d)) for t, d in
                             (("x", E4M3), ("w", E4M3))), compute_scale(3.0 * amax["g"], 57344.0))
    else:
        scales = Fp8Scales()
    s = {t: float(compute_scale(amax[t], fp8_max(d))) if getattr(scales, t) is None
         else float(getattr(scales, t)) for t, d in (("x", E4M3), ("w", E4M3), ("g", E5M2))}

    y, dx, dw, dscales = _value_and_grads(
        lambda x, w, sc: fp8_linear(x, w, sc, impl=impl), x, w, scales, ct)
    assert (y.dtype, dx.dtype, dw.dtype) == (x.dtype, x.dtype, w.dtype)
    assert y.shape == (*x.shape[:-1], n) and dx.shape == x.shape and dw.shape == w.shape

    ex, ew, eg = (_quant_error(t, s[name], d) for t, name, d in
                  ((x2, "x", E4M3), (w64, "w", E4M3), (g2, "g", E5M2)))
    exact = {"y": x2 @ w64, "dx": g2 @ w64.T, "dw": x2.T @ g2}
    quant = {"y": _product_error(x2, ex, w64, ew), "dx": _product_error(g2, eg, w64.T, ew.T),
             "dw": _product_error(x2.T, ex.T, g2, eg)}
    sums = {"y": np.abs(x2) @ np.abs(w64), "dx": np.abs(g2) @ np.abs(w64.T),
            "dw": np.abs(x2.T) @ np.abs(g2)}
    u_out = {"y": 2.0 ** -8, "dx": 2.0 ** -8, "dw": U32}
    got = {"y": np.asarray(y, np.float64).reshape(-1, n),
           "dx": np.asarray(dx, np.float64).reshape(-1, k), "dw": np.asarray(dw, np.float64)}

    # bf16 autodiff of the same layer (w cast to bf16 like a bf16 model's compute copy).
    bf16 = _value_and_grads(lambda x, w, sc: x @ w.astype(jnp.bfloat16), x, w, scales, ct)
    auto = {"y": np.asarray(bf16[0], np.float64).reshape(-1, n),
            "dx": np.asarray(bf16[1], np.float64).reshape(-1, k),
            "dw": np.asarray(bf16[2], np.float64)}
    contraction = {"y": k, "dx": n, "dw": x2.shape[0]}
    for name in ("y", "dx", "dw"):
        s_hat = sums[name] + quant[name]
        gamma = (contraction[name] + 1) * U32 * 1.01
        bound = quant[name] + gamma * s_hat
        if impl == "xla":
            bound += 2.0 ** -7 * 1.01 * s_hat
        bound += u_out[name] * (np.abs(exact[name]) + bound)
        err = np.abs(got[name] - exact[name])
        assert np.all(err <= bound), (name, float(np.max(err / bound)))
        # Quantization really happened: the error is far above bf16 level somewhere.
        assert np.max(err / sums[name]) > 2.0 ** -6, name
        dev = np.abs(auto[name] - exact[name])
        assert np.all(np.abs(got[name] - auto[name]) <= bound + dev), name

    # "Overwrite with gradient": the scales' cotangent is this call's amaxes.
    if delayed:
        np.testing.assert_allclose([float(dscales.x), float(dscales.w), float(dscales.g)],
                                   [amax["x"], np.max(np.abs(_f64(w))), amax["g"]], rtol=1e-6)
    else:
        assert dscales == Fp8Scales(None, None, None)


def test_fp8_linear_backward_is_the_kernel_on_quantized_operands():
    """dx and dw are exactly the float8 products of the quantized g, w and x (e5m2 g,
    e4m3 x/w, the given scales), up to fp32 accumulation and the output cast."""
    x, w, ct = _linear_inputs(seed=1, batch=(24,), k=40, n=56)
    scales = Fp8Scales(jnp.float32(20.0), jnp.float32(300.0), jnp.float32(2e6))
    _, dx, dw, _ = _value_and_grads(lambda x, w, sc: fp8_linear(x, w, sc, impl="pallas"),
                                    x, w, scales, ct)
    x8, w8 = quantize(x, scales.x, E4M3), quantize(w, scales.w, E4M3)
    g8 = quantize(ct, scales.g, E5M2)
    inv = {t: 1.0 / float(getattr(scales, t)) for t in "xwg"}
    want_dx = fp8_matmul_reference(g8, w8, inv["g"], inv["w"], transpose_b=True)
    want_dw = fp8_matmul_reference(x8, g8, inv["x"], inv["g"], transpose_a=True)
    for got, want, a, b, sc, k, od, ta, tb in [
            (dx, want_dx, g8, w8, inv["g"] * inv["w"], 56, jnp.bfloat16, False, True),
            (dw, want_dw, x8, g8, inv["x"] * inv["g"], 24, jnp.float32, True, False)]:
        bound = _accumulation_bound(a, b, sc, k, od, ta, tb) * 1.01 + 1e-30
        assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound)


def test_fp8_linear_fnuz_formats_and_forward_amaxes():
    x, w, _ = _linear_inputs(seed=2, batch=(2, 8), k=32, n=48)
    y_p, am = jax.jit(lambda x, w: fp8_linear_amax(x, w, impl="pallas", formats=HYBRID_FNUZ))(x, w)
    y_x = jax.jit(lambda x, w: fp8_linear(x, w, impl="xla", formats=HYBRID_FNUZ))(x, w)
    exact = _f64(x) @ _f64(w)
    # e4m3fnuz has e4m3's mantissa: the forward bound is about 2 * 2^-4 of sum|x||w|.
    sums = np.abs(_f64(x)) @ np.abs(_f64(w))
    for y in (y_p, y_x):
        assert np.all(np.abs(np.asarray(y, np.float64) - exact) <= 0.14 * sums)
    assert float(am.x) == float(np.max(np.abs(_f64(x)))) and am.g is None
    assert float(am.w) == float(np.max(np.abs(_f64(w))))
    assert HYBRID.fwd == jnp.dtype(E4M3) and HYBRID_FNUZ.bwd == jnp.dtype(E5M2_FNUZ)


def test_fp8_linear_rejects_bad_arguments():
    x, w, _ = _linear_inputs(batch=(2,), k=8, n=4)
    with pytest.raises(ValueError, match="impl='cublas'"):
        fp8_linear(x, w, impl="cublas")
    with pytest.raises(ValueError, match="w \\[K, N\\]"):
        fp8_linear(x, w.T)
    with pytest.raises(TypeError, match="Fp8Scales"):
        fp8_linear(x, w, (1.0, 1.0, 1.0))


# --------------------------------------------------------------------------- the experts' products


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "batched"])
def test_fp8_expert_product_is_the_product_of_the_quantized_operands(grouped):
    """The experts' FP8 product (grouped: rows sorted by expert; batched: capacity buffers): values
    and both gradients are the exact products of the e4m3 x, w and e5m2 g with the given scales;
    the scales' cotangent is the amaxes of x, w and g."""
    rng = np.random.default_rng(3)
    e, k, n = 3, 16, 24
    sizes = jnp.asarray([5, 0, 7], jnp.int32)
    x = jnp.asarray(rng.normal(size=(12, k) if grouped else (e, 4, k)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(e, k, n)) * 0.1, jnp.bfloat16)
    ct = jnp.asarray(rng.normal(size=(12, n) if grouped else (e, 4, n)) * 1e-3, jnp.bfloat16)
    scales = Fp8Scales(jnp.float32(40.0), jnp.float32(900.0), jnp.float32(3e5))

    def f(x, w, sc):
        return fp8_expert_product(x, w, sc, sizes if grouped else None)

    y, vjp = jax.vjp(f, x, w, scales)
    dx, dw, dscales = vjp(ct)
    q = {name: np.asarray(quantize(t, s, fmt), np.float64) / float(s)
         for name, t, s, fmt in (("x", x, scales.x, E4M3), ("w", w, scales.w, E4M3), ("g", ct, scales.g, E5M2))}
    rows = np.repeat(np.arange(e), np.asarray(sizes))
    if grouped:
        want_y = np.einsum("mk,mkn->mn", q["x"], q["w"][rows])
        want_dx = np.einsum("mn,mkn->mk", q["g"], q["w"][rows])
        want_dw = np.stack([q["x"][rows == i].T @ q["g"][rows == i] for i in range(e)])
    else:
        want_y = np.einsum("eck,ekn->ecn", q["x"], q["w"])
        want_dx = np.einsum("ecn,ekn->eck", q["g"], q["w"])
        want_dw = np.einsum("eck,ecn->ekn", q["x"], q["g"])
    for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw)):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2 ** -7, atol=1e-6 * np.abs(want).max())
    amax = lambda t: float(jnp.max(jnp.abs(t.astype(jnp.float32))))
    assert [float(dscales.x), float(dscales.w), float(dscales.g)] == [amax(x), amax(w), amax(ct)]


def test_amaxes_inside_shard_map_are_the_whole_tensors():
    """Under shard_map (a pipeline stage, a sequence-parallel product) a scale shared by shards
    gets the amax of the whole tensor (the shards' maximum) as its cotangent, and the input's
    cotangent is summed where the weight is replicated: the same as one device."""
    mesh = jax.make_mesh((4,), ("t",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
    P = jax.sharding.PartitionSpec
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(16, 32)), jnp.float32)
    scales = Fp8Scales(jnp.float32(50.0), jnp.float32(60.0), jnp.float32(1e4))

    def loss(x, w, sc):  # column-parallel: w split over `t` on its output features
        y = jax.shard_map(lambda x, w: fp8_linear(x, w, sc), mesh=mesh, in_specs=(P(), P(None, "t")),
                          out_specs=P(None, "t"))(x, w)
        return jnp.sum(y * jnp.arange(32.0))

    whole = lambda x, w, sc: jnp.sum(fp8_linear(x, w, sc) * jnp.arange(32.0))
    got = jax.grad(loss, argnums=(0, 1, 2))(x, w, scales)
    want = jax.grad(whole, argnums=(0, 1, 2))(x, w, scales)
    for g, h in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-6)


# --------------------------------------------------------------------------- GPU lowering


@pytest.mark.parametrize("platform,formats", [("cuda", HYBRID), ("rocm", HYBRID_FNUZ)])
def test_kernels_lower_to_triton_for_gpu(platform, formats):
    """The compiled (non-interpret) path: lowering for CUDA / ROCm runs Pallas' Triton
    lowering of the forward (same-type float8 dot) and both backward products (mixed
    types, widened in registers; on ROCm e4m3fnuz by bit manipulation), with ragged
    shapes (masked tiles and K tail) and the amax output; needs no GPU."""
    x = jax.ShapeDtypeStruct((3, 333, 1000), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((1000, 700), jnp.bfloat16)

    def loss(x, w):
        y = fp8_linear(x, w, impl="pallas", formats=formats, interpret=False)
        return y.astype(jnp.float32).sum()

    def with_amax(a, b):
        return fp8_matmul(a, b, 1.0, 1.0, out_dtype=jnp.float32, return_amax=True, interpret=False)

    try:
        grad_text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x, w).lower(
            lowering_platforms=(platform,)).as_text()
        amax_text = jax.jit(with_amax).trace(
            jax.ShapeDtypeStruct((4096, 4096), formats.fwd),
            jax.ShapeDtypeStruct((4096, 4096), formats.fwd)).lower(
            lowering_platforms=(platform,)).as_text()
    except Exception as e:  # newer jaxlibs compile the Triton IR while lowering
        if jax.__version_info__ > (0, 10, 2):
            pytest.skip(f"lowering for {platform} needs more than a CPU jaxlib here: {e!r:.200}")
        raise
    assert grad_text.count("triton") >= 3                  # y, dx and dw kernels
    assert "triton" in amax_text
