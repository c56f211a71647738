"""Flash attention in Pallas (Triton on NVIDIA/ROCm GPUs, interpret mode on CPU).

Layouts follow the model: q [batch, seq_q, heads, head_dim], k/v [batch, seq_kv,
kv_heads, head_dim], out like q. Grouped-query and multi-query attention never
repeat k/v: query head h reads kv head h // group through the BlockSpec index
maps, and the dk/dv kernel walks the group's query heads itself.

Visibility of key j from query i (positions are absolute, from 0):
  causal:          j <= i
  sliding_window:  i - j < sliding_window        (causal only)
  segment_ids:     q_segment[i] == kv_segment[j]
A query that sees no key at all (possible only with segment ids) gets a zero
output and zero gradients, in the kernel and in the reference alike.

The kernels work in base 2: logits are scaled by softmax_scale * log2(e) so that
exp2 replaces exp, and the log-sum-exp saved for the backward pass is base 2.

Three kernels, each one program per (batch, head, block):
  forward  grid (b, heads, q blocks):     online softmax over kv blocks -> out, lse
  dq       grid (b, heads, q blocks):     walks kv blocks               -> dq
  dk/dv    grid (b, kv_heads, kv blocks): walks group heads x q blocks  -> dk, dv
Loop bounds come from `kv_block_range` / `q_block_range`: blocks that no
visible pair touches are never visited, and blocks whose every pair is visible
run without building a mask. Sequence lengths that are not block multiples are
padded in the wrapper and the padded keys masked inside.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_LOG2E = math.log2(math.e)
# Running-max start value: finite, so that exp2(m_old - m_new) is 1 (not NaN)
# while a row has seen only masked logits (which are -inf).
_M_INIT = -1e30

# Per head_dim, for 16-bit inputs: forward tile (block_q, block_k), dq tile (q rows
# held, kv rows streamed), dk/dv tile (q rows streamed, kv rows held), Triton warps
# and pipeline stages. Chosen so that no 16-bit kernel spills registers on sm_90 (ptxas) and
# shared memory stays under 164 KiB (A100); fp32 has its own rule (default_block_sizes).
_BLOCK_TABLE = {
    64: dict(block_q=128, block_k=64, block_q_dq=64, block_k_dq=64, block_q_dkv=32,
             block_k_dkv=64, num_warps=4, num_warps_bwd=4, num_stages=3),
    128: dict(block_q=128, block_k=64, block_q_dq=64, block_k_dq=64, block_q_dkv=32,
              block_k_dkv=64, num_warps=8, num_warps_bwd=8, num_stages=2),
    256: dict(block_q=64, block_k=32, block_q_dq=32, block_k_dq=32, block_q_dkv=16,
              block_k_dkv=32, num_warps=8, num_warps_bwd=8, num_stages=2),
}
_BLOCK_ARGS = ("block_q", "block_k", "block_q_dq", "block_k_dq", "block_q_dkv", "block_k_dkv")
_MIN_BLOCK = 16  # Triton's dot needs every matmul dimension >= 16.


@dataclasses.dataclass(frozen=True)
class _Config:
    """Everything static about one call: hashable, passed as a custom_vjp nondiff arg."""

    causal: bool
    window: int | None
    scale: float            # softmax scale in natural units
    kv_len: int             # unpadded key length
    block_q: int            # forward tile
    block_k: int
    block_q_dq: int         # dq kernel tile
    block_k_dq: int
    block_q_dkv: int        # dk/dv kernel tile
    block_k_dkv: int
    num_warps: int
    num_warps_bwd: int
    num_stages: int
    interpret: bool

    @property
    def log2_scale(self) -> float:
        return self.scale * _LOG2E

    @property
    def kv_padded(self) -> bool:
        """Whether flash_attention padded the keys (to a multiple of every kv block)."""
        return self.kv_len % max(self.block_k, self.block_k_dq, self.block_k_dkv) != 0

    @property
    def masks_positions(self) -> bool:
        """Whether some (query block, kv block) pair may need a position mask at all."""
        return self.causal or self.window is not None


# --------------------------------------------------------------------------- block ranges


class BlockRange(NamedTuple):
    """Blocks [lo, hi) are visited; [full_lo, full_hi) of them need no position mask."""

    lo: jax.Array | int
    full_lo: jax.Array | int
    full_hi: jax.Array | int
    hi: jax.Array | int



def _varying(x) -> frozenset:
    """The shard_map axes a traced value is typed as varying over (empty outside one, or unchecked)."""
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ())) if mat is not None else frozenset(getattr(t, "vma", ()))


def _same_variance(args: list) -> tuple[list, dict]:
    """Inside a shard_map that checks variance (check_vma, e.g. a pipeline stage): the kernel's
    inputs cast to vary over the union of their axes, and the ShapeDtypeStruct keywords that type
    its outputs the same way (pallas_call cannot infer them); outside one: unchanged, no keywords."""
    union = frozenset().union(*map(_varying, args))
    if not union:
        inside = not jax.sharding.get_abstract_mesh().empty and jax.sharding.get_abstract_mesh().manual_axes
        # Inside shard_map the outputs are typed even when they vary over no axis.
        return args, ({"manual_axis_type": jax.typeof(args[0]).manual_axis_type} if inside else {})
    args = [jax.lax.pcast(x, tuple(sorted(union - _varying(x))), to="varying") if union - _varying(x) else x
            for x in args]
    return args, {"manual_axis_type": jax.typeof(args[0]).manual_axis_type}

def _div(a, b: int):
    """Floor division of a non-negative traced or Python int by a positive int."""
    if isinstance(a, int):
        return a // b
    return lax.div(a, jnp.int32(b))


def _clip(x, lo, hi):
    return jnp.minimum(jnp.maximum(x, lo), hi)


def kv_block_range(q_block, *, block_q: int, block_k: int, num_kv_blocks: int, kv_len: int,
                   causal: bool, window: int | None) -> BlockRange:
    """The kv blocks that query block `q_block` must visit (forward and dq kernels).

    A kv block is visited if some (query, key) pair in it is visible by position;
    it is "full" if every pair is visible and every key is real (not padding).
    Works on traced int32 scalars inside kernels and on Python ints in tests.
    """
    q_start = q_block * block_q
    q_last = q_start + block_q - 1
    hi = num_kv_blocks
    full_hi = kv_len // block_k                            # blocks free of padded keys
    if causal:
        hi = jnp.minimum(hi, _div(q_last, block_k) + 1)    # keys j <= q_last
        full_hi = jnp.minimum(full_hi, _div(q_start + 1, block_k))  # last key <= q_start
    lo, full_lo = 0, 0
    if window is not None:
        lo = _div(jnp.maximum(q_start - window + 1, 0), block_k)  # keys j > q_start - window
        # First key of the block must be > q_last - window.
        full_lo = _div(jnp.maximum(q_last - window + 1, 0) + block_k - 1, block_k)
    full_lo = _clip(full_lo, lo, hi)
    full_hi = _clip(full_hi, full_lo, hi)
    return BlockRange(lo, full_lo, full_hi, hi)


def q_block_range(kv_block, *, block_q: int, block_k: int, num_q_blocks: int, kv_len: int,
                  causal: bool, window: int | None) -> BlockRange:
    """The query blocks that kv block `kv_block` must visit (dk/dv kernel); see kv_block_range."""
    k_start = kv_block * block_k
    k_last = k_start + block_k - 1
    lo, full_lo = 0, 0
    if causal:
        lo = _div(k_start, block_q)                                 # queries i >= k_start
        full_lo = _div(k_last + block_q - 1, block_q)               # first query >= k_last
    hi, full_hi = num_q_blocks, num_q_blocks
    if window is not None:
        hi = jnp.minimum(hi, _div(k_last + window - 1, block_q) + 1)  # queries i < k_last + window
        full_hi = _div(k_start + window, block_q)                   # last query < k_start + window
    # A block holding padded keys has no full query block. (min/max, not jnp.where:
    # Pallas' Triton lowering mistypes a select between two literals.)
    real = jnp.clip(kv_len // block_k - kv_block, 0, 1)             # 1 if no padded key
    full_hi = jnp.minimum(full_hi, real * num_q_blocks)
    full_lo = _clip(full_lo, lo, hi)
    full_hi = _clip(full_hi, full_lo, hi)
    return BlockRange(lo, full_lo, full_hi, hi)


def _visible(q_pos, k_pos, cfg: _Config, q_seg=None, kv_seg=None):
    """Mask of visible pairs, by broadcasting: q_pos/q_seg [bq, 1] against k_pos/kv_seg
    [1, bk] gives [bq, bk]; the dk/dv kernel passes them the other way round."""
    mask = k_pos < cfg.kv_len
    if cfg.causal:
        mask = mask & (k_pos <= q_pos)
    if cfg.window is not None:
        mask = mask & (q_pos - k_pos < cfg.window)
    if q_seg is not None:
        mask = mask & (q_seg == kv_seg)
    return mask


def _seg_only(q_seg, kv_seg):
    return None if q_seg is None else q_seg == kv_seg


def _mask_scores(s, masked: bool, positions, cfg: _Config, q_seg, kv_seg):
    """Scores with invisible pairs at -inf: the whole mask on blocks that need it (`masked`;
    `positions()` gives their (q_pos, k_pos)), only segments on fully visible blocks."""
    mask = _visible(*positions(), cfg, q_seg, kv_seg) if masked else _seg_only(q_seg, kv_seg)
    return s if mask is None else jnp.where(mask, s, -jnp.inf)


def _dot(a, b, *, trans_a=False, trans_b=False):
    """2-D matmul with fp32 accumulation (inputs keep their dtype). fp32 inputs ask for
    HIGHEST precision: Pallas' Triton lowering would otherwise pick TF32 on GPU."""
    dims = (((0,) if trans_a else (1,), (1,) if trans_b else (0,)), ((), ()))
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _run_blocks(rng: BlockRange, body, carry, cfg: _Config):
    """Runs body(j, carry, masked) over [lo, hi): masked at the edges, unmasked in between."""
    if not cfg.masks_positions and not cfg.kv_padded:
        return lax.fori_loop(rng.lo, rng.hi, functools.partial(body, masked=False), carry)
    carry = lax.fori_loop(rng.lo, rng.full_lo, functools.partial(body, masked=True), carry)
    carry = lax.fori_loop(rng.full_lo, rng.full_hi, functools.partial(body, masked=False), carry)
    return lax.fori_loop(rng.full_hi, rng.hi, functools.partial(body, masked=True), carry)


