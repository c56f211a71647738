"""Self-attention block, with the attention core (the kernel) injected.

Layouts: q [batch, length, heads, head_dim], k/v [batch, length, kv_heads,
head_dim]. Grouped-query attention is computed without repeating k/v: the
query heads are viewed as [kv_heads, group].
"""

from __future__ import annotations

import math
from typing import Callable, Protocol

import jax
import jax.numpy as jnp
from flax import nnx, struct

from megajax.config import ModelConfig
from megajax.mesh import logical_constraint
from megajax.models.layers import Dense, LinearOps, RMSNorm, apply_rope, dropout, softmax
from megajax.models.lora import adapter


class AttentionCore(Protocol):
    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, *, segment_ids: jax.Array | None,
                 causal: bool, dropout_rate: float, dropout_rng: jax.Array | None) -> jax.Array: ...


# The attention probabilities [batch, kv heads, group, query, key].
PROBS = ("batch", "kv_heads", None, "length", None)


def xla_attention(q_BxLxHxK, k_BxTxGxK, v_BxTxGxK, *, segment_ids=None, causal=True,
                  softmax_scale=None, dropout_rate=0.0, dropout_rng=None):
    """Plain-jnp attention: softmax in fp32, causal and document (segment id) masking."""
    b, l, h, d = q_BxLxHxK.shape
    g = k_BxTxGxK.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    q = q_BxLxHxK.reshape(b, l, g, h // g, d)
    scores = jnp.einsum("blgrk,btgk->bgrlt", q, k_BxTxGxK,
                        preferred_element_type=jnp.float32) * scale
    t = k_BxTxGxK.shape[1]
    mask = None
    if causal:
        mask = (jnp.arange(l)[:, None] >= jnp.arange(t)[None, :])[None, None, None]
    if segment_ids is not None:
        same_doc = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None, None]
        mask = same_doc if mask is None else mask & same_doc
    if mask is not None:
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = softmax(scores, axis=-1)
    probs = dropout(probs, dropout_rate, dropout_rng, PROBS).astype(v_BxTxGxK.dtype)
    out = jnp.einsum("bgrlt,btgk->blgrk", probs, v_BxTxGxK)
    return out.reshape(b, l, h, v_BxTxGxK.shape[-1])  # v's head dim may differ from q's (multi-latent)


def xla_attention_with_lse(q_BxLxHxK, k_BxTxGxK, v_BxTxGxK, *, q_segment_ids=None, kv_segment_ids=None,
                           causal=True, softmax_scale=None):
    """Plain-jnp attention that also returns the log-sum-exp of each query row's logits.

    Returns (out [B, L, H, V] in q's dtype, V v's head dim (multi-latent attention's differs from
    q's), lse [B, H, L] fp32; -inf and a zero output for a row that sees no key). Differentiable in
    both outputs (for merging partial results).
    """
    b, l, h, d = q_BxLxHxK.shape
    t, g = k_BxTxGxK.shape[1], k_BxTxGxK.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    q = q_BxLxHxK.reshape(b, l, g, h // g, d)
    scores = jnp.einsum("blgrk,btgk->bgrlt", q, k_BxTxGxK, preferred_element_type=jnp.float32) * scale
    mask = jnp.ones((1, 1, 1, l, t), bool)
    if causal:
        mask = mask & (jnp.arange(l)[:, None] >= jnp.arange(t)[None, :])
    if q_segment_ids is not None:
        mask = mask & (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])[:, None, None]
    m = jax.lax.stop_gradient(jnp.max(jnp.where(mask, scores, -jnp.inf), axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(mask, jnp.exp(scores - m), 0.0)
    total = jnp.sum(e, axis=-1, keepdims=True)
    empty = total == 0.0
    probs = e / jnp.where(empty, 1.0, total)
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, total)))[..., 0]
    out = jnp.einsum("bgrlt,btgk->blgrk", probs.astype(v_BxTxGxK.dtype), v_BxTxGxK)
    return out.reshape(b, l, h, v_BxTxGxK.shape[-1]), lse.reshape(b, h, l)


