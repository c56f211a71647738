"""MoE parallel folding (parallel.expert_tensor_parallel=1): the experts split over expert x context x
tensor, each expert whole, while attention keeps its tensor (and context) split; every layout trains
as one device does (fp32 loss and grad norm per step, the parameters after step 1)."""

import jax
import numpy as np
import pytest

from layout_parity import MOE, assert_same_run, moe_accumulation_reference, reference, run

FOLD = ["parallel.expert_tensor_parallel=1"]
LAYOUTS = {
    # Megatron's TP2 x ETP1 x EP8: the experts over expert 4 x tensor 2, tokens on the sequence split; the
    # alltoall dispatcher (the GPU default; the other layouts take CPU's, allgather).
    "tensor2_expert4_sp_alltoall": ["mesh.data=1", "mesh.expert=4", "mesh.tensor=2", "parallel.sequence_parallel=true",
                                    "parallel.moe_token_dispatcher=alltoall"],
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


def test_folding_rules_split_the_experts_whole():
    """Folded: the experts' dim over expert x context x tensor, their hidden dim whole; the attention's and the
    shared MLP's `mlp` stay on `tensor`. Unset or equal to the tensor size: today's split."""
    from megajax.config import load_config
    from megajax.mesh import logical_to_spec, make_rules
    from megajax.models.moe import EXPERT_KERNEL_AXES
    from jax.sharding import PartitionSpec as P

    def rules(*extra):
        return make_rules(load_config(overrides=[*MOE, "mesh.data=1", "mesh.tensor=2", "mesh.expert=4", *extra])).params

    folded = rules(*FOLD)
    assert logical_to_spec(EXPERT_KERNEL_AXES["fc2"], folded) == P(("expert", "context", "tensor"), None, "fsdp")
    assert logical_to_spec(("embed", "mlp"), folded) == P("fsdp", "tensor")
    for plain in (rules(), rules("parallel.expert_tensor_parallel=2")):
        assert logical_to_spec(EXPERT_KERNEL_AXES["fc2"], plain) == P("expert", "tensor", "fsdp")


@pytest.mark.parametrize("overrides, message", [
    (["mesh.tensor=4", "parallel.expert_tensor_parallel=2"],
     "parallel.expert_tensor_parallel = 2: accepted values are 1 .* = 4"),
    (["mesh.tensor=-1", "mesh.data=1", "parallel.expert_tensor_parallel=1"], "mesh.tensor is -1"),
    (["model.num_experts=0", "mesh.tensor=2", "parallel.expert_tensor_parallel=1"], "model.num_experts is 0"),
])
def test_bad_expert_tensor_parallel_is_refused(overrides, message):
    from megajax.config import load_config
    from megajax.errors import ConfigError
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[*MOE, *overrides])


def test_the_plan_line_names_the_folded_expert_group(small_config):
    from megajax.plan import make_plan
    plan = make_plan(small_config(*MOE, *FOLD, "mesh.data=1", "mesh.expert=2", "mesh.context=2", "mesh.tensor=2"), 8)
    assert "experts whole over expert x context x tensor (expert parallel 8, expert tensor 1)" in plan.describe()
    assert "experts whole" not in make_plan(small_config(*MOE, "mesh.data=1", "mesh.expert=4", "mesh.tensor=2"),
                                            8).describe()


def test_folded_experts_must_split_over_the_folded_group(small_config):
    """8 experts cannot split over expert 2 x context 2 x tensor 2 x ... = 16 devices: the plan names the axes."""
    from megajax.errors import MeshError
    from megajax.mesh import validate_for_model
    cfg = small_config(*MOE, *FOLD, "mesh.data=1", "mesh.expert=4", "mesh.context=2", "mesh.tensor=2")
    with pytest.raises(MeshError, match=r"model.num_experts=8 is not divisible by mesh.expert x mesh.context x "
                                        r"mesh.tensor=16"):
        validate_for_model(cfg, {"pipeline": 1, "data": 1, "fsdp": 1, "expert": 4, "context": 2, "tensor": 2})


