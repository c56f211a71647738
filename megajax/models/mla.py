"""Multi-latent attention (DeepSeek-V2/V3; Megatron-Core's `multi_latent_attention`).

Keys are Megatron-Core's: H heads, q_lora_rank Rq (None: no q compression), kv_lora_rank Rkv,
qk_head_dim N (the part of q/k without position), qk_pos_emb_head_dim P (the rotary part),
v_head_dim V.

    q:  x[D] -> q_down [Rq] -> RMSNorm -> q_up [H, N + P]      (or x -> q [H, N + P] when Rq is None)
    kv: x[D] -> kv_down [Rkv + P]: latent c [Rkv] and the shared rope key k_pe [P]
        c -> RMSNorm -> kv_up [H, N + V]: per-head k_nope [N] and v [V]
    k = [k_nope, rope(k_pe)] (k_pe broadcast over the heads), q = [q_nope, rope(q_pe)]
    out = softmax(q . k / sqrt(N + P)) v -> o [D]

The rotary parts rotate interleaved pairs (dims 2i and 2i + 1 by frequency i): they are reordered
to [even dims, odd dims] and rotated as "rotate half", which pairs the same dims (q and k are
reordered alike, so the scores are those of the interleaved rotation). The latent norms use
model.norm_eps. Heads (the up-projections' output, o's input) are split over `tensor` like the
other attention's; the down-projections and the latent are replicated over it (Megatron's
"duplicated" linears). Under FP8 every projection is an FP8 product with its own scaling state
(LinearOps.linear; the down-projections' kind "duplicated"). The attention core takes v at its own head dim (xla, and the context-parallel
ring / all-gather over it); the fused kernels (flash, cuDNN) get v padded to q's head dim (`pad_v`).

Generation (`extend`) caches per token only c = RMSNorm(latent) [Rkv] and the rotated k_pe [P],
and decodes in the absorbed form: q_nope . k_nope = (q_nope W_uk^T) . c with W_uk kv_up's k part,
and each head's output is (probs . c) W_uv, so the cache is never expanded to per-head k and v.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from megajax.config import ModelConfig
from megajax.mesh import logical_constraint
from megajax.models.attention import PagedCache
from megajax.models.lora import adapter
from megajax.models.layers import Dense, LinearOps, RMSNorm, apply_rope, yarn_gains

ACT_Q = ("batch", "length", "heads", "head_dim")
LATENT = ("batch", "length", None)


def deinterleave(x: jax.Array) -> jax.Array:
    """[..., P] -> [even dims, odd dims]: interleaved rotary pairs in "rotate half" order."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def pad_v(v: jax.Array, qk_dim: int) -> jax.Array:
    """v [B, L, H, V] padded with zeros to [B, L, H, qk_dim] (V <= qk_dim, checked when the config
    is loaded), for kernels that take one head dim: the output's first V features are attention over
    the real v (each output feature is its own probability-weighted sum of one v feature), the rest
    zeros, and the padding gets no gradient that reaches anything."""
    return logical_constraint(jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, qk_dim - v.shape[-1]))), ACT_Q)


def _latent_norm(features: int, eps: float, dtype) -> RMSNorm:
    norm = RMSNorm(features, eps=eps, dtype=dtype)
    norm.scale.set_metadata(axes=(None,))  # the latent is replicated (not the hidden `embed` dim)
    return norm


class MultiLatentAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, core: Callable, dtype, ops: LinearOps, rngs: nnx.Rngs):
        h, nh = cfg.hidden_size, cfg.num_heads
        n, p, v = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        common = dict(use_bias=False, dtype=dtype, rngs=rngs, init_std=cfg.init_std)

        def lora(target, i, o, axes, kind):  # model.lora's adapter of one projection (or None)
            return dict(lora=adapter(cfg.lora, target, i, o, axes=axes, kind=kind, dtype=dtype, ops=ops, rngs=rngs))

        q_axes, down_axes, up_axes = ("embed", "heads", "head_dim"), ("embed", None), (None, "heads", "head_dim")
        if cfg.q_lora_rank is None:
            self.q = Dense(h, (nh, n + p), axes=q_axes, dot_general=ops.linear("column", "qkv"),
                           **lora("q_proj", h, (nh, n + p), q_axes, "column"), **common)
        else:
            self.q_down = Dense(h, cfg.q_lora_rank, axes=down_axes, dot_general=ops.linear("duplicated", "qkv"),
                                **lora("q_down_proj", h, cfg.q_lora_rank, down_axes, "duplicated"), **common)
            self.q_norm = _latent_norm(cfg.q_lora_rank, cfg.norm_eps, dtype)
            self.q_up = Dense(cfg.q_lora_rank, (nh, n + p), axes=up_axes, dot_general=ops.linear("column", "qkv"),
                              **lora("q_up_proj", cfg.q_lora_rank, (nh, n + p), up_axes, "column"), **common)
        self.kv_down = Dense(h, cfg.kv_lora_rank + p, axes=down_axes, dot_general=ops.linear("duplicated", "qkv"),
                             **lora("kv_down_proj", h, cfg.kv_lora_rank + p, down_axes, "duplicated"), **common)
        self.kv_norm = _latent_norm(cfg.kv_lora_rank, cfg.norm_eps, dtype)
        self.kv_up = Dense(cfg.kv_lora_rank, (nh, n + v), axes=up_axes, dot_general=ops.linear("column", "qkv"),
                           **lora("kv_up_proj", cfg.kv_lora_rank, (nh, n + v), up_axes, "column"), **common)
        o_axes = ("heads", "head_dim", "embed")
        self.o = Dense((nh, v), h, axes=o_axes, dot_general=ops.linear("row", "out_projection"), **lora("proj", (nh, v), h, o_axes, "row"),
                       use_bias=False, dtype=dtype, rngs=rngs, init_std=cfg.init_std / math.sqrt(2 * cfg.num_layers))
        self.dims = (n, p, v)
        self.rope_gain, self.score_gain = yarn_gains(cfg)  # (1, 1) without YaRN
        self.lora = cfg.q_lora_rank is not None
        self.core = core
        # The fused kernels (flash, cuDNN) take one head dim for q, k and v: v is padded with zeros
        # to q's (N + P) and the output sliced back (`pad_v`).
        self.pad_v = cfg.attention_impl != "xla"
        self.dropout_rate = cfg.attention_dropout

    def qkv(self, x_BxLxD, positions_BxL, inv_freq):
        """q, k [B, L, H, N + P] (rotary parts rotated; q with YaRN's softmax gain) and v [B, L, H, V]:
        the queries and the latent generation caches, k and v expanded from it."""
        q_nope, q_pe = self.queries(x_BxLxD, positions_BxL, inv_freq)
        return self.expand(q_nope, q_pe, *self.latent(x_BxLxD, positions_BxL, inv_freq))

    def expand(self, q_nope, q_pe, c, k_pe):
        """(q, k, v) from the queries and the latent: kv_up(c) gives each head's k_nope and v, the one
        rope key k_pe [B, L, P] is broadcast over the heads."""
        n, p, _ = self.dims
        kv = logical_constraint(self.kv_up(c), ACT_Q)
        k_nope, v = kv[..., :n], kv[..., n:]
        q = jnp.concatenate([q_nope, q_pe], axis=-1)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe[:, :, None].astype(k_nope.dtype), k_nope.shape[:-1] + (p,))],
                            axis=-1)
        return logical_constraint(q, ACT_Q), logical_constraint(k, ACT_Q), logical_constraint(v, ACT_Q)

    def attend(self, q, k, v, *, segment_ids_BxL, dropout_rng):
        """o(the injected core over q, k, v); the fused kernels get v padded to q's head dim (`pad_v`)
        and their output sliced back. The core's scale is 1 / sqrt(q's head dim) = 1 / sqrt(N + P),
        multi-latent attention's."""
        v_dim = v.shape[-1]
        if self.pad_v:
            v = pad_v(v, q.shape[-1])
        out = self.core(q, k, v, segment_ids=segment_ids_BxL, causal=True,
                        dropout_rate=self.dropout_rate if dropout_rng is not None else 0.0,
                        dropout_rng=dropout_rng)
        return self.o(logical_constraint(out[..., :v_dim], ACT_Q))

    def __call__(self, x_BxLxD, *, positions_BxL, segment_ids_BxL, inv_freq, dropout_rng):
        q, k, v = self.qkv(x_BxLxD, positions_BxL, inv_freq)
        return self.attend(q, k, v, segment_ids_BxL=segment_ids_BxL, dropout_rng=dropout_rng)

    # ------------------------------------------------------------------ generation

    def queries(self, x_BxLxD, positions_BxL, inv_freq):
        """(q_nope [B, L, H, N], rotated q_pe [B, L, H, P] in "rotate half" order): `qkv`'s q (with
        YaRN's gains: q_pe's cos/sin gain, and the softmax gain on both parts)."""
        n = self.dims[0]
        q = self.q_up(self.q_norm(logical_constraint(self.q_down(x_BxLxD), LATENT))) if self.lora else self.q(x_BxLxD)
        q = logical_constraint(q, ACT_Q)
        q_nope, q_pe = q[..., :n], deinterleave(q[..., n:])
        if inv_freq is not None:
            q_pe = apply_rope(q_pe, positions_BxL, inv_freq)
        if self.rope_gain != 1.0:  # YaRN's cos/sin scale
            q_pe = q_pe * self.rope_gain
        if self.score_gain != 1.0:  # YaRN's softmax scale: the scores divide by sqrt(N + P) alone
            q_nope, q_pe = q_nope * jnp.asarray(self.score_gain, q.dtype), q_pe * self.score_gain
        return q_nope, q_pe.astype(q.dtype)

    def latent(self, x_BxLxD, positions_BxL, inv_freq):
        """What generation caches per token: (the normalised kv latent c [B, L, Rkv], the rotated
        shared rope key k_pe [B, L, P]); kv_up(c) and k_pe give `qkv`'s k and v."""
        p = self.dims[1]
        kv = logical_constraint(self.kv_down(x_BxLxD), LATENT)
        c = logical_constraint(self.kv_norm(kv[..., :-p]), LATENT)
        k_pe = deinterleave(kv[..., -p:])[:, :, None, :]
        if inv_freq is not None:
            k_pe = apply_rope(k_pe, positions_BxL, inv_freq)
        if self.rope_gain != 1.0:  # YaRN's cos/sin scale
            k_pe = k_pe * self.rope_gain
        return c, logical_constraint(k_pe[:, :, 0].astype(c.dtype), LATENT)

    def extend(self, x_BxLxD, *, positions_BxL, inv_freq, cache_k_BxGxTxK, cache_v_BxGxTxK, start, mask_BxLxT,
               segment_ids_BxL=None):
        """Attention's `extend` for multi-latent attention: the cache holds, per token, the latent c
        (in `cache_k`: [B, T, Rkv]) and the rotated rope key k_pe (in `cache_v`: [B, T, P]), or their
        PagedCache pools [slots, Rkv] / [slots, P]: Rkv + P numbers per token and layer instead of
        H x (N + P + V). Returns (output, cache_k, cache_v).

        A prefill into a dense cache (`segment_ids_BxL` given) expands the new tokens' c through
        kv_up and runs the injected core, as __call__ does. Otherwise the attention is the absorbed
        form, which never expands the cache: with kv_up's kernel split into W_uk [Rkv, H, N] and
        W_uv [Rkv, H, V], q_nope . k_nope = (q_nope W_uk^T) . c, so each query is folded into the
        latent space once (q_lat [H, Rkv]), scores are (q_lat . c + q_pe . k_pe) / sqrt(N + P) over
        the cached tokens, and the heads' outputs are (probs . c) W_uv."""
        n, p, _ = self.dims
        q_nope, q_pe = self.queries(x_BxLxD, positions_BxL, inv_freq)
        c, k_pe = self.latent(x_BxLxD, positions_BxL, inv_freq)
        scale = 1.0 / math.sqrt(n + p)
        if isinstance(cache_k_BxGxTxK, PagedCache) and cache_k_BxGxTxK.blocks_used is not None:
            cache_c, cache_pe = cache_k_BxGxTxK.write(c), cache_v_BxGxTxK.write(k_pe)
            return self._absorbed(q_nope, q_pe, functools.partial(paged_latent_attention, cache_c=cache_c,
                                  cache_pe=cache_pe, mask_BxLxT=mask_BxLxT, scale=scale)), cache_c, cache_pe
        cache_c, all_c = write_latent_cache(cache_k_BxGxTxK, c, start)
        cache_pe, all_pe = write_latent_cache(cache_v_BxGxTxK, k_pe, start)
        if segment_ids_BxL is not None:
            q, k, v = self.expand(q_nope, q_pe, c, k_pe)
            return self.attend(q, k, v, segment_ids_BxL=segment_ids_BxL, dropout_rng=None), cache_c, cache_pe
        return self._absorbed(q_nope, q_pe, functools.partial(
            latent_attention, c_BxTxR=all_c.astype(q_nope.dtype), pe_BxTxP=all_pe.astype(q_nope.dtype),
            mask_BxLxT=mask_BxLxT, scale=scale)), cache_c, cache_pe

    def _absorbed(self, q_nope_BxLxHxN, q_pe_BxLxHxP, attend: Callable):
        """The absorbed form around `attend(q_lat, q_pe) -> probs . c [B, L, H, Rkv]`: o(out)."""
        n = self.dims[0]
        w = self.kv_up.kernel[...].astype(self.kv_up.dtype)  # [Rkv, H, N + V]
        q_lat = jnp.einsum("blhn,rhn->blhr", q_nope_BxLxHxN, w[..., :n], preferred_element_type=jnp.float32)
        q_lat = logical_constraint(q_lat.astype(q_nope_BxLxHxN.dtype), ACT_Q)
        out_lat = attend(q_lat, q_pe_BxLxHxP)
        out = jnp.einsum("blhr,rhv->blhv", out_lat, w[..., n:], preferred_element_type=jnp.float32)
        return self.o(logical_constraint(out.astype(q_nope_BxLxHxN.dtype), ACT_Q))


