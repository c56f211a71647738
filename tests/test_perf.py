"""Performance accounting: HLO collectives, analytic memory/communication, fit check, `megajax bench`."""

import importlib.util
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import SMALL
from megajax.cli import main
from megajax.config import load_config
from megajax.errors import MeshError
from megajax.perf import analytic, hlo
from megajax.perf.bench import communication_table, communication_verdict
from megajax.cli import run_training
from megajax.perf.fit import check_fit
from megajax.plan import make_plan
from megajax.train.loop import build_trainer

# ---------------------------------------------------------------------------------------------
# HLO accounting on hand-built programs with known collectives


@pytest.fixture(scope="module")
def mesh8():
    return jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))


def _collectives(fn, *args):
    return hlo.parse(jax.jit(fn).lower(*args).compile().as_text())


def _only(report, kind):
    ops = [o for o in report.ops if o.kind == kind]
    others = [o for o in report.ops if o.kind != kind]
    assert not others, others
    return ops


def _smap(mesh, f, in_specs, out_specs):
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def test_psum_is_one_all_reduce_of_its_operand(mesh8):
    x = jnp.ones((8 * 16, 32), jnp.float32)  # 16 x 32 per device
    f = _smap(mesh8, lambda a: jax.lax.psum(a * 2.0, "x") + 1.0, P("x"), P("x"))
    [op] = _only(_collectives(f, x), "all-reduce")
    assert (op.bytes, op.count, op.group_size) == (16 * 32 * 4, 1, 8)


def test_all_gather_counts_the_gathered_result(mesh8):
    x = jnp.ones((8 * 4, 8), jnp.float32)  # (the CPU back end computes bf16 collectives in f32)
    f = _smap(mesh8, lambda a: jax.lax.all_gather(a * 2, "x", tiled=True) + 1, P("x"), P("x"))
    [op] = _only(_collectives(f, x), "all-gather")
    assert (op.bytes, op.count, op.group_size) == (32 * 8 * 4, 1, 8)


def test_reduce_scatter_counts_its_operand(mesh8):
    x = jnp.ones((8 * 32, 8), jnp.float32)  # 32 x 8 per device, scattered into 4 x 8
    f = _smap(mesh8, lambda a: jax.lax.psum_scatter(a * 2, "x", scatter_dimension=0, tiled=True) + 1,
              P("x"), P("x"))
    report = _collectives(f, x)
    kinds = {o.kind for o in report.ops}
    if kinds == {"all-reduce"}:  # a backend that lowers reduce-scatter as all-reduce + slice
        [op] = _only(report, "all-reduce")
    else:
        [op] = _only(report, "reduce-scatter")
    assert (op.bytes, op.count) == (32 * 8 * 4, 1)


def test_ppermute_and_all_to_all(mesh8):
    x = jnp.ones((8 * 4, 8), jnp.float32)
    ring = [(i, (i + 1) % 8) for i in range(8)]
    f = _smap(mesh8, lambda a: jax.lax.ppermute(a * 2, "x", ring) + 1, P("x"), P("x"))
    [op] = _only(_collectives(f, x), "collective-permute")
    assert (op.bytes, op.count) == (4 * 8 * 4, 1)
    y = jnp.ones((8 * 8, 4), jnp.float32)  # 8 x 4 per device
    g = _smap(mesh8, lambda a: jax.lax.all_to_all(a * 2, "x", 0, 0, tiled=True) + 1, P("x"), P("x"))
    [op] = _only(_collectives(g, y), "all-to-all")
    assert (op.bytes, op.count, op.group_size) == (8 * 4 * 4, 1, 8)


def test_loop_trip_counts_multiply_including_nested_loops(mesh8):
    def body(a):
        def inner(c, _):
            return jax.lax.psum(c, "x") * 0.5 + c, None

        def outer(c, _):
            c, _ = jax.lax.scan(inner, c, None, length=5)
            return c * 0.9, None

        a, _ = jax.lax.scan(outer, a, None, length=3)
        return a

    f = _smap(mesh8, body, P("x"), P("x"))
    report = _collectives(f, jnp.ones((8 * 2, 16), jnp.float32))
    count, nbytes = report.total("all-reduce")
    assert (count, nbytes) == (15, 15 * 2 * 16 * 4)


# ---------------------------------------------------------------------------------------------
# The train step against the analytic figure