def test_folded_without_sequence_parallelism_needs_the_sequence_to_split_over_tensor(small_config):
    from megajax.errors import MeshError
    from megajax.mesh import validate_for_model
    cfg = small_config(*MOE, *FOLD, "mesh.data=1", "mesh.expert=2", "mesh.tensor=4", "train.seq_len=30")
    with pytest.raises(MeshError, match=r"train.seq_len=30 is not divisible by mesh.tensor x mesh.context = 4: with "
                                        r"parallel.expert_tensor_parallel=1 .* parallel.sequence_parallel=true"):
        validate_for_model(cfg, {"pipeline": 1, "data": 1, "fsdp": 1, "expert": 2, "context": 1, "tensor": 4})


def test_megatron_expert_tensor_parallel_size_maps_to_folding():
    from megajax.megatron_args import translate
    base = ["--num-experts", "8", "--tensor-model-parallel-size", "2", "--context-parallel-size", "2"]
    t = translate([*base, "--expert-model-parallel-size", "8", "--expert-tensor-parallel-size", "1"], defaults=False)
    assert t.assignments["parallel.expert_tensor_parallel"][0] == 1
    assert t.assignments["mesh.expert"][0] == 2  # 8 = expert 2 x context 2 x tensor 2
    t = translate([*base, "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"], defaults=False)
    assert "mesh.expert" not in t.assignments
    assert any("multiple of tensor x context = 4" in why for _, why in t.unmapped)
    t = translate([*base, "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"], defaults=False)
    assert t.assignments["mesh.expert"][0] == 2 and t.assignments["parallel.expert_tensor_parallel"][0] == 2


@pytest.mark.parametrize("layout", [
    ["mesh.expert=4", "mesh.tensor=2", "parallel.sequence_parallel=true"],
    ["mesh.pipeline=2", "mesh.expert=2", "mesh.tensor=2"],
], ids=["expert4_tensor2_sp", "1f1b_p2_expert2_tensor2"])
def test_folded_communication_matches_analytic(layout):
    """The compiled step's collectives against the analytic figure (every kind within [0.9, 1.25]): the
    exchange over the folded group of 1 / tensor of the tokens, no tensor gathers in the MoE layers
    under sequence parallelism, the sum over `tensor` of the outputs without it."""
    from conftest import SMALL
    from megajax.config import load_config
    from megajax.perf.bench import communication_verdict
    from test_perf import compiled_communication
    cfg = load_config(overrides=[*SMALL, "model.num_layers=4", "train.global_batch=16", "train.micro_batch=2",
                                 "model.num_experts=8", "model.moe_ffn_hidden_size=64", *FOLD, *layout])
    comm = compiled_communication(cfg)
    assert communication_verdict(comm).startswith("every kind within [0.9, 1.25]"), comm


def test_folded_state_memory_equals_actual_shards():
    """The analytic state bytes (read from the rules) are the shards the train state holds: each device 1 / 8
    of the experts, whole."""
    from conftest import SMALL
    from megajax.config import load_config
    from megajax.perf import analytic
    from megajax.plan import make_plan
    from megajax.train.setup import build_setup
    cfg = load_config(overrides=[*SMALL, *MOE, *FOLD, "mesh.data=1", "mesh.expert=4", "mesh.tensor=2"])
    setup = build_setup(make_plan(cfg, 8))
    state = setup.fresh_state()
    est = analytic.state_bytes(setup.spec.axes, setup.spec.abstract_params, setup.rules.params,
                               setup.rules.opt_state, setup.plan.sizes)
    params = [x for x in jax.tree.leaves(state.params) if x.ndim > 0]
    assert est["params"] == sum(x.addressable_shards[0].data.nbytes for x in params)
    fc2 = next(x for x in params if x.ndim == 4 and x.shape[1:] == (8, 64, cfg.model.hidden_size))  # [layers, E, F, D]
    assert fc2.addressable_shards[0].data.shape == (fc2.shape[0], 1, 64, cfg.model.hidden_size)


