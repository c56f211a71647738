"""Mixture of experts (Mixtral / Megatron-Core style): router, experts, balancing losses.

    x [B, L, D] -> router logits [B, L, E] (fp32) -> top-k -> softmax over the k -> weights [B, L, K]
    y = sum_k weights_k * expert_{id_k}(x)

Routing is "top-k then softmax over the k", equal to Mixtral's "softmax, top-k, renormalise"; with
model.moe_router_pre_softmax "softmax over all experts, top-k" without renormalising; or
with model.moe_router_score_function=sigmoid (DeepSeek-V3) the top-k of sigmoid(logits) weighted
by those scores renormalised over the k. Sigmoid routing can add a per-expert bias to the scores
for the choice alone (aux-loss-free balancing): the bias is training state beside the parameters,
[layers, E] fp32, moved after each step by `updated_expert_bias` from the step's token counts.
Experts are SwiGLU (gate, up, fc2) or GELU (fc1, fc2) MLPs whose kernels are stacked on a
leading `experts` dim: gate/up/fc1 W[E, D, F], fc2 W[E, F, D].

With `moe_shared_expert_ffn_size` S > 0, every token also goes through a shared expert: a dense MLP
of hidden size S with the experts' activation and no biases (megajax.models.mlp.MLP, so tensor
parallelism splits it like the dense MLP), added to the routed output (Megatron-Core's shared
experts):  y = sum_k weights_k * expert_{id_k}(x) + shared(x), or with moe_shared_expert_gate
y = ... + sigmoid(x . w_gate) * shared(x), w_gate [D] a learned per-layer vector.

Token dispatch is injected (`dispatch`), as the attention core is: on one device (or under
XLA's sharding alone) `local_dispatch` sorts the token-expert assignments by expert and runs
every expert with one grouped product (`jax.lax.ragged_dot`), or, in capacity mode, fills
fixed [experts, capacity] buffers and runs batched products; expert parallelism supplies a
dispatch that moves tokens between devices (megajax/parallel/experts.py).

The load-balancing and z losses are not computed here: the layer returns per-expert sums over
its tokens (`RouterStats`) and the train step combines them over the whole batch
(`router_losses`), so the losses do not depend on how the batch is split over devices.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from megajax.config import ModelConfig
from megajax.mesh import alike, like
from megajax.models.layers import LinearOps, normal_init, softmax, softmax_lse
from megajax.models.lora import ExpertLoRA
from megajax.models.mlp import MLP

EXPERT_KERNELS = {"swiglu": ("gate", "up", "fc2"), "gelu": ("fc1", "fc2"), "gelu_tanh": ("fc1", "fc2"),
                  "squared_relu": ("fc1", "fc2")}
# The expert kernels' logical axes: [E, D, F] in, [E, F, D] out. Their hidden dim is `expert_mlp`, not
# the dense MLP's `mlp`: parallel.expert_tensor_parallel gives the experts their own tensor split.
EXPERT_KERNEL_AXES = {"gate": ("experts", "embed", "expert_mlp"), "up": ("experts", "embed", "expert_mlp"),
                      "fc1": ("experts", "embed", "expert_mlp"), "fc2": ("experts", "expert_mlp", "embed")}


class RouterStats(NamedTuple):
    """Sums over a layer's tokens (fp32); add them over shards to get the whole batch's."""
    probs: jax.Array  # [E] sum of per-token probabilities (router_stats): the balancing loss's differentiable part
    tokens: jax.Array  # [E] token-expert assignments routed to each expert (no gradient)
    balance_tokens: jax.Array  # [E] the balancing loss's counts: `tokens`, or the unbiased top-k's with an expert bias
    lse_sq: jax.Array  # [] sum of logsumexp(logits)^2 (z-loss)
    count: jax.Array  # [] tokens
    dropped: jax.Array  # [] assignments dropped by the expert capacity (0 when dropless)


def expert_ffn(x_MxD: jax.Array, group_sizes_G: jax.Array, kernels: dict, activation: str,
               products: dict | None = None, impl: str = "auto") -> jax.Array:
    """Rows of x sorted by expert (group g = rows of expert g; rows past the groups give 0) through
    their experts' MLPs: [M, D] -> [M, D]. kernels: gate/up/fc1 [G, D, F], fc2 [G, F, D];
    `products`: per kernel name, a product with `grouped(x, w, sizes)` (FP8's: it runs its own grouped
    product whatever `impl`) or None; `impl`: model.moe_grouped_gemm_impl (ragged_dot | tiled | auto)."""
    if products is None and grouped_gemm_impl(impl) == "tiled":
        return expert_ffn_tiled(x_MxD, group_sizes_G, kernels, activation)

    def grouped(a, w, name):
        if products is not None:
            return products[name].grouped(a, w, group_sizes_G)
        return jax.lax.ragged_dot(a, w, group_sizes_G)

    first = EXPERT_KERNELS[activation][:-1]
    hidden = _hidden({name: grouped(x_MxD, kernels[name], name) for name in first}, activation)
    return grouped(hidden, kernels["fc2"], "fc2")


# Rows per tile of the tiled grouped product (`moe_grouped_gemm_impl=tiled`): each expert's rows are
# padded to a multiple of this, so every tile is one expert's.
GROUPED_GEMM_TILE = 64


def grouped_gemm_impl(impl: str) -> str:
    """model.moe_grouped_gemm_impl resolved: `auto` is `tiled` on XLA:CPU (whose ragged_dot runs every
    group's product over all rows) and `ragged_dot` elsewhere (a grouped GEMM on GPU and TPU)."""
    if impl == "auto":
        return "tiled" if jax.default_backend() == "cpu" else "ragged_dot"
    return impl


def tile_layout(group_sizes_G: jax.Array, rows: int, tile: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Rows sorted by group, each group padded to whole tiles, N = ceil(rows / tile) + G tiles (the
    most any group sizes summing to <= rows need): (src [N x tile]: the row each padded slot holds,
    `rows` for padding; dest [rows]: each row's slot, N x tile for rows past the groups; tile's group
    [N]; tile live [N]: holds rows of a group)."""
    g = group_sizes_G.shape[0]
    n = -(-rows // tile) + g
    sizes = group_sizes_G.astype(jnp.int32)
    tiles = (sizes + tile - 1) // tile
    tile_end = jnp.cumsum(tiles)
    tile_start = tile_end - tiles
    row_end = jnp.cumsum(sizes)
    row_start = row_end - sizes
    tile_group = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(n), side="right", method="compare_all"),
                             g - 1).astype(jnp.int32)
    live = jnp.arange(n) < tile_end[-1]
    slot = jnp.arange(n * tile)
    grp = tile_group[slot // tile]
    offset = slot - tile_start[grp] * tile
    src = jnp.where(live[slot // tile] & (offset < sizes[grp]), row_start[grp] + offset, rows)
    r = jnp.arange(rows)
    row_group = jnp.minimum(jnp.searchsorted(row_end, r, side="right", method="compare_all"), g - 1)
    dest = jnp.where(r < row_end[-1], tile_start[row_group] * tile + r - row_start[row_group], n * tile)
    return src, dest, tile_group, live


def _hidden(pre: dict, activation: str) -> jax.Array:
    """An expert MLP's hidden activations from its first products (gate and up, or fc1)."""
    if activation == "swiglu":
        return jax.nn.silu(pre["gate"]) * pre["up"]
    if activation == "squared_relu":
        return jnp.square(jax.nn.relu(pre["fc1"]))
    return jax.nn.gelu(pre["fc1"], approximate=activation == "gelu_tanh")


def _tile_mlp(x_TxD: jax.Array, w: dict, activation: str) -> jax.Array:
    """One tile's rows through one expert's MLP (w: that expert's kernels)."""
    first = EXPERT_KERNELS[activation][:-1]
    return (_hidden({name: x_TxD @ w[name] for name in first}, activation) @ w["fc2"]).astype(x_TxD.dtype)


def _index(a: jax.Array, g: jax.Array) -> jax.Array:
    """a[g] for a non-negative traced g (no index correction)."""
    return jax.lax.dynamic_index_in_dim(a, g, keepdims=False, allow_negative_indices=False)


def _expert_kernels(kernels: dict, g: jax.Array) -> dict:
    return {name: _index(k, g) for name, k in kernels.items()}


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _tiles_through_experts(x_NxTxD, kernels, tile_group_N, live_tiles, activation):
    """Tile n < live_tiles through expert tile_group[n]'s MLP, 0 past them: [N, T, D] -> [N, T, D].
    A loop over the live tiles alone (its trip count is data: the custom vjp keeps autodiff out)."""
    def body(n, y_NxTxD):
        x_TxD = jax.lax.dynamic_index_in_dim(x_NxTxD, n, keepdims=False)
        y_TxD = _tile_mlp(x_TxD, _expert_kernels(kernels, tile_group_N[n]), activation)
        return jax.lax.dynamic_update_index_in_dim(y_NxTxD, y_TxD, n, 0)
    return jax.lax.fori_loop(0, live_tiles, body, jnp.zeros_like(x_NxTxD))


def _tiles_fwd(x_NxTxD, kernels, tile_group_N, live_tiles, activation):
    return _tiles_through_experts(x_NxTxD, kernels, tile_group_N, live_tiles, activation), \
        (x_NxTxD, kernels, tile_group_N, live_tiles)


def _tiles_bwd(activation, res, dy_NxTxD):
    """Per live tile: its forward again and its vjp; the kernels' gradients accumulate in place into
    their expert's slice (autodiff of a loop would add a whole [E, D, F] gradient per tile)."""
    x_NxTxD, kernels, tile_group_N, live_tiles = res

    def body(n, carry):
        dx_NxTxD, dw = carry
        g = tile_group_N[n]
        x_TxD, dy_TxD = (jax.lax.dynamic_index_in_dim(a, n, keepdims=False) for a in (x_NxTxD, dy_NxTxD))
        _, vjp = jax.vjp(lambda x, w: _tile_mlp(x, w, activation), x_TxD, _expert_kernels(kernels, g))
        dx_TxD, dw_g = vjp(dy_TxD)
        dw = {name: jax.lax.dynamic_update_index_in_dim(
            acc, jax.lax.dynamic_index_in_dim(acc, g, keepdims=False) + dw_g[name], g, 0)
            for name, acc in dw.items()}
        return jax.lax.dynamic_update_index_in_dim(dx_NxTxD, dx_TxD, n, 0), dw

    dw0 = {name: jnp.zeros_like(k) for name, k in kernels.items()}
    dx_NxTxD, dw = jax.lax.fori_loop(0, live_tiles, body, (jnp.zeros_like(x_NxTxD), dw0))
    return dx_NxTxD, dw, None, None


_tiles_through_experts.defvjp(_tiles_fwd, _tiles_bwd)


def expert_ffn_tiled(x_MxD: jax.Array, group_sizes_G: jax.Array, kernels: dict, activation: str,
                     tile: int = GROUPED_GEMM_TILE) -> jax.Array:
    """expert_ffn by tiles: the rows padded so that every `tile` rows are one expert's, then a loop over
    the tiles, each through its expert's MLP (kernels indexed in place, no per-tile copies; tiles
    past the groups skipped): batched-matmul work, rows + G x (tile - 1) rows at most."""
    m, d = x_MxD.shape
    src, dest, tile_group, live = tile_layout(group_sizes_G, m, tile)
    n = tile_group.shape[0]
    x_MxD, kernels, tile_group, live_tiles = alike(x_MxD, kernels, tile_group, jnp.sum(live).astype(jnp.int32))
    x_NxTxD = jnp.take(x_MxD, src, axis=0, mode="fill", fill_value=0).reshape(n, tile, d)
    y_NxTxD = _tiles_through_experts(x_NxTxD, kernels, tile_group, live_tiles, activation)
    return jnp.take(y_NxTxD.reshape(n * tile, -1), dest, axis=0, mode="fill", fill_value=0)


_ROWS = jax.lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,))
_ADD_ROWS = jax.lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(0,),
                                            scatter_dims_to_operand_dims=(0,))


