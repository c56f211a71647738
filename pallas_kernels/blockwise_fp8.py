"""Blockwise-scaled FP8 GEMM in Pallas (DeepSeek-V3's recipe): Triton on NVIDIA sm_89+ and MI300,
interpret mode on CPU.

    blockwise_matmul(a, a_scales, b, b_scales, *, out_dtype) = sum over k-blocks of
        (a[:, blk] * a_scales[:, blk]) @ (b[:, blk] * b_scales[:, blk])^T

a [M, K] and b [N, K] hold float8 values (e4m3fn; e4m3fnuz on MI300), both contracted along
their last dim ("NT", the layout every product of the recipe is arranged in); a_scales [M, nk]
and b_scales [N, nk] are fp32 dequantization factors, one per row and block of 128 along K
(nk = ceil(K / 128)). A weight's 128 x 128 tiles reach the kernel with each tile's factor
repeated over its rows (block_scaling.tiles_as_rows), so one kernel serves the forward product
(1 x 128 activations against 128 x 128 weights), the input gradient (1 x 128 gradients against
the weight's tiles read the other way round) and the weight gradient (128 x 1 activations
against 128 x 1 gradients, both quantized along the tokens).

One program per [block_m, block_n] output tile, walking K one scaling block (128) at a time:
each block's float8 product is accumulated by the tensor cores in a fresh fp32 tile, which is
then multiplied by the block's scales (a [block_m, 1] column of a's, a [1, block_n] row of b's)
and added to the fp32 accumulator. That is DeepSeek-V3's "promotion to fp32" every 128 elements
of K (Hopper's FP8 MMA keeps about 14 bits of its accumulator; the promoted sum keeps 24), and
the per-block scales are read in the inner loop. Any M, N, K: edge tiles and the last K block
are loaded under masks. Programs are numbered in groups of `group_m` tile rows (L2 reuse).

`blockwise_matmul_xla` computes the same product as dequantize-then-dot (the operands' exact
values, products in fp32: XLA has no block-scaled FP8 GEMM, so this path has bf16 speed);
`blockwise_matmul_reference` is the float64 answer.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (
    both, cdiv, default_interpret, masked_load, next_pow2, on_rocm, shared_memory_per_block, stages_that_fit,
    tile_ids, valid)

BLOCK_K = 128   # the scaling block along K: one K step of the kernel
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e4m3fnuz))
OUT_DTYPES = tuple(jnp.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16))

# Tiles on sm_90 (227 KiB shared memory): each pipeline stage buffers (block_m + block_n) x 128
# float8 bytes (32 KiB for 128 x 128); smaller shared memories get fewer stages.
_SMALL_M = dict(block_m=64, block_n=128, num_warps=4, num_stages=4)   # M <= 64
_DEFAULT = dict(block_m=128, block_n=128, num_warps=8, num_stages=4)
_MIN_BLOCK = 16
_GROUP_M = 8


def default_block_sizes(m: int, n: int, shared_memory: int | None = None) -> dict:
    """Tile sizes and Triton launch parameters for an [M, K] x [N, K]^T product: the table's row,
    each block shrunk to the next power of two of its dim (>= 16), the stages to what fits 90% of
    `shared_memory` (bytes per block; None: sm_90's)."""
    row = dict(_SMALL_M if m <= 64 else _DEFAULT)
    row["block_m"] = min(row["block_m"], max(_MIN_BLOCK, next_pow2(m)))
    row["block_n"] = min(row["block_n"], max(_MIN_BLOCK, next_pow2(n)))
    row["num_stages"] = stages_that_fit(row["num_stages"], (row["block_m"] + row["block_n"]) * BLOCK_K, shared_memory)
    row["group_m"] = _GROUP_M
    return row


@dataclasses.dataclass(frozen=True)
class _Config:
    m: int
    n: int
    k: int
    block_m: int
    block_n: int
    group_m: int
    num_warps: int
    num_stages: int
    out_dtype: jnp.dtype
    interpret: bool

    @property
    def num_m(self) -> int:
        return cdiv(self.m, self.block_m)

    @property
    def num_n(self) -> int:
        return cdiv(self.n, self.block_n)


def _kernel(a_ref, sa_ref, b_ref, sb_ref, o_ref, *, cfg: _Config):
    """a [M, K], sa [M, nk], b [N, K], sb [nk, N] (b's factors stored K-block major) -> o [M, N]."""
    bm, bn, bk = cfg.block_m, cfg.block_n, BLOCK_K
    i, j = tile_ids(pl.program_id(0), cfg.num_m, cfg.num_n, cfg.group_m)
    m0, n0 = i * bm, j * bn
    m_rows = valid(m0, bm, cfg.m, column=False) if cfg.m % bm else None    # [bm, 1]
    n_rows = valid(n0, bn, cfg.n, column=False) if cfg.n % bn else None    # [bn, 1]
    n_cols = valid(n0, bn, cfg.n, column=True) if cfg.n % bn else None     # [1, bn]

    def step(kk, acc, k_tail: bool):
        k0 = kk * bk
        k_ok = valid(k0, bk, cfg.k, column=True) if k_tail else None       # [1, bk]
        a = masked_load(a_ref, pl.ds(m0, bm), pl.ds(k0, bk), both(m_rows, k_ok))   # [bm, bk]
        b = masked_load(b_ref, pl.ds(n0, bn), pl.ds(k0, bk), both(n_rows, k_ok))   # [bn, bk]
        part = lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        sa = masked_load(sa_ref, pl.ds(m0, bm), pl.ds(kk, 1), m_rows)      # [bm, 1]
        sb = masked_load(sb_ref, pl.ds(kk, 1), pl.ds(n0, bn), n_cols)      # [1, bn]
        return acc + part * sa * sb                                        # promoted every 128 of K

    acc = jnp.zeros((bm, bn), jnp.float32)
    full = cfg.k // bk
    if full:
        acc = lax.fori_loop(0, full, functools.partial(step, k_tail=False), acc)
    if cfg.k % bk:  # the ragged last block (a one-trip loop keeps its offset traced)
        acc = lax.fori_loop(full, full + 1, functools.partial(step, k_tail=True), acc)
    out = acc.astype(o_ref.dtype)
    if m_rows is None and n_cols is None:
        o_ref[pl.ds(m0, bm), pl.ds(n0, bn)] = out
    else:
        mask = both(valid(m0, bm, cfg.m, column=False) if m_rows is not None else None, n_cols)
        plgpu.store(o_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)], out, mask=mask)