def test_folded_run_exports_and_imports_equal(small_config, tmp_path):
    """A run trained with folding (tensor 2 x expert 4, expert-TP 1) exports gathered, whole weights: to a
    Hugging Face model and to Megatron checkpoints (torch_dist, and legacy at TP 2 x EP 4 with expert-TP 1,
    in the rank files Megatron writes for it), each imported back to the trained
    parameters, and a folded run resumes from the imported checkpoint."""
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from megajax.cli import main
    from megajax.train.loop import build_trainer, train
    cfg = small_config(*MOE, *FOLD, "mesh.data=1", "mesh.expert=4", "mesh.tensor=2",
                       "parallel.sequence_parallel=true", steps=2)
    run = train(cfg, devices=jax.devices())
    trained = jax.device_get(run.state.params)
    legacy = ["--ckpt-format", "torch", "--tensor-parallel", "2", "--expert-parallel", "4"]
    exports = {"hf": [], "megatron": [], "megatron-legacyfolded": [*legacy, "--expert-tensor-parallel", "1"]}
    for fmt, extra in exports.items():
        assert main(["export", "--format", fmt.split("-")[0], "--checkpoint", str(run.run_dir), "--output", str(tmp_path / fmt),
                     "--dtype", "fp32", *extra]) == 0
        out = tmp_path / f"{fmt}-imported"
        assert main(["import", "--format", fmt.split("-")[0], "--input", str(tmp_path / fmt), "--output", str(out)]) == 0
        tr = build_trainer(small_config(*MOE, *FOLD, "mesh.data=1", "mesh.expert=4", "mesh.tensor=2",
                                        f"checkpoint.load={out}"), devices=jax.devices())
        got = jax.device_get(tr.state.params)
        for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(got)):
            a, b = np.asarray(a), np.asarray(b)
            rows = tuple(slice(0, min(x, y)) for x, y in zip(a.shape, b.shape))  # the padded vocabulary
            np.testing.assert_array_equal(b[rows], a[rows], err_msg=fmt)
    # Megatron's files with expert-TP 1: ranks i < EP write, tensor rank i mod TP, expert rank i, experts whole.
    import torch
    step = tmp_path / "megatron-legacyfolded" / "iter_0000002"
    assert sorted(p.name for p in step.iterdir()) == ["mp_rank_00_000", "mp_rank_00_002", "mp_rank_01_001",
                                                       "mp_rank_01_003"]
    sd = torch.load(step / "mp_rank_01_003" / "model_optim_rng.pt", weights_only=False)
    assert sd["args"].expert_tensor_parallel_size == 1 and sd["args"].expert_model_parallel_size == 4
    m = cfg.model
    fc1 = {k: v for k, v in sd["model"].items() if "experts" in k and k.endswith("linear_fc1.weight")}
    assert len(fc1) == 2 * 2  # 2 layers x its 2 local experts (6 and 7), each whole
    assert all(tuple(v.shape) == ((2 if m.activation == "swiglu" else 1) * 64, m.hidden_size) for v in fc1.values())
    qkv = next(v for k, v in sd["model"].items() if k.endswith("linear_qkv.weight"))
    assert qkv.shape[0] == (m.num_heads + 2 * m.num_kv_heads) * m.head_dim // 2  # attention split over 2 ranks


@pytest.mark.parametrize("tp, ep, etp", [(4, 2, 2), (4, 2, 1)])
def test_legacy_export_refuses_other_expert_tensor_sizes(small_config, tmp_path, tp, ep, etp):
    """An expert tensor size between 1 and the tensor size, or 1 with the expert ranks not a multiple of the
    tensor ranks (Megatron's writers would leave tensor ranks out): one error naming the values."""
    pytest.importorskip("torch")
    from types import SimpleNamespace
    from megajax.checkpoint.megatron import export_megatron
    from megajax.errors import CheckpointError
    source = SimpleNamespace(model=small_config(*MOE).model)
    with pytest.raises(CheckpointError, match=rf"expert_tensor_parallel={etp} with tensor_parallel={tp}; accepted: "
                                              rf"the tensor size, or 1 .* \(here {ep}\)"):
        export_megatron(source, tmp_path / "mc", tensor_parallel=tp, expert_parallel=ep, expert_tensor_parallel=etp)
