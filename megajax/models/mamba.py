"""The Mamba-2 mixer (SSD) of hybrid models (Megatron-Core's MambaMixer, Nemotron-H's mixer).

    x [B, L, D] -> in_proj: z, x [heads, head_dim], B, C [groups, state], dt [heads]
                -> causal depthwise conv (width model.mamba_conv_kernel, with bias) over x, B, C, then SiLU
                -> dt = clamp(softplus(dt + dt_bias)), A = -exp(A_log)
                -> y = SSD(x, dt, A, B, C) + D x                  (state per head [head_dim, state])
                -> RMSNorm(y * SiLU(z)) over each group's heads (norm after the gate), x weight
                -> out_proj -> [B, L, D]

Each part of in_proj is its own column-parallel product and its own parameter (`z`, `x`, `B`, `C`,
`dt`), so tensor parallelism splits each part by heads or groups as Megatron splits its fused
in_proj part by part; the conv, `A_log`, `D`, `dt_bias` and the norm weight are split by heads (the
conv of B and C by groups), the grouped norm needs no communication (a group's heads are on one
shard: model.mamba_num_groups must divide over mesh.tensor), and `out` is row-parallel. Parameter
logical axes: `heads`, `head_dim`, `ssm_groups`, `ssm_state`, `conv`.

Context parallelism (the sequence split over mesh.context) turns sequence shards into head shards
around the conv and the scan (`sequence_mixer`, injected: megajax/parallel/context.py); on one
device it is the identity.

Packed sequences (segment ids [B, L], each document one run of equal ids): a document neither reads
nor leaves anything to another. The conv's taps that reach into another document are zero (as if
each document started after K - 1 zeros), and the scan's state resets where a document starts
(pallas_kernels/ssd.py: the decay across the boundary is zero). Without segment ids neither is traced.

The decode state of a layer (generation) is its conv window, the last conv_kernel - 1 inputs of the
conv [B, conv_kernel - 1, channels] per part, and the SSM state [B, heads, head_dim, state]: constant
in the sequence length. A call of `extend` may hold padding (`valid_BxL` false: a batched prompt's
left padding, the tail of a prefill chunk, a finished row): a padded token enters neither the conv
nor the scan (its x, B and C are zero before the conv and its dt is zero, so the state is carried
through it unchanged), and the window after the call holds the inputs up to the last real token.
Left padding before a fresh state and padding after the real tokens are both exact: the zeros a
padded input leaves in the window are those of a fresh state. The continuous engine keeps one state
per batch row (`MambaSlots`: read and written through the rows of the call, zeroed when a new
sequence takes the row).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from megajax.config import ModelConfig
from megajax.mesh import logical_constraint
from megajax.models.layers import Dense, LinearOps
from megajax.models.lora import adapter
from pallas_kernels.ssd import CHUNK_STATES, ssd_chunked

ACT_HEADS = ("batch", "length", "heads", "head_dim")
ACT_GROUPS = ("batch", "length", "ssm_groups", "ssm_state")
ACT_DT = ("batch", "length", "heads")
RESIDUAL = ("batch", "residual_length", "embed")


class MambaState(NamedTuple):
    """One Mamba layer's decode state: the conv windows of x [B, K-1, heads, head_dim], B and C
    [B, K-1, groups, state] (the last K - 1 inputs, oldest first) and the SSM state
    [B, heads, head_dim, state] (fp32)."""
    conv_x: jax.Array
    conv_B: jax.Array
    conv_C: jax.Array
    ssm: jax.Array


def causal_conv(x_BxLx_: jax.Array, w_xK: jax.Array, bias: jax.Array, window: jax.Array | None = None,
                end_B: jax.Array | None = None, segment_ids_BxL: jax.Array | None = None, silu: bool = False):
    """Depthwise causal conv along the sequence: out[t] = sum_k w[k] x[t + k - (K - 1)] + bias, the
    channels any trailing dims of x (w [channels..., K], bias [channels...]); `window` [B, K-1, ...]:
    the inputs before x (zeros when None). Returns (out in fp32, the K - 1 inputs before position
    `end_B` [B] of each row (default L: the last K - 1), the window a continuation reads).
    `segment_ids_BxL` (no window): a tap reaching a token of another document reads zero. `silu`: the
    output is SiLU(conv), its gradient written with the conv's (recomputing the conv, keeping only
    its input)."""
    k = w_xK.shape[-1]
    b, l = x_BxLx_.shape[:2]
    if window is None:
        window = jnp.zeros((b, k - 1) + x_BxLx_.shape[2:], x_BxLx_.dtype)
    elif segment_ids_BxL is not None:
        raise ValueError("causal_conv: segment ids continue no window (a packed batch starts every document afresh)")
    xp = jnp.concatenate([window.astype(x_BxLx_.dtype), x_BxLx_], axis=1).astype(jnp.float32)
    w = jnp.moveaxis(w_xK.astype(jnp.float32), -1, 0)  # [K, channels...]
    same = None
    if segment_ids_BxL is not None:  # tap i reads position t - (K - 1 - i): zero unless it is in t's document
        seg = jnp.concatenate([jnp.repeat(segment_ids_BxL[:, :1], k - 1, axis=1), segment_ids_BxL], axis=1)
        same = jnp.stack([seg[:, i:i + l] == segment_ids_BxL for i in range(k)])  # [K, B, L]
        same = same.reshape(same.shape + (1,) * (xp.ndim - 2))
    out = _conv_taps(xp, w, bias.astype(jnp.float32), same, silu)
    if end_B is None:
        return out, xp[:, l:].astype(x_BxLx_.dtype)
    at = (end_B[:, None] + jnp.arange(k - 1)).reshape((b, k - 1) + (1,) * (xp.ndim - 2))  # [B, K-1, 1...]
    return out, jnp.take_along_axis(xp, at, axis=1).astype(x_BxLx_.dtype)


def _tap_sum(xp, w_Kx_, same=None):
    """sum_i tap_i w[i], tap i = xp[:, i:i + L] (zero where `same[i]` [K, B, L, 1...] is false)."""
    k = w_Kx_.shape[0]
    l = xp.shape[1] - (k - 1)
    tap = lambda i: xp[:, i:i + l] if same is None else jnp.where(same[i], xp[:, i:i + l], 0.0)
    return sum(tap(i) * w_Kx_[i] for i in range(k))


def _tap_sum_bwd(xp, w_Kx_, same, g):
    """The gradients of _tap_sum for its output's cotangent g: of xp (each tap's g w[i] put back at
    its offset) and of w (each tap's g tap_i summed over batch and sequence)."""
    k = w_Kx_.shape[0]
    l = g.shape[1]
    gs = [g if same is None else jnp.where(same[i], g, 0.0) for i in range(k)]
    pad = lambda v, i: jnp.pad(v, [(0, 0), (i, k - 1 - i)] + [(0, 0)] * (v.ndim - 2))
    d_xp = sum(pad(gs[i] * w_Kx_[i], i) for i in range(k))
    d_w = jnp.sum(jnp.stack(gs) * jnp.stack([xp[:, i:i + l] for i in range(k)]), axis=(1, 2))  # one reduction
    return d_xp, d_w


# The conv's taps (plus bias, and SiLU with `silu`) with a hand-written gradient: autodiff would keep
# each of the K shifted copies of the input for the weights' gradient, and the conv's output for
# SiLU's; this keeps the input once and recomputes the rest (a smaller compiled step). SiLU is
# x / (1 + exp(-x)): ending in a division, XLA computes it once for all its users rather than
# inside each of them. `same`: the taps' document masks, or None.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _conv_taps(xp, w_Kx_, bias, same, silu: bool):
    out = _tap_sum(xp, w_Kx_, same) + bias
    return out / (1 + jnp.exp(-out)) if silu else out


def _conv_taps_bwd(silu, res, g):
    xp, w, bias, same = res
    if silu:  # SiLU'(x) = s (1 + x (1 - s)), s = sigmoid(x)
        out = _tap_sum(xp, w, same) + bias
        s = jax.nn.sigmoid(out)
        g = g * s * (1 + out * (1 - s))
    d_xp, d_w = _tap_sum_bwd(xp, w, same, g)
    return d_xp, d_w, jnp.sum(g, axis=(0, 1)), None


_conv_taps.defvjp(lambda xp, w, bias, same, silu: (_conv_taps(xp, w, bias, same, silu), (xp, w, bias, same)),
                  _conv_taps_bwd)


def gated_group_norm(y_BxLxHxP: jax.Array, z_BxLxHxP: jax.Array, weight_HxP: jax.Array, groups: int,
                     eps: float) -> jax.Array:
    """RMSNorm(y * SiLU(z)) over each group's heads x head_dim (Mamba-2's gated norm, norm after the
    gate, grouped by the B/C groups), times the weight; fp32."""
    return _gated_norm(y_BxLxHxP.astype(jnp.float32), z_BxLxHxP.astype(jnp.float32), weight_HxP.astype(jnp.float32),
                       groups, eps)


def _gated_normed(y, z, groups: int, eps: float):
    """(RMSNorm(y * SiLU(z)) per group [B, L, G, F], its rsqrt [B, L, G, 1])."""
    b, l, h, p = y.shape
    g = (y * jax.nn.silu(z)).reshape(b, l, groups, h // groups * p)
    r = jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + eps)
    return g * r, r


# The gated norm with a hand-written gradient that keeps only y and z (autodiff keeps the gate, the
# gated input and the normed output besides: a smaller compiled step).
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gated_norm(y, z, weight, groups: int, eps: float):
    return _gated_normed(y, z, groups, eps)[0].reshape(y.shape) * weight


def _gated_norm_fwd(y, z, weight, groups, eps):
    return _gated_norm(y, z, weight, groups, eps), (y, z, weight)


def _gated_norm_bwd(groups, eps, res, d_out):
    y, z, weight = res
    b, l, h, p = y.shape
    n, r = _gated_normed(y, z, groups, eps)
    d_weight = jnp.sum(d_out * n.reshape(y.shape), axis=(0, 1))
    d_n = (d_out * weight).reshape(n.shape)
    # n = g r with r = (mean g^2 + eps)^-1/2: dg = r (dn - n mean(dn n))
    d_g = (r * (d_n - n * jnp.mean(d_n * n, axis=-1, keepdims=True))).reshape(y.shape)
    sig = jax.nn.sigmoid(z)
    return d_g * z * sig, d_g * y * sig * (1 + z * (1 - sig)), d_weight


_gated_norm.defvjp(_gated_norm_fwd, _gated_norm_bwd)


def _uniform(key, shape, bound):
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


class Mamba2Mixer(nnx.Module):
    """The Mamba-2 mixer: [B, L, D] -> [B, L, D]. `sequence_mixer(mix, x, B, C, dt, weights,
    segment_ids)` runs mix (sequence_mix) over the whole sequence (context parallelism's all-to-all;
    None: call it as is); `ssd` the chunked scan (pallas_kernels/ssd.py). `recompute` = selective: the sequence mixing
    keeps only its inputs and the scan's chunk states for the backward (the conv, the intra-chunk
    quadratic forms and the outputs are recomputed)."""

    def __init__(self, cfg: ModelConfig, *, dtype, ops: LinearOps, rngs: nnx.Rngs,
                 sequence_mixer: Callable | None = None, ssd: Callable | None = None, recompute: str = "none"):
        d, h, p = cfg.hidden_size, cfg.mamba_num_heads, cfg.mamba_head_dim
        g, n, k = cfg.mamba_num_groups, cfg.mamba_state_dim, cfg.mamba_conv_kernel
        col = dict(dtype=dtype, rngs=rngs, init_std=cfg.init_std, use_bias=False)
        self.z = Dense(d, (h, p), axes=("embed", "heads", "head_dim"), dot_general=ops.column, **col)
        self.x = Dense(d, (h, p), axes=("embed", "heads", "head_dim"), dot_general=ops.column, **col)
        self.B = Dense(d, (g, n), axes=("embed", "ssm_groups", "ssm_state"), dot_general=ops.column, **col)
        self.C = Dense(d, (g, n), axes=("embed", "ssm_groups", "ssm_state"), dot_general=ops.column, **col)
        self.dt = Dense(d, h, axes=("embed", "heads"), dot_general=ops.column, **col)
        self.in_product = ops.linear("column", "mamba_in_proj")  # in_proj: the parts as one product (`in_proj`)
        # dt's own product where it runs in another precision than z, x, B and C (FP8 keeps the dt
        # projection in bf16 by default: precision.fp8_bf16_products); None: dt is part of in_proj's.
        self.dt_product = (ops.linear("column", "mamba_dt")
                           if ops.in_low_precision("mamba_in_proj") != ops.in_low_precision("mamba_dt") else None)
        # model.lora's `in_proj`: one A [D, r] for the five parts, B [r, G, z | x | B | C | dt] laid out as
        # the fused kernel (split over tensor by groups like it); `out_proj`: the row-parallel out's.
        lora = dict(dtype=dtype, ops=ops, rngs=rngs)
        self.in_proj_lora = adapter(cfg.lora, "in_proj", d, (g, (2 * p + 1) * (h // g) + 2 * n),
                                    axes=("embed", "ssm_groups", "in_proj_part"), kind="column", **lora)
        bound = 1.0 / math.sqrt(k)  # PyTorch's conv1d default init (fan in = the kernel width)
        self.conv_x = nnx.Param(_uniform(rngs.params(), (h, p, k), bound), axes=("heads", "head_dim", "conv"))
        self.conv_x_bias = nnx.Param(_uniform(rngs.params(), (h, p), bound), axes=("heads", "head_dim"))
        self.conv_B = nnx.Param(_uniform(rngs.params(), (g, n, k), bound), axes=("ssm_groups", "ssm_state", "conv"))
        self.conv_B_bias = nnx.Param(_uniform(rngs.params(), (g, n), bound), axes=("ssm_groups", "ssm_state"))
        self.conv_C = nnx.Param(_uniform(rngs.params(), (g, n, k), bound), axes=("ssm_groups", "ssm_state", "conv"))
        self.conv_C_bias = nnx.Param(_uniform(rngs.params(), (g, n), bound), axes=("ssm_groups", "ssm_state"))
        # dt drawn log-uniformly in [dt_min, dt_max] (floored at 1e-4), dt_bias its softplus inverse;
        # A in [1, 16] as A_log; D = 1 (Mamba-2's initialisation).
        u = jax.random.uniform(rngs.params(), (h,), jnp.float32)
        dt0 = jnp.maximum(jnp.exp(u * (math.log(cfg.mamba_dt_max) - math.log(cfg.mamba_dt_min))
                                  + math.log(cfg.mamba_dt_min)), 1e-4)
        self.dt_bias = nnx.Param(dt0 + jnp.log(-jnp.expm1(-dt0)), axes=("heads",))
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (h,), jnp.float32, 1.0, 16.0)),
                               axes=("heads",))
        self.D = nnx.Param(jnp.ones((h,), jnp.float32), axes=("heads",))
        self.norm = nnx.Param(jnp.ones((h, p), jnp.float32), axes=("heads", "head_dim"))
        self.out = Dense((h, p), d, axes=("heads", "head_dim", "embed"), dot_general=ops.linear("row", "mamba_out_proj"),
                         dtype=dtype, rngs=rngs, init_std=cfg.init_std / math.sqrt(2 * cfg.num_layers), use_bias=False,
                         lora=adapter(cfg.lora, "out_proj", (h, p), d, axes=("heads", "head_dim", "embed"), kind="row",
                                      **lora))
        self.eps, self.chunk = cfg.norm_eps, cfg.mamba_chunk_size
        self.dt_limit = (float(cfg.mamba_time_step_min),
                         None if cfg.mamba_time_step_max is None else float(cfg.mamba_time_step_max))
        self.dtype = dtype
        self.sequence_mixer = sequence_mixer
        self.ssd = ssd or ssd_chunked
        self.recompute = recompute

    def _split(self, out_BxLxGxF):
        """(z, x, B, C, dt) of in_proj's output laid out per group [B, L, G, z | x | B | C | dt]."""
        h, p = self.z.kernel.shape[1:]
        g, n = self.B.kernel.shape[1:]
        r = h // g
        b, l = out_BxLxGxF.shape[:2]
        z, xs, bm, cm, dt = jnp.split(out_BxLxGxF, np.cumsum([r * p, r * p, n, n]), axis=3)
        return (z.reshape(b, l, h, p), xs.reshape(b, l, h, p), bm, cm, dt.reshape(b, l, h))

    def in_proj(self, x_BxLxD, dropout_rng=None):
        """(z, x, B, C, dt) from one product whose kernel holds the five parts side by side per group:
        W[D, G, z | x | B | C | dt of the group's heads] (the heads of group g are g's consecutive
        H / G), split over G by tensor parallelism like the separate kernels: one input all-gather
        under sequence parallelism, one reduction of the input's gradient. An `in_proj` adapter adds
        its [B, L, G, F] delta, laid out alike."""
        d, h, p = self.z.kernel.shape
        g, n = self.B.kernel.shape[1:]
        r = h // g
        parts = [self.z.kernel[...].reshape(d, g, r * p), self.x.kernel[...].reshape(d, g, r * p),
                 self.B.kernel[...], self.C.kernel[...], self.dt.kernel[...].reshape(d, g, r)]
        x, dims = x_BxLxD.astype(self.z.dtype), (((2,), (0,)), ((), ()))
        if self.dt_product is None:
            out = self.in_product(x, jnp.concatenate(parts, axis=2).astype(self.z.dtype), dims)  # [B, L, G, F]
        else:  # z | x | B | C in one product, dt in its own, laid out as the fused product's output
            out = jnp.concatenate([self.in_product(x, jnp.concatenate(parts[:4], axis=2).astype(self.z.dtype), dims),
                                   self.dt_product(x, parts[4].astype(self.z.dtype), dims)], axis=3)
        if self.in_proj_lora is not None:
            out = out + self.in_proj_lora(x_BxLxD, dropout_rng, RESIDUAL).astype(out.dtype)
        return self._split(out)

    def projections(self, x_BxLxD, fused: bool = True, dropout_rng=None):
        """(z, x, B, C, dt): in_proj's five parts (`fused=False`: five products reading the kernels in
        place, for generation, an adapter's delta split alike)."""
        if fused:
            z, xs, b, c, dt = self.in_proj(x_BxLxD, dropout_rng)
        else:
            z, xs, b, c, dt = (self.z(x_BxLxD), self.x(x_BxLxD), self.B(x_BxLxD), self.C(x_BxLxD),
                               self.dt(x_BxLxD))
            if self.in_proj_lora is not None:
                delta = self._split(self.in_proj_lora(x_BxLxD).astype(z.dtype))
                z, xs, b, c, dt = (u + v for u, v in zip((z, xs, b, c, dt), delta))
        return (logical_constraint(z, ACT_HEADS), logical_constraint(xs, ACT_HEADS), logical_constraint(b, ACT_GROUPS),
                logical_constraint(c, ACT_GROUPS), logical_constraint(dt, ACT_DT))

    def weights(self) -> dict:
        """The parameters of the sequence mixing (conv, time steps, A, D), by name."""
        return {name: getattr(self, name)[...] for name in SEQUENCE_WEIGHTS}

    def __call__(self, x_BxLxD: jax.Array, segment_ids_BxL: jax.Array | None = None,
                 dropout_rng: jax.Array | None = None) -> jax.Array:
        """`segment_ids_BxL`: the documents of a packed batch (module docstring), or None;
        `dropout_rng`: the adapters' input dropout key (model.lora.dropout), None in evaluation."""
        rngs = [None, None] if dropout_rng is None else jax.random.split(dropout_rng)
        z, xs, b, c, dt = self.projections(x_BxLxD, dropout_rng=rngs[0])
        mix = functools.partial(sequence_mix, chunk=self.chunk, dt_limit=self.dt_limit, ssd=self.ssd)
        if self.recompute == "selective":
            mix = jax.checkpoint(mix, prevent_cse=False,
                                 policy=jax.checkpoint_policies.save_only_these_names(CHUNK_STATES))
        if self.sequence_mixer is None:
            y = mix(xs, b, c, dt, self.weights(), segment_ids=segment_ids_BxL)
        else:
            y = self.sequence_mixer(mix, xs, b, c, dt, self.weights(), segment_ids_BxL)
        # b's groups: this shard's (tensor parallelism holds whole groups with their heads)
        y = gated_group_norm(y, z, self.norm[...], b.shape[2], self.eps).astype(self.dtype)
        return self.out(logical_constraint(y, ACT_HEADS), rngs[1], ACT_HEADS)

    def extend(self, x_BxLxD: jax.Array, state, reset_B: jax.Array | None = None,
               valid_BxL: jax.Array | None = None):
        """__call__ for L new tokens continuing `state` (generation): (y [B, L, D], the new state).
        `state`: a MambaState [B, ...], or the continuous engine's MambaSlots (its own rows, resets and
        valid tokens; returned updated). `reset_B`: rows whose state starts afresh (a new sequence in
        a reused slot); `valid_BxL`: the real tokens (None: all), padding skipped (module docstring)."""
        if isinstance(state, MambaSlots):
            y, new = self.extend(x_BxLxD, state.read(), valid_BxL=state.valid_BxL)
            return y, state.write(new)
        if reset_B is not None:
            state = jax.tree.map(lambda s: jnp.where(reset_B.reshape((-1,) + (1,) * (s.ndim - 1)), 0, s), state)
        z, xs, b, c, dt = self.projections(x_BxLxD, fused=False)
        y, new = sequence_mix(xs, b, c, dt, self.weights(), chunk=self.chunk, dt_limit=self.dt_limit, ssd=self.ssd,
                              state=state, valid_BxL=valid_BxL)
        y = gated_group_norm(y, z, self.norm[...], b.shape[2], self.eps).astype(self.dtype)
        return self.out(y), new


