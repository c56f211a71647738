"""The Mamba-2 SSD scan (state-space duality): Pallas kernels, the chunked jnp form, the reference.

Shapes: x [B, L, H, P] (heads of head_dim P), dt [B, L, H] (positive: softplus'ed and clamped by the
caller), A [H] (negative, -exp(A_log)), B, C [B, L, G, N] (G groups of state size N; head h reads
group h // (H // G)), initial_state [B, H, P, N]. For each (batch, head), with a_t = dt_t * A:

    state_t = exp(a_t) * state_{t-1} + dt_t * x_t (outer) B_t        state [P, N]
    y_t     = state_t @ C_t                                          y [P]

y comes back in x's dtype (no D skip: the caller adds D * x) and the final state in fp32.

Three implementations, equal up to rounding:
  ssd_reference  the recurrence step by step (lax.scan over L): the ground truth.
  ssd_chunked    plain jnp in chunks of Q = chunk_size (autodiff gives the gradients): with
                 acs_t = a_1 + ... + a_t inside a chunk,
                   y_t   = sum_{s<=t} exp(acs_t - acs_s) (C_t . B_s) dt_s x_s    (within the chunk)
                         + exp(acs_t) H_c @ C_t                                  (state carried in)
                   S_c   = sum_s exp(acs_Q - acs_s) dt_s x_s (outer) B_s         (chunk's own state)
                   H_c+1 = exp(acs_Q) H_c + S_c                                  (scan over chunks)
                 Work and memory are linear in L: the largest intermediates are [Q, Q] per chunk.
  ssd            the same decomposition as Pallas kernels (Triton on GPU, interpret mode on CPU),
                 differentiable through a custom_vjp.

What runs where in `ssd` (grid (batch, head, chunk) for every kernel; a program holds one chunk):
  forward   jnp: a = dt * A and its cumulative sum per chunk ([B, H, L], elementwise)
            kernel `ssd_chunk_state`: S_c = (x * w)^T B with w_s = dt_s exp(acs_Q - acs_s)
            jnp: the state passing H_c+1 = exp(acs_Q) H_c + S_c, a lax.scan over chunks of
                 [B, H, P, N] elementwise updates (L / Q steps; no matmul)
            kernel `ssd_chunk_scan`: y (the intra-chunk quadratic form plus the carried state)
  backward  kernel `ssd_chunk_state` again: dH_c = (dy * exp(acs))^T C, the carried state's
                 gradient from the outputs
            jnp: the reverse state passing (dS_c, and the gradient of each chunk's decay)
            kernel `ssd_chunk_scan_bwd`: dx, dB and dC per head, d(acs), and dt's direct part
            jnp: reverse cumulative sums turn d(acs) into d(a), hence ddt and dA; dB and dC summed
                 over each group's heads; dinitial_state is the reverse pass's last carry.
Residuals: the inputs and the states entering each chunk [B, H, L / Q, P, N] fp32.

Precision: the kernels' matmul operands are in the inputs' dtype (fp32 inputs at HIGHEST
precision, never TF32) with fp32 accumulation; decays, weights, states and gradients are fp32.
ssd_reference and ssd_chunked compute in fp32 throughout (ssd_chunked's einsums follow
jax.default_matmul_precision). Sequence lengths are padded to a multiple of Q with dt = 0 (the
state passes through unchanged), P and N to powers of two >= 16 with zeros.

Limits: a program holds a whole chunk ([Q, Q] scores in registers), so Q <= 128 suits the GPU;
the Pallas calls are not typed for shard_map's varying axes (call them outside shard_map or with
check_vma=False).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_MIN_BLOCK = 16  # Triton's dot needs every matmul dimension >= 16.
_HIGHEST = lax.Precision.HIGHEST


def ssd_flops(batch: int, seq_len: int, heads: int, head_dim: int, state_dim: int, groups: int,
              chunk_size: int) -> int:
    """Forward matmul FLOPs of the chunked form, 2 per multiply-add, over the padded length
    Lp = ceil(L / Q) * Q (Q = chunk_size), counting whole Q x Q chunk squares:

        C B^T scores      2 * B * Lp * Q * N * G     (one per group; the kernel recomputes per head)
        scores @ x        2 * B * Lp * Q * P * H
        chunk states      2 * B * Lp * P * N * H     (x^T B, weighted)
        state outputs     2 * B * Lp * P * N * H     (C H_c^T)

    The backward executes about twice this (every product has two gradient products)."""
    lp = -(-seq_len // chunk_size) * chunk_size
    scores = 2 * batch * lp * chunk_size * state_dim * groups
    mix = 2 * batch * lp * chunk_size * head_dim * heads
    states = 2 * 2 * batch * lp * head_dim * state_dim * heads
    return scores + mix + states


# --------------------------------------------------------------------------- shared pieces


def _check(x, dt, A, B, C, initial_state):
    if x.ndim != 4 or dt.shape != x.shape[:3] or A.shape != x.shape[2:3]:
        raise ValueError(f"expected x [B, L, H, P], dt [B, L, H], A [H]; got {x.shape=} {dt.shape=} {A.shape=}")
    b, l, h, p = x.shape
    if B.ndim != 4 or B.shape != C.shape or B.shape[:2] != (b, l):
        raise ValueError(f"expected B, C [B, L, G, N] alike with x's batch and length; got {B.shape=} {C.shape=} "
                         f"{x.shape=}")
    if h % B.shape[2]:
        raise ValueError(f"heads={h} is not a multiple of groups={B.shape[2]}")
    if initial_state is not None and initial_state.shape != (b, h, p, B.shape[3]):
        raise ValueError(f"initial_state {initial_state.shape} is not [B, H, P, N]={(b, h, p, B.shape[3])}")


def _vary_like(x, *others):
    """x typed to vary over the shard_map axes any of `others` vary over (a scan's initial carry
    must match its update inside a shard_map that checks variance); unchanged elsewhere."""
    axes = frozenset().union(*(jax.typeof(o).manual_axis_type.varying for o in (x, *others)))
    missing = tuple(sorted(axes - jax.typeof(x).manual_axis_type.varying))
    return lax.pcast(x, missing, to="varying") if missing else x


def _pad_to(x, axis: int, size: int):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def _pass_states(s_CxZxPxN, decay_CxZ, h0_ZxPxN):
    """The inter-chunk recurrence H_c+1 = decay_c H_c + S_c, chunk axis first (Z: any batch dims).
    Returns (H_c entering each chunk [C, Z..., P, N], the final state [Z..., P, N])."""
    def step(h, inp):
        s, d = inp
        return d[..., None, None] * h + s, h

    final, h_in = lax.scan(step, _vary_like(h0_ZxPxN, s_CxZxPxN, decay_CxZ), (s_CxZxPxN, decay_CxZ))
    return h_in, final


# --------------------------------------------------------------------------- reference


def ssd_reference(x, dt, A, B, C, *, initial_state=None, return_final_state=False):
    """The recurrence one step at a time (lax.scan over L), fp32: the ground truth.
    Returns y [B, L, H, P] in x's dtype, and the final state [B, H, P, N] fp32 if asked."""
    _check(x, dt, A, B, C, initial_state)
    b, l, h, p = x.shape
    g, n = B.shape[2:]
    r = h // g
    f32 = jnp.float32
    x_LxBxGxRxP = x.astype(f32).reshape(b, l, g, r, p).swapaxes(0, 1)
    dt_LxBxGxR = dt.astype(f32).reshape(b, l, g, r).swapaxes(0, 1)
    a_GxR = A.astype(f32).reshape(g, r)
    B_LxBxGxN, C_LxBxGxN = B.astype(f32).swapaxes(0, 1), C.astype(f32).swapaxes(0, 1)
    h0 = jnp.zeros((b, g, r, p, n), f32) if initial_state is None else (
        initial_state.astype(f32).reshape(b, g, r, p, n))

    def step(state, inp):                                             # state [B, G, R, P, N]
        xt, dtt, bt, ct = inp
        state = (jnp.exp(dtt * a_GxR)[..., None, None] * state
                 + (dtt[..., None] * xt)[..., None] * bt[:, :, None, None, :])
        return state, jnp.einsum("bgrpn,bgn->bgrp", state, ct, precision=_HIGHEST)

    final, y = lax.scan(step, _vary_like(h0, x_LxBxGxRxP, dt_LxBxGxR, B_LxBxGxN, C_LxBxGxN),
                        (x_LxBxGxRxP, dt_LxBxGxR, B_LxBxGxN, C_LxBxGxN))
    y = y.swapaxes(0, 1).reshape(b, l, h, p).astype(x.dtype)
    return (y, final.reshape(b, h, p, n)) if return_final_state else y