def _q_block_id():
    """Query block of this program in the forward and dq kernels. Grid axis 2 walks the
    query blocks last to first: Triton launches it outermost, so under a causal mask the
    longest programs start first and the short ones fill the tail."""
    return pl.num_programs(2) - 1 - pl.program_id(2)


def _split_refs(refs, has_segments: bool, n_in: int):
    """(inputs, q_seg_ref, kv_seg_ref, outputs) from a kernel's flat ref list."""
    ins, rest = list(refs[:n_in]), refs[n_in:]
    if has_segments:
        return ins, rest[0], rest[1], rest[2:]
    return ins, None, None, rest


# --------------------------------------------------------------------------- forward


def _fwd_kernel(*refs, cfg: _Config, has_segments: bool):
    (q_ref, k_ref, v_ref), qs_ref, ks_ref, (o_ref, lse_ref) = _split_refs(refs, has_segments, 3)
    bq, bk = cfg.block_q, cfg.block_k
    i = _q_block_id()
    q = q_ref[...]                                                   # [bq, d]
    q_pos = i * bq + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)     # [bq, 1]
    q_seg = None if qs_ref is None else qs_ref[...][:, None]         # [bq, 1]

    def body(j, carry, masked):
        acc, m, l = carry                                            # [bq, d], [bq], [bq]
        k = k_ref[pl.ds(j * bk, bk), :]                              # [bk, d]
        v = v_ref[pl.ds(j * bk, bk), :]
        kv_seg = None if ks_ref is None else ks_ref[pl.ds(j * bk, bk)][None, :]
        s = _mask_scores(_dot(q, k, trans_b=True) * cfg.log2_scale, masked,          # [bq, bk]
                         lambda: (q_pos, j * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)),
                         cfg, q_seg, kv_seg)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)
        return acc, m_new, l

    d = q_ref.shape[-1]
    carry = (jnp.zeros((bq, d), jnp.float32), jnp.full((bq,), _M_INIT, jnp.float32),
             jnp.zeros((bq,), jnp.float32))
    rng = kv_block_range(i, block_q=bq, block_k=bk, num_kv_blocks=k_ref.shape[0] // bk,
                         kv_len=cfg.kv_len, causal=cfg.causal, window=cfg.window)
    acc, m, l = _run_blocks(rng, body, carry, cfg)
    empty = l == 0.0                                                 # row saw no key
    o_ref[...] = (acc / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))


