"""Flash attention kernel (interpret mode on CPU) against its jnp reference, and the
reference against a naive softmax(QK^T)V with explicitly repeated k/v heads."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

from megajax.models.attention import xla_attention
from pallas_kernels import flash_attention, flash_attention_reference
from pallas_kernels.flash_attention import default_block_sizes, kv_block_range, q_block_range


def _inputs(b, sq, sk, h, g, d, dtype, seed=0):
    """q, k, v and an output cotangent; numpy's generator (jax.random compiles per shape)."""
    rng = np.random.default_rng(seed)
    shapes = [(b, sq, h, d), (b, sk, g, d), (b, sk, g, d), (b, sq, h, d)]
    return tuple(jnp.asarray(rng.standard_normal(s, np.float32), dtype) for s in shapes)


def _segments(b, s, lengths):
    """[b, s] int32 document ids from document lengths (each row shifted so rows differ)."""
    ids = np.repeat(np.arange(len(lengths)), lengths)[:s]
    return jnp.asarray(np.stack([np.roll(ids, 7 * r) for r in range(b)]), jnp.int32)


def _naive(q, k, v, *, causal, segment_ids, scale, window):
    """Explicit numpy attention: repeated kv heads, masks built pair by pair."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, sq, h, d = q.shape
    sk, g = k.shape[1], k.shape[2]
    k, v = np.repeat(k, h // g, axis=2), np.repeat(v, h // g, axis=2)
    if segment_ids is None:
        q_seg = kv_seg = None
    elif isinstance(segment_ids, tuple):
        q_seg, kv_seg = (np.asarray(s) for s in segment_ids)
    else:
        q_seg = kv_seg = np.asarray(segment_ids)
    out = np.zeros_like(q)
    for bi, hi, i in itertools.product(range(b), range(h), range(sq)):
        keys = [j for j in range(sk)
                if (not causal or j <= i) and (window is None or i - j < window)
                and (q_seg is None or q_seg[bi, i] == kv_seg[bi, j])]
        if not keys:
            continue
        logits = np.array([q[bi, i, hi] @ k[bi, j, hi] for j in keys]) * scale
        p = np.exp(logits - logits.max())
        out[bi, i, hi] = (p / p.sum()) @ v[bi, keys, hi]
    return out


@pytest.mark.parametrize("h,g,causal,segmented,window", [
    (4, 4, True, False, None),
    (4, 2, True, True, 5),
    (4, 1, False, True, None),
])
def test_reference_matches_naive_attention(h, g, causal, segmented, window):
    b, s, d = 2, 12, 8
    q, k, v, _ = _inputs(b, s, s, h, g, d, jnp.float32)
    seg = _segments(b, s, [5, 4, 3]) if segmented else None
    got = jax.jit(lambda q, k, v: flash_attention_reference(
        q, k, v, causal=causal, segment_ids=seg, sliding_window=window))(q, k, v)
    want = _naive(q, k, v, causal=causal, segment_ids=seg, scale=1 / math.sqrt(d), window=window)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_reference_seq_q_differs_from_seq_kv_and_empty_rows_are_zero():
    q, k, v, _ = _inputs(1, 6, 10, 2, 1, 8, jnp.float32)
    q_seg = jnp.array([[0, 0, 1, 1, 9, 9]])          # segment 9 has no keys
    kv_seg = jnp.array([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2]])
    got = jax.jit(lambda q, k, v: flash_attention_reference(
        q, k, v, causal=False, segment_ids=(q_seg, kv_seg), softmax_scale=0.3))(q, k, v)
    want = _naive(q, k, v, causal=False, segment_ids=(q_seg, kv_seg), scale=0.3, window=None)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert not np.any(np.asarray(got[:, 4:]))


def test_reference_agrees_with_model_xla_attention():
    q, k, v, _ = _inputs(2, 16, 16, 4, 2, 8, jnp.float32)
    seg = _segments(2, 16, [6, 10])
    got = jax.jit(lambda q, k, v: flash_attention_reference(q, k, v, segment_ids=seg))(q, k, v)
    want = jax.jit(lambda q, k, v: xla_attention(q, k, v, segment_ids=seg))(q, k, v)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- kernel vs reference

def _blocks(q, k, q_dq, k_dq, q_dkv, k_dkv):
    return dict(block_q=q, block_k=k, block_q_dq=q_dq, block_k_dq=k_dq, block_q_dkv=q_dkv,
                block_k_dkv=k_dkv)


# (name, b, sq, sk, h, g, d, dtype, causal, segments, window, kernel kwargs)
CASES = [
    ("gqa_causal_ragged", 1, 80, 80, 4, 2, 64, jnp.float32, True, None, None,
     _blocks(32, 32, 32, 32, 32, 32)),
    ("mqa_noncausal_pair_segments_ragged", 2, 48, 80, 4, 1, 64, jnp.float32, False,
     "pair", None, _blocks(16, 32, 32, 16, 16, 32)),
    ("gqa_segments_window_hd128", 1, 80, 80, 4, 2, 128, jnp.float32, True, "shared", 24,
     _blocks(32, 16, 16, 32, 32, 16)),
    ("mha_hd256_causal_window", 1, 48, 48, 2, 2, 256, jnp.float32, True, None, 20,
     _blocks(16, 16, 16, 16, 16, 16)),
    ("bf16_gqa_causal_hd128", 1, 64, 64, 4, 2, 128, jnp.bfloat16, True, "shared", None,
     _blocks(32, 16, 32, 16, 16, 32)),
    ("fp16_mha_noncausal_ragged_default_blocks", 1, 40, 40, 2, 2, 64, jnp.float16, False, None,
     None, {}),
]


def _segment_arg(kind, b, sq, sk):
    if kind == "shared":
        return _segments(b, sq, [sq // 3, sq // 2, sq])
    if kind == "pair":
        return (_segments(b, sq, [sq // 2, sq]), _segments(b, sk, [sk // 3, sk]))
    return None


def _out_and_grads(f, q, k, v, do):
    """f(q, k, v) and its (dq, dk, dv) for cotangent do, as one compiled program."""
    def run(q, k, v, do):
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(do))
    return jax.jit(run)(q, k, v, do)


def _rel_err(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-6))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_matches_reference_forward_and_gradients(case):
    _, b, sq, sk, h, g, d, dtype, causal, seg_kind, window, kw = case
    q, k, v, do = _inputs(b, sq, sk, h, g, d, dtype)
    seg = _segment_arg(seg_kind, b, sq, sk)
    sem = dict(causal=causal, segment_ids=seg, sliding_window=window)
    got = _out_and_grads(lambda q, k, v: flash_attention(q, k, v, **sem, **kw), q, k, v, do)
    want = _out_and_grads(lambda q, k, v: flash_attention_reference(q, k, v, **sem), q, k, v, do)
    assert got[0].shape == q.shape and got[0].dtype == q.dtype
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for name, got, want in zip(["out", "dq", "dk", "dv"], got, want):
        assert got.dtype == want.dtype, name
        assert _rel_err(got, want) < tol, (name, _rel_err(got, want))


def test_kernel_runs_without_jit_with_explicit_scale():
    q, k, v, _ = _inputs(1, 32, 32, 2, 1, 64, jnp.float32)
    got = flash_attention(q, k, v, softmax_scale=0.2, block_q=16, block_k=16)
    want = jax.jit(lambda q, k, v: flash_attention_reference(q, k, v, softmax_scale=0.2))(q, k, v)
    assert _rel_err(got, want) < 1e-5


def test_kernel_rows_without_keys_give_zero_output_and_gradients():
    q, k, v, do = _inputs(1, 32, 32, 2, 2, 64, jnp.float32)
    q_seg = jnp.concatenate([jnp.zeros((1, 16), jnp.int32), jnp.full((1, 16), 5, jnp.int32)], 1)
    kv_seg = jnp.zeros((1, 32), jnp.int32)
    sem = dict(causal=False, segment_ids=(q_seg, kv_seg))
    got = _out_and_grads(lambda q, k, v: flash_attention(q, k, v, **sem, **_blocks(*[16] * 6)),
                         q, k, v, do)
    want = _out_and_grads(lambda q, k, v: flash_attention_reference(q, k, v, **sem), q, k, v, do)
    out, dq, _, _ = got
    assert all(np.all(np.isfinite(x)) for x in got)
    assert not np.any(np.asarray(out[:, 16:])) and not np.any(np.asarray(dq[:, 16:]))
    for a, b_ in zip(got, want):
        assert _rel_err(a, b_) < 1e-5


@pytest.mark.parametrize("h,g,d,dtype,causal,segments,window", [
    (8, 2, 128, jnp.bfloat16, True, "shared", 256),
    (4, 1, 64, jnp.float32, False, "pair", None),
    (4, 4, 256, jnp.float16, True, None, None),
])
def test_kernels_lower_to_triton_for_gpu(h, g, d, dtype, causal, segments, window):
    """The compiled (non-interpret) path: lowering for CUDA runs Pallas' Triton lowering
    of all three kernels, which needs no GPU, and catches unsupported constructs.

    The lowering asks for the target GPU (jax >= 0.11 raises 'No supported GPU devices found'
    without one): an abstract mesh names it, JAX's device-less ahead-of-time route. jax 0.10
    ignores it and falls back to compute capability 9.0, the same target."""
    b, sq, sk = 2, 1000, (1000 if causal else 700)
    q = jax.ShapeDtypeStruct((b, sq, h, d), dtype)
    kv = jax.ShapeDtypeStruct((b, sk, g, d), dtype)
    seg = {"shared": jax.ShapeDtypeStruct((b, sq), jnp.int32),
           "pair": (jax.ShapeDtypeStruct((b, sq), jnp.int32),
                    jax.ShapeDtypeStruct((b, sk), jnp.int32))}.get(segments)

    def loss(q, k, v, seg):
        out = flash_attention(q, k, v, causal=causal, segment_ids=seg, sliding_window=window,
                              interpret=False)
        return out.astype(jnp.float32).sum()

    h100 = AbstractMesh((1,), ("x",), (AxisType.Auto,),
                        abstract_device=AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="cuda"))
    with use_abstract_mesh(h100):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv, seg).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("triton") >= 3                      # forward, dq and dk/dv kernels


# --------------------------------------------------------------------------- block skipping


def _brute_force_ranges(block_q, block_k, sq_pad, sk_pad, kv_len, causal, window):
    """Per (q block, kv block): 'skip', 'masked' or 'full', from every position pair."""
    nq, nk = sq_pad // block_q, sk_pad // block_k
    kind = {}
    for i, j in itertools.product(range(nq), range(nk)):
        vis = [(qp, kp) for qp in range(i * block_q, (i + 1) * block_q)
               for kp in range(j * block_k, (j + 1) * block_k)
               if (not causal or kp <= qp) and (window is None or qp - kp < window)]
        all_real = (j + 1) * block_k <= kv_len
        if not vis:
            kind[i, j] = "skip"
        elif len(vis) == block_q * block_k and all_real:
            kind[i, j] = "full"
        else:
            kind[i, j] = "masked"
    return kind


def _from_range(rng, n, idx_is_q):
    lo, full_lo, full_hi, hi = (int(x) for x in rng)
    assert 0 <= lo <= full_lo <= full_hi <= hi <= n
    return {t: ("skip" if t < lo or t >= hi else "full" if full_lo <= t < full_hi else "masked")
            for t in range(n)}


@pytest.mark.parametrize("block_q,block_k,seq,causal,window", [
    (16, 16, 64, True, None), (32, 16, 80, True, None), (16, 32, 80, True, 20),
    (16, 16, 64, True, 1), (32, 32, 70, False, None), (16, 32, 96, True, 40),
])
def test_block_ranges_visit_exactly_the_blocks_with_visible_pairs(block_q, block_k, seq, causal,
                                                                  window):
    pad = max(block_q, block_k)
    s_pad = -(-seq // pad) * pad
    kinds = _brute_force_ranges(block_q, block_k, s_pad, s_pad, seq, causal, window)
    nq, nk = s_pad // block_q, s_pad // block_k
    common = dict(block_q=block_q, block_k=block_k, kv_len=seq, causal=causal, window=window)
    for i in range(nq):
        got = _from_range(kv_block_range(i, num_kv_blocks=nk, **common), nk, False)
        want = {j: kinds[i, j] for j in range(nk)}
        assert {j for j in got if got[j] == "skip"} == {j for j in want if want[j] == "skip"}
        assert all(want[j] == "full" for j in got if got[j] == "full")
        assert all(got[j] == "full" for j in want if want[j] == "full"), (i, got, want)
    for j in range(nk):
        got = _from_range(q_block_range(j, num_q_blocks=nq, **common), nq, True)
        want = {i: kinds[i, j] for i in range(nq)}
        assert {i for i in got if got[i] == "skip"} == {i for i in want if want[i] == "skip"}
        assert all(got[i] == "full" for i in want if want[i] == "full"), (j, got, want)
        assert all(want[i] == "full" for i in got if got[i] == "full")


def test_causal_kernel_loops_skip_blocks_above_the_diagonal():
    """seq 256, blocks 32: causal visits 36 of the 64 (q, kv) block pairs and builds a mask
    only for the 8 diagonal ones; a 64-key window visits at most 3 kv blocks per q block."""
    n, blk = 8, 32
    common = dict(block_q=blk, block_k=blk, kv_len=n * blk)
    ranges = [kv_block_range(i, num_kv_blocks=n, causal=True, window=None, **common)
              for i in range(n)]
    visited = sum(int(r.hi) - int(r.lo) for r in ranges)
    masked = sum(int(r.hi) - int(r.lo) - (int(r.full_hi) - int(r.full_lo)) for r in ranges)
    assert (visited, masked) == (36, 8)
    # Sliding window of 64 keys: each q block touches at most 3 kv blocks.
    ranges = [kv_block_range(i, num_kv_blocks=n, causal=True, window=64, **common)
              for i in range(n)]
    assert [int(r.hi) - int(r.lo) for r in ranges] == [1, 2, 3, 3, 3, 3, 3, 3]
    # The dk/dv side mirrors it.
    ranges = [q_block_range(j, num_q_blocks=n, causal=True, window=None, **common)
              for j in range(n)]
    assert sum(int(r.hi) - int(r.lo) for r in ranges) == 36


# --------------------------------------------------------------------------- configuration


def test_default_block_table_covers_head_dims_and_dtypes():
    for d in (64, 128, 256):
        for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
            sizes = default_block_sizes(d, dtype)
            assert all(v >= 16 and v & (v - 1) == 0 for k_, v in sizes.items()
                       if k_.startswith("block"))
    assert default_block_sizes(128, jnp.float32)["block_k"] < default_block_sizes(
        128, jnp.bfloat16)["block_k"]


@pytest.mark.parametrize("kwargs,shapes,message", [
    (dict(causal=True), ((1, 8, 2, 16), (1, 16, 2, 16)), "seq_q == seq_kv"),
    (dict(block_q=24), ((1, 8, 2, 16), (1, 8, 2, 16)), "power of two"),
    (dict(causal=False, sliding_window=4), ((1, 8, 2, 16), (1, 8, 2, 16)), "causal"),
    (dict(), ((1, 8, 3, 16), (1, 8, 2, 16)), "multiple of kv_heads"),
])
def test_bad_arguments_raise_with_values(kwargs, shapes, message):
    q = jnp.zeros(shapes[0], jnp.float32)
    k = jnp.zeros(shapes[1], jnp.float32)
    with pytest.raises(ValueError, match=message):
        flash_attention(q, k, k, **kwargs)


def test_kernel_matches_reference_on_fresh_random_inputs():
    """A new seed every run (printed on failure): GQA, causal, packed documents, ragged length."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    q, k, v, do = _inputs(1, 56, 56, 4, 2, 64, jnp.float32, seed=seed)
    sem = dict(causal=True, segment_ids=_segments(1, 56, [9, 20, 56]))
    got = _out_and_grads(lambda q, k, v: flash_attention(q, k, v, block_q=16, block_k=16, **sem), q, k, v, do)
    want = _out_and_grads(lambda q, k, v: flash_attention_reference(q, k, v, **sem), q, k, v, do)
    for name, a, b in zip(["out", "dq", "dk", "dv"], got, want):
        assert _rel_err(a, b) < 1e-5, (name, seed, _rel_err(a, b))


