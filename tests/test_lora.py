"""Low-rank adapters (model.lora): every layout computes the one-device function (loss and grad norm
per step, the adapters after step 1; fp32, rel 1e-5), the base stays frozen with no optimizer state,
and checkpoints hold the adapters alone."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from layout_parity import MOE, assert_same_run, reference, run

LORA = ["model.lora.rank=4", "model.lora.alpha=8"]
# layout -> (the model's overrides, the layout's)
LAYOUTS = {
    "data2_fsdp2_tensor2": ([], ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]),
    "tensor4_sp_data2": ([], ["mesh.tensor=4", "parallel.sequence_parallel=true", "mesh.data=2"]),
    "pipeline2_tensor2_sp_data2": ([], ["mesh.pipeline=2", "mesh.tensor=2", "parallel.sequence_parallel=true",
                                        "mesh.data=2", "train.micro_batch=2"]),
    "expert2_data4_moe": ([*MOE, "model.moe_layer_freq=2"], ["mesh.expert=2", "mesh.data=4"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_lora_layouts_match_one_device(small_config, layout):
    model, overrides = LAYOUTS[layout]
    micro = [o for o in overrides if o.startswith("train.micro_batch")]
    ref = reference(small_config, *LORA, *model, *micro)
    got = run(small_config, *LORA, *model, *overrides, devices=jax.devices())
    assert_same_run(got, ref)