def _check(a, a_scales, b, b_scales, out_dtype):
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"blockwise_matmul takes a [M, K] and b [N, K]; got {a.shape=} {b.shape=}")
    for name, x in (("a", a), ("b", b)):
        if jnp.dtype(x.dtype) not in FP8_DTYPES:
            raise ValueError(f"{name}.dtype={x.dtype}: accepted {[t.name for t in FP8_DTYPES]}")
    if jnp.dtype(a.dtype) != jnp.dtype(b.dtype):
        raise ValueError(f"a and b must share one float8 type; got {a.dtype} and {b.dtype}")
    nk = cdiv(a.shape[1], BLOCK_K)
    for name, s, rows in (("a_scales", a_scales, a.shape[0]), ("b_scales", b_scales, b.shape[0])):
        if tuple(s.shape) != (rows, nk):
            raise ValueError(f"{name}.shape={tuple(s.shape)}: expected ({rows}, {nk}), one factor per row "
                             f"and block of {BLOCK_K} along K={a.shape[1]}")
    if jnp.dtype(out_dtype) not in OUT_DTYPES:
        raise ValueError(f"out_dtype={out_dtype} must be one of {[t.name for t in OUT_DTYPES]}")


def blockwise_matmul(a, a_scales, b, b_scales, *, out_dtype, block_m: int | None = None,
                     block_n: int | None = None, group_m: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None, interpret: bool | None = None):
    """sum_k (a * a_scales) (b * b_scales)^T over 128-blocks of K, fp32 promotion per block.

    Args:
      a: [M, K] float8 (e4m3fn or e4m3fnuz); b: [N, K], the same type.
      a_scales: [M, ceil(K/128)] fp32 dequantization factors; b_scales: [N, ceil(K/128)].
      out_dtype: float32, bfloat16 or float16.
      block_m, block_n, group_m, num_warps, num_stages: tiles and Triton launch parameters
        (default_block_sizes); interpret: Pallas interpret mode (None: on CPU).
    Returns: [M, N] in out_dtype.
    """
    _check(a, a_scales, b, b_scales, out_dtype)
    interpret = default_interpret(interpret)
    (m, k), n = a.shape, b.shape[0]
    p = default_block_sizes(m, n, shared_memory=None if interpret else shared_memory_per_block())
    for name, v in (("block_m", block_m), ("block_n", block_n)):
        if v is not None:
            if v < _MIN_BLOCK or v & (v - 1):
                raise ValueError(f"{name}={v} must be a power of two >= {_MIN_BLOCK}")
            p[name] = int(v)
    for name, v in (("group_m", group_m), ("num_warps", num_warps), ("num_stages", num_stages)):
        if v is not None:
            p[name] = int(v)
    if num_stages is None and not interpret and on_rocm():
        p["num_stages"] = 1
    cfg = _Config(m=m, n=n, k=k, block_m=p["block_m"], block_n=p["block_n"], group_m=max(1, p["group_m"]),
                  num_warps=p["num_warps"], num_stages=p["num_stages"], out_dtype=jnp.dtype(out_dtype),
                  interpret=interpret)
    return pl.pallas_call(
        functools.partial(_kernel, cfg=cfg),
        grid=(cfg.num_m * cfg.num_n,),
        out_shape=jax.ShapeDtypeStruct((m, n), cfg.out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=cfg.interpret,
        name="blockwise_fp8_matmul",
    )(a, jnp.asarray(a_scales, jnp.float32), b, jnp.asarray(b_scales, jnp.float32).T)


def blockwise_matmul_xla(a, a_scales, b, b_scales, *, out_dtype):
    """blockwise_matmul's product as dequantize-then-dot: the operands' values (float8 x factor in
    fp32, then in out_dtype where that is 16-bit: exact for the power-of-two factors the recipe
    uses), multiplied with fp32 accumulation."""
    _check(a, a_scales, b, b_scales, out_dtype)
    dq = jnp.dtype(out_dtype) if jnp.dtype(out_dtype).itemsize == 2 else jnp.dtype(jnp.float32)

    def real(v, s):  # (fp32 products of float8 values and any fp32 factors)
        f = jnp.repeat(jnp.asarray(s, jnp.float32), BLOCK_K, axis=1)[:, :v.shape[1]]
        return (v.astype(jnp.float32) * f).astype(dq)

    a_dq, b_dq = real(a, a_scales), real(b, b_scales)
    out = lax.dot_general(a_dq, b_dq, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def blockwise_matmul_reference(a, a_scales, b, b_scales):
    """The exact product in numpy float64: [M, N]."""
    def real(v, s):
        v64 = np.asarray(jnp.asarray(v).astype(jnp.float32), np.float64)
        f = np.repeat(np.asarray(s, np.float64), BLOCK_K, axis=1)[:, :v64.shape[1]]
        return v64 * f
    return real(a, a_scales) @ real(b, b_scales).T