# One layer's multi-latent cache for generation: the latent c [batch, slots, kv_lora_rank] in cache_k
# and the rope key [batch, slots, qk_pos_emb_head_dim] in cache_v, replicated over `tensor` like the
# latent in training (every head reads all of it); as block pools, [pool slots, features].
LATENT_CACHE = ("batch", "cache_length", None)
LATENT_POOL = (None, None)


def write_latent_cache(cache_BxTxR: jax.Array, new_BxLxR: jax.Array, start):
    """(the cache with L new rows at slots [start, start + L), its view): write_cache's latent form
    (a PagedCache is written through its tables and viewed as [B, T, features])."""
    if isinstance(cache_BxTxR, PagedCache):
        cache = cache_BxTxR.write(new_BxLxR)
        n, r = cache.pool_NxGxK.shape
        b, m = cache.table_BxM.shape
        blocks = cache.pool_NxGxK.reshape(n // cache.block_size, cache.block_size, r)[cache.table_BxM]
        return cache, logical_constraint(blocks.reshape(b, m * cache.block_size, r), LATENT_CACHE)
    cache = jax.lax.dynamic_update_slice(cache_BxTxR, new_BxLxR.astype(cache_BxTxR.dtype), (0, start, 0))
    cache = logical_constraint(cache, LATENT_CACHE)
    return cache, cache


def latent_attention(q_lat_BxLxHxR, q_pe_BxLxHxP, *, c_BxTxR, pe_BxTxP, mask_BxLxT, scale):
    """Absorbed attention of L queries over T cached tokens: probs . c [B, L, H, Rkv] (the softmax and
    its weighted sum of c in fp32: with the probabilities rounded to bf16, bf16 greedy tokens of
    tiny-deepseek-v3 left fp32's within two steps; a row that sees nothing gets a uniform average:
    padding, never used)."""
    scores = (jnp.einsum("blhr,btr->bhlt", q_lat_BxLxHxR, c_BxTxR, preferred_element_type=jnp.float32)
              + jnp.einsum("blhp,btp->bhlt", q_pe_BxLxHxP, pe_BxTxP, preferred_element_type=jnp.float32))
    scores = jnp.where(mask_BxLxT[:, None], scores * scale, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhlt,btr->blhr", probs, c_BxTxR.astype(jnp.float32))
    return out.astype(c_BxTxR.dtype)


def paged_latent_attention(q_lat_BxLxHxR, q_pe_BxLxHxP, *, cache_c: PagedCache, cache_pe: PagedCache, mask_BxLxT,
                           scale):
    """latent_attention over a PagedCache's blocks in use only, an online softmax `step_blocks`
    blocks per trip like paged_attention (and like it, a row's numbers do not depend on the trip
    count: masked scores are -inf); a row that sees nothing gets zeros."""
    b, l, h, r = q_lat_BxLxHxR.shape
    bs, step, m = cache_c.block_size, cache_c.step_blocks, cache_c.table_BxM.shape[1]
    trips_max = -(-m // step)
    table = jnp.pad(cache_c.table_BxM, ((0, 0), (0, trips_max * step - m)))
    mask = jnp.pad(mask_BxLxT, ((0, 0), (0, 0), (0, trips_max * step * bs - mask_BxLxT.shape[2])))
    pools = [x.pool_NxGxK.reshape(x.pool_NxGxK.shape[0] // bs, bs, -1) for x in (cache_c, cache_pe)]
    span = step * bs
    dtype = q_lat_BxLxHxR.dtype

    def trip(i, carry):
        top, total, acc = carry  # [B, H, L], [B, H, L], [B, H, L, Rkv]
        blocks = jax.lax.dynamic_slice_in_dim(table, i * step, step, axis=1)  # [B, step]
        c, pe = (logical_constraint(pool[blocks].reshape(b, span, -1), LATENT_CACHE) for pool in pools)
        seen = jax.lax.dynamic_slice_in_dim(mask, i * span, span, axis=2)  # [B, L, span]
        scores = (jnp.einsum("blhr,btr->bhlt", q_lat_BxLxHxR, c.astype(dtype), preferred_element_type=jnp.float32)
                  + jnp.einsum("blhp,btp->bhlt", q_pe_BxLxHxP, pe.astype(dtype), preferred_element_type=jnp.float32))
        scores = jnp.where(seen[:, None], scores * scale, -jnp.inf)
        new_top = jnp.maximum(top, jnp.max(scores, axis=-1))
        shift = jnp.where(new_top == -jnp.inf, 0.0, new_top)
        keep = jnp.exp(top - shift)
        probs = jnp.exp(scores - shift[..., None])
        total = total * keep + jnp.sum(probs, axis=-1)
        acc = acc * keep[..., None] + jnp.einsum("bhlt,btr->bhlr", probs, c.astype(jnp.float32))
        return new_top, total, acc

    shape = (b, h, l)
    carry = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
             jnp.zeros(shape + (r,), jnp.float32))
    trips = (jnp.minimum(cache_c.blocks_used, m) + step - 1) // step
    _, total, acc = jax.lax.fori_loop(0, trips, trip, carry)
    out = acc / jnp.where(total == 0.0, 1.0, total)[..., None]  # [B, H, L, Rkv]
    return logical_constraint(jnp.swapaxes(out, 1, 2).astype(dtype), ACT_Q)
