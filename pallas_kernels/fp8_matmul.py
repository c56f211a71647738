"""FP8 matrix multiplication in Pallas: Triton on NVIDIA sm_89+ and AMD MI300, interpret on CPU.

    fp8_matmul(a, b, a_scale, b_scale, *, out_dtype) = (a * a_scale) @ (b * b_scale)

a [M, K] and b [K, N] hold float8 values (e4m3fn / e5m2 on NVIDIA, e4m3fnuz / e5m2fnuz on
MI300); a_scale and b_scale are per-tensor fp32 *dequantization* factors (a * a_scale is
the real value, i.e. 1 / the scale that `quantize` multiplied by). Products accumulate in
fp32; the scaling and the cast to out_dtype happen in the kernel's epilogue, which can
also return the amax (max |out|) of the result. Any M, N, K: edge tiles are loaded and
stored under masks. `transpose_a` / `transpose_b` read an operand stored the other way
round ([K, M] / [N, K]) without a copy.

One program per [block_m, block_n] output tile, walking K in block_k steps; programs are
numbered in groups of `group_m` tile rows so that neighbours share a and b tiles in L2.

Operands of one float8 type go to the tensor cores as they are (Hopper/Ada FP8 MMA, MI300
MFMA). Pallas' Triton lowering (jax 0.10 and 0.11) needs both dot operands of one element
type, so a mixed product (e5m2 gradient x e4m3 weight, as in the backward pass) converts
both tiles to float16 in registers first: exact (every e4m3/e5m2 value is a float16 value,
every product of two fits fp32), at 16-bit tensor-core rate. The same lowering refuses to
convert from e4m3fnuz, so that type is widened by bit manipulation (its magnitude bits
shifted into a float16, which is then the value times 2^-7; the 2^7 goes into the
epilogue's scale).

`fp8_matmul_xla` computes the same product as the convert -> scale -> dot pattern that
XLA's GPU compiler rewrites into one cuBLASLt FP8 GEMM (`__cublas$lt$matmul$f8`, hipBLASLt
on ROCm); `fp8_matmul_reference` is the float64 answer from the same float8 values.
`quantize` (saturating cast) and `compute_scale` (Transformer Engine's scale rule) prepare
the inputs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (
    both as _and, cdiv as _cdiv, masked_load as _load, next_pow2 as _next_pow2, on_rocm as _on_rocm,
    shared_memory_per_block as _shared_memory_per_block, stages_that_fit, tile_ids, valid as _valid)

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
E4M3_FNUZ = jnp.float8_e4m3fnuz
E5M2_FNUZ = jnp.float8_e5m2fnuz
FP8_DTYPES = tuple(jnp.dtype(t) for t in (E4M3, E5M2, E4M3_FNUZ, E5M2_FNUZ))
OUT_DTYPES = tuple(jnp.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16))


class Fp8Formats(NamedTuple):
    """The float8 types of one recipe: `fwd` for inputs and weights, `bwd` for gradients."""

    fwd: jnp.dtype
    bwd: jnp.dtype


# Megatron / Transformer Engine "hybrid": e4m3 (max 448) forward, e5m2 (max 57344) backward.
HYBRID = Fp8Formats(jnp.dtype(E4M3), jnp.dtype(E5M2))
# The same on MI300, whose float8 types have no negative zero and no infinities (max 240 / 57344).
HYBRID_FNUZ = Fp8Formats(jnp.dtype(E4M3_FNUZ), jnp.dtype(E5M2_FNUZ))


def fp8_max(dtype) -> float:
    """Largest finite value of a float8 type: 448, 57344, 240, 57344."""
    return float(jnp.finfo(dtype).max)


def default_formats() -> Fp8Formats:
    """HYBRID_FNUZ on ROCm (MI300's types), HYBRID elsewhere."""
    return HYBRID_FNUZ if _on_rocm() else HYBRID


def quantize(x, scale, dtype):
    """x * scale cast to the float8 `dtype`, saturating: values beyond the type's range
    (infinities too) become +-fp8_max instead of inf/NaN; NaN stays NaN. Computed in fp32."""
    limit = fp8_max(dtype)
    y = jnp.clip(x.astype(jnp.float32) * jnp.asarray(scale, jnp.float32), -limit, limit)
    if jnp.dtype(dtype) in (jnp.dtype(E4M3_FNUZ), jnp.dtype(E5M2_FNUZ)):
        # The fnuz types' one zero is +0 and their NaN is 0x80, the bits of -0. XLA's elemental
        # emitter (XLA:CPU with --xla_cpu_use_fusion_emitters=false) casts a negative value that
        # rounds to zero to 0x80: such values are made +0 first (what a correct cast gives).
        half_smallest = float(jnp.finfo(dtype).smallest_subnormal) / 2  # at most this rounds to 0
        y = jnp.where(jnp.abs(y) <= half_smallest, jnp.float32(0), y)
    return y.astype(dtype)


def compute_scale(amax, fp8_max_value: float, margin: int = 0, fallback=1.0):
    """Transformer Engine's scale: fp8_max / amax / 2^margin, so that amax maps to fp8_max.

    Where amax is 0 or not finite, or the quotient overflows, returns `fallback`
    (Transformer Engine keeps the previous scale: pass it). fp32."""
    amax = jnp.asarray(amax, jnp.float32)
    fallback = jnp.asarray(fallback, jnp.float32)
    scale = jnp.float32(fp8_max_value) / amax / jnp.float32(2.0 ** margin)
    ok = (amax > 0) & jnp.isfinite(amax) & jnp.isfinite(scale)
    return jnp.where(ok, scale, fallback)


# --------------------------------------------------------------------------- block sizes

# Tile shapes by problem class, for operands of one float8 type on sm_90 (H100/H200:
# 227 KiB shared memory per block). Each pipeline stage buffers (block_m + block_n) *
# block_k bytes of float8: 48 KiB for "large" (3 stages: 144 KiB), 32 KiB for "medium"
# (4 stages: 128 KiB), 24 KiB for "small_m". Smaller shared memories get fewer stages.
_BLOCK_TABLE = {
    # M <= 64 (decode, tiny batches): short tiles, more of them along N.
    "small_m": dict(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=4),
    # Fewer than _LARGE_MIN_TILES large tiles would leave SMs idle: 128 x 128 tiles.
    "medium": dict(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=4),
    # Big products: 128 x 256 tiles halve the a-tile reloads of 128 x 128.
    "large": dict(block_m=128, block_n=256, block_k=128, num_warps=8, num_stages=3),
}
_LARGE_MIN_TILES = 256  # about two waves of 128 x 256 tiles on a 132-SM H100/H200
_MIXED_BLOCK_K = 64     # mixed float8 types: tiles widened to float16 in registers
_MIN_BLOCK = 16         # Triton's dot: every dimension >= 16 ...
_MIN_BLOCK_K = 32       # ... and K >= 32 for 8-bit operands
_GROUP_M = 8


def default_block_sizes(m: int, n: int, k: int, a_dtype=E4M3, b_dtype=E4M3,
                        shared_memory: int | None = None) -> dict:
    """Block sizes and Triton launch parameters for an [M, K] x [K, N] product.

    The class comes from the table (small_m, medium, large); then every block shrinks to
    the next power of two of its dimension (>= 16, K >= 32), so a small or ragged
    problem gets no tile much larger than itself (the edges are masked), and the number
    of pipeline stages shrinks until the float8 tiles fit 90% of `shared_memory` (bytes
    per block, e.g. 99 KiB on sm_89; None: the table's sm_90 values)."""
    if m <= 64:
        row = dict(_BLOCK_TABLE["small_m"])
    elif _cdiv(m, 128) * _cdiv(n, 256) >= _LARGE_MIN_TILES:
        row = dict(_BLOCK_TABLE["large"])
    else:
        row = dict(_BLOCK_TABLE["medium"])
    if jnp.dtype(a_dtype) != jnp.dtype(b_dtype):
        row["block_k"] = _MIXED_BLOCK_K
    row["block_m"] = min(row["block_m"], max(_MIN_BLOCK, _next_pow2(m)))
    row["block_n"] = min(row["block_n"], max(_MIN_BLOCK, _next_pow2(n)))
    row["block_k"] = min(row["block_k"], max(_MIN_BLOCK_K, _next_pow2(k)))
    row["num_stages"] = stages_that_fit(row["num_stages"], (row["block_m"] + row["block_n"]) * row["block_k"],
                                        shared_memory)  # a stage's bytes of float8
    row["group_m"] = _GROUP_M
    return row


# --------------------------------------------------------------------------- kernel


@dataclasses.dataclass(frozen=True)
class _Config:
    """Everything static about one call (hashable)."""

    m: int
    n: int
    k: int
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    transpose_a: bool       # a stored [K, M]
    transpose_b: bool       # b stored [N, K]
    widen_a: str | None     # None (same float8 types), "cast" or "bits" (e4m3fnuz)
    widen_b: str | None
    out_dtype: jnp.dtype
    return_amax: bool
    num_warps: int
    num_stages: int
    interpret: bool

    @property
    def num_m(self) -> int:
        return _cdiv(self.m, self.block_m)

    @property
    def num_n(self) -> int:
        return _cdiv(self.n, self.block_n)


# e4m3fnuz bits moved into a float16 read as the value times 2^-7 (exponent bias 8 vs 15;
# subnormals line up too); the factor is undone in the epilogue.
_E4M3FNUZ_BITS_FACTOR = 2.0 ** 7


def _widen(x, how: str | None):
    """A float8 tile as float16 for a mixed-type dot (see the module docstring)."""
    if how is None:
        return x
    if how == "cast":
        return x.astype(jnp.float16)
    u = lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint16)
    h = ((u & 0x80) << 8) | ((u & 0x7F) << 7)  # sign to bit 15, exponent + mantissa below
    return lax.bitcast_convert_type(h, jnp.float16)