def flash_attention_core(q, k, v, *, segment_ids=None, causal=True, dropout_rate=0.0, dropout_rng=None):
    """The Pallas flash-attention kernel (interpret mode on CPU)."""
    from pallas_kernels import flash_attention
    assert dropout_rate == 0.0, "flash attention has no dropout (checked when the config is loaded)"
    return flash_attention(q, k, v, causal=causal, segment_ids=segment_ids)


def flash_attention_block(q, k, v, *, q_segment_ids=None, kv_segment_ids=None, causal=True):
    from pallas_kernels import flash_attention_with_lse
    seg = None if q_segment_ids is None else (q_segment_ids, kv_segment_ids)
    return flash_attention_with_lse(q, k, v, causal=causal, segment_ids=seg)


def cudnn_attention_core(q, k, v, *, segment_ids=None, causal=True, dropout_rate=0.0, dropout_rng=None):
    """cuDNN's fused attention through jax.nn.dot_product_attention (GPU only)."""
    assert dropout_rate == 0.0, "cudnn attention has no dropout here (checked when the config is loaded)"
    mask = None
    if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation="cudnn")


def lse_differentiable(attend: Callable, scale: float) -> Callable:
    """attend(q, k, v) -> (out [B, L, H, K], lse [B, H, L] fp32) for a kernel whose own VJP ignores
    lse's cotangent (cuDNN's), made exact in both outputs. The log-sum-exp's part of the gradient,
    with P the attention probabilities and g [B, H, L] lse's cotangent:

        dq_i += scale g_i sum_j P_ij k_j  (the kernel attending to k as values)
        dk_j += scale sum_i P_ij g_i q_i  (the kernel's value gradient for an output cotangent g q)
    """
    out_of = lambda q, k, v: attend(q, k, v)[0]

    @jax.custom_vjp
    def block(q, k, v):
        return attend(q, k, v)

    def fwd(q, k, v):
        return attend(q, k, v), (q, k, v)

    def bwd(res, cts):
        q, k, v = res
        d_out, d_lse = cts
        _, vjp = jax.vjp(out_of, q, k, v)
        dq, dk, dv = vjp(d_out.astype(q.dtype))
        g = jnp.transpose(jnp.where(jnp.isfinite(d_lse), d_lse, 0.0), (0, 2, 1))[..., None]  # [B, L, H, 1]
        keys_seen = out_of(q, k, k).astype(jnp.float32)
        _, vjp_v = jax.vjp(lambda v: out_of(q, k, v), v)
        (dk_lse,) = vjp_v((g * q.astype(jnp.float32)).astype(q.dtype))
        return ((dq + scale * g * keys_seen).astype(q.dtype), (dk + scale * dk_lse.astype(jnp.float32)).astype(k.dtype),
                dv)

    block.defvjp(fwd, bwd)
    return block