SEQUENCE_WEIGHTS = ("conv_x", "conv_x_bias", "conv_B", "conv_B_bias", "conv_C", "conv_C_bias", "dt_bias", "A_log", "D")


def sequence_mix(xs, b, c, dt, w: dict, *, chunk: int, dt_limit: tuple, ssd: Callable, state: MambaState | None = None,
                 valid_BxL: jax.Array | None = None, segment_ids: jax.Array | None = None):
    """The part of the mixer that runs along the sequence, for the heads of xs [B, L, h, P] (B, C
    [B, L, g, N] their groups, dt [B, L, h]; `w` the weights of those heads and groups, SEQUENCE_WEIGHTS):
    causal conv and SiLU of x, B, C, dt = clamp(softplus(dt + dt_bias)), the SSD scan with
    A = -exp(A_log) and the D skip -> y [B, L, h, P] fp32. With a decode `state`: (y, the new state);
    `valid_BxL` (with a state): padding enters neither the conv nor the scan, and the new window ends
    at each row's last real token. `segment_ids` [B, L] (without a state): the documents of a packed
    batch, neither conv nor scan crossing a boundary."""
    end = None
    if valid_BxL is not None:
        xs, b, c = (jnp.where(valid_BxL[:, :, None, None], v, 0) for v in (xs, b, c))
        end = jnp.max(jnp.where(valid_BxL, jnp.arange(1, valid_BxL.shape[1] + 1), 0), axis=1)  # [B]
    (xs, b, c), (wx, wb, wc) = _conv_xbc(xs, b, c, w, None if state is None else state, end, segment_ids)
    dt = jax.nn.softplus(dt.astype(jnp.float32) + w["dt_bias"].astype(jnp.float32))
    lo, hi = dt_limit
    if lo > 0 or hi is not None:
        dt = jnp.clip(dt, lo, hi)
    if valid_BxL is not None:  # dt = 0: exp(dt A) = 1 and no input, the state carried through unchanged
        dt = jnp.where(valid_BxL[:, :, None], dt, 0.0)
    a = -jnp.exp(w["A_log"].astype(jnp.float32))
    if state is None:
        documents = {} if segment_ids is None else {"segment_ids": segment_ids}
        y = ssd(xs, dt, a, b, c, chunk_size=chunk, **documents)
        return y.astype(jnp.float32) + xs * w["D"].astype(jnp.float32)[:, None]
    if xs.shape[1] == 1:  # a decode step: the recurrence itself (a chunked scan would pad it to a chunk)
        y, ssm = ssd_step(xs, dt, a, b, c, state.ssm)
    else:
        y, ssm = ssd(xs, dt, a, b, c, chunk_size=chunk, initial_state=state.ssm, return_final_state=True)
    y = y.astype(jnp.float32) + xs * w["D"].astype(jnp.float32)[:, None]
    new = MambaState(wx.astype(state.conv_x.dtype), wb.astype(state.conv_B.dtype), wc.astype(state.conv_C.dtype),
                     ssm.astype(state.ssm.dtype))
    return y, new


