"""Block-scaled FP8 quantization: one power-of-two scale per block of elements.

Two formats, both with e4m3 elements (e4m3fnuz on MI300) for inputs, weights and gradients alike:

* BLOCKWISE (DeepSeek-V3's recipe; Transformer Engine's Float8BlockScaling with power-of-two
  scales): blocks of 128 elements along the contracted dim (1 x 128 for activations and
  gradients), 128 x 128 tiles for weights. A block's scale is the largest power of two s with
  amax * s <= fp8_max (Transformer Engine computes fp8_max / amax in fp32 and keeps its exponent);
  scale 1 where amax is 0 or not finite. Stored as the fp32 dequantization factor 1 / s.
* MXFP8 (the OCP Microscaling Formats v1.0 data format): blocks of 32 elements along the
  contracted dim. A block's shared scale is X = 2^ceil(log2(amax / fp8_max)), Transformer Engine's
  and cuDNN's rule (what Megatron's mxfp8 recipe runs), so amax / X lies in (fp8_max / 2, fp8_max]
  and no element saturates; the OCP specification's example conversion takes floor(log2 amax) - 8,
  which saturates a block's elements above 448 X (up to 12.5 % off; it biased the products low and
  the 300-step loss 2.6 % above bf16's on the quickstart model). Clamped to the e8m0 range
  [2^-127, 2^127]; an all-zero (or subnormal) block gets 2^-127. The
  scale is stored as its e8m0 code (uint8: exponent + 127; 0xFF = NaN), and a block holding a NaN
  or an infinity gets the NaN code, so it dequantizes to NaN.

Elements: value / scale (for BLOCKWISE: value * s), rounded to nearest even, saturated to
+-fp8_max (NaN stays NaN). The scaling by a power of two is exact, for subnormal fp32 inputs too
(XLA:CPU reads subnormal operands as zero, so those are scaled through their integer bits).

Layouts (a QTensor holds `values` and `scales`):

    quantize_rows(t [R, C])                   blocks along the last dim: scales [R, ceil(C / B)]
    quantize_tiles(t [R, C])                  BLOCKWISE's 128 x 128 tiles: scales [ceil(R/128), ceil(C/128)]
    quantize_segments(t [M, C], segments [M]) blocks along M, a block never spanning two segments
                                              (an expert's rows): scales [S, C] per segment
    dequantize(...)                           the exact real values, in fp32 (or a given dtype)
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels._common import cdiv

NAN_CODE = 0xFF          # e8m0's NaN
E8M0_BIAS = 127
E8M0_MIN_EXPONENT = -127


class QTensor(NamedTuple):
    """A block-scaled tensor: float8 `values` and per-block `scales` (fp32 dequantization factors
    for BLOCKWISE, uint8 e8m0 codes for MXFP8); the layout is the producing function's."""

    values: jax.Array
    scales: jax.Array


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """One block-scaled format: `name` ("blockwise" | "mxfp8"), `block` (elements per block along
    a dim) and the float8 element type."""

    name: str
    block: int
    dtype: jnp.dtype

    @property
    def fp8_max(self) -> float:
        return float(jnp.finfo(self.dtype).max)

    @property
    def emax(self) -> int:
        """Exponent of the element type's largest power of two (8 for e4m3fn, 7 for e4m3fnuz)."""
        return int(np.floor(np.log2(self.fp8_max)))

    @property
    def significand_limit(self) -> int:
        """fp8_max's significand bits (fp8_max = 1.75 x 2^8 for e4m3fn: 0x600000)."""
        return int(round((self.fp8_max / 2.0 ** self.emax - 1.0) * 2 ** 23))

    def exponents(self, amax_f32):
        """(k, stored scale) for blocks of amax `amax_f32`: elements are value * 2^k."""
        bits = lax.bitcast_convert_type(amax_f32, jnp.uint32)
        field = ((bits >> 23) & 0xFF).astype(jnp.int32)           # 0: zero/subnormal, 255: inf/NaN
        finite = field != 0xFF
        if self.name == "mxfp8":
            # ceil(log2(amax / fp8_max)): the floor rule's exponent, one more where amax's significand
            # exceeds fp8_max's (1.75 for e4m3fn), so that no element saturates
            bump = ((bits & 0x7FFFFF).astype(jnp.int32) > self.significand_limit).astype(jnp.int32)
            shared = jnp.clip(field - E8M0_BIAS - self.emax + bump, E8M0_MIN_EXPONENT, E8M0_BIAS)
            shared = jnp.where(finite, shared, 0)
            code = jnp.where(finite, shared + E8M0_BIAS, NAN_CODE).astype(jnp.uint8)
            return -shared, code
        # BLOCKWISE: the exponent of fp8_max / amax (fp32 division, as Transformer Engine), kept
        # where amax is positive and finite (else 1); at most 2^126 (its inverse a normal number).
        quotient = jnp.float32(self.fp8_max) / amax_f32
        qfield = ((lax.bitcast_convert_type(quotient, jnp.uint32) >> 23) & 0xFF).astype(jnp.int32)
        k = jnp.minimum(qfield - E8M0_BIAS, 126)
        k = jnp.where((bits != 0) & finite, k, 0)  # (a subnormal amax is positive: its bits say so on CPU too)
        return k, pow2(-k)

    def factors(self, scales):
        """fp32 dequantization factors of stored scales (NaN for the e8m0 NaN code; 2^-127 is an fp32
        subnormal, which XLA:CPU reads as 0 where it is an operand: `dequantize` avoids it)."""
        if self.name != "mxfp8":
            return scales
        e = scales.astype(jnp.int32) - E8M0_BIAS
        half = e // 2
        return jnp.where(scales == NAN_CODE, jnp.float32(jnp.nan), pow2(half) * pow2(e - half))

    def dequantize(self, values, scales):
        """values (float8) times their scales (broadcast to values' shape), exactly, in fp32, fp32
        subnormal results included (built from their bits: XLA:CPU flushes subnormal products)."""
        v = values.astype(jnp.float32)
        if self.name != "mxfp8":  # the power-of-two factors quantize_* stores
            e = ((lax.bitcast_convert_type(scales, jnp.uint32) >> 23) & 0xFF).astype(jnp.int32) - E8M0_BIAS
            return scale_exactly(v, e)
        e = scales.astype(jnp.int32) - E8M0_BIAS
        return jnp.where(scales == NAN_CODE, jnp.float32(jnp.nan), scale_exactly(v, e))


