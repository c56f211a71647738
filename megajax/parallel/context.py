"""Attention over a mesh: kernels under shard_map, and context parallelism (ring / all-gather).

A fused kernel (Pallas flash, cuDNN) cannot be partitioned by XLA, so under a
mesh it runs per shard inside shard_map: q[B_dp, S, H_tensor, D] and
k/v[B_dp, S, G_tensor, D], each device attending its own heads.

Context parallelism splits the sequence over the `context` axis. With C
devices the sequence is cut into 2C chunks and device r holds chunks r and
2C-1-r (the loader lays tokens out that way), so that under causal masking
every device does the same work. Two schemes (`parallel.context_impl`):

- ring: k/v chunks travel around the ring with ppermute; each device merges
  the partial attention of its queries over every visiting k/v chunk with an
  online softmax (log-sum-exp merge). The backward pass sends k/v around the
  ring again, together with their gradient accumulators, which arrive back at
  the owner after C hops; no device ever holds more than its own chunks plus
  one visiting pair.
- allgather: k/v of all chunks are all-gathered once; each device attends its
  queries to the chunks at or before them. The backward reduce-scatters dk/dv.

Both call a per-block kernel that returns (out, lse) (megajax.models.attention
.BLOCK_ATTENTION: plain jnp or the Pallas flash kernel) on pairs (query chunk,
key chunk): causal on the diagonal, full below it, skipped above it.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from megajax.mesh import Rules, entry_axes, like, load_balanced_order, logical_to_spec, mesh_sizes, spec_entry
from megajax.models.attention import ACT_KV, ACT_Q
from megajax.models.transformer import shift_left
from megajax.parallel.manual import shard_map_fn

SEG_AXES = ("batch", "length")


def _specs(rules: Rules):
    """Partition specs of q, k/v and segment ids: the model's logical layouts through the rules table."""
    return tuple(logical_to_spec(a, rules) for a in (ACT_Q, ACT_KV, SEG_AXES))


def context_axes(rules: Rules):
    """The mesh axes the sequence is split over inside attention (rules['length']): a name or a tuple."""
    return spec_entry(rules["length"])


def sharded_attention(core: Callable, mesh: Mesh, rules: Rules) -> Callable:
    """Runs an attention core per shard (batch over data axes, heads over tensor); also inside a
    pipeline stage (megajax/parallel/manual.py)."""
    q_spec, kv_spec, seg_spec = _specs(rules)

    def attend(q, k, v, *, segment_ids=None, causal=True, dropout_rate=0.0, dropout_rng=None):
        def local(q, k, v, seg):
            return core(q, k, v, segment_ids=seg, causal=causal, dropout_rate=dropout_rate, dropout_rng=None)
        return shard_map_fn(local, mesh, (q_spec, kv_spec, kv_spec, seg_spec if segment_ids is not None else None),
                            q_spec)(q, k, v, segment_ids)

    return attend


# ----------------------------------------------------------------------------
# Partial results and their merge
# ----------------------------------------------------------------------------

def _empty(q, v_dim):
    """A partial result that saw no key: out 0, lse -inf; out [B, L, H, v_dim] fp32 (v's head dim:
    multi-latent attention's differs from q's), lse [B, H, L]."""
    b, l, h, _ = q.shape
    # Typed as q is (inside a pipeline stage, varying over its axes: a branch's outputs must match).
    return like(jnp.zeros((b, l, h, v_dim), jnp.float32), q), like(jnp.full((b, h, l), -jnp.inf, jnp.float32), q)


def _merge(acc, part):
    """Online-softmax merge of two partial attention results over disjoint key sets."""
    (o1, l1), (o2, l2) = acc, part
    lse = jnp.logaddexp(l1, l2)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    w1 = jnp.where(jnp.isfinite(l1), jnp.exp(l1 - safe), 0.0)
    w2 = jnp.where(jnp.isfinite(l2), jnp.exp(l2 - safe), 0.0)
    t = lambda w: jnp.transpose(w, (0, 2, 1))[..., None]  # [B, H, L] -> [B, L, H, 1]
    return o1 * t(w1) + o2.astype(jnp.float32) * t(w2), lse


def _cat(a, b):
    return jnp.concatenate([a[0], b[0]], axis=1), jnp.concatenate([a[1], b[1]], axis=2)


def _halves(x, axis=1):
    c = x.shape[axis] // 2
    return jax.lax.slice_in_dim(x, 0, c, axis=axis), jax.lax.slice_in_dim(x, c, 2 * c, axis=axis)