def _fwd_call(q, k, v, q_seg, kv_seg, cfg: _Config):
    b, sq, h, d = q.shape
    sk, g = k.shape[1], k.shape[2]
    group = h // g
    bq = cfg.block_q
    nq = sq // bq
    has_segments = q_seg is not None
    q_blk = pl.BlockSpec((None, bq, None, d), lambda bi, hi, p: (bi, nq - 1 - p, hi, 0))
    kv_all = pl.BlockSpec((None, sk, None, d), lambda bi, hi, p: (bi, 0, hi // group, 0))
    in_specs = [q_blk, kv_all, kv_all]
    args = [q, k, v]
    if has_segments:
        in_specs += [pl.BlockSpec((None, bq), lambda bi, hi, p: (bi, nq - 1 - p)),
                     pl.BlockSpec((None, sk), lambda bi, hi, p: (bi, 0))]
        args += [q_seg, kv_seg]
    args, typed = _same_variance(args)
    out, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg, has_segments=has_segments),
        grid=(b, h, nq),
        in_specs=in_specs,
        out_specs=[q_blk, pl.BlockSpec((None, None, bq), lambda bi, hi, p: (bi, hi, nq - 1 - p))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype, **typed),
                   jax.ShapeDtypeStruct((b, h, sq), jnp.float32, **typed)],
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=cfg.interpret,
        name="flash_attention_fwd",
    )(*args)
    return out, lse