def _trainer(tmp_path, *overrides):
    cfg = load_config(overrides=SMALL + ["train.steps=2", f"train.run_dir={tmp_path / 'run'}", *overrides])
    tr = build_trainer(cfg)
    tr.loader.close()
    return tr.cfg, tr, tr.plan.sizes, tr.plan.batch.micro_batch


@pytest.mark.parametrize("sp,recompute", [(False, "none"), (True, "none"), (True, "full")],
                         ids=["tp4-dp2", "tp4-dp2-sp", "tp4-dp2-sp-full-recompute"])
def test_tensor_parallel_communication_matches_analytic(tmp_path, sp, recompute):
    cfg, tr, sizes, micro = _trainer(tmp_path, "mesh.tensor=4", "mesh.data=2",
                                     f"parallel.sequence_parallel={str(sp).lower()}",
                                     f"parallel.recompute={recompute}")
    comm = communication_table(tr.plan, tr.step_fn, tr.spec)
    for kind, row in comm.items():
        if row["analytic_bytes"] or row["bytes"]:
            assert 0.9 <= row["ratio"] <= 1.25, (kind, row)
    assert communication_verdict(comm).startswith("every kind within [0.9, 1.25]")
    # Expected kinds: Megatron's 2 + 2 per layer (+ embedding/output) as all-reduce, or as AG/RS pairs.
    assert (comm["all-gather"]["count"] > 0) == sp and (comm["reduce-scatter"]["count"] > 0) == sp
    bsh = micro * cfg.train.seq_len * cfg.model.hidden_size * 4
    measured = hlo.parse(tr.step_fn.as_text())
    activation_all_reduces = [o for o in measured.ops if o.kind == "all-reduce" and o.group_size == 4
                              and o.bytes >= bsh // 4]
    if sp:
        assert not activation_all_reduces, activation_all_reduces  # SP: no activation all-reduce at all
        if recompute == "none":
            assert comm["all-gather"]["bytes"] == comm["reduce-scatter"]["bytes"]
    else:
        assert activation_all_reduces


COMPOSED = {
    "1f1b_p2_data2_tensor2_sp": ["mesh.pipeline=2", "mesh.data=2", "mesh.tensor=2", "parallel.sequence_parallel=true"],
    "1f1b_p2_context2_tensor2_sp_ring": ["mesh.pipeline=2", "mesh.context=2", "mesh.tensor=2",
                                         "parallel.sequence_parallel=true", "parallel.context_impl=ring"],
    "1f1b_p2_data2_context2_allgather": ["mesh.pipeline=2", "mesh.data=2", "mesh.context=2",
                                         "parallel.context_impl=allgather"],
    "moe_1f1b_p2_expert2_tensor2_sp": ["mesh.pipeline=2", "mesh.expert=2", "mesh.tensor=2",
                                       "parallel.sequence_parallel=true", "model.num_experts=8"],
    "moe_expert4_tensor2_capacity": ["mesh.expert=4", "mesh.tensor=2", "model.num_experts=8",
                                     "model.moe_expert_capacity_factor=1.0"],
    "fp8_data2_tensor4_sp": ["mesh.data=2", "mesh.tensor=4", "parallel.sequence_parallel=true", "train.precision=fp8"],
}


@pytest.mark.parametrize("layout", list(COMPOSED.values()), ids=list(COMPOSED))
def test_composed_layouts_communication_matches_analytic(layout):
    """The composed layouts' collectives (compiled, not run) against the analytic figure, every kind
    within [0.9, 1.25]: the stage loop's halves in every tick, context parallelism's k/v, the expert
    exchange's buffers, FP8's products under sequence parallelism."""
    cfg = load_config(overrides=[*SMALL, "model.num_layers=4", "train.global_batch=16", "train.micro_batch=2",
                                 "model.moe_ffn_hidden_size=64", *layout])
    comm = compiled_communication(cfg)
    assert communication_verdict(comm).startswith("every kind within [0.9, 1.25]"), comm


def compiled_communication(cfg, devices: int = 8) -> dict:
    """bench's communication table (per kind: measured and analytic bytes, their ratio) of `cfg`'s train
    step compiled for `devices` devices, not run."""
    from megajax.train.setup import build_setup
    setup = build_setup(make_plan(cfg, devices))
    batch = {k: jax.ShapeDtypeStruct(setup.batch.shape, np.float32 if k == "loss_mask" else np.int32, sharding=s)
             for k, s in setup.batch_shardings.items()}
    ok = jax.ShapeDtypeStruct((), np.bool_, sharding=NamedSharding(setup.mesh, P()))
    compiled = setup.train_step().lower(setup.target(), batch, ok).compile()
    return communication_table(setup.plan, compiled, setup.spec)


LORA_LAYOUTS = {
    "lora_tp2_dp4": ["mesh.tensor=2", "mesh.data=4"],
    "lora_tp2_sp_dp4": ["mesh.tensor=2", "mesh.data=4", "parallel.sequence_parallel=true"],
    "lora_experts_tp2_ep2_dp2": ["mesh.tensor=2", "mesh.expert=2", "mesh.data=2", "model.num_experts=8",
                                 "model.moe_ffn_hidden_size=64", "model.lora.targets=[qkv,proj,experts]"],
}


@pytest.mark.parametrize("layout", list(LORA_LAYOUTS.values()), ids=list(LORA_LAYOUTS))
def test_lora_tensor_parallel_communication_matches_analytic(layout, monkeypatch):
    """model.lora on tensor 2: per adapted linear and layer pass one [tokens, rank] activation crosses
    the tensor ranks (an all-reduce, or an all-gather / reduce-scatter under SP) beside the base's
    collectives, under SP the tensor-whole adapter halves' gradients are all-reduced, and the routed
    experts' merged kernels' gradient is reduced over the data axes: every kind within 3% of the
    analytic count; without the adapters' terms some kind is not."""
    from megajax.train.setup import build_setup
    cfg = load_config(overrides=[*SMALL, "train.steps=2", "model.lora.rank=4", *layout])
    setup = build_setup(make_plan(cfg, 8))
    batch = {k: jax.ShapeDtypeStruct(setup.batch.shape, np.float32 if k == "loss_mask" else np.int32, sharding=s)
             for k, s in setup.batch_shardings.items()}
    ok = jax.ShapeDtypeStruct((), np.bool_, sharding=NamedSharding(setup.mesh, P()))
    compiled = setup.train_step().lower(setup.target(), batch, ok).compile()
    comm = communication_table(setup.plan, compiled, setup.spec)
    for kind, row in comm.items():
        if row["analytic_bytes"] or row["bytes"]:
            assert 0.97 <= row["ratio"] <= 1.03, (kind, row)
    if "parallel.sequence_parallel=true" in layout:  # the [micro, seq, rank] gathers and scatters, on their own
        rank_rows = setup.plan.batch.micro_batch * cfg.train.seq_len * 4 * 4
        measured = hlo.parse(compiled.as_text())
        for kind in ("all-gather", "reduce-scatter"):
            assert sum(o.count for o in measured.ops if o.kind == kind and o.bytes == rank_rows) == 2 * 2 * 2, kind
    monkeypatch.setattr(analytic, "_lora_linears", lambda m: (0, 0))
    monkeypatch.setattr(analytic, "lora_tensor_reduced_bytes", lambda *a: 0)
    without = communication_table(setup.plan, compiled, setup.spec)
    assert any(not 0.97 <= r["ratio"] <= 1.03 for r in without.values() if r["ratio"] is not None), without


@pytest.mark.parametrize("freq, dispatcher", [(1, "alltoall"), (2, "alltoall"), (1, "allgather")])
def test_shared_expert_tensor_parallel_communication_matches_analytic(tmp_path, freq, dispatcher):
    """A MoE layer with a shared expert, tensor 2 x expert 2 x data 2 with SP: the shared expert adds
    one reduce-scatter forward and one backward per MoE layer (both layers, or with moe_layer_freq 2
    the first only: the second is dense); its all-gathers are the routed experts'. The allgather
    dispatcher adds its own gathers and reduce-scatters over `expert`."""
    cfg, tr, sizes, micro = _trainer(tmp_path, "mesh.tensor=2", "mesh.expert=2", "mesh.data=2",
                                     "parallel.sequence_parallel=true", "model.num_experts=8",
                                     "model.moe_ffn_hidden_size=64", "model.moe_shared_expert_ffn_size=96",
                                     f"model.moe_layer_freq={freq}", f"parallel.moe_token_dispatcher={dispatcher}")
    comm = communication_table(tr.plan, tr.step_fn, tr.spec)
    bsh = micro * cfg.train.seq_len * cfg.model.hidden_size * 4
    if dispatcher == "alltoall":
        assert comm["reduce-scatter"]["analytic_bytes"] == (4 * 2 + 2 + 2 * (2 // freq)) * bsh  # 2 layers
    for kind in ("all-gather", "reduce-scatter"):
        assert 0.95 <= comm[kind]["ratio"] <= 1.05, (kind, comm[kind])


@pytest.mark.parametrize("layout", [["mesh.fsdp=8"], ["mesh.tensor=4", "mesh.data=2",
                                                      "parallel.distributed_optimizer=true"],
                                    ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
                                     "parallel.distributed_optimizer=true"]],
                         ids=["fsdp8", "tp4-dp2-distopt", "dp2-fsdp2-tp2-distopt"])
def test_analytic_state_memory_equals_actual_shards(tmp_path, layout):
    # The train state exactly as `megajax train` places it (no need to compile the step).
    from megajax.train.setup import build_setup
    cfg = load_config(overrides=SMALL + ["model.vocab_size=300", *layout])
    setup = build_setup(make_plan(cfg, 8))
    rules, spec, sizes = setup.rules, setup.spec, setup.plan.sizes
    state = setup.fresh_state()
    est = analytic.state_bytes(spec.axes, spec.abstract_params, rules.params, rules.opt_state, sizes)

    def per_device(tree):
        leaves = [x for x in jax.tree.leaves(tree) if x.ndim > 0 and jnp.issubdtype(x.dtype, jnp.floating)]
        return sum(x.addressable_shards[0].data.nbytes for x in leaves)

    assert est["params"] == per_device(state.params)
    assert est["optimizer"] == per_device(state.opt_state)
    # ...and it is really sharded where the rules say so.
    assert est["params"] < sum(x.nbytes for x in jax.tree.leaves(state.params))


def test_activation_formula_orders_policies_and_sequence_parallel():
    by = {}
    for policy in ("none", "selective", "full"):
        for sp in (False, True):
            plan = make_plan(load_config(overrides=SMALL + ["mesh.data=2", "mesh.tensor=4", f"parallel.recompute={policy}",
                                                            f"parallel.sequence_parallel={str(sp).lower()}"]), 8)
            assert plan.batch.micro_batch == 4
            by[policy, sp] = analytic.activation_bytes(plan)
    assert by["none", False] > by["selective", False] > by["full", False]
    assert by["none", True] < by["none", False] and by["full", True] * 4 == pytest.approx(by["full", False], 1e-6)
    s, b, h, a, L = 32, 4, 64, 8, 2  # Korthikanti, tensor 4 + SP, no recompute, x2 for fp32
    assert by["none", True] == int(s * b * h / 4 * (34 + 5 * a * s / h) * L * 2)


# ---------------------------------------------------------------------------------------------
# Fit check


def test_fit_check_refuses_with_advice(small_config):
    cfg = small_config("mesh.data=8", "train.device_memory_gib=0.0002", steps=1)
    with pytest.raises(MeshError) as e:
        run_training(cfg)
    msg = str(e.value)
    assert "per device of 210 KiB" in msg and "train.device_memory_gib" in msg  # 0.0002 GiB, readable
    assert "try " in msg and ("parallel.recompute=" in msg or "mesh.fsdp=" in msg) and "iB est." in msg


def test_fit_check_passes_a_config_that_fits(small_config):
    result = run_training(small_config("mesh.data=8", "train.device_memory_gib=1", steps=1))
    assert len(result.losses) == 1 and math.isfinite(result.losses[0])


def test_check_fit_message_lists_advice():
    with pytest.raises(MeshError, match=r"needs 92\.1 GiB per device of 79\.6 GiB .*try parallel.recompute=full"):
        check_fit(int(92.1 * 2**30), int(79.6 * 2**30), "H100 datasheet", ["parallel.recompute=full (-31.0 GiB est.)"])
    check_fit(10, 20, "x", [])


# ---------------------------------------------------------------------------------------------
# The command


def test_bench_command_reports_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", *SMALL, "train.steps=2", "mesh.tensor=4", "mesh.data=2", "parallel.sequence_parallel=true",
               f"train.run_dir={tmp_path / 'run'}", "--steps", "3", "--warmup", "1", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    for words in ("compile", "tokens/s", "FLOP/s per device", "memory per device", "temporaries",
                  "reduce-scatter", "every kind within [0.9, 1.25]"):
        assert words in text, words
    r = json.loads(out.read_text())
    assert r["layout"]["mesh"]["tensor"] == 4 and r["step_seconds"]["n"] == 3
    assert r["cpu_step_seconds"]["n"] == 3 and r["cpu_step_seconds"]["min"] > 0 and "host work  median" in text
    assert r["tokens_per_sec"] > 0 and r["compile_seconds"] > 0
    phases = r["compile_phases"]  # the compile's stages, timed one after another
    assert set(phases) == {"trace", "lower", "compile"} and min(phases.values()) > 0
    assert sum(phases.values()) == pytest.approx(r["compile_seconds"], rel=1e-6)
    assert r["memory"]["compiled"]["total"] > 0 and r["memory"]["analytic"]["params"] > 0
    assert r["communication"]["all-gather"]["count"] > 0


def test_bench_sweep_plots_and_baseline_runs_interleaved(tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path / "sweep.json"
    rc = main(["bench", *SMALL, f"train.run_dir={tmp_path / 'run'}", "--steps", "2",
               "--warmup", "1", "--sweep", "train.seq_len=16,32", "--baseline", "torch", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert [p["sweep"]["value"] for p in r["points"]] == ["16", "32"]
    assert [p["layout"]["seq_len"] for p in r["points"]] == [16, 32]
    for p in r["points"]:
        assert p["baseline"]["name"] == "torch" and p["baseline"]["megajax_over_baseline"] > 0
        assert p["baseline"]["step_seconds"]["n"] == p["step_seconds"]["n"]
        assert p["baseline"]["cpu_step_seconds"]["n"] == p["cpu_step_seconds"]["n"]
        assert p["baseline"]["megajax_over_baseline_cpu"] == pytest.approx(
            p["baseline"]["cpu_step_seconds"]["median"] / p["cpu_step_seconds"]["median"])
    text = capsys.readouterr().out
    assert "megajax / torch" in text and "megajax / torch by host work" in text
    if importlib.util.find_spec("matplotlib") is None:
        assert "plot: skipped" in text
    else:
        png = out.with_suffix(".png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_topology_estimate_and_errors(tmp_path, capsys):
    out = tmp_path / "topo.json"
    assert main(["bench", "--config", "model/llama3-8b", "train.global_batch=64", "train.seq_len=4096",
                 "mesh.data=-1", "--topology", "8xH100", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["fits"] is False and r["mesh"]["data"] == 8 and r["advice"]
    assert "does NOT fit" in capsys.readouterr().out
    # 8B over 64 devices with FSDP fits in 80 GiB.
    assert main(["bench", "--config", "model/llama3-8b", "train.global_batch=64", "train.seq_len=4096",
                 "mesh.data=1", "mesh.fsdp=-1", "parallel.recompute=full", "--topology", "64xH100", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["fits"] is True
    assert main(["bench", "--topology", "8xTPU"]) == 2
    assert "unknown device kind 'TPU'" in capsys.readouterr().err
    assert main(["bench", "--sweep", "train.seq_len"]) == 2
    assert "expected key=v1,v2" in capsys.readouterr().err


def test_sharding_of_known_array_is_counted_per_device(mesh8):
    # A jitted program with an implicit collective from shardings alone.
    x = jax.device_put(np.ones((64, 16), np.float32), NamedSharding(mesh8, P("x")))
    report = hlo.parse(jax.jit(lambda a: a.sum(0)).lower(x).compile().as_text())
    count, nbytes = report.total("all-reduce")
    assert count == 1 and nbytes == 16 * 4


@pytest.mark.parametrize("layout", [["mesh.data=8"], ["mesh.fsdp=8"],
                                    ["mesh.data=2", "mesh.fsdp=4", "parallel.distributed_optimizer=true"]],
                         ids=["data8", "fsdp8", "data2-fsdp4-distopt"])
def test_gradient_accumulation_reduces_over_data_parallel_devices_once_per_step(tmp_path, layout):
    """Accumulation 4: the data-parallel gradient reduction (and the FSDP parameter gather) happens
    once per step, as in Megatron, not once per microbatch: the compiled step's collectives are the
    analytic minimum of one step. (On CPU, XLA lowers a reduce-scatter as an all-reduce plus a slice,
    so the kinds differ and the total is compared.)"""
    cfg, tr, sizes, micro = _trainer(tmp_path, *layout, "train.global_batch=32", "train.micro_batch=1")
    assert tr.accumulation == 4
    comm = communication_table(tr.plan, tr.step_fn, tr.spec)
    assert 0.9 <= comm["total"]["ratio"] <= 1.05, comm
    # No data-parallel collective inside the microbatch loop: every collective of the step runs once.
    assert all(op.count == 1 for op in hlo.parse(tr.step_fn.as_text()).ops), "a collective runs per microbatch"
