"""The SSD scan: the reference against a float64 loop, the chunked jnp form and the Pallas kernels
(interpret mode on CPU) against the reference, forward and backward; the chunked form's cost is
linear in the sequence length (no [L, L] intermediate in its jaxpr)."""

import importlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

from pallas_kernels.ssd import _chunked_forward, _segsum, ssd, ssd_chunked, ssd_flops, ssd_reference

ARGS = ("x", "dt", "A", "B", "C", "initial_state")


def _inputs(b, l, h, p, g, n, dtype=jnp.float32, *, seed=0, decay=(0.5, 4.0), dt_range=(0.01, 0.5)):
    """x, dt, A, B, C, initial_state and cotangents for y and the final state (numpy's generator)."""
    rng = np.random.default_rng(seed)
    normal = lambda *s: rng.standard_normal(s).astype(np.float32)
    x, bm, cm = normal(b, l, h, p), normal(b, l, g, n), normal(b, l, g, n)
    dt = rng.uniform(*dt_range, (b, l, h)).astype(np.float32)
    a = -rng.uniform(*decay, (h,)).astype(np.float32)
    h0, dy, dfinal = normal(b, h, p, n), normal(b, l, h, p), normal(b, h, p, n)
    cast = lambda t: jnp.asarray(t, dtype)
    return (cast(x), jnp.asarray(dt), jnp.asarray(a), cast(bm), cast(cm), jnp.asarray(h0)), (jnp.asarray(dy),
                                                                                             jnp.asarray(dfinal))


def _naive(x, dt, A, B, C, h0):
    """The recurrence in float64, one (batch, head, step) at a time."""
    x, dt, A, B, C, s = (np.asarray(t, np.float64) for t in (x, dt, A, B, C, h0))
    b, l, h, p = x.shape
    rep = h // B.shape[2]
    y = np.zeros_like(x)
    for bi, hi, t in itertools.product(range(b), range(h), range(l)):
        gi = hi // rep
        s[bi, hi] = np.exp(dt[bi, t, hi] * A[hi]) * s[bi, hi] + dt[bi, t, hi] * np.outer(x[bi, t, hi], B[bi, t, gi])
        y[bi, t, hi] = s[bi, hi] @ C[bi, t, gi]
    return y, s


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got))
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-12))


def _value_and_grads(f, cts, with_state=True):
    """jit(loss and gradients in all six inputs), loss = <y, dy> + <final, dfinal>."""
    dy, dfinal = cts

    def loss(x, dt, A, B, C, h0):
        y, final = f(x, dt, A, B, C, initial_state=h0 if with_state else None, return_final_state=True)
        return jnp.sum(y.astype(jnp.float32) * dy) + jnp.sum(final * dfinal)
    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6))))


def test_reference_matches_a_float64_loop():
    args, _ = _inputs(2, 9, 4, 3, 2, 5)
    y, final = jax.jit(lambda *a: ssd_reference(*a[:5], initial_state=a[5], return_final_state=True))(*args)
    want_y, want_final = _naive(*args)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(final, want_final, rtol=1e-5, atol=1e-5)
    # Without an initial state it starts from zeros.
    zero = args[:5] + (jnp.zeros_like(args[5]),)
    np.testing.assert_allclose(ssd_reference(*args[:5]), _naive(*zero)[0], rtol=1e-5, atol=1e-5)


# (b, l, h, p, g, n, chunk, initial state)
CHUNKED = [
    (2, 64, 4, 8, 1, 8, 16, False),      # one group, L a multiple of the chunk
    (2, 50, 4, 8, 2, 6, 16, True),       # two groups, ragged L, initial and final state
    (1, 5, 2, 4, 2, 4, 16, True),        # L shorter than one chunk (decode-like)
    (1, 40, 6, 4, 3, 4, 8, False),       # three groups of two heads, many chunks
]


@pytest.mark.parametrize("b,l,h,p,g,n,chunk,with_state", CHUNKED)
def test_chunked_matches_reference(b, l, h, p, g, n, chunk, with_state):
    args, _ = _inputs(b, l, h, p, g, n)
    kw = lambda a: dict(initial_state=a[5] if with_state else None, return_final_state=True)
    got = jax.jit(lambda *a: ssd_chunked(*a[:5], chunk_size=chunk, **kw(a)))(*args)
    want = jax.jit(lambda *a: ssd_reference(*a[:5], **kw(a)))(*args)
    for name, gv, wv in zip(("y", "final"), got, want):
        assert _rel(gv, wv) < 1e-5, name
    assert got[0].shape == (b, l, h, p) and got[1].shape == (b, h, p, n)
    # Unjitted, and without the final state, it returns y alone.
    y = ssd_chunked(*args[:5], chunk_size=chunk, initial_state=args[5] if with_state else None)
    assert _rel(y, want[0]) < 1e-5


