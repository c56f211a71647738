"""Expert parallelism: MoE token dispatch across devices, explicit with shard_map.

Every device routes its own tokens (x[B_batch, L_seq, D], batch split over the data-parallel
axes and `expert`, the sequence over `context`). Experts are split over the `expert` axis
(E_local = E / ep per device, kernels W[E_expert, D, F_tensor]) and each expert's hidden dim over
`tensor` (expert tensor parallelism). One MoE layer on one device:

    assignments (token, k) sorted by expert -> send buffer [ep, A, D]: slot r holds the rows
        for device r's experts (A = tokens x K, room for every assignment: dropless)
    all_to_all over `expert`                  -> recv [ep, A, D]: rows from every source device
    sort the received rows by local expert, one grouped product per kernel (ragged_dot)
    all_to_all back                           -> every assignment's output, weighted and summed

Buffers have a fixed size (the worst case: every assignment to one device), which every
backend runs; only the valid rows carry data. With parallel.moe_all_to_all=ragged (dropless
only) the exchanges are `jax.lax.ragged_all_to_all`s instead, which move only the valid rows
(XLA:GPU and TPU have it; XLA:CPU does not):

    assignments sorted by expert [A, D], device r's rows a contiguous slice -> ragged_all_to_all
        -> recv [ep x A, D]: each source's rows one after another (offsets from an all_to_all of
        the counts), grouped by local expert and run as above -> ragged_all_to_all back into
        each source's sorted slots In capacity mode the buffers are the experts'
[E_local x capacity] slots per device (megajax.models.moe.capacity_dispatch), E x capacity rows
sent per device instead of ep x tokens x K. With the tensor axis, every tensor rank of an
expert group holds the same tokens (gathered from the sequence-parallel split first) and computes
a slice of the hidden dim; the outputs are summed over `tensor` (reduce-scattered back onto the
sequence split under sequence parallelism), as in Megatron's expert tensor parallelism.

MoE parallel folding (parallel.expert_tensor_parallel=1 with tensor > 1): the experts split over
expert x context x tensor (mesh.FOLDED_EXPERT_AXES), each expert whole, and the all_to_alls run
over those axes. The tokens already differ over `expert` (batch) and `context` (sequence), and over
`tensor` under sequence parallelism, so each device dispatches its own; without sequence
parallelism every tensor rank holds the same tokens, so each dispatches 1 / tensor of the sequence
and the outputs are put together with a sum over `tensor`. No sum of partial outputs is needed.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from megajax.mesh import Rules, entry_axes, like, logical_to_spec, mesh_sizes, spec_entry, spec_without
from megajax.models.moe import (EXPERT_KERNEL_AXES, EXPERT_KERNELS, capacity_dispatch, expert_ffn, routed_expert_sum,
                                sort_by_expert)
from megajax.parallel.manual import shard_map_fn

RESIDUAL = ("batch", "residual_length", "embed")


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """`jax.lax.ragged_all_to_all` built from a fixed-size all_to_all (each slice padded to the
    operand's rows): the same result and gradients, the padded exchange's bytes. For backends
    without the op (XLA:CPU), where tests check the ragged dispatch's bookkeeping with it."""
    rows = jnp.arange(operand.shape[0])
    valid = rows[None, :] < send_sizes[:, None]  # [N slices, R]
    take = jnp.clip(input_offsets[:, None] + rows[None, :], 0, operand.shape[0] - 1)
    send = jnp.where(valid.reshape(valid.shape + (1,) * (operand.ndim - 1)), jnp.take(operand, take, axis=0),
                     jnp.zeros((), operand.dtype))  # [N, R, ...]
    recv = jax.lax.all_to_all(send, axis_name, 0, 0, tiled=True)  # slice i: from device i // (N / devices)
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where the received slices go here
    dest = jnp.where(rows[None, :] < recv_sizes[:, None], at[:, None] + rows[None, :], output.shape[0])
    return output.at[dest.reshape(-1)].set(recv.reshape((-1,) + recv.shape[2:]), mode="drop")


# The ragged exchange the `ragged` dispatch uses (tests on CPU put emulated_ragged_all_to_all here).
RAGGED_ALL_TO_ALL = jax.lax.ragged_all_to_all


def expert_parallel_dispatch(mesh: Mesh, rules: Rules, *, activation: str, num_experts: int,
                             capacity_factor: float | None,
                             all_to_all: str = "padded", grouped_impl: str = "auto",
                             dispatcher: str = "alltoall") -> Callable:
    """dispatch(x [B, L, D], ids [B, L, K], weights [B, L, K], kernels, products=None) -> (y [B, L, D], dropped [])
    over `mesh`, the axes read from the activation rules (`batch`, `residual_length`, `length`,
    `experts`, `mlp`), also inside a pipeline stage (megajax/parallel/manual.py).
    `dispatcher` (dropless): `alltoall` (the assignments' rows to their experts' devices and back;
    `all_to_all`: `padded` (fixed-size buffers) or `ragged` (only the valid rows move)) or `allgather`
    (every device gathers the expert group's tokens and sums its own experts' outputs)."""
    sizes = mesh_sizes(mesh)
    # The layouts without the axes of size 1 (whose collectives the body skips): typed varying over
    # one of them, the tokens would make the kernels varying over it too, and their gradients
    # would be psummed over a group of one device.
    ones = {a for a, n in sizes.items() if n == 1}
    x_spec = P(*spec_without(logical_to_spec(RESIDUAL, rules), ones))
    route_spec = P(x_spec[0], x_spec[1], None)
    length_inside = set(rules["length"])
    # The axes the body's collectives run over (those of size 1 have nothing to exchange).
    exp_axes = tuple(a for a in rules["experts"] if sizes[a] > 1)
    token_axes = entry_axes(x_spec[0]) + entry_axes(x_spec[1])  # the axes the tokens are split over
    # The sequence-parallel split (tensor), gathered when its devices split the experts' hidden dim.
    sp_axes = tuple(a for a in entry_axes(x_spec[1]) if a not in length_inside and a not in exp_axes and sizes[a] > 1)
    # Expert-parallel axes the tokens are not split over (MoE parallel folding's `tensor` without
    # sequence parallelism): each of their ranks dispatches its own slice of the sequence.
    split_axes = tuple(a for a in exp_axes if a not in token_axes)
    split = math.prod(sizes[a] for a in split_axes)
    mlp_axes = tuple(a for a in rules["expert_mlp"] if sizes[a] > 1)
    ep = math.prod(sizes[a] for a in exp_axes)
    e_local = num_experts // ep  # (the plan checks that the experts split: megajax/plan.py)
    names = EXPERT_KERNELS[activation]
    # The model's own layout of the kernels.
    kernel_specs = [P(*spec_without(logical_to_spec(EXPERT_KERNEL_AXES[n], rules), ones)) for n in names]
    all_axes = tuple(mesh.axis_names)
    # Devices that hold the same tokens (tensor ranks without sequence parallelism): their drop
    # counts repeat.
    duplicates = math.prod(sizes[a] for a in all_axes if a not in token_axes + split_axes)

    def local(x, ids, weights, kernels, products):
        if sp_axes:  # the sequence-parallel split gathered: every tensor rank routes the same tokens
            x, ids, weights = (jax.lax.all_gather(a, spec_entry(sp_axes), axis=1, tiled=True) for a in (x, ids, weights))
        else:
            # Each tensor rank's tokens typed as its own from here, so the gradient of its experts'
            # inputs is summed over `tensor` once, on the tokens [T, D], not on the exchanged rows.
            x = like(x, *kernels.values())
        whole = x.shape[1]
        if split_axes:  # this rank's 1 / split of the sequence (the others dispatch the rest)
            at = jax.lax.axis_index(spec_entry(split_axes)) * (whole // split)
            x, ids, weights = (jax.lax.dynamic_slice_in_dim(like(a, x), at, whole // split, axis=1)
                               for a in (x, ids, weights))
        b, l, d = x.shape
        if capacity_factor is not None:
            exchange = ((lambda buf: jax.lax.all_to_all(buf, spec_entry(exp_axes), 0, 0, tiled=True)) if ep > 1
                        else (lambda buf: buf))
            y, dropped = capacity_dispatch(x.reshape(b * l, d), ids.reshape(b * l, -1), weights.reshape(b * l, -1),
                                           kernels, activation=activation, num_experts=num_experts,
                                           capacity_factor=capacity_factor, ep=ep, exchange=exchange,
                                           products=products)
        else:
            if ep > 1 and dispatcher == "allgather":
                tokens = _dispatch_gathered
            else:
                tokens = _dispatch_ragged if all_to_all == "ragged" and ep > 1 else _dispatch_tokens
            y, dropped = tokens(x.reshape(b * l, d), ids.reshape(b * l, -1), weights.reshape(b * l, -1),
                                kernels, activation=activation, num_experts=num_experts,
                                e_local=e_local, ep=ep, exp_axes=exp_axes, products=products,
                                grouped_impl=grouped_impl)
        y = y.reshape(b, l, d)
        if split_axes:  # the slices' outputs put together on every rank of the split
            y = jax.lax.dynamic_update_slice_in_dim(jnp.zeros((b, whole, d), y.dtype), y, at, axis=1)
            y = jax.lax.psum(y, spec_entry(split_axes))
        if sp_axes:  # every tensor rank counted the same gathered tokens: each reports its share
            dropped = dropped / math.prod(sizes[a] for a in sp_axes)
        if mlp_axes:  # each tensor rank holds a slice of every expert's hidden dim: partial sums
            if sp_axes:
                y = jax.lax.psum_scatter(y, spec_entry(sp_axes), scatter_dimension=1, tiled=True)
            else:
                y = jax.lax.psum(y, spec_entry(mlp_axes))
        return y, dropped.reshape(1)

    def dispatch(x_BxLxD, ids_BxLxK, weights_BxLxK, kernels, products=None):
        def by_position(x, ids, weights, *ks):
            return local(x, ids, weights, dict(zip(names, ks)), products)

        sharded = shard_map_fn(by_position, mesh, (x_spec, route_spec, route_spec, *kernel_specs),
                               (x_spec, P(all_axes)))
        y, dropped = sharded(x_BxLxD, ids_BxLxK, weights_BxLxK, *(kernels[n] for n in names))
        # Every device's count (each group of duplicates once), or, run in place inside the manual
        # stage loop, this device's own.
        return y, jnp.sum(dropped) / (duplicates if dropped.size > 1 else 1)

    return dispatch


def _dispatch_tokens(x_TxD, ids_TxK, weights_TxK, kernels, *, activation, num_experts, e_local, ep, exp_axes,
                     products=None, grouped_impl="auto"):
    """Dropless: one device's tokens through their experts on the expert-parallel devices: (y [T, D],
    dropped [] = 0)."""
    t, k = ids_TxK.shape
    a_count = t * k
    ids = ids_TxK.reshape(-1)  # [A], assignment a = token a // K
    weights = weights_TxK.reshape(-1)
    order, sizes = sort_by_expert(ids, num_experts)
    inverse = jnp.argsort(order)  # assignment -> its place in the sorted order
    per_rank = sizes[:num_experts].reshape(ep, e_local)  # [ep, E_local] assignments to each device's experts
    rank_counts = jnp.sum(per_rank, axis=1)
    rank_starts = jnp.cumsum(rank_counts) - rank_counts
    # Send buffer: slot (r, p) = the p-th sorted assignment for device r.
    p = jnp.arange(a_count)
    valid = p[None, :] < rank_counts[:, None]  # [ep, A]
    src = jnp.take(order, jnp.clip(rank_starts[:, None] + p[None, :], 0, a_count - 1)) // k
    send = jnp.where(valid[..., None], jnp.take(x_TxD, src, axis=0), jnp.zeros((), x_TxD.dtype))  # [ep, A, D]
    if ep > 1:
        axis = spec_entry(exp_axes)
        recv = jax.lax.all_to_all(send, axis, 0, 0, tiled=True)  # [ep (source), A, D]
        recv_counts = jax.lax.all_to_all(per_rank, axis, 0, 0, tiled=True)  # [ep (source), E_local]
    else:
        recv, recv_counts = send, per_rank
    # Received rows by local expert: row (s, q) is expert j's when q falls in source s's j-th group.
    bounds = jnp.cumsum(recv_counts, axis=1)  # [ep, E_local]
    expert_of_row = jnp.sum(p[None, :, None] >= bounds[:, None, :], axis=-1)  # [ep, A]; E_local = empty row
    order2, sizes2 = sort_by_expert(expert_of_row.reshape(-1), e_local + 1)
    rows = jnp.take(recv.reshape(ep * a_count, -1), order2, axis=0)
    out_sorted = expert_ffn(rows, sizes2[:e_local], kernels, activation, products, grouped_impl)  # rows past the groups: 0
    out_recv = jnp.take(out_sorted, jnp.argsort(order2), axis=0).reshape(ep, a_count, -1)
    back = jax.lax.all_to_all(out_recv, spec_entry(exp_axes), 0, 0, tiled=True) if ep > 1 else out_recv
    # Assignment a's output sits in slot (its device, its place among that device's assignments).
    rank = ids // e_local
    out = back[rank, inverse - rank_starts[rank]]  # [A, D]
    y = jnp.sum(out.reshape(t, k, -1).astype(jnp.float32) * weights.reshape(t, k, 1), axis=1)
    return y.astype(x_TxD.dtype), jnp.zeros((), jnp.float32)


def _dispatch_ragged(x_TxD, ids_TxK, weights_TxK, kernels, *, activation, num_experts, e_local, ep, exp_axes,
                     products=None, grouped_impl="auto"):
    """_dispatch_tokens with ragged exchanges: only each device's real assignments travel."""
    t, k = ids_TxK.shape
    a_count, d = t * k, x_TxD.shape[1]
    axis = spec_entry(exp_axes)
    ids = ids_TxK.reshape(-1)  # [A], assignment a = token a // K
    order, sizes = sort_by_expert(ids, num_experts)
    per_rank = sizes[:num_experts].reshape(ep, e_local)  # [ep, E_local] my assignments to each device's experts
    send_sizes = jnp.sum(per_rank, axis=1)  # [ep]
    send_offsets = jnp.cumsum(send_sizes) - send_sizes  # device r's rows start here in my sorted rows
    recv_per_expert = jax.lax.all_to_all(per_rank, axis, 0, 0, tiled=True)  # [ep (source), E_local]
    recv_sizes = jnp.sum(recv_per_expert, axis=1)
    recv_ends = jnp.cumsum(recv_sizes)
    recv_offsets = recv_ends - recv_sizes  # source s's rows start here in my receive buffer
    # Where my rows land on each device, and where each source wants its outputs back.
    land_offsets = jax.lax.all_to_all(recv_offsets, axis, 0, 0, tiled=True)
    back_offsets = jax.lax.all_to_all(send_offsets, axis, 0, 0, tiled=True)
    rows = jnp.take(x_TxD, order // k, axis=0)  # [A, D] sorted by expert, so by device
    recv = RAGGED_ALL_TO_ALL(rows, jnp.zeros((ep * a_count, d), x_TxD.dtype), send_offsets, send_sizes,
                             land_offsets, recv_sizes, axis_name=axis)  # [ep x A, D] (worst case: all to me)
    # Received row q: from source s (the first whose rows end after q), local expert by its counts.
    q = jnp.arange(ep * a_count)
    src = jnp.minimum(jnp.sum(q[:, None] >= recv_ends[None, :], axis=1), ep - 1)
    bounds = jnp.cumsum(recv_per_expert, axis=1)[src]  # [ep x A, E_local]
    expert_of_row = jnp.where(q < recv_ends[-1], jnp.sum((q - recv_offsets[src])[:, None] >= bounds, axis=1), e_local)
    order2, sizes2 = sort_by_expert(expert_of_row, e_local + 1)
    out_sorted = expert_ffn(jnp.take(recv, order2, axis=0), sizes2[:e_local], kernels, activation, products,
                            grouped_impl)
    out_recv = jnp.take(out_sorted, jnp.argsort(order2), axis=0)  # [ep x A, D] in the receive layout
    back = RAGGED_ALL_TO_ALL(out_recv, jnp.zeros((a_count, d), out_recv.dtype), recv_offsets, recv_sizes,
                             back_offsets, send_sizes, axis_name=axis)  # [A, D] my sorted assignments' outputs
    out = jnp.take(back, jnp.argsort(order), axis=0)  # [A, D] in assignment order
    y = jnp.sum(out.reshape(t, k, -1).astype(jnp.float32) * weights_TxK.reshape(t, k, 1), axis=1)
    return y.astype(x_TxD.dtype), jnp.zeros((), jnp.float32)


def _dispatch_gathered(x_TxD, ids_TxK, weights_TxK, kernels, *, activation, num_experts, e_local, ep, exp_axes,
                       products=None, grouped_impl="auto"):
    """Dropless, Megatron's allgather dispatcher: the expert group's tokens, routes and weights
    gathered on every device [ep x T, ...], each device's experts' weighted outputs summed per token
    (routed_expert_sum), the partial sums reduce-scattered back to their devices (fp32). No
    worst-case buffers: ep x T token rows move each way, where the padded all_to_all moves ep x T x K."""
    axis = spec_entry(exp_axes)
    x_all, ids_all, weights_all = (jax.lax.all_gather(a, axis, axis=0, tiled=True) for a in (x_TxD, ids_TxK, weights_TxK))
    first = jax.lax.axis_index(axis) * e_local  # this device's experts: first .. first + E_local - 1
    y_all = routed_expert_sum(x_all, ids_all, weights_all, kernels, activation=activation, first=first,
                              products=products, grouped_impl=grouped_impl)  # [ep x T, D] this device's part
    y = jax.lax.psum_scatter(y_all, axis, scatter_dimension=0, tiled=True)
    return y.astype(x_TxD.dtype), jnp.zeros((), jnp.float32)