def cudnn_attention_block(q, k, v, *, q_segment_ids=None, kv_segment_ids=None, causal=True):
    """(out, lse [B, H, L] fp32) from cuDNN's fused attention (GPU only): the per-block kernel that
    context parallelism merges. JAX's cuDNN binding returns the log-sum-exp (`return_residual`) but
    does not differentiate it; `lse_differentiable` adds that part of the gradient."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn
    scale = 1.0 / math.sqrt(q.shape[-1])
    mask = None if q_segment_ids is None else (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])[:, None]
    kind = cudnn.MaskType.CAUSAL if causal else cudnn.MaskType.NO_MASK

    def attend(q, k, v):
        out, lse = cudnn.dot_product_attention(q, k, v, mask=mask, scale=scale, mask_type=kind, return_residual=True)
        return out, lse.astype(jnp.float32)

    return lse_differentiable(attend, scale)(q, k, v)


# The attention core per model.attention_impl, and the per-block kernel (with log-sum-exp)
# that context parallelism merges over key blocks.
ATTENTION_IMPLS: dict[str, Callable] = {"xla": xla_attention, "flash": flash_attention_core,
                                        "cudnn": cudnn_attention_core}
BLOCK_ATTENTION: dict[str, Callable] = {"xla": xla_attention_with_lse, "flash": flash_attention_block,
                                        "cudnn": cudnn_attention_block}


def make_attention_core(impl: str, recompute: str) -> Callable:
    """The attention core chosen once from config; `selective` recompute wraps it in a checkpoint."""
    core = ATTENTION_IMPLS[impl]
    if recompute != "selective" or impl != "xla":
        return core  # fused kernels already keep only their inputs and the log-sum-exp

    # Megatron's selective recomputation: only QK^T, softmax, dropout and AV are
    # recomputed in the backward pass; their inputs and output are kept.
    def recomputed_core(q, k, v, *, segment_ids, causal, dropout_rate, dropout_rng):
        def f(q, k, v, segment_ids, dropout_rng):
            return core(q, k, v, segment_ids=segment_ids, causal=causal,
                        dropout_rate=dropout_rate, dropout_rng=dropout_rng)
        return jax.checkpoint(f, prevent_cse=False)(q, k, v, segment_ids, dropout_rng)

    return recomputed_core


# One layer's k (or v) cache for generation: [batch, kv_heads, slots, head_dim] (head-major: each
# (sequence, kv head) reads its slots contiguously, without a transposed copy per step).
ACT_CACHE = ("batch", "kv_heads", "cache_length", "head_dim")


def cached_attention(q_BxLxHxK, k_BxGxTxK, v_BxGxTxK, mask_BxLxT):
    """Plain-jnp attention of L new queries over T cache slots (softmax in fp32).

    `mask_BxLxT` says which slots each query sees; a row that sees none gets a uniform average
    (its output is never used: such rows are padding). Grouped-query heads are viewed as
    [kv_heads, group] like xla_attention, without repeating k/v; both products keep (batch,
    kv head) leading, so they read the head-major cache in place."""
    b, l, h, d = q_BxLxHxK.shape
    g = k_BxGxTxK.shape[1]
    q = q_BxLxHxK.reshape(b, l, g, h // g, d)
    scores = jnp.einsum("blgrk,bgtk->bgrlt", q, k_BxGxTxK, preferred_element_type=jnp.float32)
    scores = jnp.where(mask_BxLxT[:, None, None], scores / math.sqrt(d), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BxGxTxK.dtype)
    out = jnp.einsum("bgrlt,bgtk->blgrk", probs, v_BxGxTxK)
    return out.reshape(b, l, h, d)


# One layer's k (or v) block pool: [pool slots, kv_heads, head_dim] (slots = blocks x block size;
# slot-major, so that a position's write and a block's read are contiguous).
ACT_POOL = (None, "kv_heads", "head_dim")


@struct.dataclass
class PagedCache:
    """One layer's k (or v) cache as a pool of fixed-size blocks shared by every sequence, and where
    this call writes and reads it (continuous batching, megajax/inference/engine.py).

    `write_BxL` is the pool slot of each new token (table[pos // block] * block + pos % block; a slot
    outside the pool drops the write: padding); `table_BxM` each sequence's blocks, in position order
    (entries past the sequence's end name any block: the mask hides what they hold). With
    `blocks_used` (a traced int32 scalar: how many leading table entries any row of this call uses),
    the attention reads only those blocks, `step_blocks` at a time (paged_attention); without it,
    every row gathers its whole table (`view`)."""
    pool_NxGxK: jax.Array
    write_BxL: jax.Array
    table_BxM: jax.Array
    block_size: int = struct.field(pytree_node=False)
    blocks_used: jax.Array | None = None
    step_blocks: int = struct.field(pytree_node=False, default=1)
    axes: tuple = struct.field(pytree_node=False, default=ACT_POOL)  # the pool's logical axes

    def write(self, new_BxLxGxK: jax.Array) -> "PagedCache":
        """The pool with the new tokens' rows [B, L, ...per-token shape] at their slots (a
        multi-latent layer's pools hold [slots, features]: megajax/models/mla.py)."""
        new = new_BxLxGxK.astype(self.pool_NxGxK.dtype).reshape((-1,) + self.pool_NxGxK.shape[1:])  # [B*L, ...]
        pool = self.pool_NxGxK.at[self.write_BxL.reshape(-1)].set(new, mode="drop")
        return self.replace(pool_NxGxK=logical_constraint(pool, self.axes))

    def view(self) -> jax.Array:
        """The sequences' caches [B, kv_heads, T, head_dim] (T = M x block size), gathered block by block."""
        n, g, k = self.pool_NxGxK.shape
        b, m = self.table_BxM.shape
        pool = self.pool_NxGxK.reshape(n // self.block_size, self.block_size, g, k)
        blocks = pool[self.table_BxM]  # [B, M, block_size, G, K]
        return logical_constraint(blocks.reshape(b, m * self.block_size, g, k).swapaxes(1, 2), ACT_CACHE)


def paged_attention(q_BxLxHxK, cache_k: PagedCache, cache_v: PagedCache, mask_BxLxT):
    """cached_attention over a PagedCache's blocks in use only: an online softmax over the table's
    first `blocks_used` entries, `step_blocks` blocks per loop trip, in table order (the trip count
    is traced: one compiled program for any length).

    Each row's numbers do not depend on the trip count (that is, on the other rows): masked scores
    are -inf, so a trip whose keys a row cannot see leaves its running max (max(m, -inf) = m), its
    normaliser (x * exp(0) + 0) and its accumulator (x * 1 + 0) exactly as they were. Scores, the
    normaliser and the accumulator are fp32; a row that sees no key gets zeros (padding)."""
    b, l, h, d = q_BxLxHxK.shape
    n, g, k = cache_k.pool_NxGxK.shape
    bs, step, m = cache_k.block_size, cache_k.step_blocks, cache_k.table_BxM.shape[1]
    trips_max = -(-m // step)
    table = jnp.pad(cache_k.table_BxM, ((0, 0), (0, trips_max * step - m)))  # padded entries: masked below
    mask = jnp.pad(mask_BxLxT, ((0, 0), (0, 0), (0, trips_max * step * bs - mask_BxLxT.shape[2])))
    q = q_BxLxHxK.reshape(b, l, g, h // g, d)
    pools = [c.pool_NxGxK.reshape(n // bs, bs, g, k) for c in (cache_k, cache_v)]
    span = step * bs

    def trip(i, carry):
        top, total, acc = carry  # [B, G, R, L], [B, G, R, L], [B, G, R, L, K]
        blocks = jax.lax.dynamic_slice_in_dim(table, i * step, step, axis=1)  # [B, step]
        keys, values = (logical_constraint(p[blocks].reshape(b, span, g, k), ACT_KV) for p in pools)
        seen = jax.lax.dynamic_slice_in_dim(mask, i * span, span, axis=2)  # [B, L, span]
        scores = jnp.einsum("blgrk,btgk->bgrlt", q, keys.astype(q.dtype), preferred_element_type=jnp.float32)
        scores = jnp.where(seen[:, None, None], scores / math.sqrt(d), -jnp.inf)
        new_top = jnp.maximum(top, jnp.max(scores, axis=-1))
        shift = jnp.where(new_top == -jnp.inf, 0.0, new_top)  # nothing seen yet: exp(-inf - 0) = 0 below
        keep = jnp.exp(top - shift)
        probs = jnp.exp(scores - shift[..., None])
        total = total * keep + jnp.sum(probs, axis=-1)
        acc = acc * keep[..., None] + jnp.einsum("bgrlt,btgk->bgrlk", probs, values.astype(jnp.float32))
        return new_top, total, acc

    shape = (b, g, h // g, l)
    carry = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
             jnp.zeros(shape + (d,), jnp.float32))
    trips = (jnp.minimum(cache_k.blocks_used, m) + step - 1) // step
    _, total, acc = jax.lax.fori_loop(0, trips, trip, carry)
    out = acc / jnp.where(total == 0.0, 1.0, total)[..., None]  # [B, G, R, L, K]
    return jnp.moveaxis(out, 3, 1).reshape(b, l, h, d).astype(q_BxLxHxK.dtype)


def write_cache(cache, new_BxLxGxK: jax.Array, start):
    """(the cache with L new k or v rows at slots [start, start + L), its [B, kv_heads, T, head_dim] view):
    a dense per-sequence cache is written in place; a PagedCache through its block tables."""
    if isinstance(cache, PagedCache):
        cache = cache.write(new_BxLxGxK)
        return cache, cache.view()
    cache = jax.lax.dynamic_update_slice(cache, new_BxLxGxK.swapaxes(1, 2).astype(cache.dtype), (0, 0, start, 0))
    cache = logical_constraint(cache, ACT_CACHE)
    return cache, cache


ACT_Q = ("batch", "length", "heads", "head_dim")
RESIDUAL = ("batch", "residual_length", "embed")
ACT_KV = ("batch", "length", "kv_heads", "head_dim")


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, core: Callable, dtype, ops: LinearOps, rngs: nnx.Rngs):
        h, nh, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        common = dict(use_bias=cfg.use_bias, dtype=dtype, rngs=rngs)
        col = dict(common, dot_general=ops.column, init_std=cfg.init_std)
        self.q = Dense(h, (nh, hd), axes=("embed", "heads", "head_dim"), **col)
        self.k = Dense(h, (kv, hd), axes=("embed", "kv_heads", "head_dim"), **col)
        self.v = Dense(h, (kv, hd), axes=("embed", "kv_heads", "head_dim"), **col)
        # Output projection (row-parallel): Megatron's scaled init std / sqrt(2 * layers).
        lora = dict(dtype=dtype, ops=ops, rngs=rngs)
        self.o = Dense((nh, hd), h, axes=("heads", "head_dim", "embed"), dot_general=ops.linear("row", "out_projection"),
                       init_std=cfg.init_std / math.sqrt(2 * cfg.num_layers),
                       lora=adapter(cfg.lora, "proj", (nh, hd), h, axes=("heads", "head_dim", "embed"), kind="row",
                                    **lora), **common)
        self.qkv_product = ops.linear("column", "qkv")  # the fused q/k/v product (`qkv`)
        # model.lora's `qkv`: one A [D, r] for q, k and v, and B [r, G, group + 2, K] laid out as the fused kernel.
        self.qkv_lora = adapter(cfg.lora, "qkv", h, (kv, nh // kv + 2, hd),
                                axes=("embed", "kv_heads", "qkv_slot", "head_dim"), kind="column", **lora)
        # model.qk_norm: per-head RMSNorm of q and k (one [head_dim] scale each, replicated over heads).
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, eps=cfg.norm_eps, dtype=dtype, axis="head_dim")
            self.k_norm = RMSNorm(hd, eps=cfg.norm_eps, dtype=dtype, axis="head_dim")
        else:
            self.q_norm = self.k_norm = None
        self.core = core
        self.dropout_rate = cfg.attention_dropout

    def qkv(self, x_BxLxD, dropout_rng=None):
        """q, k, v from one product with the three kernels side by side per kv group:
        W[D, G, group + 2, K] (q heads of group g, then k and v of g), split over G by tensor
        parallelism like the separate kernels, and one input all-gather under sequence parallelism."""
        d, h, k_dim = self.q.kernel.shape
        g = self.k.kernel.shape[1]
        r = h // g
        w = jnp.concatenate([self.q.kernel[...].reshape(d, g, r, k_dim), self.k.kernel[...][:, :, None],
                             self.v.kernel[...][:, :, None]], axis=2).astype(self.q.dtype)
        out = self.qkv_product(x_BxLxD.astype(self.q.dtype), w, (((2,), (0,)), ((), ())))
        if self.q.bias is not None:
            bias = jnp.concatenate([self.q.bias[...].reshape(g, r, k_dim), self.k.bias[...][:, None],
                                    self.v.bias[...][:, None]], axis=1)
            out = out + bias.astype(out.dtype)
        if self.qkv_lora is not None:
            out = out + self.qkv_lora(x_BxLxD, dropout_rng, RESIDUAL).astype(out.dtype)
        b, l = out.shape[:2]
        return out[:, :, :, :r].reshape(b, l, h, k_dim), out[:, :, :, r], out[:, :, :, r + 1]

    def positioned(self, q, k, positions_BxL, inv_freq):
        """q and k after the projections: their per-head norms (model.qk_norm), then rope."""
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if inv_freq is not None:
            q = apply_rope(q, positions_BxL, inv_freq)
            k = apply_rope(k, positions_BxL, inv_freq)
        return q, k

    def __call__(self, x_BxLxD, *, positions_BxL, segment_ids_BxL, inv_freq, dropout_rng):
        lora_rngs = [None, None] if dropout_rng is None else jax.random.split(jax.random.fold_in(dropout_rng, 1))
        q, k, v = self.qkv(x_BxLxD, lora_rngs[0])
        q = logical_constraint(q, ACT_Q)
        k = logical_constraint(k, ACT_KV)
        v = logical_constraint(v, ACT_KV)
        q, k = self.positioned(q, k, positions_BxL, inv_freq)
        out = self.core(q, k, v, segment_ids=segment_ids_BxL, causal=True,
                        dropout_rate=self.dropout_rate if dropout_rng is not None else 0.0,
                        dropout_rng=dropout_rng)
        out = logical_constraint(out, ACT_Q)
        return self.o(out, lora_rngs[1], ACT_Q)

    def extend(self, x_BxLxD, *, positions_BxL, inv_freq, cache_k_BxGxTxK, cache_v_BxGxTxK, start, mask_BxLxT,
               segment_ids_BxL=None):
        """Attention of L new tokens (cache slots start..start+L-1) over this layer's cache, for generation.

        Writes the new k/v into the cache (ACT_CACHE) at slots [start, start + L) and attends over
        all T slots as `mask_BxLxT` allows; returns (output, cache_k, cache_v). A prefill (the cache
        empty before these tokens) passes `segment_ids_BxL` (1: a token, 0: padding) and runs the
        injected core (the configured kernel) on the new tokens alone, which is the same attention;
        a decode step runs plain jnp over the cache. The same parameters as __call__; q, k and v are
        three products reading their kernels in place (`qkv`'s fused product would copy all three
        on every call). The cache is a dense [B, kv_heads, T, head_dim] array or a PagedCache (then
        `start` only shapes the mask, and the tables say where to write; with its `blocks_used`, the
        attention is paged_attention over the blocks in use, prefill chunks included)."""
        q, k, v = self.q(x_BxLxD), self.k(x_BxLxD), self.v(x_BxLxD)
        if self.qkv_lora is not None:  # unmerged adapters: their [B, L, G, group + 2, K] delta split as qkv's
            delta = self.qkv_lora(x_BxLxD).astype(q.dtype)
            r = delta.shape[3] - 2
            q = q + delta[:, :, :, :r].reshape(q.shape)
            k, v = k + delta[:, :, :, r], v + delta[:, :, :, r + 1]
        q = logical_constraint(q, ACT_Q)
        q, k = self.positioned(q, k, positions_BxL, inv_freq)
        if isinstance(cache_k_BxGxTxK, PagedCache) and cache_k_BxGxTxK.blocks_used is not None:
            cache_k, cache_v = cache_k_BxGxTxK.write(k), cache_v_BxGxTxK.write(v)
            out = logical_constraint(paged_attention(q, cache_k, cache_v, mask_BxLxT), ACT_Q)
            return self.o(out), cache_k, cache_v
        cache_k, keys = write_cache(cache_k_BxGxTxK, k, start)
        cache_v, values = write_cache(cache_v_BxGxTxK, v, start)
        if segment_ids_BxL is not None:
            k, v = logical_constraint(k, ACT_KV), logical_constraint(v, ACT_KV)
            out = self.core(q, k, v, segment_ids=segment_ids_BxL, causal=True, dropout_rate=0.0, dropout_rng=None)
        else:
            out = cached_attention(q, keys.astype(q.dtype), values.astype(q.dtype), mask_BxLxT)
        out = logical_constraint(out, ACT_Q)
        return self.o(out), cache_k, cache_v