class _Blocks:
    """Per-block attention on (query part, key part) pairs, with optional segment ids."""

    def __init__(self, block: Callable):
        self.block = block

    def __call__(self, q, k, v, qs, ks, causal):
        o, lse = self.block(q, k, v, q_segment_ids=qs, kv_segment_ids=ks, causal=causal)
        return o.astype(jnp.float32), lse


def _seg_halves(seg):
    return (None, None) if seg is None else _halves(seg)


# ----------------------------------------------------------------------------
# Ring attention
# ----------------------------------------------------------------------------

def _step_parts(q, qs, k, v, ks, step, size, blocks, axis):
    """Partial results (lo, hi) of this device's two query chunks against the visiting k/v."""
    r = jax.lax.axis_index(axis)
    q_lo, q_hi = _halves(q)
    qs_lo, qs_hi = _seg_halves(qs)
    k_lo, k_hi = _halves(k)
    v_lo, v_hi = _halves(v)
    ks_lo, ks_hi = _seg_halves(ks)
    if step == 0:
        lo = blocks(q_lo, k_lo, v_lo, qs_lo, ks_lo, True)
        hi = _merge(blocks(q_hi, k_hi, v_hi, qs_hi, ks_hi, True), blocks(q_hi, k_lo, v_lo, qs_hi, ks_lo, False))
        return lo, hi
    src = (r - step) % size

    def earlier():  # src < r: both query chunks see key chunk src in full
        return _halves_of(blocks(q, k_lo, v_lo, qs, ks_lo, False))

    def later():  # src > r: query chunk 2C-1-r sees both key chunks of src in full
        return _empty(q_lo, v.shape[-1]), blocks(q_hi, k, v, qs_hi, ks, False)

    return jax.lax.cond(src < r, earlier, later)


def _halves_of(part):
    o, lse = part
    o_lo, o_hi = _halves(o, 1)
    l_lo, l_hi = _halves(lse, 2)
    return (o_lo, l_lo), (o_hi, l_hi)


def _shift(tree, size, axis):
    perm = [(i, (i + 1) % size) for i in range(size)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, axis, perm), tree)


def _ring_forward(q, k, v, q_seg, kv_seg, blocks, size, axis):
    acc_lo, acc_hi = (_empty(half, v.shape[-1]) for half in _halves(q))
    visiting = (k, v, kv_seg)
    for step in range(size):
        if step:
            visiting = _shift(visiting, size, axis)
        lo, hi = _step_parts(q, q_seg, *visiting, step, size, blocks, axis)
        acc_lo, acc_hi = _merge(acc_lo, lo), _merge(acc_hi, hi)
    out, lse = _cat(acc_lo, acc_hi)
    return out.astype(q.dtype), lse