def test_outputs_ignore_the_future_and_other_documents():
    """Property: output at position t changes neither when inputs after t change (causal) nor when
    inputs of another document change."""
    q, k, v, _ = _inputs(1, 48, 48, 2, 1, 64, jnp.float32, seed=3)
    seg = _segments(1, 48, [20, 48])  # positions 0..19 document 0, 20..47 document 1 (rolled per row)
    attend = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True, segment_ids=seg,
                                                     block_q=16, block_k=16))
    base = np.asarray(attend(q, k, v))
    t = 30
    noise = jax.random.normal(jax.random.key(1), q.shape)
    later = jnp.arange(48)[None, :, None, None] > t
    changed = np.asarray(attend(jnp.where(later, q + noise, q), jnp.where(later[:, :, :1], k + noise[:, :, :1], k),
                                jnp.where(later[:, :, :1], v + noise[:, :, :1], v)))
    np.testing.assert_array_equal(changed[:, :t + 1], base[:, :t + 1])
    assert not np.allclose(changed[:, t + 1:], base[:, t + 1:])
    other = (np.asarray(seg) != np.asarray(seg)[0, 0])[:, :, None, None]  # not position 0's document
    k2 = jnp.where(other[:, :, :1], k + noise[:, :, :1], k)
    v2 = jnp.where(other[:, :, :1], v + noise[:, :, :1], v)
    same_doc = ~other[0, :, 0, 0]
    np.testing.assert_array_equal(np.asarray(attend(q, k2, v2))[:, same_doc], base[:, same_doc])