# --------------------------------------------------------------------------- backward


def _dq_kernel(*refs, cfg: _Config, has_segments: bool):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), qs_ref, ks_ref, (dq_ref,) = (
        _split_refs(refs, has_segments, 6))
    bq, bk = cfg.block_q_dq, cfg.block_k_dq
    i = _q_block_id()
    q, do = q_ref[...], do_ref[...]                                  # [bq, d]
    lse, delta = lse_ref[...], delta_ref[...]                        # [bq]
    q_pos = i * bq + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
    q_seg = None if qs_ref is None else qs_ref[...][:, None]         # [bq, 1]

    def body(j, dq, masked):
        k = k_ref[pl.ds(j * bk, bk), :]                              # [bk, d]
        v = v_ref[pl.ds(j * bk, bk), :]
        kv_seg = None if ks_ref is None else ks_ref[pl.ds(j * bk, bk)][None, :]
        s = _mask_scores(_dot(q, k, trans_b=True) * cfg.log2_scale, masked,          # [bq, bk]
                         lambda: (q_pos, j * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)),
                         cfg, q_seg, kv_seg)
        p = jnp.exp2(s - lse[:, None])                               # softmax probabilities
        dp = _dot(do, v, trans_b=True)                               # [bq, bk]
        ds = p * (dp - delta[:, None])                               # d loss / d logits
        return dq + _dot(ds.astype(k.dtype), k)

    rng = kv_block_range(i, block_q=bq, block_k=bk, num_kv_blocks=k_ref.shape[0] // bk,
                         kv_len=cfg.kv_len, causal=cfg.causal, window=cfg.window)
    dq = _run_blocks(rng, body, jnp.zeros(q.shape, jnp.float32), cfg)
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, cfg: _Config, has_segments: bool, group: int):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), qs_ref, ks_ref, (dk_ref, dv_ref) = (
        _split_refs(refs, has_segments, 6))
    bq, bk = cfg.block_q_dkv, cfg.block_k_dkv
    t = pl.program_id(2)
    # Works on transposed scores [bk, bq], so that every matmul's left operand is
    # untransposed (Hopper's wgmma takes it from registers only in that layout).
    k, v = k_ref[...], v_ref[...]                                    # [bk, d]
    k_pos = t * bk + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)     # [bk, 1]
    kv_seg = None if ks_ref is None else ks_ref[...][:, None]        # [bk, 1]

    def body(r, i, carry, masked):
        dk, dv = carry                                               # [bk, d] each
        q = q_ref[pl.ds(i * bq, bq), r, :]                           # [bq, d] of group head r
        do = do_ref[pl.ds(i * bq, bq), r, :]
        lse = lse_ref[r, pl.ds(i * bq, bq)][None, :]                 # [1, bq]
        delta = delta_ref[r, pl.ds(i * bq, bq)][None, :]
        q_seg = None if qs_ref is None else qs_ref[pl.ds(i * bq, bq)][None, :]
        s_t = _mask_scores(_dot(k, q, trans_b=True) * cfg.log2_scale, masked,        # [bk, bq]
                           lambda: (i * bq + lax.broadcasted_iota(jnp.int32, (1, bq), 1), k_pos),
                           cfg, q_seg, kv_seg)
        p_t = jnp.exp2(s_t - lse)                                    # softmax probabilities^T
        dv = dv + _dot(p_t.astype(do.dtype), do)
        dp_t = _dot(v, do, trans_b=True)                             # [bk, bq]
        ds_t = p_t * (dp_t - delta)
        dk = dk + _dot(ds_t.astype(q.dtype), q)
        return dk, dv

    rng = q_block_range(t, block_q=bq, block_k=bk, num_q_blocks=q_ref.shape[0] // bq,
                        kv_len=cfg.kv_len, causal=cfg.causal, window=cfg.window)

    def over_head(r, carry):
        return _run_blocks(rng, functools.partial(body, r), carry, cfg)

    zeros = jnp.zeros(k.shape, jnp.float32)
    if group == 1:
        dk, dv = over_head(0, (zeros, zeros))
    else:
        # A while loop, not fori_loop: with static bounds fori_loop becomes a scan,
        # and Pallas' Triton lowering mis-lowers loops nested in a scan.
        _, dk, dv = lax.while_loop(lambda c: c[0] < group,
                                   lambda c: (c[0] + 1, *over_head(c[0], c[1:])),
                                   (jnp.int32(0), zeros, zeros))
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _bwd_calls(q, k, v, q_seg, kv_seg, out, lse, do, cfg: _Config, dlse=None):
    b, sq, h, d = q.shape
    sk, g = k.shape[1], k.shape[2]
    group = h // g
    has_segments = q_seg is not None
    # delta_i = sum_d out_id * dout_id = sum_j p_ij dp_ij, the softmax-gradient row term.
    delta = jnp.einsum("bqhd,bqhd->bhq", out.astype(jnp.float32), do.astype(jnp.float32))
    if dlse is not None:
        # A cotangent of the (natural) log-sum-exp adds p_ij * dlse_i to d loss / d logit_ij,
        # i.e. ds = p * (dp - (delta - dlse)).
        delta = delta - dlse
    params = plgpu.CompilerParams(num_warps=cfg.num_warps_bwd, num_stages=cfg.num_stages)

    # dq: one program per (batch, head, q block), kv head by index map.
    bq, bk = cfg.block_q_dq, cfg.block_k_dq
    nq = sq // bq
    q_blk = pl.BlockSpec((None, bq, None, d), lambda bi, hi, p: (bi, nq - 1 - p, hi, 0))
    kv_all = pl.BlockSpec((None, sk, None, d), lambda bi, hi, p: (bi, 0, hi // group, 0))
    row_blk = pl.BlockSpec((None, None, bq), lambda bi, hi, p: (bi, hi, nq - 1 - p))
    in_specs = [q_blk, kv_all, kv_all, q_blk, row_blk, row_blk]
    args = [q, k, v, do, lse, delta]
    if has_segments:
        in_specs += [pl.BlockSpec((None, bq), lambda bi, hi, p: (bi, nq - 1 - p)),
                     pl.BlockSpec((None, sk), lambda bi, hi, p: (bi, 0))]
        args += [q_seg, kv_seg]
    args, typed = _same_variance(args)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg, has_segments=has_segments),
        grid=(b, h, nq),
        in_specs=in_specs,
        out_specs=q_blk,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype, **typed),
        compiler_params=params,
        interpret=cfg.interpret,
        name="flash_attention_dq",
    )(*args)

    # dk/dv: one program per (batch, kv head, kv block); it reads all `group` query
    # heads of its kv head (a head block of size `group`) and sums over them.
    bq, bk = cfg.block_q_dkv, cfg.block_k_dkv
    q_group = pl.BlockSpec((None, sq, group, d), lambda bi, gi, ki: (bi, 0, gi, 0))
    kv_blk = pl.BlockSpec((None, bk, None, d), lambda bi, gi, ki: (bi, ki, gi, 0))
    row_group = pl.BlockSpec((None, group, sq), lambda bi, gi, ki: (bi, gi, 0))
    in_specs = [q_group, kv_blk, kv_blk, q_group, row_group, row_group]
    args = [q, k, v, do, lse, delta]
    if has_segments:
        in_specs += [pl.BlockSpec((None, sq), lambda bi, gi, ki: (bi, 0)),
                     pl.BlockSpec((None, bk), lambda bi, gi, ki: (bi, ki))]
        args += [q_seg, kv_seg]
    args, typed = _same_variance(args)
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg, has_segments=has_segments, group=group),
        grid=(b, g, sk // bk),
        in_specs=in_specs,
        out_specs=[kv_blk, kv_blk],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype, **typed), jax.ShapeDtypeStruct(v.shape, v.dtype, **typed)],
        compiler_params=params,
        interpret=cfg.interpret,
        name="flash_attention_dkv",
    )(*args)
    return dq, dk, dv