@pytest.mark.parametrize("b,l,h,p,g,n,chunk,with_state", [CHUNKED[1], CHUNKED[3]])
def test_chunked_gradients_match_reference(b, l, h, p, g, n, chunk, with_state):
    args, cts = _inputs(b, l, h, p, g, n)
    v, grads = _value_and_grads(lambda *a, **k: ssd_chunked(*a, chunk_size=chunk, **k), cts, with_state)(*args)
    v_ref, want = _value_and_grads(ssd_reference, cts, with_state)(*args)
    assert abs(float(v - v_ref)) <= 1e-5 * abs(float(v_ref))
    names = ARGS if with_state else ARGS[:5]
    for name, gv, wv in zip(names, grads, want):
        assert _rel(gv, wv) < 1e-4, name


def _autodiff_chunked(x, dt, A, B, C, *, chunk_size, initial_state=None, return_final_state=False,
                      segment_ids=None):
    """The chunked form's forward differentiated by autodiff (what ssd_chunked's written gradient replaces)."""
    b, _, h, p = x.shape
    h0 = jnp.zeros((b, h, p, B.shape[3]), jnp.float32) if initial_state is None else initial_state
    y, final, _ = _chunked_forward(x, dt, A, B, C, h0, segment_ids, chunk_size)
    return (y, final) if return_final_state else y


@pytest.mark.parametrize("b,l,h,p,g,n,chunk,with_state,documents", [
    (2, 50, 4, 8, 2, 6, 16, True, True),     # two groups, ragged L, initial state, document boundaries
    (1, 40, 6, 4, 3, 4, 8, False, False),    # three groups of two heads, many chunks
    (1, 5, 2, 4, 1, 4, 16, True, False),     # L shorter than one chunk
])
def test_chunked_written_gradient_matches_autodiff_of_its_forward(b, l, h, p, g, n, chunk, with_state, documents):
    """ssd_chunked's custom_vjp against jax.grad of the same chunked forward: every input's gradient
    (the initial state's too) to fp32 rounding, with and without segment ids."""
    args, cts = _inputs(b, l, h, p, g, n, seed=3)
    seg = _segment_ids(2, 50, SEGMENTS) if documents else None
    k = dict(chunk_size=chunk, segment_ids=seg)
    v, grads = _value_and_grads(lambda *a, **kw: ssd_chunked(*a, **k, **kw), cts, with_state)(*args)
    v_ad, want = _value_and_grads(lambda *a, **kw: _autodiff_chunked(*a, **k, **kw), cts, with_state)(*args)
    assert abs(float(v - v_ad)) <= 1e-6 * abs(float(v_ad))
    for name, gv, wv in zip(ARGS if with_state else ARGS[:5], grads, want):
        assert _rel(gv, wv) < 2e-6, name
    if documents:  # it keeps far less for the backward (the point of writing it): the inputs and chunk states
        kept = lambda f: sum(int(np.prod(t.shape)) for t in jax.tree.leaves(
            jax.vjp(lambda *a: f(*a, **k), *args[:5])[1]) if hasattr(t, "shape"))
        assert kept(ssd_chunked) < 0.5 * kept(_autodiff_chunked)


def test_chunked_written_gradient_sums_the_inputs_that_vary_less_under_shard_map():
    """Inside a shard_map that checks varying types (a pipeline stage): x, dt, B, C split by batch and
    A replicated; A's gradient is the sum over the shards, as on one device."""
    from jax.sharding import PartitionSpec as P
    args, cts = _inputs(4, 24, 4, 4, 2, 4, seed=5)
    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,))

    def loss(x, dt, A, B, C, dy):
        local = lambda x, dt, A, B, C, dy: jax.lax.psum(jnp.sum(ssd_chunked(x, dt, A, B, C, chunk_size=8) * dy), "data")
        row = P("data")
        return jax.shard_map(local, mesh=mesh, in_specs=(row, row, P(), row, row, row), out_specs=P())(
            x, dt, A, B, C, dy)

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*args[:5], cts[0])
    want = jax.jit(jax.grad(lambda *a: jnp.sum(ssd_reference(*a[:5]) * a[5]), argnums=(0, 1, 2, 3, 4)))(
        *args[:5], cts[0])
    for name, gv, wv in zip(ARGS, got, want):
        assert _rel(gv, wv) < 1e-5, name