BLOCKWISE = BlockFormat("blockwise", 128, jnp.dtype(jnp.float8_e4m3fn))
BLOCKWISE_FNUZ = BlockFormat("blockwise", 128, jnp.dtype(jnp.float8_e4m3fnuz))
MXFP8 = BlockFormat("mxfp8", 32, jnp.dtype(jnp.float8_e4m3fn))
MXFP8_FNUZ = BlockFormat("mxfp8", 32, jnp.dtype(jnp.float8_e4m3fnuz))


def block_format(recipe: str, fnuz: bool = False) -> BlockFormat:
    """The BlockFormat of a recipe ("blockwise" | "mxfp8"); `fnuz`: MI300's e4m3fnuz elements."""
    table = {("blockwise", False): BLOCKWISE, ("blockwise", True): BLOCKWISE_FNUZ,
             ("mxfp8", False): MXFP8, ("mxfp8", True): MXFP8_FNUZ}
    if (recipe, bool(fnuz)) not in table:
        raise ValueError(f"recipe={recipe!r}: block-scaled recipes are blockwise and mxfp8")
    return table[recipe, bool(fnuz)]


# ----------------------------------------------------------------------------------- exact scaling


def pow2(k):
    """2^k in fp32 for integer k in [-126, 127] (built from its exponent bits)."""
    k = jnp.asarray(k, jnp.int32)
    return lax.bitcast_convert_type(((k + E8M0_BIAS) << 23).astype(jnp.uint32), jnp.float32)