def _tile_ids(pid, cfg: _Config):
    return tile_ids(pid, cfg.num_m, cfg.num_n, cfg.group_m)


def _kernel(a_ref, b_ref, scale_ref, o_ref, *amax_ref, cfg: _Config):
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    pid = pl.program_id(0)
    i, j = _tile_ids(pid, cfg)
    m0, n0 = i * bm, j * bn
    # Row / column masks exist only when the dimension is ragged (static).
    m_ok = _valid(m0, bm, cfg.m, column=cfg.transpose_a) if cfg.m % bm else None
    n_ok = _valid(n0, bn, cfg.n, column=not cfg.transpose_b) if cfg.n % bn else None

    def step(kk, acc, k_tail: bool):
        k0 = kk * bk
        if cfg.transpose_a:                                  # a stored [K, M]: tile [bk, bm]
            k_ok = _valid(k0, bk, cfg.k, column=False) if k_tail else None
            a = _load(a_ref, pl.ds(k0, bk), pl.ds(m0, bm), _and(k_ok, m_ok))
        else:                                                # a [M, K]: tile [bm, bk]
            k_ok = _valid(k0, bk, cfg.k, column=True) if k_tail else None
            a = _load(a_ref, pl.ds(m0, bm), pl.ds(k0, bk), _and(m_ok, k_ok))
        if cfg.transpose_b:                                  # b stored [N, K]: tile [bn, bk]
            k_ok = _valid(k0, bk, cfg.k, column=True) if k_tail else None
            b = _load(b_ref, pl.ds(n0, bn), pl.ds(k0, bk), _and(n_ok, k_ok))
        else:                                                # b [K, N]: tile [bk, bn]
            k_ok = _valid(k0, bk, cfg.k, column=False) if k_tail else None
            b = _load(b_ref, pl.ds(k0, bk), pl.ds(n0, bn), _and(k_ok, n_ok))
        dims = (((0 if cfg.transpose_a else 1,), (1 if cfg.transpose_b else 0,)), ((), ()))
        return acc + lax.dot_general(_widen(a, cfg.widen_a), _widen(b, cfg.widen_b), dims,
                                     preferred_element_type=jnp.float32)   # [bm, bn]

    acc = jnp.zeros((bm, bn), jnp.float32)
    if cfg.k >= bk:  # (not even traced otherwise: its unmasked tile would overrun K)
        acc = lax.fori_loop(0, cfg.k // bk, functools.partial(step, k_tail=False), acc)
    if cfg.k % bk:  # the ragged last K block (a one-trip loop keeps its offset traced)
        acc = lax.fori_loop(cfg.k // bk, cfg.k // bk + 1, functools.partial(step, k_tail=True), acc)

    out = (acc * scale_ref[0]).astype(o_ref.dtype)          # epilogue: scale, then cast
    out_mask = None
    if m_ok is not None or n_ok is not None:
        out_mask = _and(_valid(m0, bm, cfg.m, column=False) if m_ok is not None else None,
                        _valid(n0, bn, cfg.n, column=True) if n_ok is not None else None)
    if out_mask is None:
        o_ref[pl.ds(m0, bm), pl.ds(n0, bn)] = out
    else:
        plgpu.store(o_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)], out, mask=out_mask)
    if cfg.return_amax:
        # Masked-off rows/columns of a and b read as 0, so the tile's padding is 0 here.
        amax_ref[0][pid] = jnp.max(jnp.abs(out.astype(jnp.float32)))


