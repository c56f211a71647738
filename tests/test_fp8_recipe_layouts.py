"""The block-scaled FP8 recipes (precision.fp8_recipe blockwise and mxfp8) on composed layouts against
one device running the same recipe: per-step loss and grad norm within the FP8 bar the per-tensor
recipes meet (tests/test_fp8_training.py), and no scaling state (each block is scaled by its own
amax where it is quantized, so there is nothing to carry between steps or reduce across replicas).

Blocks follow the local shards: a row-parallel product's K blocks are its own shard's (mxfp8's 32
divide every shard here; blockwise's 128 do not: the small model's K of 128 is one block on one
device and two of 64 on tensor 2), and the weight gradient's token blocks are each microbatch's, as
in Megatron with Transformer Engine. The layouts therefore quantize some blocks differently from
one device, and the bar is the per-tensor recipes' layout bar, not exact equality."""

import jax
import numpy as np
import pytest

from test_fp8_training import FP8, FP8_GRAD_NORM_RTOL, FP8_LOSS_RTOL, MOE, _steps

LAYOUTS = {
    # tensor 2 + sequence parallelism x expert 2 x data 2, the experts' grouped (dropless) products
    "tensor2_sp_expert2_data2": [*MOE, "mesh.tensor=2", "parallel.sequence_parallel=true", "mesh.expert=2",
                                 "mesh.data=2", "precision.param_dtype=fp32"],
    # pipeline 2 (1F1B) x tensor 2 x data 2, one sample a microbatch
    "1f1b_p2_tensor2_data2": ["mesh.pipeline=2", "mesh.tensor=2", "mesh.data=2", "train.micro_batch=1"],
    # context 2 x FSDP 2 x data 2, the float8 weights gathered over FSDP (precision.fp8_param_gather)
    "context2_fsdp2_data2_fp8_gather": ["mesh.context=2", "mesh.fsdp=2", "mesh.data=2",
                                        "precision.fp8_param_gather=true"],
}
STEPS = 3


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_block_scaled_recipe_tracks_one_device(small_config, recipe, layout):
    overrides = LAYOUTS[layout]
    model = [o for o in overrides if o.startswith(("model.", "precision."))]
    common = [*FP8, f"precision.fp8_recipe={recipe}", "optim.warmup_steps=0", "model.num_layers=4", *model]
    one, one_fp8, _ = _steps(small_config(*common, "mesh.data=1"), jax.devices()[:1], STEPS)
    got, got_fp8, final = _steps(small_config(*common, *overrides), jax.devices(), STEPS)
    assert one_fp8 is None and got_fp8 is None and final is None  # stateless recipes
    assert np.all(np.isfinite(got)) and np.all(np.isfinite(one))
    np.testing.assert_allclose(got[:, 0], one[:, 0], rtol=2 * FP8_LOSS_RTOL)
    np.testing.assert_allclose(got[:, 1], one[:, 1], rtol=FP8_GRAD_NORM_RTOL)


# The hybrid (Mamba-2 + attention + MoE) at tensor 2 + SP x data 4, step 1 only: past step 1 a
# hybrid in reduced precision drifts from one device as tests/test_hybrid.py describes (over 3
# steps, grad norm: blockwise 0.11 %, 3.8 %, 1.2 %; mxfp8 0.03 %, 0.36 %, 1.9 %; losses within 3e-4).
@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_block_scaled_recipe_on_the_hybrid_tracks_one_device_at_step_1(small_config, recipe):
    from test_hybrid import HYBRID
    common = [*FP8, *HYBRID, f"precision.fp8_recipe={recipe}", "optim.warmup_steps=0", "precision.param_dtype=fp32"]
    one, _, _ = _steps(small_config(*common, "mesh.data=1", steps=1), jax.devices()[:1], 1)
    got, _, _ = _steps(small_config(*common, "mesh.tensor=2", "parallel.sequence_parallel=true", "mesh.data=4",
                                    steps=1), jax.devices(), 1)
    np.testing.assert_allclose(got[:, 0], one[:, 0], rtol=2 * FP8_LOSS_RTOL)
    np.testing.assert_allclose(got[:, 1], one[:, 1], rtol=FP8_GRAD_NORM_RTOL)
