"""Block-scaled FP8 (precision.fp8_recipe blockwise and mxfp8): the quantizers against float64
models of their rules bit for bit (the OCP MX v1.0 conversion; Transformer Engine's power-of-two
block scales) on random and adversarial inputs; the Pallas blockwise kernel (interpret mode)
against a float64 reference; the linear's custom VJP and the experts' products against the
products of the quantized operands they are defined by; the Triton and block-scaled-dot
lowerings for CUDA and ROCm."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import (
    BLOCKWISE, MXFP8, block_scaled_expert_product, block_scaled_linear, blockwise_matmul,
    blockwise_matmul_reference, blockwise_matmul_xla, dequantize_rows, mxfp8_matmul, mxfp8_matmul_reference,
    quantize_rows, quantize_tiles)
from pallas_kernels.block_scaled_linear import quantize_weight
from pallas_kernels.block_scaling import (
    BLOCKWISE_FNUZ, MXFP8_FNUZ, dequantize_segments, quantize_columns, quantize_segments, segment_blocks,
    tiles_as_rows)

F32_MAX = float(np.finfo(np.float32).max)
U32 = 2.0 ** -24


# ----------------------------------------------------------------------------------- float64 models


def e4m3_round(v: np.ndarray, fp8_max: float = 448.0, min_exp: int = -6) -> np.ndarray:
    """Round-to-nearest-even onto the e4m3 grid (3 mantissa bits, subnormals below 2^min_exp),
    saturating at +-fp8_max; NaN stays NaN (float64, written from the format's definition)."""
    a = np.abs(v)
    with np.errstate(divide="ignore", invalid="ignore"):
        e = np.floor(np.log2(np.where((a > 0) & np.isfinite(a), a, 1.0)))
    step = 2.0 ** (np.maximum(e, min_exp) - 3)
    r = np.minimum(np.round(np.where(np.isfinite(a), a, 0.0) / step) * step, fp8_max)  # np.round: half to even
    r = np.where(np.isinf(a), fp8_max, r)
    return np.where(np.isnan(v), np.nan, np.copysign(r, v))


def mx_block(v: np.ndarray, fp8_max: float = 448.0) -> tuple[int, np.ndarray]:
    """One block of fp32 values (as float64) in the OCP MX v1.0 format as Transformer Engine and cuDNN
    convert it: (e8m0 code, elements). X = 2^ceil(log2(max|V| / fp8_max)) clamped to [2^-127, 2^127],
    all-zero blocks 2^-127; P_i = V_i / X rounded to e4m3 (RNE; nothing saturates). A block holding a
    NaN or an infinity gets the NaN code (megajax's elements there: V_i rounded as if X = 1)."""
    if not np.all(np.isfinite(v)):
        return 255, e4m3_round(v)
    amax = float(np.max(np.abs(v)))
    shared = -127
    if amax:  # the least s with amax <= fp8_max x 2^s (exact products in float64)
        shared = math.frexp(amax)[1] - 9
        while amax > math.ldexp(fp8_max, shared):
            shared += 1
        while amax <= math.ldexp(fp8_max, shared - 1):
            shared -= 1
        shared = min(max(shared, -127), 127)
    return shared + 127, e4m3_round(v / 2.0 ** shared)


def te_pow2_block(v: np.ndarray, fp8_max: float = 448.0, min_exp: int = -6) -> tuple[float, np.ndarray]:
    """Transformer Engine's power-of-two block scale: s = 2^floor(log2(fp8_max / amax)) (the
    quotient in fp32), 1 where amax is 0 or not finite, at most 2^126: (1 / s, elements)."""
    amax = np.float32(np.max(np.abs(v))) if np.all(~np.isnan(v)) else np.float32(np.nan)
    if not (amax > 0 and np.isfinite(amax)):
        k = 0
    else:
        with np.errstate(over="ignore", divide="ignore"):
            q = np.float32(fp8_max) / amax
        k = 126 if not np.isfinite(q) else min(math.frexp(float(q))[1] - 1, 126)
    return 2.0 ** -k, e4m3_round(v * 2.0 ** k, fp8_max, min_exp)


def _f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def _same(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal values, NaNs in the same places and zeros of the same sign."""
    return bool(np.array_equal(got, want, equal_nan=True) and np.array_equal(np.signbit(got), np.signbit(want)))


def adversarial_rows(width: int, rng) -> np.ndarray:
    """Rows of fp32 values that exercise every rule: normal data across binades, zeros (and -0),
    subnormals only, subnormals beside normals, max-magnitude blocks (448..512 x 2^j, the tie at
    464, fp32's largest), NaN and infinities, tiny normals."""
    rows = [rng.standard_normal(width) * np.exp(rng.normal(0, 6)) for _ in range(6)]
    rows.append(np.zeros(width))
    rows.append(np.where(rng.random(width) < 0.5, -0.0, 0.0))
    rows.append(rng.standard_normal(width) * 2.0 ** -140)                      # subnormals only
    sub = rng.standard_normal(width) * 2.0 ** -140
    sub[::7] = 2.0 ** -120                                                      # tiny normals among them
    rows.append(sub)
    rows.append(np.full(width, 464.0))                                         # e4m3's tie at 464
    rows.append(rng.uniform(448, 512, width) * 2.0 ** rng.integers(-20, 20))   # saturating MX blocks
    big = rng.standard_normal(width) * 1e37
    big[::5] = F32_MAX
    big[1::5] = -F32_MAX
    rows.append(big)
    special = rng.standard_normal(width)
    special[3] = np.nan
    rows.append(special)
    special = rng.standard_normal(width)
    special[min(40, width - 1)] = np.inf
    special[0] = -np.inf
    rows.append(special)
    rows.append(rng.standard_normal(width) * 2.0 ** -125)
    return np.stack(rows).astype(np.float32)


# ----------------------------------------------------------------------------------- quantizers


@pytest.mark.parametrize("width", [96, 100])
def test_mxfp8_quantization_is_the_mx_conversion_bit_for_bit(width):
    """Each 32-element block: e8m0 code and e4m3 elements equal the float64 model of the MX
    conversion (the scale rounded up, clamped, RNE, no saturation, NaN code), on random data and on
    zeros, subnormals, blocks the OCP floor rule saturates, fp32-max blocks, NaN and infinities; a
    short last block."""
    rng = np.random.default_rng(width)
    x = adversarial_rows(width, rng)
    q = jax.jit(lambda t: quantize_rows(t, MXFP8))(jnp.asarray(x))
    codes, values = np.asarray(q.scales), _f64(q.values)
    for r in range(x.shape[0]):
        for b in range(math.ceil(width / 32)):
            block = x[r, b * 32:(b + 1) * 32].astype(np.float64)
            code, elements = mx_block(block)
            assert codes[r, b] == code, (r, b, block)
            assert _same(values[r, b * 32:(b + 1) * 32], elements), (r, b, block)
    # The bits too: the model's elements are e4m3 values, equal to the kernel's bytes.
    want_bits = np.concatenate([mx_block(x[r, b * 32:(b + 1) * 32].astype(np.float64))[1]
                                for r in range(x.shape[0]) for b in range(math.ceil(width / 32))])
    got_bits = np.asarray(jax.lax.bitcast_convert_type(q.values, jnp.uint8)).reshape(-1)
    assert np.array_equal(got_bits, want_bits.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    # Dequantized: exactly element x 2^(code - 127) (2^-127 included), NaN for the NaN code.
    deq = _f64(dequantize_rows(q, MXFP8))
    factors = np.where(codes == 255, np.nan, np.ldexp(1.0, codes.astype(np.int64) - 127))
    want = values * np.repeat(factors, 32, axis=1)[:, :width]
    # (fp32's largest values: the element rounds up to 256 x 2^120 = 2^128, past fp32's range)
    assert _same(deq, np.where(np.abs(want) > F32_MAX, np.copysign(np.inf, want), want))
    # Nothing saturates: a finite block's largest value comes back within e4m3's rounding (2^-4); the
    # OCP example conversion's floor rule returned the 448..512 blocks' tops as 448 (up to 12.5 % off).
    for r in range(x.shape[0]):
        for b in range(math.ceil(width / 32)):
            block = x[r, b * 32:(b + 1) * 32].astype(np.float64)
            if np.all(np.isfinite(block)) and 2.0 ** -100 < np.max(np.abs(block)) < 2.0 ** 127:
                i = np.argmax(np.abs(block))
                assert abs(deq[r, b * 32 + i] - block[i]) <= 2.0 ** -4 * abs(block[i]), (r, b, block[i])


def test_mxfp8_quantization_of_bf16_inputs():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((8, 64)) * np.exp(rng.normal(0, 5, (8, 1))), jnp.bfloat16)
    q = quantize_rows(x, MXFP8)
    x64 = _f64(x)
    for r in range(8):
        for b in range(2):
            code, elements = mx_block(x64[r, b * 32:(b + 1) * 32])
            assert int(q.scales[r, b]) == code and _same(_f64(q.values)[r, b * 32:(b + 1) * 32], elements)


@pytest.mark.parametrize("fmt", [BLOCKWISE, BLOCKWISE_FNUZ], ids=["e4m3fn", "e4m3fnuz"])
def test_blockwise_quantization_is_the_power_of_two_rule_bit_for_bit(fmt):
    """1 x 128 blocks and 128 x 128 tiles: the scale 2^floor(log2(fp8_max / amax)) of Transformer
    Engine's power-of-two block scaling, elements RNE and saturating, bit for bit."""
    rng = np.random.default_rng(3)
    limit = float(jnp.finfo(fmt.dtype).max)
    min_exp = -6 if limit == 448.0 else -7
    x = adversarial_rows(300, rng)
    q = quantize_rows(jnp.asarray(x), fmt)
    for r in range(x.shape[0]):
        for b in range(3):
            block = x[r, b * 128:(b + 1) * 128].astype(np.float64)
            factor, elements = te_pow2_block(block, limit, min_exp)
            if limit != 448.0:  # e4m3fnuz: one zero, +0
                elements = np.where(elements == 0, 0.0, elements)
            assert float(q.scales[r, b]) == factor, (r, b)
            assert _same(_f64(q.values)[r, b * 128:(b + 1) * 128], elements), (r, b)
    # Tiles: one scale per 128 x 128 tile, from the tile's amax.
    w = np.concatenate([x[:8], rng.standard_normal((140, 300)).astype(np.float32)])
    t = quantize_tiles(jnp.asarray(w), fmt)
    assert t.scales.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            tile = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].astype(np.float64)
            factor, elements = te_pow2_block(tile, limit, min_exp)
            if limit != 448.0:
                elements = np.where(elements == 0, 0.0, elements)
            assert float(t.scales[i, j]) == factor
            assert _same(_f64(t.values)[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128], elements)


def test_segment_blocks_never_span_two_experts():
    sizes = jnp.asarray([5, 0, 40, 3], jnp.int32)   # 48 rows used of 52
    segment, count = segment_blocks(sizes, 52, 32)
    segment = np.asarray(segment)
    want = np.concatenate([np.zeros(5), 1 + np.arange(40) // 32, np.full(3, 3), np.full(4, 4)])
    assert np.array_equal(segment, want) and count >= segment.max() + 1
    x = jnp.asarray(np.random.default_rng(0).standard_normal((52, 6)) * np.exp(np.arange(52))[:, None] * 1e-20,
                    jnp.float32)
    q = quantize_segments(x, MXFP8, jnp.asarray(segment), count)
    for s in range(5):
        rows = segment == s
        code, _ = mx_block(_f64(x)[rows][:, 2])
        assert int(q.scales[s, 2]) == code
    assert np.allclose(_f64(dequantize_segments(q, MXFP8, jnp.asarray(segment))), _f64(x), rtol=2 ** -3)


# ----------------------------------------------------------------------------------- products


def _block_bound(a, sa, b, sb, k, out_dtype):
    """|kernel - exact| bound: fp32 sums of exact float8 products within a block (gamma_128), each
    block's partial scaled by two factors (2 roundings) and summed over the blocks (gamma_nk), then
    the cast to out_dtype."""
    real_a = np.abs(_f64(a)) * np.repeat(np.abs(np.asarray(sa, np.float64)), 128, axis=1)[:, :k]
    real_b = np.abs(_f64(b)) * np.repeat(np.abs(np.asarray(sb, np.float64)), 128, axis=1)[:, :k]
    s = real_a @ real_b.T
    terms = 128 + 2 + math.ceil(k / 128)
    u_out = {jnp.dtype(jnp.float32): U32, jnp.dtype(jnp.bfloat16): 2.0 ** -8, jnp.dtype(jnp.float16): 2.0 ** -11}
    return s * terms * U32 / (1 - terms * U32) * 1.01 + u_out[jnp.dtype(out_dtype)] * s


@pytest.mark.parametrize("fmt, m, n, k, out_dtype, blocks", [
    (BLOCKWISE, 100, 72, 300, jnp.float32, dict(block_m=32, block_n=32)),
    (BLOCKWISE, 33, 130, 128, jnp.bfloat16, dict(block_m=16, block_n=64)),
    (BLOCKWISE_FNUZ, 48, 40, 200, jnp.float32, dict(block_m=16, block_n=16)),
    (BLOCKWISE, 70, 45, 77, jnp.float16, {}),
], ids=["ragged-f32", "one-block-bf16", "fnuz", "default-blocks"])
def test_blockwise_kernel_matches_float64_reference(fmt, m, n, k, out_dtype, blocks):
    rng = np.random.default_rng(m + n + k)
    a = quantize_rows(jnp.asarray(rng.standard_normal((m, k)) * 3, jnp.float32), fmt).values
    b = quantize_rows(jnp.asarray(rng.standard_normal((n, k)), jnp.float32), fmt).values
    nk = math.ceil(k / 128)
    small = 2.0 ** -8 if out_dtype == jnp.float16 else 1.0              # (within float16's range)
    sa = jnp.asarray(np.exp(rng.normal(0, 2, (m, nk))) * small, jnp.float32)   # any fp32 factors
    sb = jnp.asarray(np.exp(rng.normal(0, 2, (n, nk))) * small, jnp.float32)
    got = jax.jit(lambda *o: blockwise_matmul(*o, out_dtype=out_dtype, interpret=True, **blocks))(a, sa, b, sb)
    want = blockwise_matmul_reference(a, sa, b, sb)
    assert got.shape == (m, n) and got.dtype == jnp.dtype(out_dtype)
    assert np.all(np.abs(_f64(got) - want) <= _block_bound(a, sa, b, sb, k, out_dtype))
    xla = blockwise_matmul_xla(a, sa, b, sb, out_dtype=out_dtype)
    assert np.all(np.abs(_f64(xla) - want) <= _block_bound(a, sa, b, sb, k, out_dtype))


def test_blockwise_kernel_rejects_bad_arguments():
    a = jnp.zeros((4, 256), jnp.float8_e4m3fn)
    s = jnp.ones((4, 2), jnp.float32)
    with pytest.raises(ValueError, match=r"a_scales.shape=\(4, 1\): expected \(4, 2\)"):
        blockwise_matmul(a, s[:, :1], a, s, out_dtype=jnp.float32)
    with pytest.raises(ValueError, match="share one float8 type"):
        blockwise_matmul(a, s, a.astype(jnp.float8_e4m3fnuz), s, out_dtype=jnp.float32)
    with pytest.raises(ValueError, match="block_m=24 must be a power of two"):
        blockwise_matmul(a, s, a, s, out_dtype=jnp.float32, block_m=24)


def test_mxfp8_emulation_is_the_exact_product():
    rng = np.random.default_rng(5)
    a = quantize_rows(jnp.asarray(rng.standard_normal((40, 100)), jnp.float32), MXFP8)
    b = quantize_rows(jnp.asarray(rng.standard_normal((24, 100)) * 1e-3, jnp.float32), MXFP8)
    got = mxfp8_matmul(a.values, a.scales, b.values, b.scales, out_dtype=jnp.float32, native=False)
    want = mxfp8_matmul_reference(a.values, a.scales, b.values, b.scales)
    s = np.abs(_f64(dequantize_rows(a, MXFP8))) @ np.abs(_f64(dequantize_rows(b, MXFP8))).T
    assert np.all(np.abs(_f64(got) - want) <= 101 * U32 * s)


@pytest.mark.parametrize("recipe, impl", [("blockwise", "xla"), ("blockwise", "pallas"), ("mxfp8", "xla")])
def test_linear_vjp_is_the_products_of_its_quantized_operands(recipe, impl):
    """y = Q_K(x) Q(w), dx = Q_N(g) Q(w)^T, dw = Q_M(x)^T Q_M(g): each tensor quantized along the dim
    its product contracts (blockwise: w's 128 x 128 tiles read both ways; mxfp8: w quantized along
    K and along N); and the result close to the exact product."""
    rng = np.random.default_rng(7)
    fmt = BLOCKWISE if recipe == "blockwise" else MXFP8
    x = jnp.asarray(rng.standard_normal((2, 90, 160)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((160, 200)) * 0.05, jnp.float32)
    g = jnp.asarray(rng.standard_normal((2, 90, 200)), jnp.float32)
    y, vjp = jax.vjp(lambda x, w: block_scaled_linear(x, w, recipe=recipe, impl=impl, interpret=True), x, w)
    dx, dw = vjp(g)
    deq = lambda t: _f64(dequantize_rows(quantize_rows(t, fmt), fmt))
    x2, g2 = x.reshape(-1, 160), g.reshape(-1, 200)
    w_fwd, w_bwd = quantize_weight(w, fmt)
    want_y = deq(x2) @ _f64(dequantize_rows(w_fwd, fmt)).T
    want_dx = deq(g2) @ _f64(dequantize_rows(w_bwd, fmt)).T
    want_dw = deq(x2.T) @ deq(g2.T).T
    if recipe == "blockwise":  # the weight's tiles, read both ways, hold the same values
        tiles = _f64(dequantize_rows(tiles_as_rows(quantize_tiles(w.T, fmt), fmt), fmt))
        assert np.array_equal(tiles, _f64(dequantize_rows(w_fwd, fmt)))
        assert np.array_equal(tiles.T, _f64(dequantize_rows(w_bwd, fmt)))
    for got, want in ((y.reshape(-1, 200), want_y), (dx.reshape(-1, 160), want_dx), (dw, want_dw)):
        np.testing.assert_allclose(_f64(got), want, rtol=0, atol=1e-5 * np.max(np.abs(want)))
    exact = (_f64(x2) @ _f64(w), _f64(g2) @ _f64(w).T, _f64(x2).T @ _f64(g2))
    for got, want in zip((y.reshape(-1, 200), dx.reshape(-1, 160), dw), exact):
        assert np.max(np.abs(_f64(got) - want)) < 0.08 * np.max(np.abs(want))


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_expert_products_quantize_each_expert_apart(recipe):
    """Grouped rows (expert sizes not multiples of a block): the weight gradient's blocks along the
    tokens restart at each expert's first row, so dw of an expert is its own rows' product."""
    rng = np.random.default_rng(11)
    fmt = BLOCKWISE if recipe == "blockwise" else MXFP8
    sizes = np.array([37, 0, 70, 23])
    # Experts of very different magnitudes: a block spanning two would crush the smaller one's values.
    magnitude = np.concatenate([np.repeat([1.0, 1.0, 1e-3, 50.0], sizes), np.ones(130 - sizes.sum())])
    x = jnp.asarray(rng.standard_normal((130, 64)) * magnitude[:, None], jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 64, 48)) * 0.1, jnp.float32)
    g = jnp.asarray(rng.standard_normal((130, 48)), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    y, vjp = jax.vjp(lambda x, w: block_scaled_expert_product(x, w, gs, recipe=recipe), x, w)
    dx, dw = vjp(g)
    start = 0
    for e, n in enumerate(sizes):
        rows = slice(start, start + n)
        w_fwd, w_bwd = quantize_weight(w[e], fmt)
        xe, ge = x[rows], g[rows]
        if n:
            np.testing.assert_allclose(_f64(y[rows]), _f64(dequantize_rows(quantize_rows(xe, fmt), fmt))
                                       @ _f64(dequantize_rows(w_fwd, fmt)).T, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(_f64(dx[rows]), _f64(dequantize_rows(quantize_rows(ge, fmt), fmt))
                                       @ _f64(dequantize_rows(w_bwd, fmt)).T, rtol=1e-5, atol=1e-5)
        cols = lambda t: _f64(dequantize_rows(quantize_rows(t.T, fmt), fmt)).T if n else np.zeros(t.shape)
        np.testing.assert_allclose(_f64(dw[e]), cols(xe).T @ cols(ge), rtol=1e-5, atol=1e-5)
        start += n
    assert np.all(_f64(y[start:]) == 0)  # rows past the groups


def test_batched_expert_product_blocks_along_each_experts_capacity():
    rng = np.random.default_rng(13)
    x = jnp.asarray(rng.standard_normal((3, 40, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 64, 32)) * 0.1, jnp.float32)
    g = jnp.asarray(rng.standard_normal((3, 40, 32)), jnp.float32)
    y, vjp = jax.vjp(lambda x, w: block_scaled_expert_product(x, w, recipe="mxfp8"), x, w)
    _, dw = vjp(g)
    for e in range(3):
        def cols(t):
            q = quantize_columns(t, MXFP8)
            return _f64(MXFP8.dequantize(q.values, jnp.repeat(q.scales, 32, axis=0)[:t.shape[0]]))
        np.testing.assert_allclose(_f64(dw[e]), cols(x[e]).T @ cols(g[e]), rtol=1e-5, atol=1e-5)


def test_block_scaled_linear_rejects_bad_arguments():
    x, w = jnp.zeros((4, 64)), jnp.zeros((64, 8))
    with pytest.raises(ValueError, match="recipe='rowwise': accepted"):
        block_scaled_linear(x, w, recipe="rowwise")
    with pytest.raises(ValueError, match="no Pallas MXFP8 kernel"):
        block_scaled_linear(x, w, recipe="mxfp8", impl="pallas")
    with pytest.raises(ValueError, match=r"x \[..., K\] and w \[K, N\]"):
        block_scaled_linear(x, w.T, recipe="blockwise")


# ----------------------------------------------------------------------------------- GPU lowering


@pytest.mark.parametrize("platform, fnuz", [("cuda", False), ("rocm", True)])
def test_blockwise_kernel_lowers_to_triton_for_gpu(platform, fnuz):
    """The forward and both backward products of the blockwise linear (ragged shapes: masked tiles,
    a short last K block) through Pallas' Triton lowering, e4m3fnuz on ROCm; needs no GPU."""
    x = jax.ShapeDtypeStruct((3, 333, 1000), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((1000, 700), jnp.bfloat16)

    def loss(x, w):
        y = block_scaled_linear(x, w, recipe="blockwise", impl="pallas", fnuz=fnuz, interpret=False)
        return y.astype(jnp.float32).sum()

    try:
        text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x, w).lower(lowering_platforms=(platform,)).as_text()
    except Exception as e:  # newer jaxlibs compile the Triton IR while lowering
        if jax.__version_info__ > (0, 10, 2):
            pytest.skip(f"lowering for {platform} needs more than a CPU jaxlib here: {e!r:.200}")
        raise
    assert text.count("blockwise_fp8_matmul") >= 3 and "triton" in text      # y, dx and dw kernels


@pytest.mark.parametrize("platform, marker", [("cuda", "__op$block_scaled_dot"), ("rocm", "xla.scaled_dot")])
def test_mxfp8_native_path_lowers_to_the_block_scaled_gemm(platform, marker):
    """On Blackwell the three products go to jax.nn.scaled_matmul with e8m0 scales (cuDNN's
    block-scaled dot on CUDA, XLA's scaled_dot composite on ROCm)."""
    x = jax.ShapeDtypeStruct((4, 256, 100), jnp.bfloat16)      # K = 100: padded to 128 for the GEMM
    w = jax.ShapeDtypeStruct((100, 256), jnp.bfloat16)

    def loss(x, w):
        return block_scaled_linear(x, w, recipe="mxfp8", native=True, fnuz=False).astype(jnp.float32).sum()

    # (value_and_grad: with the loss a plain sum, the forward product would be dead code)
    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).trace(x, w).lower(
        lowering_platforms=(platform,)).as_text()
    assert text.count(marker) >= 3 and "f8E8M0FNU" in text