def _call(a, b, scale, cfg: _Config):
    num_tiles = cfg.num_m * cfg.num_n
    out_shape = [jax.ShapeDtypeStruct((cfg.m, cfg.n), cfg.out_dtype)]
    if cfg.return_amax:
        out_shape.append(jax.ShapeDtypeStruct((num_tiles,), jnp.float32))
    outs = pl.pallas_call(
        functools.partial(_kernel, cfg=cfg),
        grid=(num_tiles,),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=cfg.interpret,
        name="fp8_matmul",
    )(a, b, scale)
    return (outs[0], jnp.max(outs[1])) if cfg.return_amax else outs[0]


# --------------------------------------------------------------------------- public API


def _check(a, b, a_scale, b_scale, out_dtype, transpose_a, transpose_b):
    """(M, N, K) after checking the operands; ValueError naming the bad value otherwise."""
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"fp8_matmul takes 2-D a and b; got {a.shape=} {b.shape=}")
    for name, x in (("a", a), ("b", b)):
        if jnp.dtype(x.dtype) not in FP8_DTYPES:
            raise ValueError(f"{name}.dtype={x.dtype} is not a float8 type; accepted: "
                             f"{[t.name for t in FP8_DTYPES]}")
    if jnp.dtype(out_dtype) not in OUT_DTYPES:
        raise ValueError(f"out_dtype={out_dtype} must be one of {[t.name for t in OUT_DTYPES]}")
    for name, s in (("a_scale", a_scale), ("b_scale", b_scale)):
        if np.size(s) != 1:
            raise ValueError(f"{name} must be one per-tensor value; got shape {np.shape(s)}")
    m, ka = (a.shape[1], a.shape[0]) if transpose_a else a.shape
    kb, n = (b.shape[1], b.shape[0]) if transpose_b else b.shape
    if ka != kb:
        raise ValueError(f"contracting dimensions differ: a gives K={ka}, b gives K={kb} "
                         f"({a.shape=} {transpose_a=}, {b.shape=} {transpose_b=})")
    return m, n, ka


