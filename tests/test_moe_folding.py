"""MoE parallel folding (parallel.expert_tensor_parallel=1): the experts split over expert x context x
tensor, each expert whole, while attention keeps its tensor (and context) split; every layout trains
as one device does (fp32 loss and grad norm per step, the parameters after step 1)."""

import jax
import pytest

from layout_parity import MOE, assert_same_run, moe_accumulation_reference, reference, run

FOLD = ["parallel.expert_tensor_parallel=1"]
LAYOUTS = {
    # Megatron's TP2 x ETP1 x EP8: the experts over expert 4 x tensor 2, tokens on the sequence split.
    "tensor2_expert4_sp": ["mesh.data=1", "mesh.expert=4", "mesh.tensor=2", "parallel.sequence_parallel=true"],
    # Megatron's TP2 x CP2 x DP2 with ETP1 x EP4: the experts over context 2 x tensor 2; without sequence
    # parallelism each tensor rank dispatches half of its context shard.
    "tensor2_context2_data2": ["mesh.data=2", "mesh.context=2", "mesh.tensor=2"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_folded_layout_matches_one_device(small_config, layout):
    ref = reference(small_config, *MOE)
    got = run(small_config, *MOE, *FOLD, *LAYOUTS[layout], devices=jax.devices())
    assert_same_run(got, ref)


def test_folded_pipeline_matches_one_device(small_config):
    """PP2 x TP2 x EP2 (mesh.expert) with ETP1, 1F1B: in each stage the experts over expert 2 x tensor 2
    (dispatched inside the stage loop), 2 microbatches of 4 sequences per step as the reference."""
    ref = moe_accumulation_reference(small_config)
    got = run(small_config, "model.num_layers=4", *MOE, *FOLD, "mesh.data=1", "mesh.pipeline=2", "mesh.expert=2",
              "mesh.tensor=2", "train.micro_batch=2", devices=jax.devices(), steps=3)
    assert_same_run(got, ref)