def _conv_xbc(xs, b, c, w: dict, state: MambaState | None, end, segment_ids):
    """The causal convs and SiLU of x [B, L, h, P], B and C [B, L, g, N] as one conv over their
    channels laid out per group, [B, L, g, x of the group's heads | B | C] (the concatenation is
    local to a shard of groups, and the conv is per channel: the same numbers as three convs, in a
    third of the program). Returns ((x, B, C) convolved and SiLU'd, fp32; their windows, as
    causal_conv)."""
    bs, l, h, p = xs.shape
    g, n = b.shape[2:]
    k = w["conv_x"].shape[-1]
    per_group = lambda v, lead: v.reshape(lead + (g, -1))
    u = jnp.concatenate([per_group(xs, (bs, l)), b.astype(xs.dtype), c.astype(xs.dtype)], axis=3)
    wt = jnp.concatenate([w["conv_x"].reshape(g, h // g * p, k), w["conv_B"], w["conv_C"]], axis=1)
    bias = jnp.concatenate([w["conv_x_bias"].reshape(g, h // g * p), w["conv_B_bias"], w["conv_C_bias"]], axis=1)
    window = None
    if state is not None:
        window = jnp.concatenate([per_group(state.conv_x, (bs, k - 1)), state.conv_B.astype(state.conv_x.dtype),
                                  state.conv_C.astype(state.conv_x.dtype)], axis=3)
    out, win = causal_conv(u, wt, bias, window, end, segment_ids, silu=True)
    cuts = np.cumsum([h // g * p, n])
    xo, bo, co = jnp.split(out, cuts, axis=3)
    wx, wb, wc = jnp.split(win, cuts, axis=3)
    return ((xo.reshape(bs, l, h, p), bo, co),
            (wx.reshape((bs, k - 1, h, p)), wb, wc))


def ssd_step(x_Bx1xHxP, dt_Bx1xH, a_H, b_Bx1xGxN, c_Bx1xGxN, state_BxHxPxN):
    """One token of the SSD recurrence (a decode step): s = exp(dt A) s + dt x B^T, y = s C (each head
    with its group's B and C), in fp32. Returns (y [B, 1, H, P], the new state [B, H, P, N])."""
    r = x_Bx1xHxP.shape[2] // b_Bx1xGxN.shape[2]
    b, c = (jnp.repeat(m[:, 0].astype(jnp.float32), r, axis=1) for m in (b_Bx1xGxN, c_Bx1xGxN))  # [B, H, N]
    dt = dt_Bx1xH[:, 0].astype(jnp.float32)  # [B, H]
    x = dt[..., None] * x_Bx1xHxP[:, 0].astype(jnp.float32)  # [B, H, P]
    s = state_BxHxPxN.astype(jnp.float32) * jnp.exp(dt * a_H)[..., None, None] + x[..., None] * b[:, :, None, :]
    return jnp.einsum("bhpn,bhn->bhp", s, c)[:, None], s


def state_axes(batch: str | None = "batch") -> MambaState:
    """A MambaState's logical axes (`batch` None: the continuous engine's rows, replicated over the data
    axes like its KV pools)."""
    return MambaState((batch, None, "heads", "head_dim"), (batch, None, "ssm_groups", "ssm_state"),
                      (batch, None, "ssm_groups", "ssm_state"), (batch, "heads", "head_dim", "ssm_state"))


@struct.dataclass
class MambaSlots:
    """One Mamba layer's states in the continuous engine, one per batch row, and this call's view of
    them: `state` [rows, ...]; the row of each of the call's B sequences `rows_B` (i32; a row >= rows
    is padding: it reads any state and writes nothing); `reset_B` the sequences that start here (a new
    request took the row: their state read as zeros); `valid_BxL` their real tokens."""
    state: MambaState
    rows_B: jax.Array
    reset_B: jax.Array
    valid_BxL: jax.Array

    def read(self) -> MambaState:
        """The B sequences' states [B, ...] (zeros where reset)."""
        def one(s):
            got = jnp.take(s, self.rows_B, axis=0, mode="clip")
            return jnp.where(self.reset_B.reshape((-1,) + (1,) * (s.ndim - 1)), 0, got)
        return jax.tree.map(one, self.state)

    def write(self, new: MambaState) -> "MambaSlots":
        """The states with the B sequences' new ones in their rows (padding rows dropped)."""
        axes = state_axes(None)
        state = MambaState(*(logical_constraint(s.at[self.rows_B].set(n.astype(s.dtype), mode="drop"), a)
                             for s, n, a in zip(self.state, new, axes)))
        return self.replace(state=state)


def empty_state(cfg: ModelConfig, batch: int, dtype=jnp.float32) -> MambaState:
    """A Mamba layer's decode state before any token."""
    h, p, g, n, k = (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_num_groups, cfg.mamba_state_dim,
                     cfg.mamba_conv_kernel)
    return MambaState(jnp.zeros((batch, k - 1, h, p), dtype), jnp.zeros((batch, k - 1, g, n), dtype),
                      jnp.zeros((batch, k - 1, g, n), dtype), jnp.zeros((batch, h, p, n), jnp.float32))


def state_numbers(cfg: ModelConfig) -> int:
    """Numbers in one sequence's decode state of one Mamba layer (constant in the sequence length)."""
    h, p, g, n, k = (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_num_groups, cfg.mamba_state_dim,
                     cfg.mamba_conv_kernel)
    return (k - 1) * (h * p + 2 * g * n) + h * p * n