def _rows(x_TxD: jax.Array, tokens_S: jax.Array) -> jax.Array:
    """Rows of x by token index, an index past the rows giving the last row (XLA's clamped gather: no
    bounds checks; the tile loops give such padding slots weight 0 and drop their outputs)."""
    return jax.lax.gather(x_TxD, tokens_S[:, None], _ROWS, (1, x_TxD.shape[1]),
                          mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def _add_rows(y_TxD: jax.Array, tokens_S: jax.Array, rows_SxD: jax.Array) -> jax.Array:
    """y with each row of `rows_SxD` added into its token's row; an index past the rows adds nothing."""
    return jax.lax.scatter_add(y_TxD, tokens_S[:, None], rows_SxD, _ADD_ROWS,
                               mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


def _slice(a: jax.Array, n: jax.Array, size: int) -> jax.Array:
    """a[n x size : (n + 1) x size] (the loop's index is never negative: no index correction)."""
    return jax.lax.dynamic_slice_in_dim(a, n * size, size, allow_negative_indices=False)


def _slot_tokens(assignment_S: jax.Array, weights_TxK: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Slots' tokens and weights from their assignments (a = token x K + choice; T x K: padding,
    token T, weight 0), computed once for all slots outside the tile loops."""
    k = weights_TxK.shape[1]
    # unsigned division: the floor of these non-negative indices without sign corrections; the
    # padding assignment T x K gives token T, and weight 0 from the zero appended to the weights
    tokens = jax.lax.div(assignment_S.astype(jnp.uint32), jnp.uint32(k)).astype(assignment_S.dtype)
    padded = jnp.concatenate([weights_TxK.reshape(-1, 1), jnp.zeros((1, 1), weights_TxK.dtype)])  # [A + 1, 1]
    return tokens, _rows(padded, assignment_S)[:, 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _routed_tiles(x_TxD, weights_TxK, kernels, assignment_S, tile_group_N, live_tiles, activation, tile):
    """y [T, D] fp32 = sum over the slots s of tiles n < live_tiles of
    w[a] * MLP_{tile_group[n]}(x[a // K]), a = assignment_S[s], w = weights_TxK flattened, slot s of
    tile n = s // tile; a = T x K is a padding slot. The slots' tokens and weights are gathered once;
    each tile gathers its rows, runs its expert's MLP and adds its weighted outputs into their
    tokens: no [slots, D] buffers, work in proportion to the live tiles, and only the assignments
    kept for the backward pass."""
    tokens_S, w_S = _slot_tokens(assignment_S, weights_TxK)

    def body(n, y_TxD):
        tokens, w = _slice(tokens_S, n, tile), _slice(w_S, n, tile)
        k = _expert_kernels(kernels, _slice(tile_group_N, n, 1)[0])
        out = _tile_mlp(_rows(x_TxD, tokens), k, activation)
        return _add_rows(y_TxD, tokens, out.astype(jnp.float32) * w[:, None])
    return jax.lax.fori_loop(0, live_tiles, body, like(jnp.zeros(x_TxD.shape, jnp.float32), x_TxD))


def _routed_fwd(x_TxD, weights_TxK, kernels, assignment_S, tile_group_N, live_tiles, activation, tile):
    y = _routed_tiles(x_TxD, weights_TxK, kernels, assignment_S, tile_group_N, live_tiles, activation, tile)
    return y, (x_TxD, weights_TxK, kernels, assignment_S, tile_group_N, live_tiles)


def _routed_bwd(activation, tile, res, dy_TxD):
    """Per live tile: its first products again (gate and up, or fc1; keeping them from the forward
    would take [slots, ffn] buffers of the worst case), g = dy W2^T, the hidden layer's gradient
    w g and the weight's <hidden, g> (the output itself is not recomputed); the rows' gradients
    added into their tokens, the kernels' into their expert's slice, in place, the slots' weights'
    gradients written per slot and added into their assignments after the loop. A padding slot
    (weight 0, a clamped row) adds 0 to the rows and kernels; its weight's gradient is dropped."""
    x_TxD, weights_TxK, kernels, assignment_S, tile_group_N, live_tiles = res
    first = EXPERT_KERNELS[activation][:-1]
    tokens_S, w_S = _slot_tokens(assignment_S, weights_TxK)

    def body(n, carry):
        dx_TxD, dw_S, dk = carry
        g = _slice(tile_group_N, n, 1)[0]
        tokens, w = _slice(tokens_S, n, tile), _slice(w_S, n, tile)
        k = _expert_kernels(kernels, g)
        x = _rows(x_TxD, tokens)
        hidden, hidden_vjp = jax.vjp(lambda p: _hidden(p, activation), {name: x @ k[name] for name in first})
        dy = _rows(dy_TxD, tokens)  # [tile, D] fp32
        grad_h = jnp.dot(dy.astype(x.dtype), k["fc2"].T, preferred_element_type=jnp.float32)  # d<out, dy>/d hidden
        dw = jnp.sum(hidden.astype(jnp.float32) * grad_h, axis=-1)
        (dpre,) = hidden_vjp((grad_h * w[:, None]).astype(x.dtype))
        dk_g = {"fc2": hidden.T @ (dy * w[:, None]).astype(x.dtype)}
        dk_g.update({name: x.T @ dpre[name] for name in first})
        dx = sum(dpre[name] @ k[name].T for name in first)
        dk = {name: jax.lax.dynamic_update_index_in_dim(
            acc, _index(acc, g) + dk_g[name].astype(acc.dtype), g, 0, allow_negative_indices=False)
            for name, acc in dk.items()}
        dw_S = jax.lax.dynamic_update_slice_in_dim(dw_S, dw.astype(dw_S.dtype), n * tile, 0,
                                                   allow_negative_indices=False)
        return _add_rows(dx_TxD, tokens, dx.astype(dx_TxD.dtype)), dw_S, dk

    carry = (jnp.zeros_like(x_TxD), jnp.zeros_like(w_S), {name: jnp.zeros_like(k) for name, k in kernels.items()})
    dx_TxD, dw_S, dk = jax.lax.fori_loop(0, live_tiles, body, carry)
    dw_A = _add_rows(jnp.zeros_like(weights_TxK.reshape(-1, 1)), assignment_S, dw_S[:, None])
    return dx_TxD, dw_A.reshape(weights_TxK.shape), dk, None, None, None


_routed_tiles.defvjp(_routed_fwd, _routed_bwd)


def routed_expert_sum(x_TxD: jax.Array, ids_TxK: jax.Array, weights_TxK: jax.Array, kernels: dict, *,
                      activation: str, first: jax.Array | int = 0, products: dict | None = None,
                      grouped_impl: str = "auto", tile: int = GROUPED_GEMM_TILE) -> jax.Array:
    """y [T, D] fp32 = sum over each token's assignments to the experts held here (ids first ..
    first + G - 1, kernels [G, ...]) of weight x expert(x); the other assignments add nothing.

    `tiled` (model.moe_grouped_gemm_impl): the assignments sorted by expert and padded to whole
    tiles, a loop over the live tiles that gathers each tile's rows and adds its outputs into their
    tokens (`_routed_tiles`). Otherwise (ragged_dot, FP8's products): the sorted rows gathered, one
    grouped product per kernel (`expert_ffn`), the outputs back in assignment order."""
    t, k = ids_TxK.shape
    g = next(iter(kernels.values())).shape[0]
    a = t * k  # assignment a = token a // K
    local = ids_TxK.reshape(-1) - first
    local = jnp.where((local >= 0) & (local < g), local, g)  # group G: not here
    if products is None and grouped_gemm_impl(grouped_impl) == "tiled":
        assignment, tile_group, live_tiles = routed_slots(local, g, tile)
        x_TxD, weights_TxK, kernels, assignment, tile_group, live_tiles = alike(
            x_TxD, weights_TxK, kernels, assignment, tile_group, live_tiles)
        return _routed_tiles(x_TxD, weights_TxK, kernels, assignment, tile_group, live_tiles, activation, tile)
    order, sizes = sort_by_expert(local, g + 1)
    rows = jnp.take(x_TxD, order // k, axis=0)  # [A, D] sorted by expert
    out_sorted = expert_ffn(rows, sizes[:g], kernels, activation, products, grouped_impl)  # others' rows: 0
    out = jnp.take(out_sorted, jnp.argsort(order), axis=0)  # [A, D] in assignment order
    return jnp.sum(out.reshape(t, k, -1).astype(jnp.float32) * weights_TxK[..., None], axis=1)


def routed_slots(group_A: jax.Array, g: int, tile: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The assignments sorted by group (0 .. g - 1; g: none of them, left out), each group padded to
    whole tiles, N = ceil(A / tile) + g tiles: (assignment [N x tile]: the assignment each slot
    holds, A for padding; tile's group [N]; live tiles []). One stable sort, each assignment's slot
    its sorted position shifted by its group's padding before it, one scatter into the slots."""
    a = group_A.shape[0]
    n = -(-a // tile) + g
    sorted_A, order_A = jax.lax.sort((group_A, jnp.arange(a, dtype=jnp.int32)), num_keys=1, is_stable=True)
    below = group_A[:, None] < jnp.arange(1, g + 1, dtype=group_A.dtype)  # [A, g]: in a group < g' + 1
    row_end = jnp.sum(below, axis=0, dtype=jnp.int32)  # [g]
    sizes = row_end - jnp.concatenate([jnp.zeros((1,), jnp.int32), row_end[:-1]])
    tile_end = jnp.cumsum((sizes + tile - 1) // tile)
    # sorted position p of group e -> slot p + (tile_start[e] x tile - row_start[e]); group g past the slots
    shift = jnp.concatenate([(tile_end - (sizes + tile - 1) // tile) * tile - (row_end - sizes),
                             jnp.full((1,), n * tile, jnp.int32)])
    slot = jnp.arange(a, dtype=jnp.int32) + jax.lax.gather(
        shift, sorted_A[:, None], jax.lax.GatherDimensionNumbers(offset_dims=(), collapsed_slice_dims=(0,),
                                                                  start_index_map=(0,)), (1,),
        mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)
    assignment = jax.lax.scatter(
        jnp.full((n * tile,), a, jnp.int32), slot[:, None], order_A,
        jax.lax.ScatterDimensionNumbers(update_window_dims=(), inserted_window_dims=(0,),
                                        scatter_dims_to_operand_dims=(0,)),
        indices_are_sorted=True, unique_indices=True, mode=jax.lax.GatherScatterMode.FILL_OR_DROP)
    tile_group = jnp.minimum(jnp.sum(tile_end[None, :] <= jnp.arange(n, dtype=jnp.int32)[:, None], axis=1,
                                     dtype=jnp.int32), g - 1)
    return assignment, tile_group, tile_end[-1]


def sort_by_expert(ids_A: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """(order [A]: assignments sorted by expert, stable; group sizes [E] int32)."""
    order = jnp.argsort(ids_A, stable=True)
    sizes = jnp.zeros((num_experts,), jnp.int32).at[ids_A].add(1)
    return order, sizes


def capacity(num_tokens: int, topk: int, num_experts: int, factor: float) -> int:
    """Assignments each expert accepts from `num_tokens` tokens (Megatron's rule)."""
    return max(1, math.ceil(num_tokens * topk / num_experts * factor))


def capacity_slots(ids_A: jax.Array, num_experts: int, cap: int) -> tuple[jax.Array, jax.Array]:
    """(slot [A] in the [experts x cap] buffer, or experts x cap when dropped; kept [A] bool): an
    expert keeps its first `cap` assignments in token order; later ones are dropped and their
    tokens pass through the residual only."""
    order, sizes = sort_by_expert(ids_A, num_experts)
    starts = jnp.cumsum(sizes) - sizes
    rank_sorted = jnp.arange(ids_A.shape[0]) - starts[ids_A[order]]
    rank = jnp.zeros_like(rank_sorted).at[order].set(rank_sorted)
    keep = rank < cap
    return jnp.where(keep, ids_A * cap + rank, num_experts * cap), keep


def expert_ffn_buffers(x_GxCxD: jax.Array, kernels: dict, activation: str, products: dict | None = None) -> jax.Array:
    """Fixed-size buffers (group g = expert g's rows) through their experts: batched products
    (`products`: per kernel name, one with `batched(x, w)`, FP8's, or None)."""
    def product(a, w, name):
        if products is not None:
            return products[name].batched(a, w)
        return jnp.einsum("gcd,gdf->gcf", a, w)

    first = EXPERT_KERNELS[activation][:-1]
    hidden = _hidden({name: product(x_GxCxD, kernels[name], name) for name in first}, activation)
    return product(hidden, kernels["fc2"], "fc2")


def capacity_dispatch(x_TxD: jax.Array, ids_TxK: jax.Array, weights_TxK: jax.Array, kernels: dict, *,
                      activation: str, num_experts: int, capacity_factor: float, ep: int = 1,
                      exchange: Callable = lambda buf: buf, products: dict | None = None) -> tuple[jax.Array, jax.Array]:
    """Capacity mode: (y [T, D], dropped assignments []) with fixed [experts, capacity] buffers.

    Experts are held by `ep` devices (E / ep each, contiguous); `exchange` is the all-to-all over
    them ([ep, E/ep x C, D] -> the same shape, slot r to/from device r; identity on one device)."""
    t, k = ids_TxK.shape
    e, d = num_experts, x_TxD.shape[-1]
    cap = capacity(t, k, e, capacity_factor)
    slot, keep = capacity_slots(ids_TxK.reshape(-1), e, cap)
    rows = jnp.repeat(x_TxD, k, axis=0)  # [A, D], assignment a = token a // K
    send = jnp.zeros((e * cap, d), x_TxD.dtype).at[slot].set(rows, mode="drop")
    recv = exchange(send.reshape(ep, e // ep * cap, d))  # [ep (source), E_local x C, D]
    by_expert = recv.reshape(ep, e // ep, cap, d).transpose(1, 0, 2, 3).reshape(e // ep, ep * cap, d)
    out = expert_ffn_buffers(by_expert, kernels, activation, products)
    back = exchange(out.reshape(e // ep, ep, cap, d).transpose(1, 0, 2, 3).reshape(ep, e // ep * cap, d))
    out_rows = jnp.take(back.reshape(e * cap, d), slot, axis=0, mode="fill", fill_value=0)  # dropped: 0
    y = jnp.sum(out_rows.reshape(t, k, d).astype(jnp.float32) * weights_TxK[..., None], axis=1)
    return y.astype(x_TxD.dtype), jnp.sum(~keep).astype(jnp.float32)


def local_dispatch(x_TxD: jax.Array, ids_TxK: jax.Array, weights_TxK: jax.Array, kernels: dict, *,
                   activation: str, num_experts: int, capacity_factor: float | None,
                   products: dict | None = None, grouped_impl: str = "auto") -> tuple[jax.Array, jax.Array]:
    """Every token through its top-k experts on this device: (y [T, D], dropped assignments [])."""
    if capacity_factor is not None:
        return capacity_dispatch(x_TxD, ids_TxK, weights_TxK, kernels, activation=activation,
                                 num_experts=num_experts, capacity_factor=capacity_factor, products=products)
    y = routed_expert_sum(x_TxD, ids_TxK, weights_TxK, kernels, activation=activation, products=products,
                          grouped_impl=grouped_impl)
    return y.astype(x_TxD.dtype), jnp.zeros((), jnp.float32)


def make_local_dispatch(activation: str, num_experts: int, capacity_factor: float | None,
                        grouped_impl: str = "auto") -> Callable:
    """dispatch(x [B, L, D], ids [B, L, K], weights [B, L, K], kernels, products=None) -> (y [B, L, D],
    dropped); `products`: the experts' FP8 products by kernel name, or None."""
    def dispatch(x_BxLxD, ids_BxLxK, weights_BxLxK, kernels, products=None):
        b, l, d = x_BxLxD.shape
        y, dropped = local_dispatch(x_BxLxD.reshape(b * l, d), ids_BxLxK.reshape(b * l, -1),
                                    weights_BxLxK.reshape(b * l, -1), kernels, activation=activation,
                                    num_experts=num_experts, capacity_factor=capacity_factor, products=products,
                                    grouped_impl=grouped_impl)
        return y.reshape(b, l, d), dropped
    return dispatch


def _topk_ids(scores_TxE: jax.Array, topk: int) -> jax.Array:
    """Expert ids [..., K] int32 of the k largest scores, best first (ties: the lower expert id, as
    lax.top_k), as k rounds of argmax: XLA partitions these reductions along the token dims, where
    its top_k gathers a token-sharded input first."""
    e = scores_TxE.shape[-1]
    rest, ids = scores_TxE, []
    for _ in range(topk):
        i = jnp.argmax(rest, axis=-1).astype(jnp.int32)
        ids.append(i)
        rest = jnp.where(jax.nn.one_hot(i, e, dtype=jnp.bool_), -jnp.inf, rest)
    return jnp.stack(ids, axis=-1)


def group_limited(scores_TxE: jax.Array, topk: int, num_groups: int, group_topk: int) -> jax.Array:
    """The scores with the experts outside each token's `group_topk` best groups set to -inf
    (device/node-limited routing, DeepSeek-V2/V3): the E experts form `num_groups` groups of
    consecutive ids, a group's score is the sum of its topk / group_topk best scores."""
    e = scores_TxE.shape[-1]
    grouped = scores_TxE.reshape(scores_TxE.shape[:-1] + (num_groups, e // num_groups))
    best = jnp.sum(jnp.take_along_axis(grouped, _topk_ids(grouped, topk // group_topk), axis=-1), axis=-1)  # [..., G]
    chosen = jnp.sum(jax.nn.one_hot(_topk_ids(best, group_topk), num_groups, dtype=jnp.int32), axis=-2) > 0
    return jnp.where(jnp.repeat(chosen, e // num_groups, axis=-1), scores_TxE, -jnp.inf)


def route(logits_TxE: jax.Array, topk: int, score_function: str = "softmax", expert_bias_E: jax.Array | None = None,
          scaling_factor: float | None = None, groups: tuple[int, int] | None = None,
          pre_softmax: bool = False) -> tuple[jax.Array, jax.Array]:
    """(expert ids [..., K] int32, weights [..., K] fp32) from fp32 router logits.

    softmax: the top-k logits, softmax over the k. sigmoid: scores sigmoid(logits); the top-k of
    scores + `expert_bias_E` (the bias steers the choice only), weighted by their unbiased scores,
    normalised to sum 1 when k > 1. `scaling_factor` (None: 1) multiplies the weights. `groups`
    (num_groups, group_topk): the top-k is taken within each token's best groups (group_limited
    of what the top-k is taken of), as Megatron-Core's moe_router_num_groups / group_topk.
    `pre_softmax` (softmax only): the top-k of softmax over all experts, weighted by those
    probabilities as they are (Megatron-Core's moe_router_pre_softmax)."""
    def topk_ids(x):
        return _topk_ids(x if groups is None else group_limited(x, topk, *groups), topk)

    if score_function == "softmax" and pre_softmax:
        probs = softmax(logits_TxE)
        ids = topk_ids(probs)
        weights = jnp.take_along_axis(probs, ids, axis=-1)
    elif score_function == "softmax":
        ids = topk_ids(logits_TxE)
        weights = softmax(jnp.take_along_axis(logits_TxE, ids, axis=-1))
    else:
        scores = jax.nn.sigmoid(logits_TxE)
        ids = topk_ids(scores if expert_bias_E is None else scores + expert_bias_E)
        weights = jnp.take_along_axis(scores, ids, axis=-1)
        if topk > 1:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    if scaling_factor is not None:
        weights = weights * scaling_factor
    return ids, weights


def router_stats(logits_TxE: jax.Array, ids_TxK: jax.Array, dropped: jax.Array, score_function: str = "softmax",
                 biased: bool = False) -> RouterStats:
    """The layer's RouterStats. The balancing loss's probabilities are softmax(logits), or for sigmoid
    the scores normalised over the experts; its counts are the routed assignments, or, when those
    were chosen otherwise (`biased`: an expert bias or group-limited routing), those of the plain
    top-k of the scores (as Megatron-Core: the bias and the groups are outside the loss)."""
    e, k = logits_TxE.shape[-1], ids_TxK.shape[-1]
    softmax_TxE, lse = softmax_lse(logits_TxE)
    if score_function == "softmax":
        probs = scores = softmax_TxE
    else:
        scores = jax.nn.sigmoid(logits_TxE)
        probs = scores / (jnp.sum(scores, axis=-1, keepdims=True) + 1e-20)

    def counts(ids):
        # A sum of one-hots, not a scatter: a token-sharded batch reduces its partial counts (e experts).
        return jax.lax.stop_gradient(jnp.sum(jax.nn.one_hot(ids, e, dtype=jnp.float32), axis=(0, 1)))

    tokens = counts(ids_TxK)
    balance = counts(_topk_ids(jax.lax.stop_gradient(scores), k)) if biased else tokens
    return RouterStats(probs=jnp.sum(probs, axis=0), tokens=tokens, balance_tokens=balance,
                       lse_sq=jnp.sum(jnp.square(lse)), count=jnp.float32(logits_TxE.shape[0]),
                       dropped=jax.lax.stop_gradient(dropped))


def router_losses(local: RouterStats, total_tokens: jax.Array, total_count: jax.Array,
                  cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """(load-balancing loss, z-loss) of each layer [layers], this shard's share: summed over the
    shards of a batch they give the batch's losses.

    Switch/GShard balancing loss, Megatron-Core's formula with T the batch's tokens, f_e the batch's
    assignments to expert e and P_e the sum of softmax probabilities of expert e:
        aux = coeff * E / (K * T^2) * sum_e P_e * f_e
    The counts f are the whole batch's (`total_tokens`, [layers, E]); the probabilities this shard's,
    so the gradient of every token's probabilities is the batch's. z-loss = coeff * mean_t lse_t^2.
    """
    e, k = cfg.num_experts, cfg.moe_router_topk
    t = total_count  # [layers]
    aux = cfg.moe_aux_loss_coeff * e / (k * t * t) * jnp.sum(local.probs * total_tokens, axis=-1)
    z = cfg.moe_z_loss_coeff * local.lse_sq / t
    return aux, z


def updated_expert_bias(bias_LxE: jax.Array, tokens_LxE: jax.Array, rate: float) -> jax.Array:
    """The expert bias after a step: each expert's bias moves by `rate` toward balance, up when the
    expert got fewer than the mean assignments of its layer, down when more (0 when equal).
    `tokens_LxE`: the step's assignments per expert, over all microbatches and devices."""
    mean = jnp.mean(tokens_LxE, axis=-1, keepdims=True)
    return bias_LxE + rate * jnp.sign(mean - tokens_LxE)


class MoE(nnx.Module):
    """Router + experts (+ the shared expert) in place of the MLP of a block; `ops` are the shared
    expert's products (the dense MLP's)."""

    def __init__(self, cfg: ModelConfig, *, dtype, dispatch: Callable | None, rngs: nnx.Rngs,
                 ops: LinearOps = LinearOps()):
        e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_ffn_hidden_size
        self.topk, self.activation, self.dtype = cfg.moe_router_topk, cfg.activation, dtype
        self.score_function, self.scaling_factor = cfg.moe_router_score_function, cfg.moe_router_topk_scaling_factor
        self.groups = (cfg.moe_router_num_groups, cfg.moe_router_group_topk) if cfg.moe_router_group_topk else None
        self.pre_softmax = cfg.moe_router_pre_softmax
        self.router = nnx.Param(normal_init(rngs.params(), (d, e), cfg.init_std), axes=("embed", "expert_scores"))
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        shapes = {"gate": ((e, d, f), cfg.init_std), "up": ((e, d, f), cfg.init_std),
                  "fc1": ((e, d, f), cfg.init_std), "fc2": ((e, f, d), out_std)}
        for name in EXPERT_KERNELS[cfg.activation]:
            shape, std = shapes[name]
            setattr(self, name, nnx.Param(normal_init(rngs.params(), shape, std), axes=EXPERT_KERNEL_AXES[name]))
        # model.lora's `experts`: per-expert adapters of the first kernel(s) (gate and up under SwiGLU: one A,
        # B [E, r, F, 2]) and of fc2, merged into the kernels in the step (ExpertLoRA).
        experts = cfg.lora is not None and "experts" in cfg.lora.target_names()
        swiglu = cfg.activation == "swiglu"
        self.experts_fc1_lora = (ExpertLoRA(e, d, (f, 2) if swiglu else (f,), in_axis="embed",
                                            out_axes=("expert_mlp", "gate_up") if swiglu else ("expert_mlp",),
                                            cfg=cfg.lora,
                                            rngs=rngs) if experts else None)
        self.experts_fc2_lora = (ExpertLoRA(e, f, (d,), in_axis="expert_mlp", out_axes=("embed",), cfg=cfg.lora, rngs=rngs)
                                 if experts else None)
        self.dispatch = dispatch or make_local_dispatch(cfg.activation, e, cfg.moe_expert_capacity_factor,
                                                            cfg.moe_grouped_gemm_impl)
        # The experts' products with their own scaling state (FP8), one per kernel (`gate_product`, ...).
        self.fp8_experts = ops.in_low_precision("experts")
        for name in EXPERT_KERNELS[cfg.activation] if self.fp8_experts else ():
            setattr(self, f"{name}_product", ops.low_precision(None, "column"))
        # Drawn after the experts: a model without one initialises as before.
        self.shared_experts = (MLP(dataclasses.replace(cfg, ffn_hidden_size=cfg.moe_shared_expert_ffn_size,
                                                       use_bias=False), dtype=dtype, ops=ops, rngs=rngs)
                               if cfg.moe_shared_expert_ffn_size else None)
        if cfg.moe_shared_expert_gate:
            self.shared_expert_gate = nnx.Param(normal_init(rngs.params(), (d,), cfg.init_std), axes=("embed",))
        else:
            self.shared_expert_gate = None

    def forward(self, x_BxLxD: jax.Array, expert_bias_E: jax.Array | None = None,
                fused: bool = True) -> tuple[jax.Array, RouterStats]:
        """(y [B, L, D], RouterStats); `expert_bias_E` [E] fp32: the router's expert bias (sigmoid
        routing with model.moe_router_bias_update_rate > 0), None without one; `fused` as for MLP
        (the shared expert's gate and up)."""
        b, l, d = x_BxLxD.shape
        logits = jnp.einsum("bld,de->ble", x_BxLxD.astype(jnp.float32), self.router[...].astype(jnp.float32))
        bias = None if expert_bias_E is None else jax.lax.stop_gradient(expert_bias_E.astype(jnp.float32))
        ids, weights = route(logits, self.topk, self.score_function, bias, self.scaling_factor, self.groups,
                             self.pre_softmax)
        kernels = self.expert_kernels()
        products = ({name: getattr(self, f"{name}_product") for name in EXPERT_KERNELS[self.activation]}
                    if self.fp8_experts else None)
        y, dropped = self.dispatch(x_BxLxD.astype(self.dtype), ids, weights, kernels, products)
        if self.shared_experts is not None:
            shared = self.shared_experts(x_BxLxD, fused)
            if self.shared_expert_gate is not None:  # a per-token scalar in (0, 1), from fp32 logits
                score = jax.nn.sigmoid(jnp.einsum("bld,d->bl", x_BxLxD.astype(jnp.float32),
                                                  self.shared_expert_gate[...].astype(jnp.float32)))
                shared = shared * score[..., None].astype(shared.dtype)
            y = y + shared.astype(y.dtype)
        stats = router_stats(logits.reshape(b * l, -1), ids.reshape(b * l, -1), dropped, self.score_function,
                             biased=bias is not None or self.groups is not None)
        return y, stats

    def expert_kernels(self) -> dict:
        """The routed experts' kernels by name in the compute dtype, model.lora's `experts` adapters merged in."""
        kernels = {name: getattr(self, name)[...] for name in EXPERT_KERNELS[self.activation]}
        if self.experts_fc1_lora is not None:
            if self.activation == "swiglu":
                both = self.experts_fc1_lora.merged(jnp.stack([kernels["gate"], kernels["up"]], axis=-1))
                kernels["gate"], kernels["up"] = both[..., 0], both[..., 1]
            else:
                kernels["fc1"] = self.experts_fc1_lora.merged(kernels["fc1"])
            kernels["fc2"] = self.experts_fc2_lora.merged(kernels["fc2"])
        return {name: k.astype(self.dtype) for name, k in kernels.items()}

    def __call__(self, x_BxLxD: jax.Array, fused: bool = True, expert_bias_E: jax.Array | None = None) -> jax.Array:
        return self.forward(x_BxLxD, expert_bias_E, fused)[0]