def test_chunked_gradients_are_finite_under_strong_decay():
    """exp(segsum) underflows to 0 and is -inf above the diagonal: no NaN or inf in any gradient
    (differences of cumulative sums would overflow above the diagonal)."""
    args, cts = _inputs(1, 32, 2, 4, 1, 4, decay=(40.0, 60.0), dt_range=(1.0, 3.0))
    _, grads = _value_and_grads(lambda *a, **k: ssd_chunked(*a, chunk_size=16, **k), cts)(*args)
    for name, gv in zip(ARGS, grads):
        assert np.all(np.isfinite(np.asarray(gv))), name
    seg = _segsum(jnp.asarray([-1.0, -2.0, -3.0]))
    np.testing.assert_allclose(seg, [[0, -np.inf, -np.inf], [-2, 0, -np.inf], [-5, -3, 0]])


# --------------------------------------------------------------------------- linear cost


def _avals(jaxpr):
    """Every variable's shape in a jaxpr and in the jaxprs nested in its equations (scan bodies, ...)."""
    for eqn in jaxpr.eqns:
        for v in itertools.chain(eqn.invars, eqn.outvars):
            if hasattr(v.aval, "shape"):
                yield v.aval.shape
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _avals(inner)


def _largest_per_head(f, l, chunk):
    """The largest intermediate of f and of its gradient, in elements per (batch, head), and whether
    any shape has L in two dims."""
    args, cts = _inputs(1, l, 2, 4, 1, 4)
    fwd = jax.make_jaxpr(lambda *a: f(*a[:5], chunk_size=chunk))(*args).jaxpr
    bwd = jax.make_jaxpr(lambda *a: jax.grad(lambda *a: jnp.sum(f(*a, chunk_size=chunk) * cts[0]),
                                             argnums=(0, 1, 2, 3, 4))(*a[:5]))(*args).jaxpr
    shapes = list(_avals(fwd)) + list(_avals(bwd))
    largest = max(int(np.prod(s)) for s in shapes) // 2
    return largest, any(list(s).count(l) >= 2 for s in shapes)


@pytest.mark.parametrize("documents", [False, True])
def test_states_between_chunks_by_product_and_by_scan_agree(monkeypatch, documents):
    """Few chunks pass the states by one product of the decays between chunks, many by a scan over
    the chunks (PRODUCT_MAX_CHUNKS): both give the reference's outputs, final state and gradients."""
    ssd_module = importlib.import_module("pallas_kernels.ssd")  # the package exports a function `ssd`
    b, l, h, p, g, n, chunk = 2, 50, 4, 8, 2, 6, 8
    args, cts = _inputs(b, l, h, p, g, n, seed=5)
    seg = _segment_ids(2, 50, SEGMENTS) if documents else None
    v_ref, want = _value_and_grads(lambda *a, **kw: ssd_reference(*a, segment_ids=seg, **kw), cts, True)(*args)
    for limit in (ssd_module.PRODUCT_MAX_CHUNKS, 0):  # 7 chunks: the product, then the scan
        monkeypatch.setattr(ssd_module, "PRODUCT_MAX_CHUNKS", limit)
        v, grads = _value_and_grads(lambda *a, **kw: ssd_chunked(*a, chunk_size=chunk, segment_ids=seg, **kw),
                                    cts, True)(*args)
        assert abs(float(v - v_ref)) <= 1e-5 * abs(float(v_ref)), limit
        for name, gv, wv in zip(ARGS, grads, want):
            assert _rel(gv, wv) < 1e-4, (limit, name)


def _quadratic(x, dt, A, B, C, *, chunk_size):
    """The whole sequence as one chunk: the [L, L] form the chunked scan avoids (a control)."""
    return ssd_chunked(x, dt, A, B, C, chunk_size=x.shape[1])


def test_chunked_cost_is_linear_in_length():
    l, chunk = 1024, 64
    largest, square = _largest_per_head(ssd_chunked, l, chunk)
    assert not square and largest <= l * chunk, largest          # [chunks, Q, Q] at most
    largest, square = _largest_per_head(_quadratic, l, chunk)    # the check sees an [L, L] form
    assert square and largest >= l * l


def test_flops_formula():
    b, l, h, p, n, g, q = 2, 1000, 8, 64, 128, 2, 256
    lp = 1024
    want = 2 * b * lp * (q * n * g + q * p * h + 2 * p * n * h)
    assert ssd_flops(b, l, h, p, n, g, q) == want
    assert ssd_flops(b, 2 * lp, h, p, n, g, q) == 2 * want       # linear in the length