def _widening(a_dtype, b_dtype):
    """How each operand is widened for the dot: None when both share one float8 type."""
    if jnp.dtype(a_dtype) == jnp.dtype(b_dtype):
        return None, None
    how = lambda t: "bits" if jnp.dtype(t) == jnp.dtype(E4M3_FNUZ) else "cast"
    return how(a_dtype), how(b_dtype)


def fp8_matmul(a, b, a_scale, b_scale, *, out_dtype, return_amax: bool = False,
               transpose_a: bool = False, transpose_b: bool = False,
               block_m: int | None = None, block_n: int | None = None,
               block_k: int | None = None, group_m: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None,
               interpret: bool | None = None):
    """(a * a_scale) @ (b * b_scale) with fp32 accumulation, scaled and cast in the epilogue.

    Args:
      a: [M, K] float8 (e4m3fn, e5m2, e4m3fnuz or e5m2fnuz); [K, M] with transpose_a.
      b: [K, N] float8; [N, K] with transpose_b.
      a_scale, b_scale: per-tensor dequantization factors (one value each, fp32).
      out_dtype: float32, bfloat16 or float16.
      return_amax: also return max |out| (fp32 scalar, of the values as stored).
      block_m, block_n, block_k: tile (powers of two; block_k >= 32); group_m: tile rows
        per program group; num_warps, num_stages: Triton launch parameters. Defaults:
        `default_block_sizes` for this GPU's shared memory (num_stages 1 on ROCm, as
        Pallas' own ROCm default).
      interpret: Pallas interpret mode; None picks True exactly when the default backend
        is CPU.

    Returns:
      out [M, N] in out_dtype, or (out, amax) with return_amax.
    """
    m, n, k = _check(a, b, a_scale, b_scale, out_dtype, transpose_a, transpose_b)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    defaults = default_block_sizes(m, n, k, a.dtype, b.dtype,
                                   shared_memory=None if interpret else _shared_memory_per_block())
    given = dict(block_m=block_m, block_n=block_n, block_k=block_k, group_m=group_m,
                 num_warps=num_warps, num_stages=num_stages)
    for name in ("block_m", "block_n", "block_k"):
        v = given[name]
        floor = _MIN_BLOCK_K if name == "block_k" else _MIN_BLOCK
        if v is not None and (v < floor or v & (v - 1)):
            raise ValueError(f"{name}={v} must be a power of two >= {floor}")
    if num_stages is None and not interpret and _on_rocm():
        given["num_stages"] = 1
    p = {key: defaults[key] if v is None else int(v) for key, v in given.items()
         if key in defaults}
    widen_a, widen_b = _widening(a.dtype, b.dtype)
    factor = 1.0
    for how in (widen_a, widen_b):
        factor *= _E4M3FNUZ_BITS_FACTOR if how == "bits" else 1.0
    cfg = _Config(m=m, n=n, k=k, block_m=p["block_m"], block_n=p["block_n"],
                  block_k=p["block_k"], group_m=max(1, p["group_m"]),
                  transpose_a=bool(transpose_a), transpose_b=bool(transpose_b),
                  widen_a=widen_a, widen_b=widen_b, out_dtype=jnp.dtype(out_dtype),
                  return_amax=bool(return_amax), num_warps=p["num_warps"],
                  num_stages=p["num_stages"], interpret=bool(interpret))
    scale = (jnp.asarray(a_scale, jnp.float32).reshape(()) *
             jnp.asarray(b_scale, jnp.float32).reshape(()) * jnp.float32(factor)).reshape(1)
    return _call(a, b, scale, cfg)