def _make_ring(blocks: _Blocks, size: int, axis):
    @jax.custom_vjp
    def ring(q, k, v, q_seg, kv_seg):
        return _ring_forward(q, k, v, q_seg, kv_seg, blocks, size, axis)[0]

    def forward(q, k, v, q_seg, kv_seg):
        out, lse = _ring_forward(q, k, v, q_seg, kv_seg, blocks, size, axis)
        return out, (q, k, v, q_seg, kv_seg, out, lse)

    def backward(res, d_out):
        q, k, v, q_seg, kv_seg, out, lse = res
        out32, d_out32 = out.astype(jnp.float32), d_out.astype(jnp.float32)

        def part_grads(q_part, qs_part, rows, k_part, v_part, ks_part, causal):
            """Gradients of one block's contribution, given the final out/lse of its query rows."""
            def f(qq, kk, vv):
                return blocks(qq, kk, vv, qs_part, ks_part, causal)
            (o_b, l_b), vjp = jax.vjp(f, q_part, k_part, v_part)
            o_f, l_f, do = out32[:, rows], lse[:, :, rows], d_out32[:, rows]
            a = jnp.where(jnp.isfinite(l_b), jnp.exp(l_b - jnp.where(jnp.isfinite(l_f), l_f, 0.0)), 0.0)
            a_t = jnp.transpose(a, (0, 2, 1))[..., None]
            d_o_b = do * a_t
            d_l_b = a * jnp.transpose(jnp.sum(do * (o_b - o_f), axis=-1), (0, 2, 1))
            # Typed like the block's outputs (inside a pipeline stage they vary over `pipeline`).
            return vjp((like(d_o_b, o_b, q_part, k_part, v_part), like(d_l_b, l_b, q_part, k_part, v_part)))

        c = q.shape[1] // 2
        lo, hi, whole = slice(0, c), slice(c, 2 * c), slice(0, 2 * c)
        q_lo, q_hi = _halves(q)
        qs_lo, qs_hi = _seg_halves(q_seg)
        r = jax.lax.axis_index(axis)
        dq = jnp.zeros(q.shape, jnp.float32)
        travelling = (k, v, kv_seg, jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
        for step in range(size):
            if step:
                travelling = _shift(travelling, size, axis)
            kk, vv, ks, dk, dv = travelling
            k_lo, k_hi = _halves(kk)
            v_lo, v_hi = _halves(vv)
            ks_lo, ks_hi = _seg_halves(ks)
            if step == 0:
                pairs = [(q_lo, qs_lo, lo, k_lo, v_lo, ks_lo, True, lo),
                         (q_hi, qs_hi, hi, k_hi, v_hi, ks_hi, True, hi),
                         (q_hi, qs_hi, hi, k_lo, v_lo, ks_lo, False, lo)]
                for q_part, qs_part, rows, k_part, v_part, ks_part, causal, kv_rows in pairs:
                    gq, gk, gv = part_grads(q_part, qs_part, rows, k_part, v_part, ks_part, causal)
                    dq = dq.at[:, rows].add(gq)
                    dk = dk.at[:, kv_rows].add(gk)
                    dv = dv.at[:, kv_rows].add(gv)
            else:
                src = (r - step) % size

                def earlier(dq, dk, dv):
                    gq, gk, gv = part_grads(q, q_seg, whole, k_lo, v_lo, ks_lo, False)
                    return dq + gq, dk.at[:, lo].add(gk), dv.at[:, lo].add(gv)

                def later(dq, dk, dv):
                    gq, gk, gv = part_grads(q_hi, qs_hi, hi, kk, vv, ks, False)
                    return dq.at[:, hi].add(gq), dk + gk, dv + gv

                dq, dk, dv = jax.lax.cond(src < r, earlier, later, dq, dk, dv)
            travelling = (kk, vv, ks, dk, dv)
        # One more hop brings every device's k/v gradients home (size hops in all).
        _, _, _, dk, dv = _shift(travelling, size, axis)
        return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None)

    ring.defvjp(forward, backward)
    return ring


# ----------------------------------------------------------------------------
# All-gather k/v
# ----------------------------------------------------------------------------

def _allgather_attention(q, k, v, q_seg, kv_seg, blocks: _Blocks, size: int, axis):
    """Queries of chunks (r, 2C-1-r) against the all-gathered k/v of every chunk."""
    gather = lambda x: None if x is None else jax.lax.all_gather(x, axis, axis=1, tiled=True)
    k_all, v_all, ks_all = gather(k), gather(v), gather(kv_seg)
    c = q.shape[1] // 2
    r = jax.lax.axis_index(axis)
    q_lo, q_hi = _halves(q)
    qs_lo, qs_hi = _seg_halves(q_seg)
    results = []
    for q_part, qs_part, q_chunk in ((q_lo, qs_lo, r), (q_hi, qs_hi, 2 * size - 1 - r)):
        acc = _empty(q_part, v.shape[-1])
        for j in range(size):  # gathered device j holds chunks j and 2C-1-j
            for half, k_chunk in ((0, j), (1, 2 * size - 1 - j)):
                sl = slice((2 * j + half) * c, (2 * j + half + 1) * c)
                kb, vb = k_all[:, sl], v_all[:, sl]
                ksb = None if ks_all is None else ks_all[:, sl]
                kind = jnp.where(k_chunk < q_chunk, 2, jnp.where(k_chunk == q_chunk, 1, 0))
                part = jax.lax.switch(kind, [
                    lambda: _empty(q_part, v.shape[-1]),
                    lambda: blocks(q_part, kb, vb, qs_part, ksb, True),
                    lambda: blocks(q_part, kb, vb, qs_part, ksb, False)])
                acc = _merge(acc, part)
        results.append(acc)
    out, _ = _cat(*results)
    return out.astype(q.dtype)


# ----------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------

