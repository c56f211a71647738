"""`megajax plan`: layouts of a cluster estimated, ranked and written as a mesh config."""

import jax
import pytest
import yaml

from megajax.cli import main
from megajax.config import MESH_AXES, load_config
from megajax.errors import ConfigError
from megajax.perf import analytic, planner
from megajax.plan import make_plan
from megajax.train.state import build_model_spec


def _plan(config, cluster, *overrides, **kw):
    return planner.plan_cluster(load_config([config], list(overrides)), cluster, **kw)


def test_llama3_70b_on_32_h100_and_megatrons_tp8_pp4():
    """The free choice against Megatron's usual TP 8 x PP 4 (pinned by setting the two sizes): both fit;
    tensor parallelism never leaves a node; the pinned layout is slower by its tensor-parallel
    transfers, which the estimate puts on the critical path (the report says so in its parts)."""
    free = _plan("model/llama3-70b", "32xH100", "train.global_batch=64")
    best = free["ranked"][0]
    assert best.fits and best.memory["total"] <= free["capacity"]
    assert all(c.ici["tensor"] == c.sizes["tensor"] for c in free["ranked"])
    # (ranked by the step time to the microsecond: layouts that tie are ordered by micro batch, memory)
    assert [round(c.step_seconds, 6) for c in free["ranked"]] == sorted(round(c.step_seconds, 6)
                                                                       for c in free["ranked"])
    pinned = _plan("model/llama3-70b", "32xH100", "train.global_batch=64", "mesh.tensor=8", "mesh.pipeline=4",
                   "mesh.data=1")
    tp8 = pinned["ranked"][0]
    assert tp8.sizes["tensor"] == 8 and tp8.sizes["pipeline"] == 4 and tp8.dcn["pipeline"] == 4
    assert tp8.step_seconds >= best.step_seconds
    # its slowest part beside the work itself (the products, the memory-bound element-wise ops)
    slowest_part = max((k for k in tp8.parts if k not in ("compute", "memory-bound")), key=tp8.parts.get)
    assert slowest_part == "tensor" and "tensor" in planner.reasons(tp8)


def test_mixtral_plan_uses_expert_parallelism_or_says_why_not():
    """Free, the plan either chooses expert parallelism or names the fastest layout that uses it, with
    the all-to-alls among its timed parts; pinned (mesh.expert=8), every layout keeps it."""
    r = _plan("model/mixtral-8x7b", "32xH100", "train.global_batch=64")
    best = r["ranked"][0]
    if best.sizes["expert"] == 1:
        alt = r["alternatives"]["expert"]
        assert alt.sizes["expert"] > 1 and alt.fits and alt.step_seconds >= best.step_seconds
        assert "expert" in alt.parts  # the all-to-alls are timed
        text = planner.format_plan(r)
        assert "not chosen" in text and f"expert {alt.sizes['expert']}" in text.split("not chosen")[1]
    for axis, alt in r["alternatives"].items():  # one per axis the best leaves out, the fastest with it
        assert best.sizes[axis] == 1 and alt.sizes[axis] > 1
        assert alt is next(c for c in r["ranked"] if c.sizes[axis] > 1)
    pinned = _plan("model/mixtral-8x7b", "32xH100", "train.global_batch=64", "mesh.expert=8", "mesh.data=-1")
    assert pinned["ranked"] and all(c.sizes["expert"] == 8 for c in pinned["ranked"])
    assert "expert" not in pinned["alternatives"]


def test_the_written_mesh_config_plans_to_the_chosen_layout(tmp_path, capsys):
    out = tmp_path / "mesh.yaml"
    assert main(["plan", "--config", "model/llama3-8b", "--cluster", "16xH100", "train.global_batch=32",
                 "--output", str(out), "--top", "2"]) == 0
    text = capsys.readouterr().out
    assert " 1. " in text and "s/step" in text and f"wrote {out}" in text
    doc = yaml.safe_load(out.read_text())
    assert set(doc) == {"mesh", "parallel", "train"}
    assert out.read_text().startswith("# megajax plan --config model/llama3-8b --cluster 16xH100")
    cfg = load_config(["model/llama3-8b", str(out)], ["train.global_batch=32"])
    plan = make_plan(cfg, 16)
    best = _plan("model/llama3-8b", "16xH100", "train.global_batch=32")["ranked"][0]
    assert plan.sizes == best.sizes and plan.ici == best.ici and plan.dcn == best.dcn
    assert plan.batch.micro_batch == best.micro_batch