# --------------------------------------------------------------------------- custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, q_seg, kv_seg, cfg):
    return _fwd_call(q, k, v, q_seg, kv_seg, cfg)[0]


def _flash_fwd(q, k, v, q_seg, kv_seg, cfg):
    out, lse = _fwd_call(q, k, v, q_seg, kv_seg, cfg)
    return out, (q, k, v, q_seg, kv_seg, out, lse)


def _flash_bwd(cfg, res, do):
    q, k, v, q_seg, kv_seg, out, lse = res
    dq, dk, dv = _bwd_calls(q, k, v, q_seg, kv_seg, out, lse, do, cfg)
    return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash_lse(q, k, v, q_seg, kv_seg, cfg):
    """(out, lse) with lse base 2 as the kernel keeps it (+inf for rows that see no key)."""
    return _fwd_call(q, k, v, q_seg, kv_seg, cfg)


def _flash_lse_fwd(q, k, v, q_seg, kv_seg, cfg):
    out, lse = _fwd_call(q, k, v, q_seg, kv_seg, cfg)
    return (out, lse), (q, k, v, q_seg, kv_seg, out, lse)


def _flash_lse_bwd(cfg, res, cts):
    q, k, v, q_seg, kv_seg, out, lse = res
    do, dlse2 = cts
    # lse2 = lse_natural * log2(e), so d loss / d lse_natural = dlse2 * log2(e).
    dlse = jnp.where(jnp.isfinite(lse), dlse2 * _LOG2E, 0.0)
    dq, dk, dv = _bwd_calls(q, k, v, q_seg, kv_seg, out, lse, do, cfg, dlse=dlse)
    return dq, dk, dv, None, None


