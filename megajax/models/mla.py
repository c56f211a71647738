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
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from megajax.config import ModelConfig
from megajax.mesh import logical_constraint
from megajax.models.layers import Dense, LinearOps, RMSNorm, apply_rope

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
        if cfg.q_lora_rank is None:
            self.q = Dense(h, (nh, n + p), axes=("embed", "heads", "head_dim"), dot_general=ops.linear("column"),
                           **common)
        else:
            self.q_down = Dense(h, cfg.q_lora_rank, axes=("embed", None), dot_general=ops.linear("duplicated"), **common)
            self.q_norm = _latent_norm(cfg.q_lora_rank, cfg.norm_eps, dtype)
            self.q_up = Dense(cfg.q_lora_rank, (nh, n + p), axes=(None, "heads", "head_dim"),
                              dot_general=ops.linear("column"), **common)
        self.kv_down = Dense(h, cfg.kv_lora_rank + p, axes=("embed", None), dot_general=ops.linear("duplicated"),
                             **common)
        self.kv_norm = _latent_norm(cfg.kv_lora_rank, cfg.norm_eps, dtype)
        self.kv_up = Dense(cfg.kv_lora_rank, (nh, n + v), axes=(None, "heads", "head_dim"),
                           dot_general=ops.linear("column"), **common)
        self.o = Dense((nh, v), h, axes=("heads", "head_dim", "embed"), dot_general=ops.linear("row"),
                       use_bias=False, dtype=dtype, rngs=rngs, init_std=cfg.init_std / math.sqrt(2 * cfg.num_layers))
        self.dims = (n, p, v)
        self.lora = cfg.q_lora_rank is not None
        self.core = core
        # The fused kernels (flash, cuDNN) take one head dim for q, k and v: v is padded with zeros
        # to q's (N + P) and the output sliced back (`pad_v`).
        self.pad_v = cfg.attention_impl != "xla"
        self.dropout_rate = cfg.attention_dropout

    def qkv(self, x_BxLxD, positions_BxL, inv_freq):
        """q, k [B, L, H, N + P] (rotary parts rotated) and v [B, L, H, V]."""
        n, p, v_dim = self.dims
        if self.lora:
            latent_q = logical_constraint(self.q_down(x_BxLxD), LATENT)
            q = self.q_up(self.q_norm(latent_q))
        else:
            q = self.q(x_BxLxD)
        q = logical_constraint(q, ACT_Q)
        kv = logical_constraint(self.kv_down(x_BxLxD), LATENT)
        latent, k_pe = kv[..., :-p], kv[..., -p:]
        kv = logical_constraint(self.kv_up(self.kv_norm(latent)), ACT_Q)
        k_nope, v = kv[..., :n], kv[..., n:]
        q_pe = deinterleave(q[..., n:])
        k_pe = deinterleave(k_pe)[:, :, None, :]  # one rope key for every head
        if inv_freq is not None:
            q_pe = apply_rope(q_pe, positions_BxL, inv_freq)
            k_pe = apply_rope(k_pe, positions_BxL, inv_freq)
        q = jnp.concatenate([q[..., :n], q_pe.astype(q.dtype)], axis=-1)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe.astype(k_nope.dtype), k_nope.shape[:-1] + (p,))], axis=-1)
        return logical_constraint(q, ACT_Q), logical_constraint(k, ACT_Q), logical_constraint(v, ACT_Q)

    def __call__(self, x_BxLxD, *, positions_BxL, segment_ids_BxL, inv_freq, dropout_rng):
        q, k, v = self.qkv(x_BxLxD, positions_BxL, inv_freq)
        v_dim = v.shape[-1]
        if self.pad_v:
            v = pad_v(v, q.shape[-1])
        # The core's scale is 1 / sqrt(q's head dim) = 1 / sqrt(N + P), multi-latent attention's.
        out = self.core(q, k, v, segment_ids=segment_ids_BxL, causal=True,
                        dropout_rate=self.dropout_rate if dropout_rng is not None else 0.0,
                        dropout_rng=dropout_rng)
        return self.o(logical_constraint(out[..., :v_dim], ACT_Q))

    def extend(self, *args, **kwargs):
        raise NotImplementedError("generation with multi-latent attention (model.multi_latent_attention=true) "
                                  "is not implemented yet: its compressed latent cache is later work")
