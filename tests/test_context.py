"""Attention kernels in the model, and context parallelism (ring / all-gather), against one device."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megajax.data.indexed import IndexedDatasetWriter
from megajax.errors import ConfigError, MeshError
from megajax.plan import make_plan
from megajax.train.loop import build_trainer

from layout_parity import assert_same_run, reference, run

DOCS = ["data.reset_position_ids=true", "data.reset_attention_mask=true", "data.eod_mask_loss=true",
        "train.eval_every=0"]


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory):
    """Documents of 3..40 bytes (ended by the byte tokenizer's EOD, 256): samples cross many of them."""
    rng = np.random.default_rng(0)
    prefix = str(tmp_path_factory.mktemp("docs") / "docs_text_document")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for _ in range(2000):
            w.add_document(np.append(rng.integers(97, 123, rng.integers(3, 40)), 256))
    return prefix


def data_overrides(corpus):
    """Document-aware batches from `corpus` ('' : the embedded corpus, plain batches)."""
    return [f"data.path={corpus}", *DOCS] if corpus else []


CONTEXT_LAYOUTS = {
    "context2_data4": ["mesh.context=2", "mesh.data=4"],
    "context4_data2": ["mesh.context=4", "mesh.data=2"],
    "context2_tensor2_data2_sp": ["mesh.context=2", "mesh.tensor=2", "mesh.data=2",
                                  "parallel.sequence_parallel=true"],
}
FLASH_LAYOUTS = {
    "flash_tensor4_data2": ["mesh.tensor=4", "mesh.data=2", "model.attention_impl=flash"],
    "flash_ring_context2_tensor2_data2": ["mesh.context=2", "mesh.tensor=2", "mesh.data=2",
                                          "model.attention_impl=flash"],
}


# Every layout with both implementations, each implementation with and without documents (segment
# ids), not all 12 combinations: each case costs ~30 s on a 2-core machine.
CONTEXT_CASES = [("context2_data4", "ring", True), ("context2_data4", "allgather", False),
                 ("context4_data2", "ring", False), ("context4_data2", "allgather", True),
                 ("context2_tensor2_data2_sp", "ring", True), ("context2_tensor2_data2_sp", "allgather", False)]


@pytest.mark.parametrize("layout, impl, documents", CONTEXT_CASES,
                         ids=[f"{l}-{i}-{'segment_ids' if d else 'no_segment_ids'}" for l, i, d in CONTEXT_CASES])
def test_context_parallel_matches_one_device(small_config, short_docs, monkeypatch, layout, impl, documents):
    """Also the collectives of the compiled step: the ring passes K/V around (collective-permutes; the
    forward's 3 hops and the backward's 4 with gradients sit in the scanned layers' loop body) and
    gathers nothing without `tensor`; all-gather gathers K/V and passes nothing around."""
    data = data_overrides(short_docs if documents else "")
    steps = compiled_steps(monkeypatch)
    got = run(small_config, *data, *CONTEXT_LAYOUTS[layout], f"parallel.context_impl={impl}")
    assert_same_run(got, reference(small_config, *data))
    count = _collectives(steps[0])
    if impl == "ring":
        assert count["collective-permute"] >= 2, count
        assert count["all-gather"] == 0 or "mesh.tensor=2" in CONTEXT_LAYOUTS[layout], count
    else:
        assert count["all-gather"] >= 1 and count["collective-permute"] == 0, count


@pytest.mark.parametrize("layout", list(FLASH_LAYOUTS))
def test_flash_kernel_in_the_model_matches_one_device(small_config, short_docs, layout):
    data = data_overrides(short_docs)
    assert_same_run(run(small_config, *data, *FLASH_LAYOUTS[layout], params=False), reference(small_config, *data),
                    params=False)


def test_documents_change_the_loss(small_config, short_docs):
    """Control for the test above: the packed documents really reach attention."""
    plain = run(small_config, f"data.path={short_docs}", "train.eval_every=0", "mesh.data=1",
                devices=jax.devices()[:1], params=False)
    assert not np.allclose(plain.losses, reference(small_config, *data_overrides(short_docs)).losses)


def compiled_steps(monkeypatch) -> list:
    """The compiled train steps of the runs that follow, in order (the trainers' step functions)."""
    from megajax.train import loop
    steps, build = [], loop.build_trainer

    def build_and_keep(*args, **kwargs):
        tr = build(*args, **kwargs)
        steps.append(tr.step_fn)
        return tr
    monkeypatch.setattr(loop, "build_trainer", build_and_keep)
    return steps


def _collectives(step_fn):
    hlo = step_fn.as_text()
    return {k: len(re.findall(rf"\b{k}(?:-start)?\(", hlo)) for k in ("collective-permute", "all-gather")}


def test_kernel_and_context_errors(small_config):
    with pytest.raises(ConfigError, match="needs an NVIDIA GPU"):
        build_trainer(small_config("model.attention_impl=cudnn"))
    with pytest.raises(ConfigError, match="attention_dropout = 0.1 needs model.attention_impl=xla"):
        small_config("model.attention_impl=flash", "model.attention_dropout=0.1")
    with pytest.raises(ConfigError, match="needs an NVIDIA GPU"):  # cuDNN with context: a GPU still
        build_trainer(small_config("model.attention_impl=cudnn", "mesh.context=2", "mesh.data=4"))
    with pytest.raises(MeshError, match=r"train.seq_len=36 does not split over mesh.context=4.*must be a "
                                        r"multiple of 8. Context sizes that work for this seq_len and the 8 devices: 1, 2; or "
                                        r"train.seq_len=32 or train.seq_len=40\."):
        make_plan(small_config("mesh.context=4", "mesh.data=2", "train.seq_len=36"), 8)


def test_flash_with_lse_matches_reference_including_lse_gradients():
    from megajax.models.attention import xla_attention_with_lse
    from pallas_kernels import flash_attention_with_lse
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(k1, (2, 40, 4, 16))
    k = jax.random.normal(k2, (2, 40, 2, 16))
    v = jax.random.normal(k3, (2, 40, 2, 16))
    seg = jnp.asarray(np.repeat([[0, 1, 2, 3]], 10, axis=1).reshape(1, 40).repeat(2, 0))
    w = jax.random.normal(k4, (2, 4, 40))

    def loss(fn):
        def f(q, k, v):
            o, lse = fn(q, k, v)
            return jnp.sum(o ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w)
        return f

    flash = lambda q, k, v: flash_attention_with_lse(q, k, v, causal=True, segment_ids=seg)
    plain = lambda q, k, v: xla_attention_with_lse(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, causal=True)
    for a, b in zip(flash(q, k, v), plain(q, k, v)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.grad(loss(flash), (0, 1, 2))(q, k, v), jax.grad(loss(plain), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