def context_parallel_attention(block: Callable, mesh: Mesh, rules: Rules, impl: str = "ring") -> Callable:
    """An attention core for sequences sharded over `context` (load-balanced chunk layout), also
    inside a pipeline stage (megajax/parallel/manual.py)."""
    axis = context_axes(rules)
    sizes = mesh_sizes(mesh)
    size = math.prod(sizes[a] for a in (axis if isinstance(axis, tuple) else (axis,)))
    blocks = _Blocks(block)
    q_spec, kv_spec, seg_spec = _specs(rules)
    ring = _make_ring(blocks, size, axis)

    def attend(q, k, v, *, segment_ids=None, causal=True, dropout_rate=0.0, dropout_rng=None):
        if not causal:
            raise NotImplementedError("context parallelism is implemented for causal attention")

        def local(q, k, v, seg):
            if impl == "ring":
                return ring(q, k, v, seg, seg)
            return _allgather_attention(q, k, v, seg, seg, blocks, size, axis)

        seg_in = seg_spec if segment_ids is not None else None
        return shard_map_fn(local, mesh, (q_spec, kv_spec, kv_spec, seg_in), q_spec, check_vma=False)(q, k, v, segment_ids)

    return attend


def sequence_shift(mesh: Mesh | None, rules: Rules | None) -> Callable:
    """shift(x [B, L], k) -> x[:, i + k] at position i and zeros past the sequence's end, for the
    sequence in its natural order (multi-token prediction's shifted tokens, positions and labels;
    megajax.models.transformer.shift_left). Under context parallelism the sequence is laid out in
    load-balanced chunks, so a shift crosses devices: each device all-gathers the [B, L] integers
    (or mask) over `context`, shifts them in natural order and keeps its own chunks (Megatron-Core
    exchanges the chunks' boundaries; these arrays are small)."""
    if mesh is None or rules is None:
        return shift_left
    axis = context_axes(rules)
    size = math.prod(mesh_sizes(mesh)[a] for a in (axis if isinstance(axis, tuple) else (axis,)))
    if size == 1:
        return shift_left
    spec = logical_to_spec(SEG_AXES, rules)

    def shift(x, k):
        def local(x):  # [b, L / size]: this device's chunks r and 2 size - 1 - r
            whole = jax.lax.all_gather(x, axis, axis=1, tiled=True)  # [b, L] in load-balanced order
            n = whole.shape[1]
            order = load_balanced_order(n, size)  # the natural position at each slot
            natural = jnp.take(whole, jnp.asarray(np.argsort(order)), axis=1)
            shifted = jnp.take(shift_left(natural, k), jnp.asarray(order), axis=1)
            return jax.lax.dynamic_slice_in_dim(shifted, jax.lax.axis_index(axis) * (n // size), n // size, axis=1)
        return shard_map_fn(local, mesh, (spec,), spec)(x)

    return shift


def mamba_context(mesh: Mesh | None, rules: Rules | None) -> Callable | None:
    """The sequence mixing of a Mamba mixer (conv and scan, megajax.models.mamba.sequence_mix) under
    context parallelism, as Megatron-Core runs it: the inputs arrive split over `context` by sequence
    (load-balanced chunks) and over `tensor` by heads; an all-to-all over `context` turns the sequence
    shards into head shards (each device: the whole sequence, in its natural order, for 1 / context of
    its heads), the conv and scan run there, and the inverse all-to-all brings y back to sequence
    shards in the load-balanced order. B and C are all-gathered over `context` (their groups are
    few) and each device takes its heads' groups, so a shard holding fewer groups than the context
    size needs no special case. Segment ids (a packed batch) are all-gathered like B and C: each device
    runs the conv and the scan over whole documents in natural order. None without context parallelism."""
    from megajax.models.mamba import ACT_DT, ACT_GROUPS, ACT_HEADS
    if mesh is None or rules is None:
        return None
    axis = context_axes(rules)
    size = math.prod(mesh_sizes(mesh)[a] for a in (axis if isinstance(axis, tuple) else (axis,)))
    if size == 1:
        return None
    x_spec, g_spec, dt_spec = (logical_to_spec(a, rules) for a in (ACT_HEADS, ACT_GROUPS, ACT_DT))
    per_head = {"conv_x": ("heads", "head_dim", None), "conv_x_bias": ("heads", "head_dim"),
                "dt_bias": ("heads",), "A_log": ("heads",), "D": ("heads",)}
    per_group = {"conv_B": ("ssm_groups", "ssm_state", None), "conv_B_bias": ("ssm_groups", "ssm_state"),
                 "conv_C": ("ssm_groups", "ssm_state", None), "conv_C_bias": ("ssm_groups", "ssm_state")}
    w_specs = {k: logical_to_spec(v, rules) for k, v in {**per_head, **per_group}.items()}

    seg_spec = logical_to_spec(SEG_AXES, rules)

    def mixer(mix: Callable, xs, b, c, dt, w: dict, segment_ids=None):
        def local(xs, b, c, dt, w, seg):
            n = xs.shape[1] * size
            order = load_balanced_order(n, size)  # the natural position at each slot
            natural, slots = jnp.asarray(np.argsort(order)), jnp.asarray(order)

            def to_heads(a):  # [b, n / size, h, ...] -> [b, n, h / size, ...], natural order
                return jnp.take(jax.lax.all_to_all(a, axis, 2, 1, tiled=True), natural, axis=1)

            def whole(a):  # [b, n / size, ...] -> [b, n, ...], natural order
                return jnp.take(jax.lax.all_gather(a, axis, axis=1, tiled=True), natural, axis=1)

            h, g = xs.shape[2], b.shape[2]
            if h % size:
                raise ValueError(f"{h} heads per tensor shard do not split over context {size}")
            count = h // size
            heads = jax.lax.axis_index(axis) * count + jnp.arange(count)
            groups = heads // (h // g)  # each of this device's heads' group
            mine = {k: jnp.take(w[k], heads, axis=0) for k in per_head}
            mine |= {k: jnp.take(w[k], groups, axis=0) for k in per_group}
            y = mix(to_heads(xs), jnp.take(whole(b), groups, axis=2), jnp.take(whole(c), groups, axis=2),
                    to_heads(dt), mine, segment_ids=None if seg is None else whole(seg))
            return jax.lax.all_to_all(jnp.take(y, slots, axis=1), axis, 1, 2, tiled=True)

        return shard_map_fn(local, mesh, (x_spec, g_spec, g_spec, dt_spec, w_specs,
                                          None if segment_ids is None else seg_spec), x_spec,
                            check_vma=False)(xs, b, c, dt, w, segment_ids)

    return mixer


def sharded_ssd(ssd: Callable, mesh: Mesh, rules: Rules) -> Callable:
    """A Mamba mixer's SSD kernel (pallas_kernels/ssd.py's Pallas `ssd`, which XLA cannot partition)
    per shard: batch over the data axes, heads and their groups over tensor; also inside a pipeline
    stage or context parallelism's head shards (megajax/parallel/manual.py: the kernel itself). A
    generation prefill's carried state [B, H, P, N] (initial_state, and the final state returned) is
    split like x: rows and heads."""
    from megajax.models.mamba import ACT_DT, ACT_GROUPS, ACT_HEADS
    x_spec, g_spec, dt_spec, a_spec = (logical_to_spec(a, rules) for a in (ACT_HEADS, ACT_GROUPS, ACT_DT, ("heads",)))

    seg_spec = logical_to_spec(SEG_AXES, rules)
    sizes = mesh_sizes(mesh)

    def scan(x, dt, a, b, c, *, chunk_size, initial_state=None, return_final_state=False, segment_ids=None):
        if initial_state is not None or return_final_state:  # generation: from a carried state
            # rows over the data axes where they divide (the continuous engine's rows need not), heads
            # over tensor; the state [B, H, P, N] like x
            rows = x_spec[0] if x.shape[0] % math.prod(sizes[n] for n in entry_axes(x_spec[0])) == 0 else None
            xs_, dts, gs = (jax.sharding.PartitionSpec(rows, *spec[1:]) for spec in (x_spec, dt_spec, g_spec))
            state_spec = jax.sharding.PartitionSpec(rows, x_spec[2], None, None)

            def local_state(x, dt, a, b, c, h0, seg):
                return ssd(x, dt, a, b, c, chunk_size=chunk_size, initial_state=h0, return_final_state=True,
                           segment_ids=seg)
            if initial_state is None:
                initial_state = jnp.zeros(x.shape[:1] + x.shape[2:] + b.shape[3:], jnp.float32)
            seg = None if segment_ids is None else jax.sharding.PartitionSpec(rows, None)
            y, final = shard_map_fn(local_state, mesh, (xs_, dts, a_spec, gs, gs, state_spec, seg), (xs_, state_spec),
                                    check_vma=False)(x, dt, a, b, c, initial_state, segment_ids)
            return (y, final) if return_final_state else y

        def local(x, dt, a, b, c, seg):
            return ssd(x, dt, a, b, c, chunk_size=chunk_size, segment_ids=seg)
        return shard_map_fn(local, mesh, (x_spec, dt_spec, a_spec, g_spec, g_spec,
                                          None if segment_ids is None else seg_spec), x_spec,
                            check_vma=False)(x, dt, a, b, c, segment_ids)

    return scan