_flash_lse.defvjp(_flash_lse_fwd, _flash_lse_bwd)


# --------------------------------------------------------------------------- public API


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _pad_to(x, axis: int, size: int):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def default_block_sizes(head_dim: int, dtype) -> dict:
    """Block sizes and Triton launch parameters from the table, for one head_dim and dtype."""
    row = dict(next((_BLOCK_TABLE[k] for k in sorted(_BLOCK_TABLE) if head_dim <= k),
                    _BLOCK_TABLE[max(_BLOCK_TABLE)]))
    if jnp.dtype(dtype).itemsize >= 4:
        # fp32 matmuls run on FMA units (HIGHEST precision), which need more registers:
        # smaller forward and streamed tiles, 8 warps.
        for name in ("block_q", "block_k", "block_k_dq", "block_q_dkv"):
            row[name] = max(row[name] // 2, _MIN_BLOCK)
        row.update(num_warps=8, num_warps_bwd=8)
    return row


def _normalize_segment_ids(segment_ids, b: int, sq: int, sk: int):
    if segment_ids is None:
        return None, None
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError(f"segment_ids must be one [batch, seq] array or a (q, kv) pair; "
                             f"got a sequence of {len(segment_ids)}")
        q_seg, kv_seg = segment_ids
    else:
        if sq != sk:
            raise ValueError(f"one segment_ids array needs seq_q == seq_kv, got {sq=} {sk=}; "
                             "pass a (q_segment_ids, kv_segment_ids) pair")
        q_seg = kv_seg = segment_ids
    if q_seg.shape != (b, sq) or kv_seg.shape != (b, sk):
        raise ValueError(f"segment ids shapes {q_seg.shape} and {kv_seg.shape} do not match "
                         f"[batch, seq_q]={(b, sq)} and [batch, seq_kv]={(b, sk)}")
    return q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32)


def _on_rocm() -> bool:
    try:
        return "rocm" in jax.devices()[0].client.platform_version.lower()
    except Exception:  # no device, or a client without the attribute: not ROCm
        return False


def _fit_block(block: int, seq: int, name: str) -> int:
    if not _is_pow2(block) or block < _MIN_BLOCK:
        raise ValueError(f"{name}={block} must be a power of two >= {_MIN_BLOCK}")
    # Never larger than the (padded) sequence needs.
    return min(block, max(_MIN_BLOCK, _next_pow2(seq)))