def times_pow2(v_f32, k):
    """v * 2^k exactly for fp32 v (subnormals too) and integer k in [-127, 127], where the result
    is an fp32 normal number or below 2^-126 (then approximately: such values round to 0 in
    float8 after any block scaling)."""
    k = jnp.asarray(k, jnp.int32)
    normal = v_f32 * pow2(jnp.clip(k, -126, 127))
    bits = lax.bitcast_convert_type(v_f32, jnp.uint32)
    # A subnormal v is m * 2^-149 (m its 23 mantissa bits): m * 2^(k - 149) in two normal steps.
    m = (bits & 0x7FFFFF).astype(jnp.int32).astype(jnp.float32)
    e = k - 149
    first = jnp.maximum(e, -126)
    rest = e - first                                             # in [-142, 0]
    sub = m * pow2(first) * pow2(jnp.maximum(rest, -126))
    sub = jnp.where(rest < -126, jnp.float32(0), sub)
    sub = jnp.where((bits >> 31) == 1, -sub, sub)
    return jnp.where(((bits >> 23) & 0xFF) == 0, sub, normal)


def scale_exactly(v_f32, e):
    """v * 2^e for fp32 v that is zero or a normal number with at most 11 significant bits (a
    float8 value) and integer e, exact where the result is an fp32 normal or subnormal number:
    its bits are written directly (the exponent field moved; a subnormal's significand shifted)."""
    bits = lax.bitcast_convert_type(v_f32, jnp.uint32)
    sign, mantissa = bits & jnp.uint32(0x80000000), bits & jnp.uint32(0x7FFFFF)
    field = ((bits >> 23) & 0xFF).astype(jnp.int32)
    moved = field + e
    normal = lax.bitcast_convert_type(sign | mantissa | (jnp.clip(moved, 1, 254).astype(jnp.uint32) << 23),
                                      jnp.float32)
    shift = jnp.clip(1 - moved, 0, 31).astype(jnp.uint32)
    sub = sign | ((mantissa | jnp.uint32(0x800000)) >> shift)
    sub = lax.bitcast_convert_type(jnp.where(1 - moved > 24, sign, sub), jnp.float32)
    out = jnp.where(moved >= 1, normal, sub)
    out = jnp.where(moved > 254, jnp.copysign(jnp.float32(jnp.inf), v_f32), out)
    return jnp.where((field == 0) | (field == 0xFF), v_f32, out)


def _elements(v_f32, k, fmt: BlockFormat):
    """The float8 elements of fp32 values whose block exponent is k: v * 2^k, saturated, RNE."""
    y = jnp.clip(times_pow2(v_f32, k), -fmt.fp8_max, fmt.fp8_max)
    if fmt.dtype == jnp.dtype(jnp.float8_e4m3fnuz):
        # As pallas_kernels.fp8_matmul.quantize: a negative value that rounds to zero becomes +0
        # first (the fnuz types' bits of -0 are their NaN).
        half = float(jnp.finfo(fmt.dtype).smallest_subnormal) / 2
        y = jnp.where(jnp.abs(y) <= half, jnp.float32(0), y)
    return y.astype(fmt.dtype)


def _magnitude_bits(v_f32):
    """|v|'s bits as uint32: ordered as the magnitudes, NaNs above infinity."""
    return lax.bitcast_convert_type(v_f32, jnp.uint32) & jnp.uint32(0x7FFFFFFF)


def _amax(blocks_f32, axis):
    """max |x| over `axis` (a NaN when the block holds one), taken on the bits: exact for subnormals,
    which XLA:CPU's float comparisons read as zero."""
    return lax.bitcast_convert_type(jnp.max(_magnitude_bits(blocks_f32), axis=axis), jnp.float32)


# ----------------------------------------------------------------------------------- layouts


def quantize_rows(t, fmt: BlockFormat) -> QTensor:
    """Blocks of fmt.block along the last dim: values like t, scales [..., ceil(C / block)]."""
    c = t.shape[-1]
    nb = cdiv(c, fmt.block)
    v = t.astype(jnp.float32)
    padded = jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, nb * fmt.block - c)])
    blocks = padded.reshape(*v.shape[:-1], nb, fmt.block)
    k, scales = fmt.exponents(_amax(blocks, -1))
    q = _elements(blocks, k[..., None], fmt).reshape(*v.shape[:-1], nb * fmt.block)[..., :c]
    return QTensor(q, scales)