# --------------------------------------------------------------------------- Pallas kernels


# (b, l, h, p, g, n, chunk, initial state, dtype)
KERNEL = [
    (2, 64, 4, 16, 2, 16, 16, True, jnp.float32),   # the typical small case: two groups, four chunks
    (1, 45, 2, 8, 1, 12, 16, False, jnp.float32),   # one group, ragged L, P and N padded to 16
]


@pytest.mark.parametrize("b,l,h,p,g,n,chunk,with_state,dtype", KERNEL)
def test_kernel_matches_reference_forward_and_backward(b, l, h, p, g, n, chunk, with_state, dtype):
    args, cts = _inputs(b, l, h, p, g, n, dtype)
    f = lambda *a, **k: ssd(*a, chunk_size=chunk, interpret=True, **k)
    v, grads = _value_and_grads(f, cts, with_state)(*args)
    v_ref, want = _value_and_grads(ssd_reference, cts, with_state)(*args)
    assert abs(float(v - v_ref)) <= 1e-5 * abs(float(v_ref))
    for name, gv, wv in zip(ARGS if with_state else ARGS[:5], grads, want):
        assert gv.dtype == wv.dtype and _rel(gv, wv) < 1e-4, name
    y, final = f(*args[:5], initial_state=args[5] if with_state else None, return_final_state=True)
    y_ref, final_ref = ssd_reference(*args[:5], initial_state=args[5] if with_state else None,
                                     return_final_state=True)
    assert y.shape == y_ref.shape and final.shape == final_ref.shape and final.dtype == jnp.float32
    assert _rel(y, y_ref) < 1e-5 and _rel(final, final_ref) < 1e-5


def test_bf16_inputs_kernel_and_chunked_near_the_fp32_reference():
    args, cts = _inputs(2, 48, 4, 16, 2, 16, jnp.bfloat16)
    y_ref, final_ref = ssd_reference(*args[:5], initial_state=args[5], return_final_state=True)
    for f in (lambda *a, **k: ssd(*a, chunk_size=16, interpret=True, **k),
              lambda *a, **k: ssd_chunked(*a, chunk_size=16, **k)):
        y, final = jax.jit(lambda *a: f(*a[:5], initial_state=a[5], return_final_state=True))(*args)
        assert y.dtype == jnp.bfloat16 and final.dtype == jnp.float32
        assert _rel(y, y_ref) < 3e-2 and _rel(final, final_ref) < 3e-2
    _, grads = _value_and_grads(lambda *a, **k: ssd(*a, chunk_size=16, interpret=True, **k), cts)(*args)
    _, want = _value_and_grads(ssd_reference, cts)(*args)
    for name, gv, wv in zip(ARGS, grads, want):
        assert gv.dtype == wv.dtype and _rel(gv, wv) < 5e-2, name


def test_bad_arguments_name_their_values():
    args, _ = _inputs(1, 16, 3, 4, 2, 4)
    with pytest.raises(ValueError, match="heads=3 is not a multiple of groups=2"):
        ssd_chunked(*args[:5], chunk_size=16)
    args, _ = _inputs(1, 16, 2, 4, 1, 4)
    with pytest.raises(ValueError, match="chunk_size=24"):
        ssd(*args[:5], chunk_size=24)


@pytest.mark.parametrize("dtype,l,p,n,chunk,documents", [(jnp.bfloat16, 200, 64, 128, 64, False),
                                                        (jnp.float32, 128, 24, 16, 128, True)])
def test_kernels_lower_to_triton_for_cuda(dtype, l, p, n, chunk, documents):
    """Pallas' Triton lowering accepts every kernel, with segment ids too (no GPU needed to lower; the
    GPU suite compiles and runs them)."""
    b, h, g = 2, 4, 2
    sd = jax.ShapeDtypeStruct
    args = (sd((b, l, h, p), dtype), sd((b, l, h), jnp.float32), sd((h,), jnp.float32), sd((b, l, g, n), dtype),
            sd((b, l, g, n), dtype), sd((b, h, p, n), jnp.float32))

    def loss(x, dt, A, B, C, h0):
        seg = (jnp.arange(l) // 37)[None].repeat(b, 0) if documents else None
        y, final = ssd(x, dt, A, B, C, chunk_size=chunk, initial_state=h0, return_final_state=True, interpret=False,
                       segment_ids=seg)
        return y.astype(jnp.float32).sum() + final.sum()

    h100 = AbstractMesh((1,), ("x",), (AxisType.Auto,),
                        abstract_device=AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="cuda"))
    with use_abstract_mesh(h100):
        text = jax.jit(jax.grad(loss, argnums=tuple(range(6)))).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("triton") >= 4                      # chunk state x 2, chunk scan, chunk scan backward


