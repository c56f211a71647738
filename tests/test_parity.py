"""Every parallel layout computes the same function as one device: per-step fp32 loss and grad norm,
and the parameters after step 1 (see layout_parity.py)."""

import jax
import pytest

from layout_parity import BF16_GRAD_NORM_RTOL, BF16_LOSS_RTOL, assert_same_run, family, reference, run

LAYOUTS = {
    "data8": ["mesh.data=8"],
    "fsdp8": ["mesh.data=1", "mesh.fsdp=8"],
    "data2_tensor4": ["mesh.data=2", "mesh.tensor=4"],
    "data2_tensor4_sp": ["mesh.data=2", "mesh.tensor=4", "parallel.sequence_parallel=true"],
    "data2_fsdp2_tensor2_sp": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
                               "parallel.sequence_parallel=true"],
    "distributed_optimizer": ["mesh.data=4", "mesh.tensor=2", "parallel.distributed_optimizer=true"],
}
# Options that do not depend on the model family: llama only.
LLAMA_LAYOUTS = {
    "data2_tensor4_sp_recompute_selective": ["mesh.data=2", "mesh.tensor=4", "parallel.sequence_parallel=true",
                                             "parallel.recompute=selective"],
    "data4_tensor2_recompute_full": ["mesh.data=4", "mesh.tensor=2", "parallel.recompute=full"],
    # 8 = micro 1 x accumulation 2 x data-parallel 4, the gradient reduced once per step
    "data2_fsdp2_tensor2_distopt_accumulation2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
                                                  "parallel.distributed_optimizer=true", "train.micro_batch=1"],
}
CASES = [(f, name, LAYOUTS[name]) for name in LAYOUTS for f in ("llama", "gpt")] + \
        [("llama", name, LLAMA_LAYOUTS[name]) for name in LLAMA_LAYOUTS]


@pytest.mark.parametrize("model, layout, overrides", CASES, ids=[f"{c[1]}-{c[0]}" for c in CASES])
def test_layout_matches_one_device(small_config, model, layout, overrides):
    ref = reference(small_config, *family(model))
    got = run(small_config, *family(model), *overrides, devices=jax.devices())
    assert_same_run(got, ref)


def test_gradient_accumulation_matches_large_batch(small_config):
    """4 microbatches of b give the same update as one batch of 4b (same samples), on one device too."""
    ref = reference(small_config)
    four = run(small_config, "mesh.data=2", "train.micro_batch=1", devices=jax.devices()[:2])
    assert_same_run(four, ref)
    accumulated_one_device = run(small_config, "mesh.data=1", "train.micro_batch=2",
                                 devices=jax.devices()[:1], params=False)
    assert_same_run(accumulated_one_device, ref, params=False)


# bf16: within one bf16 rounding of one device (BF16_LOSS_RTOL, BF16_GRAD_NORM_RTOL: see layout_parity.py).
BF16_LAYOUTS = {
    "data2_tensor4_sp": ["mesh.data=2", "mesh.tensor=4", "parallel.sequence_parallel=true"],
    "data2_fsdp2_tensor2_distopt_accumulation2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
                                                  "parallel.distributed_optimizer=true", "train.micro_batch=1"],
    "context2_data4": ["mesh.context=2", "mesh.data=4"],
}


@pytest.mark.parametrize("layout", list(BF16_LAYOUTS))
def test_bf16_layout_matches_one_device(small_config, layout):
    ref = reference(small_config, "train.precision=bf16", params=False)
    got = run(small_config, "train.precision=bf16", *BF16_LAYOUTS[layout], devices=jax.devices(), params=False)
    assert_same_run(got, ref, rtol=BF16_LOSS_RTOL, grad_norm_rtol=BF16_GRAD_NORM_RTOL, params=False)



# Qwen3's attention (per-head q/k norms, head_dim 16 other than hidden / heads = 8) on pipeline 2 x
# fsdp 2 x context 2, against one device with the same microbatches (2 sequences each); tensor
# parallelism with sequence parallelism and the data axis: tests/test_moe_parity.py's Qwen3-MoE case.
QWEN3 = ["model.qk_norm=true", "model.head_dim=16"]


def test_qk_norm_on_pipeline_fsdp_context_matches_one_device(small_config):
    ref = reference(small_config, *QWEN3, "train.micro_batch=2")
    got = run(small_config, *QWEN3, "mesh.pipeline=2", "mesh.data=1", "mesh.fsdp=2", "mesh.context=2",
              "parallel.context_impl=allgather", "train.micro_batch=1", devices=jax.devices())
    assert_same_run(got, ref)
    assert ref.params1["layers/attn/q_norm/scale"].shape == (2, 16)