def fp8_matmul_xla(a, b, a_scale, b_scale, *, out_dtype, return_amax: bool = False,
                   transpose_a: bool = False, transpose_b: bool = False):
    """fp8_matmul's product written as XLA's GPU compiler recognises an FP8 GEMM.

    Each operand is converted to out_dtype and multiplied by its scalar scale, then one
    dot_general: on sm_89+ (CUDA 12+) and MI300 (ROCm 6+) XLA rewrites this into a single
    `__cublas$lt$matmul$f8` custom call that reads the float8 operands and applies the
    scales itself. The scales pass through out_dtype (a bfloat16 scale carries 8
    significant bits). On other backends it is an ordinary dot of the dequantized values.
    Same arguments and result as fp8_matmul.
    """
    _check(a, b, a_scale, b_scale, out_dtype, transpose_a, transpose_b)
    cd = jnp.dtype(out_dtype)
    a_dq = a.astype(cd) * jnp.asarray(a_scale, jnp.float32).reshape(()).astype(cd)
    b_dq = b.astype(cd) * jnp.asarray(b_scale, jnp.float32).reshape(()).astype(cd)
    dims = (((0 if transpose_a else 1,), (1 if transpose_b else 0,)), ((), ()))
    out = lax.dot_general(a_dq, b_dq, dims, preferred_element_type=cd)
    if return_amax:
        return out, jnp.max(jnp.abs(out.astype(jnp.float32)))
    return out


# --------------------------------------------------------------------------- reference


def fp8_matmul_reference(a, b, a_scale, b_scale, *, out_dtype=None, return_amax: bool = False,
                         transpose_a: bool = False, transpose_b: bool = False):
    """The exact product in numpy float64 from the same float8 values and scales.

    Returns float64 [M, N] (cast to out_dtype, rounding once, when given), or (out, amax).
    """
    a64 = np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)   # float8 -> fp32 is exact
    b64 = np.asarray(jnp.asarray(b).astype(jnp.float32), np.float64)
    a64 = a64.T if transpose_a else a64
    b64 = b64.T if transpose_b else b64
    sa, sb = (float(np.asarray(s).reshape(())) for s in (a_scale, b_scale))
    out = (a64 * sa) @ (b64 * sb)
    if out_dtype is not None:
        out = out.astype(jnp.dtype(out_dtype))
    if return_amax:
        return out, float(np.max(np.abs(out.astype(np.float64)), initial=0.0))
    return out