def flash_attention(q, k, v, *, causal: bool = True, segment_ids=None,
                    softmax_scale: float | None = None, sliding_window: int | None = None,
                    block_q: int | None = None, block_k: int | None = None,
                    block_q_dq: int | None = None, block_k_dq: int | None = None,
                    block_q_dkv: int | None = None, block_k_dkv: int | None = None,
                    num_warps: int | None = None, num_warps_bwd: int | None = None,
                    num_stages: int | None = None, interpret: bool | None = None):
    """Memory-efficient exact attention; differentiable (Pallas backward kernels).

    Args:
      q: [batch, seq_q, heads, head_dim]; k, v: [batch, seq_kv, kv_heads, head_dim],
        heads a multiple of kv_heads. fp32, bf16 or fp16; accumulation is fp32.
      causal: key j visible from query i only if j <= i (needs seq_q == seq_kv).
      segment_ids: int [batch, seq] (shared by q and kv) or a (q_ids [batch, seq_q],
        kv_ids [batch, seq_kv]) pair: attention stays within equal ids (packed documents).
      softmax_scale: defaults to 1/sqrt(head_dim).
      sliding_window: with causal, query i sees keys i - sliding_window < j <= i.
      block_q, block_k: forward tile (query rows, key rows); block_q_dq, block_k_dq:
        dq kernel tile; block_q_dkv, block_k_dkv: dk/dv kernel tile. Powers of two
        >= 16, shrunk to the sequence when larger. num_warps (forward),
        num_warps_bwd, num_stages: Triton launch parameters. Defaults come from a
        table per head_dim and dtype (`default_block_sizes`).
      interpret: run the kernels in Pallas interpret mode; None picks True exactly
        when the default backend is CPU.

    Returns:
      [batch, seq_q, heads, head_dim] in q's dtype.
    """
    args, cfg, (sq, d) = _prepare(q, k, v, causal=causal, segment_ids=segment_ids,
                                  softmax_scale=softmax_scale, sliding_window=sliding_window,
                                  blocks=dict(block_q=block_q, block_k=block_k, block_q_dq=block_q_dq,
                                              block_k_dq=block_k_dq, block_q_dkv=block_q_dkv,
                                              block_k_dkv=block_k_dkv),
                                  num_warps=num_warps, num_warps_bwd=num_warps_bwd, num_stages=num_stages,
                                  interpret=interpret)
    return _flash(*args, cfg)[:, :sq, :, :d]


def flash_attention_with_lse(q, k, v, *, causal: bool = True, segment_ids=None,
                             softmax_scale: float | None = None, sliding_window: int | None = None,
                             interpret: bool | None = None, **blocks):
    """flash_attention that also returns the log-sum-exp of each query row's logits.

    Returns (out [batch, seq_q, heads, head_dim], lse [batch, heads, seq_q] fp32, natural
    log, -inf for a row that sees no key). Differentiable in both outputs, so partial
    results over key blocks can be merged (ring attention) and trained through.
    """
    names = ("num_warps", "num_warps_bwd", "num_stages")
    launch = {n: blocks.pop(n, None) for n in names}
    args, cfg, (sq, d) = _prepare(q, k, v, causal=causal, segment_ids=segment_ids,
                                  softmax_scale=softmax_scale, sliding_window=sliding_window,
                                  blocks={n: blocks.pop(n, None) for n in _BLOCK_ARGS},
                                  interpret=interpret, **launch)
    if blocks:
        raise TypeError(f"unknown arguments {sorted(blocks)}")
    out, lse2 = _flash_lse(*args, cfg)
    lse = jnp.where(jnp.isinf(lse2), -jnp.inf, lse2 / _LOG2E)
    return out[:, :sq, :, :d], lse[:, :, :sq]