def quantize_tiles(t, fmt: BlockFormat, tile: int | None = None) -> QTensor:
    """Square tiles of `tile` (default fmt.block) over a 2-D t [R, C]: scales [ceil(R/tile), ceil(C/tile)]."""
    tile = tile or fmt.block
    r, c = t.shape
    nr, nc = cdiv(r, tile), cdiv(c, tile)
    v = jnp.pad(t.astype(jnp.float32), [(0, nr * tile - r), (0, nc * tile - c)])
    blocks = v.reshape(nr, tile, nc, tile)
    k, scales = fmt.exponents(_amax(blocks, (1, 3)))
    q = _elements(blocks, k[:, None, :, None], fmt).reshape(nr * tile, nc * tile)[:r, :c]
    return QTensor(q, scales)


def segment_blocks(group_sizes, rows: int, block: int):
    """(segment of each of `rows` rows [rows], number of segments): blocks of `block` consecutive
    rows that restart at each group's first row (groups of `group_sizes` rows, in order; rows past
    their sum form one more group)."""
    sizes = jnp.asarray(group_sizes, jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    r = jnp.arange(rows, dtype=jnp.int32)
    g = jnp.searchsorted(ends, r, side="right")                  # the group of each row (E: past the end)
    starts = jnp.concatenate([starts, ends[-1:]])
    sizes = jnp.concatenate([sizes, jnp.maximum(rows - ends[-1:], 0)])
    first_block = jnp.cumsum((sizes + block - 1) // block) - (sizes + block - 1) // block
    segment = first_block[g] + (r - starts[g]) // block
    return segment, cdiv(rows, block) + len(group_sizes) + 1


def quantize_segments(t, fmt: BlockFormat, segment, num_segments: int) -> QTensor:
    """Blocks along dim 0 of t [M, C] given by each row's segment id: scales [num_segments, C]."""
    v = t.astype(jnp.float32)
    bits = jax.ops.segment_max(_magnitude_bits(v), segment, num_segments=num_segments, indices_are_sorted=True)
    amax = lax.bitcast_convert_type(bits, jnp.float32)  # (an empty segment's: 0)
    k, scales = fmt.exponents(amax)
    return QTensor(_elements(v, k[segment], fmt), scales)


def quantize_columns(t, fmt: BlockFormat) -> QTensor:
    """Blocks of fmt.block along dim 0 of t [M, C] (one segment of all rows): scales [ceil(M/block), C]."""
    rows = t.shape[0]
    segment = jnp.arange(rows, dtype=jnp.int32) // fmt.block
    return quantize_segments(t, fmt, segment, cdiv(rows, fmt.block))


def dequantize_rows(q: QTensor, fmt: BlockFormat, dtype=jnp.float32):
    """The real values of quantize_rows' result, in `dtype` (fp32: exact)."""
    c = q.values.shape[-1]
    return fmt.dequantize(q.values, jnp.repeat(q.scales, fmt.block, axis=-1)[..., :c]).astype(dtype)


def dequantize_tiles(q: QTensor, fmt: BlockFormat, dtype=jnp.float32, tile: int | None = None):
    tile = tile or fmt.block
    r, c = q.values.shape
    scales = jnp.repeat(jnp.repeat(q.scales, tile, axis=0), tile, axis=1)[:r, :c]
    return fmt.dequantize(q.values, scales).astype(dtype)


def dequantize_segments(q: QTensor, fmt: BlockFormat, segment, dtype=jnp.float32):
    return fmt.dequantize(q.values, q.scales[segment]).astype(dtype)


def tiles_as_rows(q: QTensor, fmt: BlockFormat, transpose: bool = False) -> QTensor:
    """A tiled QTensor [R, C] as a row-blocked one (each row's blocks along C carry its tile's
    scale): the layout the kernels take. `transpose`: of q's transpose [C, R] instead."""
    values, scales = (q.values.T, q.scales.T) if transpose else (q.values, q.scales)
    rows = values.shape[0]
    return QTensor(values, jnp.repeat(scales, fmt.block, axis=0)[:rows])
