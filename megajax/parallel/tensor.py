"""Tensor parallelism (Megatron TP) and sequence parallelism (Megatron SP) as explicit collectives.

Where XLA partitions a layout by itself (a step outside the pipeline stages), tensor parallelism
is an entry in the rules tables and needs no code: the kernels are split over `tensor` and the
compiler inserts the all-reduces. Two places write the collectives out, as `LinearOps` the model
is given:

- inside the pipeline stage loop, which is manual over every mesh axis (megajax/parallel/
  pipeline.py): every device holds its own shards, so each product says what crosses `tensor`;
- sequence parallelism (`parallel.sequence_parallel`), on every layout: XLA:GPU derives its
  collectives from the shardings alone, but XLA:CPU leaves an all-reduce followed by a slice.

The products, x[B, S, D] a token's hidden state and `tp` the tensor axes:

- column-parallel (q/k/v, fc1/gate/up, output layer):
    x[B_dp, S(_tp under SP), D] (-all-gather S over tp under SP) . W[D, F_tp] -> y[B_dp, S, F_tp]
- row-parallel (o, fc2):
    x[B_dp, S, F_tp] . W[F_tp, D] -> partial sums -> all-reduce (SP: reduce-scatter S) -> y[B_dp, S(_tp), D]
- vocab-parallel embedding lookup (learned positions: this rank's part of the sequence under SP):
    E[V_tp, D][ids] (masked to this shard's rows) -> all-reduce (SP: reduce-scatter S) -> x[B_dp, S(_tp), D]
- vocab-parallel cross entropy of logits[B, S, V_tp] (`vocab_parallel_cross_entropy`): only [B, S]
  maxima and sums cross `tensor`.

Backward passes follow by transposition (all-gather <-> reduce-scatter; an all-reduce's
cotangent is not reduced again, and a value replicated over `tensor` that meets a split weight
gets its cotangent summed over `tensor`, as JAX's typing of manual axes prescribes: Megatron's
f/g operators). A product the model asks for per layer (FP8's, with its scaling state) is wrapped
the same way (`LinearOps.layout`).

Collective matmuls (`collective_matmul`, parallel.tp_comm_overlap on GPUs): under sequence
parallelism the plain products' gather and scatter are split into the tensor size's steps around
a ring, each step's collective-permute independent of the partial product beside it, so that the
scheduler runs the transfer while the product computes (Megatron's --tp-comm-overlap ring
exchange; XLA's windowed einsum does the same for products it partitions itself, but these are
manual):

- column:  for s in 0..n-1: y[chunk (i - s) mod n] = x_held . W; x_held <- x_held from rank i - 1
- row:     for s in 0..n-1: acc = (acc from rank i - 1) + x[chunk (i - 1 - s) mod n] . W
           (after n steps rank i holds the sum over the ranks of its own chunk)

Their backward passes are rings too (the transposed collective-permutes). FP8's stateful products
keep the one gather and scatter (their scaling reads the whole input).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from megajax.mesh import Rules, entry_axes, logical_to_spec, mesh_sizes, spec_entry
from megajax.models.layers import DotGeneral, LinearOps
from megajax.models.transformer import RESIDUAL
from megajax.parallel.manual import shard_map_fn


def tensor_parallel_ops(mesh: Mesh, rules: Rules, dot_general: DotGeneral = jax.lax.dot_general, *,
                        sequence_parallel: bool, collective_matmul: bool = False) -> LinearOps:
    """LinearOps whose projections and embedding lookups carry their tensor-parallel (and, with
    `sequence_parallel`, sequence-parallel) collectives; with `collective_matmul` as well, the plain
    products' sequence-parallel gathers and scatters run as rings of partial products (see above).

    Every mesh axis comes from the activation rules table: the tensor-parallel axes are those of
    `heads` (which `mlp` and `vocab` share), the sequence is split as `length` inside
    tensor-parallel regions and as `residual_length` outside, and sequence parallelism gathers /
    scatters over the axes `residual_length` adds to `length`."""
    tp = spec_entry(rules["heads"])
    sp = spec_entry(a for a in rules["residual_length"] if a not in rules["length"]) if sequence_parallel else None
    outer = logical_to_spec(RESIDUAL, rules)  # x[B, S, D] outside tensor-parallel regions
    bt, inner = tuple(logical_to_spec(("batch", "length"), rules))  # batch and sequence inside them
    if sequence_parallel and (sp is None or sp != tp):
        raise ValueError(f"sequence parallelism needs residual_length = length + the tensor-parallel axes "
                         f"{tp}; the rules give {rules['residual_length']} and {rules['length']}")
    split = tp is not None and all(mesh_sizes(mesh)[a] > 1 for a in entry_axes(tp))

    def gather(x):  # entering a tensor-parallel region
        return jax.lax.all_gather(x, sp, axis=1, tiled=True) if sp is not None else x

    def reduce(y):  # leaving it: partial sums over the tensor shards
        if not split:
            return y
        return jax.lax.psum_scatter(y, sp, scatter_dimension=1, tiled=True) if sp is not None else jax.lax.psum(y, tp)

    ring = collective_matmul and sp is not None and split
    n = math.prod(mesh_sizes(mesh)[a] for a in entry_axes(sp)) if sp is not None else 1
    forward = [(j, (j + 1) % n) for j in range(n)]  # each rank's block to the next

    def gathered_dot(dot, x, k, dimension_numbers, **kw):
        """dot(all_gather(x over the sequence), k) as n partial products, the blocks passed round."""
        i = jax.lax.axis_index(sp)
        held, parts = x, []
        for step in range(n):
            parts.append(dot(held, k, dimension_numbers, **kw))  # the block of rank (i - step) mod n
            if step < n - 1:
                held = jax.lax.ppermute(held, sp, forward)
        blocks = jnp.take(jnp.stack(parts), (i - jnp.arange(n)) % n, axis=0)  # [n, B, S/n, ...] by rank
        return jnp.moveaxis(blocks, 0, 1).reshape(x.shape[0], n * x.shape[1], *blocks.shape[3:])

    def scattered_dot(dot, x, k, dimension_numbers, **kw):
        """reduce_scatter(dot(x, k) over the sequence) as n partial products, the sums passed round."""
        i, size = jax.lax.axis_index(sp), x.shape[1] // n
        acc = None
        for step in range(n):
            block = jax.lax.dynamic_slice_in_dim(x, ((i - 1 - step) % n) * size, size, axis=1)
            part = dot(block, k, dimension_numbers, **kw)
            acc = part if acc is None else jax.lax.ppermute(acc, sp, forward) + part
        return acc

    def column_with(dot: DotGeneral, in_ring: bool = False) -> DotGeneral:
        def column(x, k, dimension_numbers, **kw):
            (lc, rc), _ = dimension_numbers
            assert tuple(lc) == tuple(range(2, x.ndim)), "column projection expects x[B, S, contracting...]"
            k_free = [d for d in range(k.ndim) if d not in rc]
            k_spec = [None] * k.ndim
            k_spec[k_free[0]] = tp
            out_spec = [bt, inner] + [None] * len(k_free)
            out_spec[2] = tp
            local = ((lambda x, k: gathered_dot(dot, x, k, dimension_numbers, **kw)) if in_ring else
                     (lambda x, k: dot(gather(x), k, dimension_numbers, **kw)))
            return shard_map_fn(local, mesh, (outer, P(*k_spec)), P(*out_spec))(x, k)
        return column

    def row_with(dot: DotGeneral, in_ring: bool = False) -> DotGeneral:
        def row(x, k, dimension_numbers, **kw):
            (lc, rc), _ = dimension_numbers
            assert tuple(lc) == tuple(range(2, x.ndim)), "row projection expects x[B, S, contracting...]"
            x_spec = [bt, inner] + [None] * (x.ndim - 2)
            x_spec[lc[0]] = tp
            k_spec = [None] * k.ndim
            k_spec[rc[0]] = tp
            local = ((lambda x, k: scattered_dot(dot, x, k, dimension_numbers, **kw)) if in_ring else
                     (lambda x, k: reduce(dot(x, k, dimension_numbers, **kw))))
            return shard_map_fn(local, mesh, (P(*x_spec), P(*k_spec)), outer)(x, k)
        return row

    def embed(table, ids):
        def local(table, ids):
            rows = table.shape[0]
            local_ids = ids - (jax.lax.axis_index(tp) * rows if split else 0)
            valid = (local_ids >= 0) & (local_ids < rows)
            out = jnp.take(table, jnp.where(valid, local_ids, 0), axis=0)
            return reduce(jnp.where(valid[..., None], out, jnp.zeros((), out.dtype)))

        return shard_map_fn(local, mesh, (logical_to_spec(("vocab", "embed"), rules), P(bt, inner)), outer)(table, ids)

    def embed_positions(table, positions):
        """Learned positions, laid out as the token embeddings are (this rank's part of the
        sequence under sequence parallelism)."""
        if sp is None:
            return jnp.take(table, positions, axis=0)

        def local(table, positions):
            n = positions.shape[1] // math.prod(mesh_sizes(mesh)[a] for a in entry_axes(sp))
            mine = jax.lax.dynamic_slice_in_dim(positions, jax.lax.axis_index(sp) * n, n, axis=1)
            return jnp.take(table, mine, axis=0)

        return shard_map_fn(local, mesh, (P(), P(bt, inner)), outer)(table, positions)

    def layout(kind: str, dot: DotGeneral) -> DotGeneral:
        return row_with(dot) if kind == "row" else column_with(dot)

    return LinearOps(column=column_with(dot_general, ring), row=row_with(dot_general, ring), embed=embed,
                     embed_positions=embed_positions, layout=layout)


def vocab_parallel_cross_entropy(mesh: Mesh, rules: Rules, vocab_size: int) -> Callable:
    """ce(logits [B, S, V_tp] (padded vocabulary, split over the tensor axes), labels [B, S]) ->
    per-token cross entropy [B, S] fp32; the padding columns (ids >= `vocab_size`) take no part.
    Only [B, S] maxima and sums cross `tensor` (Megatron's vocab-parallel cross entropy)."""
    tp = spec_entry(rules["vocab"])
    split = tp is not None and all(mesh_sizes(mesh)[a] > 1 for a in entry_axes(tp))
    bt, inner = tuple(logical_to_spec(("batch", "length"), rules))

    def local(logits, labels):
        v = logits.shape[-1]
        first = jax.lax.axis_index(tp) * v if split else 0
        ids = first + jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
        logits = jnp.where(ids < vocab_size, logits.astype(jnp.float32), jnp.finfo(jnp.float32).min)
        m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
        if split:
            m = jax.lax.pmax(m, tp)
        total = jnp.sum(jnp.exp(logits - m), axis=-1)
        label_logit = jnp.sum(jnp.where(ids == labels[..., None], logits, 0.0), axis=-1)
        if split:
            total, label_logit = jax.lax.psum((total, label_logit), tp)
        return jnp.log(total) + m[..., 0] - label_logit

    return shard_map_fn(local, mesh, (P(bt, inner, tp), P(bt, inner)), P(bt, inner))
