"""Sequence parallelism's collectives (Megatron SP), explicit with shard_map.

With `parallel.sequence_parallel`, activations outside tensor-parallel
regions are sharded on the sequence over `tensor` (a rules-table entry).
Entering a tensor-parallel region all-gathers the sequence; leaving it
reduce-scatters the partial sums back onto sequence shards. XLA:GPU derives
these collectives from the shardings alone, but XLA:CPU leaves an all-reduce
followed by a slice, so the three places where SP changes communication are
written out here and injected into the model as `LinearOps`:

- column-parallel projection (q/k/v, fc1/gate/up, output layer):
    x[B_dp, S_tensor, D] -all-gather S-> x[B_dp, S, D] . W[D, F_tensor] -> y[B_dp, S, F_tensor]
- row-parallel projection (o, fc2):
    x[B_dp, S, F_tensor] . W[F_tensor, D] -> partial y -reduce-scatter S-> y[B_dp, S_tensor, D]
- vocab-parallel embedding lookup:
    E[V_tensor, D][ids] (masked to the local vocab shard) -reduce-scatter S-> x[B_dp, S_tensor, D]

Backward passes follow by transposition (all-gather <-> reduce-scatter).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from megajax.mesh import Rules, logical_to_spec, spec_entry
from megajax.parallel.manual import shard_map_fn
from megajax.models.layers import LinearOps
from megajax.models.transformer import RESIDUAL


def sequence_parallel_ops(mesh: Mesh, rules: Rules, dot_general: Callable = jax.lax.dot_general) -> LinearOps:
    """LinearOps whose projections and embedding carry Megatron's SP all-gather / reduce-scatter.

    Every mesh axis comes from the activation rules table: the tensor-parallel axes are those of
    `heads` (which `mlp` and `vocab` share), the sequence is split as `length` inside tensor-parallel
    regions and as `residual_length` outside, and sequence parallelism gathers / scatters over the
    axes `residual_length` adds to `length` (the tensor axes, possibly after `context`). Inside a
    pipeline stage they are differentiated by hand (megajax/parallel/manual.py)."""
    tp = spec_entry(rules["heads"])
    sp = spec_entry(a for a in rules["residual_length"] if a not in rules["length"])
    outer = logical_to_spec(RESIDUAL, rules)  # x[B, S, D] outside tensor-parallel regions
    bt, inner = tuple(logical_to_spec(("batch", "length"), rules))  # batch and sequence inside them
    if sp is None or sp != tp:
        raise ValueError(f"sequence parallelism needs residual_length = length + the tensor-parallel axes "
                         f"{tp}; the rules give {rules['residual_length']} and {rules['length']}")

    def column(x, k, dimension_numbers, **kw):
        (lc, rc), _ = dimension_numbers
        assert tuple(lc) == tuple(range(2, x.ndim)), "column projection expects x[B, S, contracting...]"
        k_free = [d for d in range(k.ndim) if d not in rc]
        k_spec = [None] * k.ndim
        k_spec[k_free[0]] = tp
        out_spec = [bt, inner] + [None] * len(k_free)
        out_spec[2] = tp

        def local(x, k):
            x = jax.lax.all_gather(x, tp, axis=1, tiled=True)
            return dot_general(x, k, dimension_numbers, **kw)

        return shard_map_fn(local, mesh, (outer, P(*k_spec)), P(*out_spec))(x, k)

    def row(x, k, dimension_numbers, **kw):
        (lc, rc), _ = dimension_numbers
        assert tuple(lc) == tuple(range(2, x.ndim)), "row projection expects x[B, S, contracting...]"
        x_spec = [bt, inner] + [None] * (x.ndim - 2)
        x_spec[lc[0]] = tp
        k_spec = [None] * k.ndim
        k_spec[rc[0]] = tp

        def local(x, k):
            y = dot_general(x, k, dimension_numbers, **kw)
            return jax.lax.psum_scatter(y, tp, scatter_dimension=1, tiled=True)

        return shard_map_fn(local, mesh, (P(*x_spec), P(*k_spec)), outer)(x, k)

    def embed(table, ids):
        def local(table, ids):
            rows = table.shape[0]
            local_ids = ids - jax.lax.axis_index(tp) * rows
            valid = (local_ids >= 0) & (local_ids < rows)
            out = jnp.take(table, jnp.where(valid, local_ids, 0), axis=0)
            out = jnp.where(valid[..., None], out, jnp.zeros((), out.dtype))
            return jax.lax.psum_scatter(out, tp, scatter_dimension=1, tiled=True)

        return shard_map_fn(local, mesh, (logical_to_spec(("vocab", "embed"), rules), P(bt, inner)), outer)(table, ids)

    return LinearOps(column=column, row=row, embed=embed)