# --------------------------------------------------------------------------- chunked jnp


def _segsum(a_xQ):
    """[..., Q] -> [..., Q, Q]: out[t, s] = a_{s+1} + ... + a_t for s <= t, -inf above the diagonal.
    Sums of masked terms rather than differences of cumulative sums (no cancellation), and the
    mask applied before exp, so exp's gradient is 0 (not NaN) above the diagonal."""
    q = a_xQ.shape[-1]
    t = jnp.arange(q)[:, None]
    s = jnp.arange(q)[None, :]
    terms = jnp.where(t > s, a_xQ[..., :, None], 0.0)                 # [..., k, s]: a_k for k > s
    return jnp.where(t >= s, jnp.cumsum(terms, axis=-2), -jnp.inf)


def ssd_chunked(x, dt, A, B, C, *, chunk_size: int, initial_state=None, return_final_state=False):
    """The SSD scan in chunks of `chunk_size`, in plain jnp (fp32); see the module docstring.
    Differentiable by autodiff; cost linear in L. Same arguments and results as ssd_reference."""
    _check(x, dt, A, B, C, initial_state)
    b, l, h, p = x.shape
    g, n = B.shape[2:]
    r, q = h // g, int(chunk_size)
    nc = -(-l // q)
    f32 = lambda t: _pad_to(t.astype(jnp.float32), 1, nc * q)        # dt = 0 past L: state unchanged
    x_ = f32(x).reshape(b, nc, q, g, r, p)
    B_, C_ = f32(B).reshape(b, nc, q, g, n), f32(C).reshape(b, nc, q, g, n)
    dt_ = jnp.moveaxis(f32(dt).reshape(b, nc, q, g, r), 2, -1)       # [b, c, g, r, q]
    a = dt_ * A.astype(jnp.float32).reshape(g, r)[..., None]
    acs = jnp.cumsum(a, axis=-1)                                     # [b, c, g, r, q]

    # Within each chunk: the quadratic (attention-like) form.
    cb = jnp.einsum("bcqgn,bcsgn->bcgqs", C_, B_)                    # [b, c, g, q, s]
    m = cb[:, :, :, None] * jnp.exp(_segsum(a)) * dt_[..., None, :]  # [b, c, g, r, q, s]
    y = jnp.einsum("bcgrqs,bcsgrp->bcqgrp", m, x_)
    # Each chunk's own final state, then the states carried between chunks.
    w = jnp.exp(acs[..., -1:] - acs) * dt_                           # [b, c, g, r, q]
    s = jnp.einsum("bcgrq,bcqgrp,bcqgn->bcgrpn", w, x_, B_)          # [b, c, g, r, p, n]
    h0 = (jnp.zeros((b, g, r, p, n), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32).reshape(b, g, r, p, n))
    h_in, final = _pass_states(jnp.moveaxis(s, 1, 0), jnp.moveaxis(jnp.exp(acs[..., -1]), 1, 0), h0)
    y = y + jnp.einsum("bcqgn,cbgrpn,bcgrq->bcqgrp", C_, h_in, jnp.exp(acs))
    y = y.reshape(b, nc * q, h, p)[:, :l].astype(x.dtype)
    return (y, final.reshape(b, h, p, n)) if return_final_state else y