def _prepare(q, k, v, *, causal, segment_ids, softmax_scale, sliding_window, blocks: dict,
             num_warps, num_warps_bwd, num_stages, interpret):
    """Checks, block sizes and padding shared by the public entry points:
    ((q, k, v, q_seg, kv_seg) padded, _Config, (seq_q, head_dim) to slice the output back)."""
    block_q, block_k = blocks["block_q"], blocks["block_k"]
    block_q_dq, block_k_dq = blocks["block_q_dq"], blocks["block_k_dq"]
    block_q_dkv, block_k_dkv = blocks["block_q_dkv"], blocks["block_k_dkv"]
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"expected q [b, s, h, d] and k, v [b, s, kv_h, d] alike; "
                         f"got {q.shape=} {k.shape=} {v.shape=}")
    b, sq, h, d = q.shape
    _, sk, g, dk_ = k.shape
    if k.shape[0] != b or dk_ != d:
        raise ValueError(f"q and k/v disagree on batch or head_dim: {q.shape=} {k.shape=}")
    if h % g:
        raise ValueError(f"heads={h} is not a multiple of kv_heads={g}")
    if not q.dtype == k.dtype == v.dtype or q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"q, k, v must share one of float32/bfloat16/float16; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if causal and sq != sk:
        raise ValueError(f"causal attention needs seq_q == seq_kv, got {sq=} {sk=}")
    if sliding_window is not None:
        if not causal:
            raise ValueError("sliding_window is only defined for causal attention")
        if int(sliding_window) < 1:
            raise ValueError(f"sliding_window={sliding_window} must be >= 1")
    q_seg, kv_seg = _normalize_segment_ids(segment_ids, b, sq, sk)

    defaults = default_block_sizes(d, q.dtype)
    pick = lambda given, key: defaults[key] if given is None else int(given)
    given = dict(block_q=block_q, block_k=block_k, block_q_dq=block_q_dq, block_k_dq=block_k_dq,
                 block_q_dkv=block_q_dkv, block_k_dkv=block_k_dkv)
    blocks = {name: _fit_block(pick(given[name], name), sq if name.startswith("block_q") else sk,
                              name)
              for name in _BLOCK_ARGS}
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if num_stages is None and not interpret and _on_rocm():
        num_stages = 1  # AMD's 64 KiB LDS: no multi-buffering (Pallas' own ROCm default)
    cfg = _Config(
        causal=bool(causal), window=None if sliding_window is None else int(sliding_window),
        scale=float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d),
        kv_len=sk, **blocks,
        num_warps=pick(num_warps, "num_warps"), num_warps_bwd=pick(num_warps_bwd, "num_warps_bwd"),
        num_stages=pick(num_stages, "num_stages"), interpret=bool(interpret))

    # Pad: sequences to a multiple of every block (all powers of two), head_dim to a
    # power of two >= 16 (Triton tiles). Zero rows/columns change no real result:
    # padded keys are masked by position, padded queries and features are sliced off.
    q_mult = max(blocks["block_q"], blocks["block_q_dq"], blocks["block_q_dkv"])
    k_mult = max(blocks["block_k"], blocks["block_k_dq"], blocks["block_k_dkv"])
    sq_pad, sk_pad = -(-sq // q_mult) * q_mult, -(-sk // k_mult) * k_mult
    d_pad = max(_MIN_BLOCK, _next_pow2(d))
    qp = _pad_to(_pad_to(q, 1, sq_pad), 3, d_pad)
    kp = _pad_to(_pad_to(k, 1, sk_pad), 3, d_pad)
    vp = _pad_to(_pad_to(v, 1, sk_pad), 3, d_pad)
    if q_seg is not None:
        q_seg, kv_seg = _pad_to(q_seg, 1, sq_pad), _pad_to(kv_seg, 1, sk_pad)
    return (qp, kp, vp, q_seg, kv_seg), cfg, (sq, d)


# --------------------------------------------------------------------------- reference


def flash_attention_reference(q, k, v, *, causal: bool = True, segment_ids=None,
                              softmax_scale: float | None = None,
                              sliding_window: int | None = None):
    """Plain-jnp attention with flash_attention's semantics: fp32 logits and softmax,
    grouped heads without repeating k/v, rows that see no key give zeros."""
    b, sq, h, d = q.shape
    sk, g = k.shape[1], k.shape[2]
    if causal and sq != sk:
        raise ValueError(f"causal attention needs seq_q == seq_kv, got {sq=} {sk=}")
    if sliding_window is not None and not causal:
        raise ValueError("sliding_window is only defined for causal attention")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    q_seg, kv_seg = _normalize_segment_ids(segment_ids, b, sq, sk)
    q5 = q.reshape(b, sq, g, h // g, d)
    s = jnp.einsum("bqgrd,bkgd->bgrqk", q5, k, preferred_element_type=jnp.float32) * scale
    qi, kj = jnp.arange(sq)[:, None], jnp.arange(sk)[None, :]
    mask = jnp.ones((sq, sk), bool)
    if causal:
        mask &= kj <= qi
    if sliding_window is not None:
        mask &= qi - kj < sliding_window
    mask = jnp.broadcast_to(mask, (b, 1, 1, sq, sk))
    if q_seg is not None:
        mask = mask & (q_seg[:, :, None] == kv_seg[:, None, :])[:, None, None]
    s = jnp.where(mask, s, jnp.finfo(jnp.float32).min)
    p = jnp.where(mask, jax.nn.softmax(s, axis=-1), 0.0)
    out = jnp.einsum("bgrqk,bkgd->bqgrd", p, v.astype(jnp.float32))
    return out.reshape(b, sq, h, d).astype(q.dtype)