def test_bad_clusters_and_device_kinds(tmp_path):
    cfg = load_config(["model/tiny"], [])
    with pytest.raises(ConfigError, match=r"--cluster '32xTPU': unknown device kind 'TPU'; known kinds: H100"):
        planner.plan_cluster(cfg, "32xTPU")
    with pytest.raises(ConfigError, match="12 devices are not whole nodes of 8 H100"):
        planner.plan_cluster(cfg, "12xH100")
    kinds = tmp_path / "kinds.yaml"
    kinds.write_text("GB200: {memory_gib: 186, peak_tflops: {bf16: 2500}, node_size: 4, intra_node_gbps: 900}\n"
                     "H100: {inter_node_gbps: 100}\n")
    table = planner.load_device_kinds(str(kinds))
    assert table["GB200"].node_size == 4 and table["H100"].inter_node_gbps == 100.0
    assert table["H100"].memory_gib == 80.0
    kinds.write_text("X: {memory: 1}\n")
    with pytest.raises(ConfigError, match=r"kinds.yaml: kind 'X' must be a mapping of"):
        planner.load_device_kinds(str(kinds))


def test_communication_by_axis_adds_up_to_benchs_figures(small_config):
    """The planner times analytic.communication_by_axis; by kind it is exactly the figure `megajax
    bench` compares with the compiled HLO (tests/test_perf.py)."""
    for overrides in (["mesh.data=2", "mesh.tensor=2", "mesh.pipeline=2", "parallel.sequence_parallel=true",
                       "train.micro_batch=1"],
                      ["mesh.data=1", "mesh.fsdp=2", "mesh.context=2", "mesh.tensor=2"],
                      ["mesh.data=2", "mesh.expert=4", "model.num_experts=4", "model.moe_ffn_hidden_size=32",
                       "parallel.distributed_optimizer=true"]):
        plan = make_plan(small_config(*overrides), 8)
        spec, _ = build_model_spec(plan.cfg, plan.padded_vocab)
        r, s = plan.rules, plan.sizes
        args = (plan, analytic.tensor_shard_param_bytes(spec.axes, spec.abstract_params, r.params, s),
                analytic.expert_shard_param_bytes(spec.axes, spec.abstract_params, r.params, s),
                analytic.stage_shared_param_bytes(spec.axes, spec.abstract_params, r.params, s)
                if plan.pipeline else 0)
        by_kind = analytic.communication_bytes(*args)
        by_axis = analytic.communication_by_axis(*args)
        for kind in analytic.COLLECTIVES:
            assert abs(sum(v for (k, _), v in by_axis.items() if k == kind) - by_kind[kind]) <= len(MESH_AXES)
        assert {a for _, a in by_axis} <= {a for a in MESH_AXES if s[a] > 1}


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_memory_ranking_matches_the_compiled_programs(small_config):
    """On 8 CPU devices: the plan's per-device memory orders three layouts as XLA's memory analysis
    of their compiled train steps does (a model whose state outweighs its activations)."""
    from megajax.perf.bench import bench_one
    layouts = {"data8": ["mesh.data=8"],
               "data8_distopt": ["mesh.data=8", "parallel.distributed_optimizer=true"],
               "fsdp8": ["mesh.data=1", "mesh.fsdp=8"]}
    compiled, estimated = {}, {}
    for name, overrides in layouts.items():
        cfg = small_config("model.vocab_size=4096", "model.hidden_size=128", "train.seq_len=16", *overrides)
        r = bench_one(cfg, steps=1, warmup=0, rounds=1)
        compiled[name] = r["memory"]["compiled"]["total"]
        estimated[name] = r["memory"]["analytic"]["total"]
    assert sorted(compiled, key=compiled.get) == sorted(estimated, key=estimated.get) == \
        ["fsdp8", "data8_distopt", "data8"]


def test_a_pipelined_vision_language_model_pays_for_its_encoder_on_stage_0():
    """The encoder and projector run on the first pipeline stage only: a pipelined layout's estimate
    adds what the other stages' share of the encoder's work costs that stage, and nothing without a
    pipeline."""
    from megajax.train.flops import vision_flops_per_token
    args = ("train.global_batch=16", "train.seq_len=4096", "mesh.pipeline=2", "mesh.tensor=2", "mesh.context=1",
            "mesh.expert=1")
    pp = _plan("model/llava-siglip-llama3-8b", "8xH100", *args, top=1)
    c = next(c for c in pp["ranked"] if c.sizes["pipeline"] == 2)
    cfg = load_config(["model/llava-siglip-llama3-8b"], list(args))
    kind = planner.DEVICE_KINDS["H100"]
    peak = kind.peak_tflops.get(cfg.train.precision) or kind.peak_tflops["bf16"]
    vision = vision_flops_per_token(cfg.model, 4096)
    assert vision > 0
    # compute holds each device's even share; stage 0 does the other stage's share of the encoder too
    expected = 16 * 4096 * vision * (2 - 1) / 8 / (peak * 1e12 * kind.efficiency)
    assert c.parts["encoder on stage 0"] == pytest.approx(expected, rel=1e-6)
    free = _plan("model/llava-siglip-llama3-8b", "8xH100", "train.global_batch=16", "train.seq_len=4096", top=1)
    assert {c.sizes["pipeline"] for c in free["ranked"]} > {1}
    assert all(("encoder on stage 0" in c.parts) == (c.sizes["pipeline"] > 1) for c in free["ranked"])
