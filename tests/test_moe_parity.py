"""Mixture of experts: every expert-parallel layout trains as one device does (dropless routing):
per-step fp32 loss (balancing and z losses included in the gradient) and grad norm, and the
parameters after step 1 (see layout_parity.py)."""

from pathlib import Path

import jax
import numpy as np
import pytest

from layout_parity import MOE, PARITY, assert_same_run, moe_accumulation_reference, reference, run

LAYOUTS = {
    "expert2_data4": ["mesh.data=4", "mesh.expert=2"],
    "expert8": ["mesh.data=1", "mesh.expert=8"],
    "expert4_tensor2_sp": ["mesh.data=1", "mesh.expert=4", "mesh.tensor=2", "parallel.sequence_parallel=true"],
    "expert2_fsdp2_context2": ["mesh.data=1", "mesh.fsdp=2", "mesh.expert=2", "mesh.context=2"],
    "expert2_fsdp2_tensor2_sp_distopt": ["mesh.data=1", "mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2",
                                         "parallel.sequence_parallel=true", "parallel.distributed_optimizer=true"],
    # The alltoall dispatcher (the default on GPU; on CPU the default is allgather).
    "expert8_alltoall": ["mesh.data=1", "mesh.expert=8", "parallel.moe_token_dispatcher=alltoall"],
    "expert4_tensor2_sp_alltoall": ["mesh.data=1", "mesh.expert=4", "mesh.tensor=2", "parallel.sequence_parallel=true",
                                    "parallel.moe_token_dispatcher=alltoall"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_layout_matches_one_device(small_config, layout):
    ref = reference(small_config, *MOE)
    got = run(small_config, *MOE, *LAYOUTS[layout], devices=jax.devices())
    assert_same_run(got, ref)


def test_expert_parallel_capacity_mode(small_config):
    """Capacity mode across expert-parallel devices: a capacity no expert can fill is the dropless run;
    capacity 1.0 (per device, on its own tokens, as in Megatron) drops and logs the dropped fraction."""
    ref = reference(small_config, *MOE)
    roomy = run(small_config, *MOE, "mesh.data=4", "mesh.expert=2", "model.moe_expert_capacity_factor=4.0",
                devices=jax.devices(), params=False)
    assert_same_run(roomy, ref, params=False)
    tight = train_records(small_config, *MOE, "mesh.data=4", "mesh.expert=2", "model.moe_expert_capacity_factor=1.0")
    assert all(0 < r["moe_dropped_fraction"] < 0.5 for r in tight)
    assert all(r["moe_min_expert_share"] < 1 / 8 < r["moe_max_expert_share"] for r in tight)


def train_records(small_config, *overrides):
    from megajax.train.loop import train
    return train(small_config(*overrides, steps=2), devices=jax.devices()).records


def test_expert_parallel_with_full_recompute_matches_one_device(small_config):
    """Full recompute re-runs each MoE layer (router, dispatch, experts) in the backward pass."""
    ref = reference(small_config, *MOE)
    got = run(small_config, *MOE, "mesh.data=4", "mesh.expert=2", "parallel.recompute=full", devices=jax.devices())
    assert_same_run(got, ref)


@pytest.mark.parametrize("precision", [["train.precision=bf16"],
                                       ["train.precision=fp16", "train.initial_loss_scale=1024"]],
                         ids=["bf16", "fp16"])
def test_expert_parallel_half_precision_tracks_one_device(small_config, precision):
    """bf16 / fp16 (router logits stay fp32; fp16's loss scale also scales the router losses'
    gradient): within the bf16 tolerances of tests/test_parity.py."""
    ref = reference(small_config, *MOE, *precision, steps=3, params=False)
    got = run(small_config, *MOE, *precision, "mesh.data=4", "mesh.expert=2", devices=jax.devices(),
              steps=3, params=False)
    assert_same_run(got, ref, rtol=2.0 ** -8 / 16, grad_norm_rtol=2.0 ** -8, params=False, moe=False)


def test_moe_checkpoint_resumes_on_another_expert_layout(small_config, tmp_path):
    """2 steps on expert 2 x data 4, then step 3 on expert 8: one device's step 3."""
    from megajax.train.loop import train
    ref = reference(small_config, *MOE)  # its schedule (PARITY) does not depend on train.steps
    d = str(tmp_path / "moe")
    train(small_config(*MOE, *PARITY, "mesh.data=4", "mesh.expert=2", f"train.run_dir={d}", "checkpoint.every=2",
                       steps=2), devices=jax.devices())
    resumed = train(small_config(*MOE, *PARITY, "mesh.data=1", "mesh.expert=8", f"train.run_dir={d}", steps=3),
                    devices=jax.devices())
    np.testing.assert_allclose(resumed.losses[-1], ref.losses[2], rtol=1e-5)


def test_shared_expert_with_accumulation_matches_one_device(small_config):
    """A shared expert (a dense MLP beside the routed experts: split over `tensor`, the `expert` axis a
    data axis for it) on expert 2 x data 2 x tensor 2 with sequence parallelism, and two microbatches
    per step (the balancing losses are per microbatch, over all of its shards)."""
    shared = "model.moe_shared_expert_ffn_size=96"
    ref = moe_accumulation_reference(small_config, shared)
    got = run(small_config, "model.num_layers=4", *MOE, shared, "mesh.data=2", "mesh.expert=2", "mesh.tensor=2",
              "parallel.sequence_parallel=true", "train.micro_batch=1", devices=jax.devices(), steps=3)
    assert_same_run(got, ref)
    assert any("shared_experts" in name for name in ref.params1)


# Sigmoid routing with aux-loss-free balancing (a rate large enough to move the routing within steps) and
# group-limited top-k (the 8 experts in 4 groups, each token's 2 best groups).
SIGMOID_BIAS = ["model.moe_router_score_function=sigmoid", "model.moe_router_bias_update_rate=0.01",
                "model.moe_router_topk_scaling_factor=2.0", "model.moe_router_num_groups=4",
                "model.moe_router_group_topk=2"]


def test_expert_bias_on_expert_parallel_accumulation_matches_one_device(small_config):
    """Expert 2 x data 2 with 2 microbatches per step: the bias update sees the step's token counts over
    both microbatches and all devices, so losses, grad norms and the bias after the run are one device's."""
    ref = moe_accumulation_reference(small_config, *SIGMOID_BIAS)
    assert np.abs(ref.expert_bias).max() > 0.01  # moved on more than one step
    got = run(small_config, "model.num_layers=4", *MOE, *SIGMOID_BIAS, "mesh.data=2", "mesh.expert=2",
              "train.micro_batch=1", devices=jax.devices()[:4], steps=3, params=False)
    assert_same_run(got, ref, params=False)


def test_expert_bias_resumes_exactly(small_config, tmp_path):
    """2 steps on expert 2 x data 4, saved, resumed for step 3: the uninterrupted run's step 3 and bias."""
    from megajax.checkpoint.manager import CheckpointSource
    from megajax.models.layout import EXPERT_BIAS
    from megajax.train.loop import train
    fixed = [*MOE, *SIGMOID_BIAS, "optim.warmup_steps=0", "optim.decay_steps=3", "mesh.data=4", "mesh.expert=2"]
    ref = train(small_config(*fixed, steps=3), devices=jax.devices())
    d = tmp_path / "moe"
    train(small_config(*fixed, f"train.run_dir={d}", "checkpoint.every=2", steps=2), devices=jax.devices())
    resumed = train(small_config(*fixed, f"train.run_dir={d}", steps=3), devices=jax.devices())
    assert len(resumed.losses) == 1  # step 3 only
    np.testing.assert_allclose(resumed.losses[-1], ref.losses[2], rtol=1e-6)

    def bias(run_dir, step):
        return CheckpointSource(Path(run_dir) / "checkpoints" / str(step)).get(EXPERT_BIAS)
    assert np.abs(bias(d, 2)).max() > 0
    np.testing.assert_array_equal(bias(d, 3), bias(ref.run_dir, 3))



def test_qwen3_moe_on_expert_tensor_sp_data_matches_one_device(small_config):
    """Qwen3-MoE's blocks: per-head q/k norms (head_dim 16; their scales replicated over `tensor`),
    pre-softmax routing (softmax over all experts, top-k not renormalised), layer 0 MoE and layer 1
    dense, on expert 2 x tensor 2 (sequence parallel) x data 2."""
    qwen3 = ["model.qk_norm=true", "model.head_dim=16", "model.moe_router_pre_softmax=true", "model.moe_layer_freq=2"]
    ref = reference(small_config, *MOE, *qwen3)
    got = run(small_config, *MOE, *qwen3, "mesh.data=2", "mesh.expert=2", "mesh.tensor=2",
              "parallel.sequence_parallel=true", devices=jax.devices())
    assert_same_run(got, ref)
    assert "dense_layers/attn/k_norm/scale" in ref.params1