# --------------------------------------------------------------------------- document boundaries


def _segment_ids(b: int, l: int, starts: list[list[int]]) -> jnp.ndarray:
    """[B, L] int32: row r's documents start at starts[r] (and 0), numbered from 0."""
    seg = np.zeros((b, l), np.int32)
    for r, row in enumerate(starts):
        for s in row:
            seg[r, s:] += 1
    return jnp.asarray(seg)


def _naive_documents(x, dt, A, B, C, h0, seg):
    """Each document of each row run alone by the float64 loop, the first from the initial state and
    the others from zeros: (y, the final state of each row's last document)."""
    seg = np.asarray(seg)
    b, l, h, p = x.shape
    y, final = np.zeros((b, l, h, p)), np.zeros((b, h, p, B.shape[3]))
    for r in range(b):
        cuts = [0] + [t for t in range(1, l) if seg[r, t] != seg[r, t - 1]] + [l]
        for i, (lo, hi) in enumerate(zip(cuts[:-1], cuts[1:])):
            start = np.asarray(h0)[r:r + 1] if i == 0 else np.zeros((1,) + final.shape[1:])
            part = lambda t: np.asarray(t)[r:r + 1, lo:hi]
            yy, ff = _naive(part(x), part(dt), A, part(B), part(C), start)
            y[r, lo:hi], final[r] = yy[0], ff[0]
    return y, final


# Documents starting mid-chunk, at a chunk's first and last token, one a single token long, a chunk
# holding three boundaries; row 1: a boundary at the last token; ragged L (padding in the last chunk).
SEGMENTS = [[5, 16, 31, 32, 35, 38, 47], [15, 30, 49]]
SSD_FORMS = {
    "reference": ssd_reference,
    "chunked": lambda *a, **k: ssd_chunked(*a, chunk_size=16, **k),
    "kernel": lambda *a, **k: ssd(*a, chunk_size=16, interpret=True, **k),
}


@pytest.mark.parametrize("form", list(SSD_FORMS))
def test_the_state_resets_at_every_document_boundary(form):
    """Every form, forward: y and the final state equal each document run alone (the float64 loop)."""
    args, _ = _inputs(2, 50, 4, 8, 2, 6)
    seg = _segment_ids(2, 50, SEGMENTS)
    f = SSD_FORMS[form]
    y, final = jax.jit(lambda *a: f(*a[:5], initial_state=a[5], return_final_state=True, segment_ids=seg))(*args)
    want_y, want_final = _naive_documents(*args, seg)
    assert _rel(y, want_y) < 1e-5 and _rel(final, want_final) < 1e-5
    # One segment id per row is the scan without segment ids.
    one = f(*args[:5], initial_state=args[5], segment_ids=jnp.zeros((2, 50), jnp.int32))
    assert _rel(one, f(*args[:5], initial_state=args[5])) < 1e-6


@pytest.mark.parametrize("form", ["chunked", "kernel"])
def test_document_boundaries_backward_match_reference(form):
    """The chunked form's autodiff and the Pallas backward kernels with segment ids: every input's
    gradient (the initial state's too) equals the reference's."""
    args, cts = _inputs(2, 50, 4, 8, 2, 6)
    seg = _segment_ids(2, 50, SEGMENTS)
    with_seg = lambda f: lambda *a, **k: f(*a, segment_ids=seg, **k)
    v, grads = _value_and_grads(with_seg(SSD_FORMS[form]), cts)(*args)
    v_ref, want = _value_and_grads(with_seg(ssd_reference), cts)(*args)
    assert abs(float(v - v_ref)) <= 1e-5 * abs(float(v_ref))
    for name, gv, wv in zip(ARGS, grads, want):
        assert _rel(gv, wv) < 1e-5, name
    # The boundaries matter to the gradients: without them the same inputs give others.
    _, plain = _value_and_grads(SSD_FORMS[form], cts)(*args)
    assert _rel(plain[0], want[0]) > 1e-2


def test_segment_ids_of_the_wrong_shape_are_refused():
    args, _ = _inputs(1, 16, 2, 4, 1, 4)
    with pytest.raises(ValueError, match=r"segment_ids \(1, 15\) is not \[B, L\]=\(1, 16\)"):
        ssd_chunked(*args[:5], chunk_size=16, segment_ids=jnp.zeros((1, 15), jnp.int32))
