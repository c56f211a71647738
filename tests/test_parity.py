"""Every parallel layout computes the same function: per-step fp32 losses equal one device's."""

import jax
import numpy as np
import pytest

from megajax.train.loop import train

LAYOUTS = {
    "data8": ["mesh.data=8"],
    "fsdp8": ["mesh.data=1", "mesh.fsdp=8"],
    "data2_tensor4": ["mesh.data=2", "mesh.tensor=4"],
    "data2_tensor4_sp": ["mesh.data=2", "mesh.tensor=4", "parallel.sequence_parallel=true"],
    "data2_fsdp2_tensor2_sp": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
                               "parallel.sequence_parallel=true"],
    "distributed_optimizer": ["mesh.data=4", "mesh.tensor=2", "parallel.distributed_optimizer=true"],
}
STEPS = 4
_reference: dict = {}


def losses(small_config, family, overrides, devices):
    cfg = small_config(f"model.family={family}", *overrides, steps=STEPS)
    return np.asarray(train(cfg, devices=devices).losses)


def reference(small_config, family):
    if family not in _reference:
        _reference[family] = losses(small_config, family, ["mesh.data=1"], jax.devices()[:1])
    return _reference[family]


@pytest.mark.parametrize("family", ["llama", "gpt"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_device(small_config, family, layout):
    ref = reference(small_config, family)
    got = losses(small_config, family, LAYOUTS[layout], jax.devices())
    assert len(got) == STEPS
    assert ref[-1] < ref[0]  # it trains
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=0)


def test_gradient_accumulation_matches_large_batch(small_config):
    """4 microbatches of b give the same update as one batch of 4b (same samples)."""
    one = train(small_config("mesh.data=2", "train.micro_batch=4", steps=STEPS), devices=jax.devices()[:2])
    four = train(small_config("mesh.data=2", "train.micro_batch=1", steps=STEPS), devices=jax.devices()[:2])
    np.testing.assert_allclose(four.losses, one.losses, rtol=1e-5, atol=0)
    for a, b in zip(jax.tree.leaves(four.state.params), jax.tree.leaves(one.state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
