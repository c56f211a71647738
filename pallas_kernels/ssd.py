"""The Mamba-2 SSD scan (state-space duality): Pallas kernels, the chunked jnp form, the reference.

Shapes: x [B, L, H, P] (heads of head_dim P), dt [B, L, H] (positive: softplus'ed and clamped by the
caller), A [H] (negative, -exp(A_log)), B, C [B, L, G, N] (G groups of state size N; head h reads
group h // (H // G)), initial_state [B, H, P, N]. For each (batch, head), with a_t = dt_t * A:

    state_t = exp(a_t) * state_{t-1} + dt_t * x_t (outer) B_t        state [P, N]
    y_t     = state_t @ C_t                                          y [P]

y comes back in x's dtype (no D skip: the caller adds D * x) and the final state in fp32.

Document boundaries (packed sequences): with segment_ids [B, L] (each document one run of equal ids,
as a packer lays them out), the state resets where a document starts: exp(a_t) is replaced by 0 at
a token whose segment differs from the previous token's, so no token reads another document's
inputs. In the chunked forms the decay between two tokens is multiplied by "same segment" (the
intra-chunk form, each chunk's own state at its last token) and the state carried into a chunk
reaches only the tokens of the segment it ends in (and the carry across the chunk boundary is zero
where a new document starts there). The initial state belongs to the first token's document.
Without segment ids none of this is traced.

Three implementations, equal up to rounding:
  ssd_reference  the recurrence step by step (lax.scan over L): the ground truth.
  ssd_chunked    plain jnp in chunks of Q = chunk_size (a written backward, custom_vjp): with
                 acs_t = a_1 + ... + a_t inside a chunk,
                   y_t   = sum_{s<=t} exp(acs_t - acs_s) (C_t . B_s) dt_s x_s    (within the chunk)
                         + exp(acs_t) H_c @ C_t                                  (state carried in)
                   S_c   = sum_s exp(acs_Q - acs_s) dt_s x_s (outer) B_s         (chunk's own state)
                   H_c+1 = exp(acs_Q) H_c + S_c                                  (between chunks)
                 laid out [B, H, chunks, Q, ...] so that every product is a batched matmul with no
                 transpose between them; up to PRODUCT_MAX_CHUNKS chunks the states between chunks
                 are one product with the [chunks + 1, chunks + 1] matrix of the decays from each
                 chunk's end to each later chunk's start (no sequential scan; its work, (L / Q)^2 P N
                 per head, then stays under a tenth of the intra-chunk products'), beyond that a scan
                 over the chunks. Memory and work are linear in L (the largest intermediates are
                 [Q, Q] per chunk).
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
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
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


def _check(x, dt, A, B, C, initial_state, segment_ids=None):
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
    if segment_ids is not None and segment_ids.shape != (b, l):
        raise ValueError(f"segment_ids {segment_ids.shape} is not [B, L]={(b, l)}")


def _continues(seg_BxL):
    """[B, L] bool: the token continues the previous token's document (True at position 0: the
    initial state belongs to the first document)."""
    return seg_BxL == jnp.concatenate([seg_BxL[:, :1], seg_BxL[:, :-1]], axis=1)


def _chunk_segments(seg_BxL, q: int):
    """Per chunk of Q tokens (the length a multiple of Q): (seg [B, chunks, Q], keep_in [B, chunks, Q]:
    the token is in the document of the token before the chunk (the carried state reaches it; the
    last token's entry says whether the state passes the whole chunk), keep_out [B, chunks, Q]: the
    token is in the chunk's last token's document (it reaches the chunk's own final state))."""
    b, l = seg_BxL.shape
    seg = seg_BxL.reshape(b, l // q, q)
    before = jnp.concatenate([seg[:, :1, 0], seg[:, :-1, -1]], axis=1)  # [B, chunks]
    return seg, seg == before[..., None], seg == seg[..., -1:]


def _pad_segments(seg_BxL, size: int):
    """Segment ids padded to `size` with the last id (the padding, dt = 0, stays in the last document)."""
    if seg_BxL.shape[1] == size:
        return seg_BxL
    return jnp.pad(seg_BxL, ((0, 0), (0, size - seg_BxL.shape[1])), mode="edge")


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


def ssd_reference(x, dt, A, B, C, *, initial_state=None, return_final_state=False, segment_ids=None):
    """The recurrence one step at a time (lax.scan over L), fp32: the ground truth.
    Returns y [B, L, H, P] in x's dtype, and the final state [B, H, P, N] fp32 if asked.
    `segment_ids` [B, L]: the state resets where the segment changes (module docstring)."""
    _check(x, dt, A, B, C, initial_state, segment_ids)
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

    # With segment ids: 0 where a document starts (the decay across the boundary), else 1.
    keep_LxB = None if segment_ids is None else _continues(segment_ids).astype(f32).swapaxes(0, 1)

    def step(state, inp):                                             # state [B, G, R, P, N]
        xt, dtt, bt, ct, kt = inp
        decay = jnp.exp(dtt * a_GxR) if kt is None else jnp.exp(dtt * a_GxR) * kt[:, None, None]
        state = (decay[..., None, None] * state
                 + (dtt[..., None] * xt)[..., None] * bt[:, :, None, None, :])
        return state, jnp.einsum("bgrpn,bgn->bgrp", state, ct, precision=_HIGHEST)

    final, y = lax.scan(step, _vary_like(h0, x_LxBxGxRxP, dt_LxBxGxR, B_LxBxGxN, C_LxBxGxN),
                        (x_LxBxGxRxP, dt_LxBxGxR, B_LxBxGxN, C_LxBxGxN, keep_LxB))
    y = y.swapaxes(0, 1).reshape(b, l, h, p).astype(x.dtype)
    return (y, final.reshape(b, h, p, n)) if return_final_state else y


# --------------------------------------------------------------------------- chunked jnp


def _tri(q: int, upper: bool = False):
    """[Q, Q] fp32: 1 where s <= t for [s, t] (the lower triangle, `upper`: s >= t), else 0."""
    s, t = np.arange(q)[:, None], np.arange(q)[None, :]
    return jnp.asarray(s >= t if upper else s <= t, jnp.float32)


def _chunk_cumsum(a_xQ, reverse: bool = False):
    """Cumulative sum along the last axis (a chunk's length) as one product with a triangular matrix
    of ones (`reverse`: the sums from each position to the chunk's end). jnp.cumsum reaches XLA as a
    reduce-window (and its gradient as another), which the CPU backend compiles and runs several
    times slower at chunk sizes than this product: the chunked scan's forward and backward at b 8,
    L 128, 16 heads, chunk 32 compiled in 0.97 s instead of 2.09 s and ran in 9.3 ms instead of
    20.8 ms. fp32 products are exact; only the summation order differs."""
    return jnp.einsum("...s,st->...t", a_xQ, _tri(a_xQ.shape[-1], upper=reverse), precision=_HIGHEST)


def _segsum(a_xQ, transposed: bool = False):
    """[..., Q] -> [..., Q, Q]: out[t, s] = a_{s+1} + ... + a_t for s <= t, -inf above the diagonal
    (`transposed`: out[s, t], the layout the chunked form uses). Sums of masked terms rather than
    differences of cumulative sums (no cancellation), and the mask applied before exp, so exp's
    gradient is 0 (not NaN) above the diagonal. One product: terms[s, k] = a_k for k > s, summed
    over k <= t."""
    q = a_xQ.shape[-1]
    s, k = np.arange(q)[:, None], np.arange(q)[None, :]
    terms = jnp.where(k > s, a_xQ[..., None, :], 0.0)               # [..., s, k]
    out = jnp.where(s <= k, jnp.einsum("...sk,kt->...st", terms, _tri(q), precision=_HIGHEST), -jnp.inf)
    return out if transposed else jnp.swapaxes(out, -1, -2)


# The name of the states carried into each chunk [b, h, chunks, p, n] in ssd_chunked, for a remat
# policy that keeps them and recomputes the rest (jax.checkpoint_policies.save_only_these_names).
CHUNK_STATES = "ssd_chunk_states"

# Up to this many chunks ssd_chunked passes the states between chunks by one product with the
# [chunks + 1, chunks + 1] matrix of decays between them (a smaller program than a scan forward and
# backward); beyond, by a scan over the chunks, whose work and memory stay linear in L. At 32 chunks
# the product's work is at most (32 / Q) P N / (Q (P + N)) of the intra-chunk products' (under 1/10
# for Q >= 64 whatever P and N).
PRODUCT_MAX_CHUNKS = 32

_NO_PASS = -1e30  # the log of a zero decay across a chunk (a finite -inf: the segment sums stay NaN-free)


@dataclasses.dataclass(frozen=True)
class _Chunks:
    """The chunked form's fp32 operands, padded to whole chunks of q (dt = 0 past L: the state passes
    unchanged), laid out so that every product of the forward and the backward is a batched matmul
    over (batch, head, chunk) with no transpose between them: x [b, h, c, q, p], B and C per group
    [b, g, c, q, n], dt and acs (the cumulative sums of dt * A within each chunk) [b, h, c, q]; the
    decays: within a chunk, transposed, [b, h, c, s, t] (exp(acs_t - acs_s) for s <= t, else 0), of
    each token's input to its chunk's end (to_end), of the carried state to each token (out)
    [b, h, c, q], across each chunk (across [b, h, c]) and from the state after chunk j (h0 for j = 0)
    to the state entering chunk i (between [b, h, c + 1, c + 1], i then j); with segment ids each is 0
    across a document boundary (module docstring)."""
    x: jax.Array
    B: jax.Array
    C: jax.Array
    dt: jax.Array
    acs: jax.Array
    within_t: jax.Array
    to_end: jax.Array
    out: jax.Array
    across: jax.Array
    between: jax.Array

    def per_head(self, m_BxGx_):
        """A group's [b, g, ...] rows for each of its heads [b, h, ...]."""
        b, g = m_BxGx_.shape[:2]
        r = self.x.shape[1] // g
        return jnp.broadcast_to(m_BxGx_[:, :, None], (b, g, r) + m_BxGx_.shape[2:]).reshape(
            (b, g * r) + m_BxGx_.shape[2:])


def _per_group(m_BxHx_, g: int):
    """The sum over each group's heads of [b, h, ...] -> [b, g, ...]."""
    b, h = m_BxHx_.shape[:2]
    return m_BxHx_.reshape((b, g, h // g) + m_BxHx_.shape[2:]).sum(2)


def _to_chunks(t, nc: int, q: int):
    """[B, L, H, ...] -> [B, H, chunks, Q, ...] fp32, L padded with zeros to nc * q."""
    b, _, h = t.shape[:3]
    t = _pad_to(t.astype(jnp.float32), 1, nc * q).reshape((b, nc, q, h) + t.shape[3:])
    return jnp.moveaxis(t, 3, 1)


def _from_chunks(t, l: int):
    """[B, H, chunks, Q, ...] -> [B, L, H, ...] (the padding dropped)."""
    b, h, nc, q = t.shape[:4]
    return jnp.moveaxis(t, 1, 3).reshape((b, nc * q, h) + t.shape[4:])[:, :l]


def _chunks(x, dt, A, B, C, segment_ids, q: int) -> _Chunks:
    b, l, h, p = x.shape
    nc = -(-l // q)
    # One product gives dt's cumulative sums in each chunk and, by its identity half, dt itself: every
    # later use reads dt from that product's output (a buffer) rather than each recomputing its
    # softplus and layout (a smaller program; the identity's products are exact).
    dt_ = _to_chunks(dt, nc, q)                                      # [b, h, c, q]
    a32 = A.astype(jnp.float32)[:, None, None]
    both = jnp.einsum("...s,sk->...k", dt_, jnp.concatenate([_tri(q), jnp.eye(q, dtype=jnp.float32)], axis=1),
                      precision=_HIGHEST)
    acs, dt_ = both[..., :q] * a32, both[..., q:]
    a = dt_ * a32
    within_t = jnp.exp(_segsum(a, transposed=True))                  # [b, h, c, s, t]
    to_end = jnp.exp(acs[..., -1:] - acs)
    out, log_across = jnp.exp(acs), acs[..., -1]
    if segment_ids is not None:
        seg, keep_in, keep_out = (t[:, None] for t in
                                  _chunk_segments(_pad_segments(segment_ids, nc * q), q))  # [b, 1, c, q] each
        within_t = within_t * (seg[..., :, None] == seg[..., None, :])
        to_end = to_end * keep_out
        out = out * keep_in
        log_across = jnp.where(keep_in[..., -1], log_across, _NO_PASS)
    # between[i, j] = exp(log_across_j + ... + log_across_i-1) (j <= i): the state after chunk j - 1
    # (j = 0: the initial state) decayed to the start of chunk i. Its size and work grow with the
    # square of the chunks, so past PRODUCT_MAX_CHUNKS the states pass by a scan instead (None).
    between = None
    if nc <= PRODUCT_MAX_CHUNKS:
        log_across_0 = jnp.concatenate([jnp.zeros_like(log_across[..., :1]), log_across], axis=-1)
        between = jnp.exp(_segsum(log_across_0))                     # [b, h, c + 1, c + 1]
    return _Chunks(_to_chunks(x, nc, q), _to_chunks(B, nc, q), _to_chunks(C, nc, q), dt_, acs, within_t, to_end,
                   out, jnp.exp(log_across), between)


def _chunked_forward(x, dt, A, B, C, h0, segment_ids, q: int):
    """(y [B, L, H, P] fp32, the final state [B, H, P, N], the states entering each chunk
    [b, h, chunks, p, n]); h0 [B, H, P, N] fp32."""
    l = x.shape[1]
    k = _chunks(x, dt, A, B, C, segment_ids, q)
    # Within each chunk: the quadratic (attention-like) form, m[s, t] = (B_s . C_t) within[s, t] dt_s.
    bc = jnp.einsum("bgcsn,bgctn->bgcst", k.B, k.C)                  # [b, g, c, s, t]
    m = k.per_head(bc) * k.within_t * k.dt[..., None]               # [b, h, c, s, t]
    y = jnp.einsum("bhcst,bhcsp->bhctp", m, k.x)
    # Each chunk's own final state, then the states carried between chunks: one product of the
    # decays between chunks with (h0, the chunks' own states).
    s = jnp.einsum("bhcsp,bhcsn->bhcpn", k.x * (k.to_end * k.dt)[..., None], k.per_head(k.B))
    if k.between is not None:
        states = jnp.einsum("bhij,bhjpn->bhipn", k.between, jnp.concatenate([h0[:, :, None], s], axis=2))
        h_in, final = states[:, :, :-1], states[:, :, -1]
    else:  # many chunks: the recurrence by a scan over them (linear work and memory)
        h_in, final = _pass_states(jnp.moveaxis(s, 2, 0), jnp.moveaxis(k.across, 2, 0), h0)
        h_in = jnp.moveaxis(h_in, 0, 2)
    h_in = checkpoint_name(h_in, CHUNK_STATES)  # what a selective recompute keeps (the model's policy)
    y = y + k.out[..., None] * jnp.einsum("bhctn,bhcpn->bhctp", k.per_head(k.C), h_in)
    return _from_chunks(y, l), final, h_in


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _ssd_chunked(x, dt, A, B, C, h0, segment_ids, q):
    y, final, _ = _chunked_forward(x, dt, A, B, C, h0, segment_ids, q)
    return y, final


def _ssd_chunked_fwd(x, dt, A, B, C, h0, segment_ids, q):
    y, final, h_in = _chunked_forward(x, dt, A, B, C, h0, segment_ids, q)
    return (y, final), (x, dt, A, B, C, h_in, segment_ids)


def _ssd_chunked_bwd(q, res, cts):
    """The chunked form's gradients written out: the intra-chunk products recomputed from the inputs
    (only the inputs and the chunk states are kept), the state passing run backwards (one product
    with the decays between chunks), and the gradients of the cumulative decays turned into dt's and
    A's by reverse cumulative sums. The same decomposition as the Pallas backward kernels
    (_chunk_scan_bwd_kernel), over all chunks at once, each product a batched matmul over (batch,
    head, chunk) in _Chunks' layout."""
    x, dt, A, B, C, h_in, segment_ids = res
    dy, dfinal = cts
    l, g = x.shape[1], B.shape[2]
    k = _chunks(x, dt, A, B, C, segment_ids, q)
    dy_ = _to_chunks(dy, k.x.shape[2], q)                            # [b, h, c, q, p]
    b_h, c_h = k.per_head(k.B), k.per_head(k.C)                      # [b, h, c, q, n]

    # The state passing backwards: the gradient of the state entering chunk j (j = nc: the final
    # state) from the outputs is dH_j; the total one G_j = sum_i>=j between[i, j] dH_i. h0 gets G_0,
    # chunk c's own state G_c+1, and its decay across <G_c+1, H_c>.
    dh_out = jnp.einsum("bhctp,bhctn->bhcpn", dy_ * k.out[..., None], c_h)
    if k.between is not None:
        dstates = jnp.einsum("bhij,bhipn->bhjpn", k.between,
                             jnp.concatenate([dh_out, dfinal.astype(jnp.float32)[:, :, None]], axis=2))
        dh0, ds = dstates[:, :, 0], dstates[:, :, 1:]
    else:  # many chunks: G_c = dH_c + across_c G_c+1 from G_nc = dfinal, a reverse scan
        def back(g_next, inp):
            dh, across = inp
            return dh + across[..., None, None] * g_next, g_next

        dh0, ds = lax.scan(back, _vary_like(dfinal.astype(jnp.float32), dh_out),
                           (jnp.moveaxis(dh_out, 2, 0), jnp.moveaxis(k.across, 2, 0)), reverse=True)
        ds = jnp.moveaxis(ds, 0, 2)
    dacross = jnp.sum(ds * h_in, axis=(-2, -1))                      # [b, h, c]

    # Within each chunk: y_t = sum_s (B_s . C_t) within[s, t] dt_s x_s.
    bc = k.per_head(jnp.einsum("bgcsn,bgctn->bgcst", k.B, k.C))     # [b, h, c, s, t]
    xdy = jnp.einsum("bhcsp,bhctp->bhcst", k.x, dy_)                 # x_s . dy_t
    e0 = bc * k.within_t * xdy                                       # d loss / d dt_s, per (s, t)
    e = e0 * k.dt[..., None]                                         # d loss / d (acs_t - acs_s)
    dbc = _per_group(xdy * k.within_t * k.dt[..., None], g)          # [b, g, c, s, t]
    dx = jnp.einsum("bhcst,bhctp->bhcsp", bc * k.within_t * k.dt[..., None], dy_)
    db = jnp.einsum("bgcst,bgctn->bgcsn", dbc, k.C)
    dc = jnp.einsum("bgcst,bgcsn->bgctn", dbc, k.B)
    dacs = jnp.sum(e, axis=-2) - jnp.sum(e, axis=-1)                 # [b, h, c, q]
    ddt = jnp.sum(e0, axis=-1)

    # The carried state's outputs: y_t += out_t H_c C_t.
    dyh = jnp.einsum("bhctp,bhcpn->bhctn", dy_, h_in)
    dacs = dacs + k.out * jnp.sum(dyh * c_h, axis=-1)

    # Each chunk's own state: S_c = sum_s to_end_s dt_s x_s (outer) B_s.
    w = k.to_end * k.dt
    xds = jnp.einsum("bhcsp,bhcpn->bhcsn", k.x, ds)                  # x_s^T dS
    dx = dx + w[..., None] * jnp.einsum("bhcsn,bhcpn->bhcsp", b_h, ds)
    db = db + _per_group(w[..., None] * xds, g)
    dc = dc + _per_group(k.out[..., None] * dyh, g)
    f0 = jnp.sum(xds * b_h, axis=-1)                                 # x_s^T dS B_s
    ddt = ddt + k.to_end * f0
    f = w * f0
    last = jnp.sum(f, axis=-1) + dacross * k.across                  # acs_Q's: own states and the decay across
    dacs = dacs - f + jnp.where(jnp.arange(q) == q - 1, last[..., None], 0.0)

    da = _chunk_cumsum(dacs, reverse=True)                           # d loss / d (dt * A)
    ddt = ddt + da * A.astype(jnp.float32)[:, None, None]
    dA = jnp.sum(da * k.dt, axis=(0, 2, 3))
    dsegs = None if segment_ids is None else (np.zeros(segment_ids.shape, jax.dtypes.float0)
                                              if not jnp.issubdtype(segment_ids.dtype, jnp.inexact)
                                              else jnp.zeros_like(segment_ids))
    return (_from_chunks(dx, l).astype(x.dtype), _from_chunks(ddt, l).astype(dt.dtype), dA.astype(A.dtype),
            _from_chunks(db, l).astype(B.dtype), _from_chunks(dc, l).astype(C.dtype), dh0, dsegs)


_ssd_chunked.defvjp(_ssd_chunked_fwd, _ssd_chunked_bwd)


def ssd_chunked(x, dt, A, B, C, *, chunk_size: int, initial_state=None, return_final_state=False,
                segment_ids=None):
    """The SSD scan in chunks of `chunk_size`, in plain jnp (fp32); see the module docstring. Its
    gradient is written out (_ssd_chunked_bwd: the intra-chunk products recomputed rather than kept,
    a far smaller program than autodiff's); cost linear in L. Same arguments and results as
    ssd_reference."""
    _check(x, dt, A, B, C, initial_state, segment_ids)
    b, l, h, p = x.shape
    h0 = (jnp.zeros((b, h, p, B.shape[3]), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))
    # One varying type for all (inside a shard_map that checks it): the written gradients then have
    # their inputs' types, and the casts' transposes sum the gradients of the inputs that vary less.
    x, dt, A, B, C, h0 = (_vary_like(t, x, dt, A, B, C, h0) for t in (x, dt, A, B, C, h0))
    q = min(int(chunk_size), l)  # a chunk longer than the sequence is the sequence (no [Q, Q] mask past it)
    y, final = _ssd_chunked(x, dt, A, B, C, h0, segment_ids, q)
    y = y.astype(x.dtype)
    return (y, final) if return_final_state else y


# --------------------------------------------------------------------------- Pallas kernels


@dataclasses.dataclass(frozen=True)
class _Config:
    """Everything static about one call: hashable, passed as a custom_vjp nondiff arg."""

    chunk: int          # Q: rows per program
    heads_per_group: int
    num_warps: int
    num_stages: int
    interpret: bool
    segments: bool = False  # document boundaries: the scan kernels read seg, keep_in, keep_out rows


def _dot(a, b, *, trans_a=False, trans_b=False):
    """2-D matmul with fp32 accumulation; fp32 operands at HIGHEST precision (no TF32)."""
    dims = (((0,) if trans_a else (1,), (1,) if trans_b else (0,)), ((), ()))
    precision = _HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _decay(acs_Q, q: int, seg_Q=None):
    """[Q, Q]: exp(acs_t - acs_s) for s <= t (and, with segment ids, t and s in one document), else 0
    (masked before exp: no overflow)."""
    t = lax.broadcasted_iota(jnp.int32, (q, 1), 0)
    s = lax.broadcasted_iota(jnp.int32, (1, q), 1)
    visible = t >= s
    if seg_Q is not None:
        visible = visible & (seg_Q[:, None] == seg_Q[None, :])
    return jnp.exp(jnp.where(visible, acs_Q[:, None] - acs_Q[None, :], -jnp.inf))


def _segment_refs(refs, cfg: "_Config", n_in: int):
    """(inputs, (seg [Q] i32, keep_in [Q], keep_out [Q] fp32) or Nones, outputs) of a scan kernel's refs:
    the segment rows follow the n_in inputs when cfg.segments."""
    if not cfg.segments:
        return refs[:n_in], (None, None, None), refs[n_in:]
    return refs[:n_in], tuple(r[...] for r in refs[n_in:n_in + 3]), refs[n_in + 3:]


def _is_last(q: int):
    return lax.broadcasted_iota(jnp.int32, (q,), 0) == q - 1


def _last(v_Q, q: int):
    """v's last element (a masked sum: no scalar indexing into a register block)."""
    return jnp.sum(jnp.where(_is_last(q), v_Q, 0.0))


def _chunk_state_kernel(x_ref, w_ref, b_ref, s_ref):
    """S = (x * w)^T B: x [Q, P], w [Q] fp32, B [Q, N] -> S [P, N] fp32."""
    x = x_ref[...]
    xw = (x.astype(jnp.float32) * w_ref[...][:, None]).astype(x.dtype)
    s_ref[...] = _dot(xw, b_ref[...].astype(x.dtype), trans_a=True)


def _chunk_scan_kernel(*refs, cfg: _Config):
    """y [Q, P] of one chunk: the masked, decayed C B^T scores times dt x, plus the state H [P, N]
    carried in, read out by C and decayed by exp(acs) (with segment ids: only within a document,
    the carried state only into the document it ends in)."""
    (x_ref, b_ref, c_ref, dt_ref, acs_ref, h_ref), (seg, keep_in, _), (y_ref,) = _segment_refs(refs, cfg, 6)
    x, bm, cm = x_ref[...], b_ref[...], c_ref[...]                   # [Q, P], [Q, N], [Q, N]
    dt, acs = dt_ref[...], acs_ref[...]                              # [Q] fp32
    cdt = x.dtype
    m = _dot(cm, bm, trans_b=True) * _decay(acs, cfg.chunk, seg) * dt[None, :]  # [Q, Q] (t, s)
    y = _dot(m.astype(cdt), x)
    out_decay = jnp.exp(acs) if keep_in is None else jnp.exp(acs) * keep_in
    y += out_decay[:, None] * _dot(cm, h_ref[...].astype(cdt), trans_b=True)
    y_ref[...] = y.astype(y_ref.dtype)


def _chunk_scan_bwd_kernel(*refs, cfg: _Config):
    """Gradients of one chunk's outputs y (cotangent dy [Q, P]) and of its own state S (cotangent dS
    [P, N], the state after the chunk's): dx [Q, P], dB and dC [Q, N] for this head, d(acs) [Q] and
    the part of ddt [Q] where dt multiplies (not through a = dt * A). With segment ids every decay
    is the forward's masked one (its gradient masked alike)."""
    ((x_ref, b_ref, c_ref, dt_ref, acs_ref, h_ref, dy_ref, ds_ref), (seg, keep_in, keep_out),
     (dx_ref, db_ref, dc_ref, dacs_ref, ddt_ref)) = _segment_refs(refs, cfg, 8)
    q = cfg.chunk
    x, bm, cm, dy = x_ref[...], b_ref[...], c_ref[...], dy_ref[...]
    dt, acs = dt_ref[...], acs_ref[...]
    h, ds = h_ref[...], ds_ref[...]                                  # [P, N] fp32
    cdt = x.dtype
    f32 = jnp.float32

    # Within the chunk: y_t = sum_s cb[t, s] decay[t, s] dt_s x_s.
    decay = _decay(acs, q, seg)
    cb = _dot(cm, bm, trans_b=True)                                  # [Q, Q] C_t . B_s
    dyx = _dot(dy, x, trans_b=True)                                  # [Q, Q] dy_t . x_s
    e0 = cb * decay * dyx                                            # d loss / d dt_s per (t, s)
    e = e0 * dt[None, :]                                             # d loss / d acs_t per (t, s)
    m = cb * decay * dt[None, :]
    dm = dyx * decay * dt[None, :]                                   # d loss / d cb
    dx = _dot(m.astype(cdt), dy, trans_a=True)                       # [Q, P]
    dc = _dot(dm.astype(cdt), bm)                                    # [Q, N]
    db = _dot(dm.astype(cdt), cm, trans_a=True)                      # [Q, N]
    dacs = jnp.sum(e, axis=1) - jnp.sum(e, axis=0)
    ddt = jnp.sum(e0, axis=0)

    # The carried state's output: y_t += exp(acs_t) H C_t.
    out_decay = jnp.exp(acs) if keep_in is None else jnp.exp(acs) * keep_in
    dc += out_decay[:, None] * _dot(dy, h.astype(cdt))              # [Q, N]
    y_off = out_decay[:, None] * _dot(cm, h.astype(cdt), trans_b=True)   # [Q, P]
    dacs += jnp.sum(dy.astype(f32) * y_off, axis=1)

    # The chunk's own state: S = sum_s exp(acs_Q - acs_s) dt_s x_s (outer) B_s.
    to_end = jnp.exp(_last(acs, q) - acs)                            # [Q]
    if keep_out is not None:
        to_end = to_end * keep_out
    w = to_end * dt
    xds = _dot(x, ds.astype(cdt))                                    # [Q, N] x_s^T dS
    db += w[:, None] * xds
    dx += w[:, None] * _dot(bm, ds.astype(cdt), trans_b=True)        # [Q, P] dS B_s
    f0 = jnp.sum(xds * bm.astype(f32), axis=1)                       # [Q] x_s^T dS B_s
    ddt += to_end * f0
    f = w * f0
    dacs += jnp.where(_is_last(q), jnp.sum(f), 0.0) - f

    dx_ref[...] = dx.astype(dx_ref.dtype)
    db_ref[...] = db
    dc_ref[...] = dc
    dacs_ref[...] = dacs
    ddt_ref[...] = ddt


def _specs(cfg: _Config, p: int, n: int):
    """BlockSpecs over grid (batch, head, chunk): rows of x-like [B, L, H, P] arrays, of B/C-like
    [B, L, G, N] arrays at the head's group, of B/C-like arrays per head [B, L, H, N], of [B, H, L]
    arrays (dt, acs, weights), of [B, L] arrays (the segment rows), and states [B, H, chunks, P, N]."""
    q, r = cfg.chunk, cfg.heads_per_group
    return dict(
        x=pl.BlockSpec((None, q, None, p), lambda b, h, c: (b, c, h, 0)),
        group=pl.BlockSpec((None, q, None, n), lambda b, h, c: (b, c, h // r, 0)),
        head_n=pl.BlockSpec((None, q, None, n), lambda b, h, c: (b, c, h, 0)),
        row=pl.BlockSpec((None, None, q), lambda b, h, c: (b, h, c)),
        seq=pl.BlockSpec((None, q), lambda b, h, c: (b, c)),
        state=pl.BlockSpec((None, None, None, p, n), lambda b, h, c: (b, h, c, 0, 0)),
    )


def _call(kernel, name: str, cfg: _Config, grid, in_specs, out_specs, out_shape):
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=cfg.interpret, name=name)


def _chunk_state_call(x, w, bm, cfg: _Config, *, per_head_b: bool = False):
    """sum over each chunk's rows of w_t x_t (outer) B_t -> [B, H, chunks, P, N] fp32 (B read at each
    head's group, or per head)."""
    b, l, h, p = x.shape
    n, nc = bm.shape[-1], l // cfg.chunk
    sp = _specs(cfg, p, n)
    return _call(_chunk_state_kernel, "ssd_chunk_state", cfg, (b, h, nc),
                 [sp["x"], sp["row"], sp["head_n"] if per_head_b else sp["group"]], sp["state"],
                 jax.ShapeDtypeStruct((b, h, nc, p, n), jnp.float32))(x, w, bm)


def _segment_inputs(segs, sp) -> tuple[list, tuple]:
    """(BlockSpecs, arrays) of the segment rows a scan kernel reads: none without segment ids."""
    return ([], ()) if segs is None else ([sp["seq"]] * 3, segs)


def _chunk_scan_call(x, bm, cm, dt, acs, h_in, segs, cfg: _Config):
    b, l, h, p = x.shape
    n, nc = bm.shape[-1], l // cfg.chunk
    sp = _specs(cfg, p, n)
    seg_specs, seg_args = _segment_inputs(segs, sp)
    return _call(functools.partial(_chunk_scan_kernel, cfg=cfg), "ssd_chunk_scan", cfg, (b, h, nc),
                 [sp["x"], sp["group"], sp["group"], sp["row"], sp["row"], sp["state"], *seg_specs], sp["x"],
                 jax.ShapeDtypeStruct(x.shape, x.dtype))(x, bm, cm, dt, acs, h_in, *seg_args)


def _chunk_scan_bwd_call(x, bm, cm, dt, acs, h_in, dy, ds, segs, cfg: _Config):
    b, l, h, p = x.shape
    n, nc = bm.shape[-1], l // cfg.chunk
    sp = _specs(cfg, p, n)
    f32 = jnp.float32
    seg_specs, seg_args = _segment_inputs(segs, sp)
    return _call(functools.partial(_chunk_scan_bwd_kernel, cfg=cfg), "ssd_chunk_scan_bwd", cfg, (b, h, nc),
                 [sp["x"], sp["group"], sp["group"], sp["row"], sp["row"], sp["state"], sp["x"], sp["state"],
                  *seg_specs],
                 [sp["x"], sp["head_n"], sp["head_n"], sp["row"], sp["row"]],
                 [jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((b, l, h, n), f32),
                  jax.ShapeDtypeStruct((b, l, h, n), f32), jax.ShapeDtypeStruct((b, h, l), f32),
                  jax.ShapeDtypeStruct((b, h, l), f32)])(x, bm, cm, dt, acs, h_in, dy, ds, *seg_args)


# --------------------------------------------------------------------------- custom_vjp


def _decays(dt, A, cfg: _Config):
    """dt [B, L, H] -> (dt [B, H, L] fp32, acs [B, H, L]: the cumulative sums of dt * A per chunk)."""
    b, l, h = dt.shape
    dt_BxHxL = dt.astype(jnp.float32).transpose(0, 2, 1)
    a = (dt_BxHxL * A.astype(jnp.float32)[:, None]).reshape(b, h, l // cfg.chunk, cfg.chunk)
    return dt_BxHxL, jnp.cumsum(a, axis=-1).reshape(b, h, l)


def _segment_rows(seg_BxL, q: int):
    """The scan kernels' segment rows [B, L]: (seg i32, keep_in fp32, keep_out fp32), _chunk_segments'."""
    b, l = seg_BxL.shape
    seg, keep_in, keep_out = _chunk_segments(seg_BxL.astype(jnp.int32), q)
    return seg.reshape(b, l), keep_in.astype(jnp.float32).reshape(b, l), keep_out.astype(jnp.float32).reshape(b, l)


def _chunk_decays(acs, segs, cfg: _Config):
    """(the decay of the state across each chunk [B, H, nc] (0 where a document starts in it), the
    decay of the carried state to each token [B, H, L] (0 outside the document it ends in), the weight
    of each token in its chunk's own state before dt [B, H, L] (0 outside the chunk's last document))."""
    b, h, l = acs.shape
    acs_c = acs.reshape(b, h, l // cfg.chunk, cfg.chunk)
    chunk, out, to_end = jnp.exp(acs_c[..., -1]), jnp.exp(acs), jnp.exp(acs_c[..., -1:] - acs_c).reshape(b, h, l)
    if segs is None:
        return chunk, out, to_end
    _, keep_in, keep_out = (r[:, None] for r in segs)                # [B, 1, L]
    return chunk * keep_in.reshape(b, 1, -1, cfg.chunk)[..., -1], out * keep_in, to_end * keep_out


def _forward(x, dt, A, bm, cm, h0, segs, cfg: _Config):
    """(y, final state, states entering each chunk [B, H, chunks, P, N])."""
    dt_t, acs = _decays(dt, A, cfg)
    chunk_decay, _, to_end = _chunk_decays(acs, segs, cfg)
    s = _chunk_state_call(x, to_end * dt_t, bm, cfg)                # [B, H, nc, P, N]
    h_in, final = _pass_states(jnp.moveaxis(s, 2, 0), jnp.moveaxis(chunk_decay, 2, 0), h0)
    h_in = jnp.moveaxis(h_in, 0, 2)
    return _chunk_scan_call(x, bm, cm, dt_t, acs, h_in, segs, cfg), final, h_in


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _ssd(x, dt, A, bm, cm, h0, segs, cfg):
    y, final, _ = _forward(x, dt, A, bm, cm, h0, segs, cfg)
    return y, final


def _ssd_fwd(x, dt, A, bm, cm, h0, segs, cfg):
    y, final, h_in = _forward(x, dt, A, bm, cm, h0, segs, cfg)
    return (y, final), (x, dt, A, bm, cm, h_in, segs)


def _ssd_bwd(cfg, res, cts):
    x, dt, A, bm, cm, h_in, segs = res
    dy, dfinal = cts
    b, l, h, p = x.shape
    g, n = bm.shape[2:]
    nc, q = l // cfg.chunk, cfg.chunk
    dt_t, acs = _decays(dt, A, cfg)
    decay, out_decay, _ = _chunk_decays(acs, segs, cfg)              # [B, H, nc], [B, H, L]

    # The carried states' gradients from the outputs, then the state passing backwards:
    # g_c = dH_out_c + decay_c g_c+1 from g_nc = dfinal; dS_c = g_c+1.
    dh_out = _chunk_state_call(dy, out_decay, cm, cfg)               # [B, H, nc, P, N]

    def back(g_next, inp):
        dh_c, d_c, h_c = inp
        return dh_c + d_c[..., None, None] * g_next, (g_next, jnp.sum(g_next * h_c, axis=(-2, -1)))

    first = lambda t: jnp.moveaxis(t, 2, 0)
    dh0, (ds, ddecay) = lax.scan(back, _vary_like(dfinal, dh_out, h_in),
                                 (first(dh_out), first(decay), first(h_in)), reverse=True)
    ds, ddecay = jnp.moveaxis(ds, 0, 2), jnp.moveaxis(ddecay, 0, 2)

    dx, db_h, dc_h, dacs, ddt_direct = _chunk_scan_bwd_call(x, bm, cm, dt_t, acs, h_in, dy, ds, segs, cfg)
    dacs = dacs.reshape(b, h, nc, q).at[..., -1].add(ddecay * decay)
    da = lax.cumsum(dacs, axis=3, reverse=True).reshape(b, h, l)     # d loss / d (dt * A)
    a32 = A.astype(jnp.float32)
    ddt = (ddt_direct + da * a32[:, None]).transpose(0, 2, 1)
    dA = jnp.sum(da * dt_t, axis=(0, 2))
    db = db_h.reshape(b, l, g, h // g, n).sum(3)
    dc = dc_h.reshape(b, l, g, h // g, n).sum(3)
    dsegs = None if segs is None else jax.tree.map(lambda r: np.zeros(r.shape, jax.dtypes.float0)
                                                   if jnp.issubdtype(r.dtype, jnp.integer) else jnp.zeros_like(r), segs)
    return (dx, ddt.astype(dt.dtype), dA.astype(A.dtype), db.astype(bm.dtype), dc.astype(cm.dtype), dh0, dsegs)


_ssd.defvjp(_ssd_fwd, _ssd_bwd)


# --------------------------------------------------------------------------- public API


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def ssd(x, dt, A, B, C, *, chunk_size: int, initial_state=None, return_final_state=False, segment_ids=None,
        num_warps: int | None = None, num_stages: int | None = None, interpret: bool | None = None):
    """The SSD scan as Pallas kernels; differentiable (Pallas backward kernels, see the module
    docstring for what runs where). Same arguments and results as ssd_reference (segment ids: the
    scan kernels mask their decays by document, forward and backward), plus:

      chunk_size: Q, the rows each program holds; a power of two >= 16 (<= 128 suits the GPU).
      num_warps, num_stages: Triton launch parameters (default 4 warps, or 8 for Q >= 128; 2 stages).
      interpret: run the kernels in Pallas interpret mode; None picks True exactly when the default
        backend is CPU.
    """
    _check(x, dt, A, B, C, initial_state, segment_ids)
    q = int(chunk_size)
    if q < _MIN_BLOCK or q & (q - 1):
        raise ValueError(f"chunk_size={chunk_size} must be a power of two >= {_MIN_BLOCK}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    b, l, h, p = x.shape
    q = min(q, max(_MIN_BLOCK, _next_pow2(l)))  # a chunk longer than the sequence: the sequence's power of two
    g, n = B.shape[2:]
    cfg = _Config(chunk=q, heads_per_group=h // g, num_warps=num_warps or (8 if q >= 128 else 4),
                  num_stages=num_stages or 2, interpret=bool(interpret), segments=segment_ids is not None)
    # Pad: L to a multiple of Q with dt = 0 (the state passes through), P and N to powers of two
    # >= 16 with zeros (their rows and columns of every product are zero and are sliced off).
    lp = -(-l // q) * q
    pp, np_ = max(_MIN_BLOCK, _next_pow2(p)), max(_MIN_BLOCK, _next_pow2(n))
    if not x.dtype == B.dtype == C.dtype:
        B, C = B.astype(x.dtype), C.astype(x.dtype)
    xp = _pad_to(_pad_to(x, 1, lp), 3, pp)
    Bp, Cp = (_pad_to(_pad_to(t, 1, lp), 3, np_) for t in (B, C))
    dtp = _pad_to(dt, 1, lp)
    h0 = (jnp.zeros((b, h, pp, np_), jnp.float32) if initial_state is None
          else _pad_to(_pad_to(initial_state.astype(jnp.float32), 2, pp), 3, np_))
    segs = None if segment_ids is None else _segment_rows(_pad_segments(segment_ids, lp), q)
    y, final = _ssd(xp, dtp, A, Bp, Cp, h0, segs, cfg)
    y = y[:, :l, :, :p]
    return (y, final[:, :, :p, :n]) if return_final_state else y
