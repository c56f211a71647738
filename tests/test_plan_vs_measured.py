"""`megajax plan`'s compute model: the matmul table (megajax/perf/gemm.py) and the estimates against
the step times scripts/plan_vs_measured.py recorded on 8 simulated CPU devices (no timing here)."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

from megajax.config import load_config
from megajax.errors import ConfigError
from megajax.perf import gemm, planner
from megajax.parallel.pipeline import build_schedule
from megajax.perf.device_kinds import load_device_kinds
from megajax.plan import make_plan
from megajax.train.flops import train_flops_per_token
from megajax.train.state import build_model_spec

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "tests" / "data" / "plan_vs_measured.json"


def _script():
    spec = importlib.util.spec_from_file_location("plan_vs_measured", ROOT / "scripts" / "plan_vs_measured.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


GRID = [[m, k, n, 0.1 + 0.2 * (m == 64) + 0.3 * (n == 64)] for m in (4, 64) for k in (4, 64) for n in (4, 64)]


def test_interpolation_is_linear_in_log_size_and_clamped():
    assert gemm.efficiency(GRID, 4, 4, 4) == pytest.approx(0.1)
    assert gemm.efficiency(GRID, 64, 4, 64) == pytest.approx(0.6)
    assert gemm.efficiency(GRID, 16, 4, 4) == pytest.approx(0.2)  # halfway in log2 between 4 and 64
    assert gemm.efficiency(GRID, 16, 30, 16) == pytest.approx(0.1 + 0.1 + 0.15)
    assert gemm.efficiency(GRID, 1, 1, 1) == pytest.approx(0.1)
    assert gemm.efficiency(GRID, 10**6, 10**6, 10**6) == pytest.approx(0.6)


def test_bad_tables_are_refused_naming_the_file_and_row(tmp_path):
    f = tmp_path / "kinds.yaml"
    f.write_text("H100: {gemm_efficiency: [[4, 4, 4, 1.5]]}\n")
    with pytest.raises(ConfigError, match=r"kinds.yaml, kind 'H100': gemm_efficiency row \[4, 4, 4, 1.5\]"):
        load_device_kinds(str(f))
    f.write_text("H100: {gemm_efficiency: [[4, 4, 4, 0.5], [8, 4, 4, 0.5], [4, 8, 4, 0.5]]}\n")
    with pytest.raises(ConfigError, match=r"no row for \[M, K, N\] = \[8, 8, 4\]"):
        load_device_kinds(str(f))
    f.write_text("H100: {gemm_efficiency: 0.5}\n")
    with pytest.raises(ConfigError, match="gemm_efficiency = '0.5': expected a list of"):
        load_device_kinds(str(f))


def test_measured_table_round_trips_through_device_kinds(tmp_path):
    measured = gemm.measure("float32", sizes=(8, 16), min_seconds=0.001)
    assert len(measured["rows"]) == 8 and all(r[3] > 0 for r in measured["rows"])
    kind, text = gemm.table_yaml(measured, 1e-3, "test", "megajax bench --gemm-table t.yaml")
    assert kind == "CPU" and text.startswith("# megajax bench --gemm-table t.yaml")
    f = tmp_path / "t.yaml"
    f.write_text(text)
    rows = load_device_kinds(str(f))["CPU"].gemm_efficiency
    assert [list(r[:3]) for r in rows] == [r[:3] for r in measured["rows"]] and all(0 < r[3] <= 1 for r in rows)


@pytest.mark.parametrize("config, overrides", [
    ("model/tiny", ["mesh.data=2", "mesh.tensor=2", "mesh.pipeline=2", "train.micro_batch=1"]),
    ("model/tiny", ["mesh.data=2", "mesh.context=2", "mesh.fsdp=2"]),
    ("model/tiny-moe", ["mesh.data=2", "mesh.expert=4"]),
    ("model/tiny-moe", ["mesh.data=1", "mesh.fsdp=2", "mesh.expert=4"]),
])
def test_step_products_add_up_to_the_model_flops_less_attention(config, overrides):
    """A device's products are its even share of the step's matmul FLOPs (6 x matmul parameters per
    token; attention is the rest), whatever the layout splits (a MoE router, whole on every tensor rank,
    would add its repeats under tensor parallelism)."""
    cfg = load_config([config], ["train.global_batch=16", *overrides])
    plan = make_plan(cfg, 8)
    spec, _ = build_model_spec(plan.cfg, plan.padded_vocab)
    gemms = gemm.step_gemms(plan, spec)

    # (a pipeline recomputes no forward of its own: its backward half runs the VJP its forward half took)
    products = sum(2 * g["m"] * g["k"] * g["n"] * g["count"] for g in gemms if not g["name"].startswith("attention"))
    m, s = plan.cfg.model, plan.batch.seq_len
    # attention's own products (attention_impl xla): scores and output over the whole square, 3 passes;
    # under the context ring its blocks of half chunks
    scores = sum(2 * g["m"] * g["k"] * g["n"] * g["count"] for g in gemms if g["name"].startswith("attention"))
    forward = 4 * plan.batch.global_batch * s * s * m.num_heads * m.head_dim * m.num_layers / 8
    if plan.sizes["context"] == 1:  # the backward's four products are twice the forward's two
        assert scores == pytest.approx(forward * 3, rel=1e-6)
    else:  # the ring skips the blocks above the diagonal
        assert 0 < scores < forward * 3
    attention = 6 * m.num_layers * s * m.num_heads * m.head_dim
    tokens = plan.batch.global_batch * s
    assert products == pytest.approx(tokens * (train_flops_per_token(m, s, plan.padded_vocab) - attention) / 8,
                                     rel=1e-6)
    if m.num_experts:  # a routed expert's rows: its share of the expert group's tokens
        rows = {g["m"] for g in gemm.step_gemms(plan, spec) if g["name"] == "layers/mlp/fc2"}
        assert rows == {plan.sizes["expert"] * plan.batch.micro_batch * s * m.moe_router_topk // m.num_experts}


def test_a_table_changes_only_the_compute_part(tmp_path):
    """Without a table (A100 has no built-in one) the estimate is the constant efficiency's; a table of
    one share everywhere equal to `efficiency` gives the same compute time; a slower table a longer one,
    the collectives unchanged (not overlapped with the products here, which would tie them)."""
    # (with fused attention: no products of its own for the table to time)
    cfg = load_config(["model/tiny"], ["train.global_batch=16", "mesh.data=2", "mesh.tensor=4",
                                       "model.attention_impl=cudnn", "parallel.tp_comm_overlap=false"])
    plain = planner.estimate(cfg, "8xA100")
    assert planner.DEVICE_KINDS["A100"].gemm_efficiency is None
    f = tmp_path / "kinds.yaml"
    grid = lambda share: [[m, k, n, share] for m in (16, 4096) for k in (16, 4096) for n in (16, 4096)]  # noqa: E731
    f.write_text(json.dumps({"A100": {"gemm_efficiency": grid(0.5)}}))
    same = planner.estimate(cfg, "8xA100", str(f))
    assert same.parts["compute"] == pytest.approx(plain.parts["compute"], rel=1e-9)
    f.write_text(json.dumps({"A100": {"gemm_efficiency": grid(0.05)}}))
    slow = planner.estimate(cfg, "8xA100", str(f))
    assert slow.parts["compute"] > 5 * plain.parts["compute"]
    assert slow.parts["tensor"] == plain.parts["tensor"]


def test_spearman_by_ranks():
    s = _script()
    assert s.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert s.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert s.spearman([1, 2, 3, 4, 5], [1, 3, 2, 5, 4]) == pytest.approx(0.8)  # 1 - 6 * 4 / (5 * 24)
    assert s.worst_ratio([1, 2, 4], [1, 2, 2]) == pytest.approx(2.0)


# The record of this host (steps, table and probes measured together), and two earlier ones: this host's of
# an earlier day, and steps of an AVX-512 host with this host's probes (docs/performance.md).
RECORDS = [RECORD, RECORD.with_name("plan_vs_measured.host2.json"), RECORD.with_name("plan_vs_measured.host1.json")]


@pytest.mark.parametrize("path", RECORDS, ids=lambda p: p.stem)
def test_estimates_rank_the_recorded_layouts_as_measured(path):
    """The planner's estimates, recomputed now for the recorded layouts and device figures, rank them as
    the recorded step times do (Spearman >= 0.6 over both models; scripts/plan_vs_measured.py)."""
    s = _script()
    record = json.loads(path.read_text())
    assert len([r for r in record["layouts"] if r["model"] == "llama"]) >= 10
    assert len([r for r in record["layouts"] if r["model"] == "moe"]) >= 10
    now = s.estimates(record, use_table=True)
    rho = s.spearman(now, [r["measured"] for r in record["layouts"]])
    assert rho >= 0.6 and math.isfinite(rho)


def test_devices_sharing_a_host_lose_no_time_to_the_pipeline_bubble(tmp_path):
    """The CPU kind's simulated devices share the host's cores: an idle stage's cores work for the others."""
    cfg = load_config(["model/tiny"], ["train.global_batch=16", "mesh.data=4", "mesh.pipeline=2",
                                       "train.micro_batch=1"])
    shared = planner.estimate(cfg, "8xCPU")
    assert shared.bubble > 0 and shared.parts["bubble"] == 0
    f = tmp_path / "kinds.yaml"
    f.write_text("CPU: {shared_host: false}\n")
    apart = planner.estimate(cfg, "8xCPU", str(f))
    work = apart.parts["compute"] + apart.parts["memory-bound"]
    assert apart.parts["bubble"] == pytest.approx(work * shared.bubble / (1 - shared.bubble))
    f.write_text("CPU: {shared_host: 1}\n")
    with pytest.raises(ConfigError, match="kind 'CPU': shared_host = 1: expected true or false"):
        load_device_kinds(str(f))


def test_bench_gemm_table_writes_a_device_kinds_file(tmp_path, monkeypatch, capsys):
    """`megajax bench --gemm-table FILE.yaml` (a 2^3 grid here) writes what --device-kinds reads."""
    from megajax.cli import main
    monkeypatch.setitem(gemm.SIZES, "cpu", (8, 16))
    out = tmp_path / "t" / "cpu.yaml"
    assert main(["bench", "--gemm-table", str(out)]) == 0
    assert f"wrote {out} (device kind CPU" in capsys.readouterr().out
    assert out.read_text().startswith(f"# megajax bench --gemm-table {out}")
    kind = load_device_kinds(str(out))["CPU"]
    assert len(kind.gemm_efficiency) == 8
    # the probes: the memory bandwidth, and with the 8 devices a collective's latency and a tick's cost
    assert kind.memory_gbps > 0 and kind.memory_efficiency == 1.0
    assert kind.collective_latency_us > 0 and kind.tick_overhead_us > 0
    # the optimizer's update streamed through memory, and the 8 devices' all-reduce bandwidth
    assert kind.optimizer_gbps > 0 and kind.collective_gbps > 0
    c = planner.estimate(load_config(["model/tiny"], ["train.global_batch=8", "mesh.data=8"]), "8xCPU", str(out))
    assert c.step_seconds > 0 and math.isfinite(c.step_seconds)


def test_expert_rows_are_padded_to_whole_tiles_where_the_host_tiles(tmp_path):
    """On XLA:CPU the routed experts run as a loop over tiles of GROUPED_GEMM_TILE rows, each expert's rows
    padded to whole tiles: the CPU kind times the padded products (a GPU's grouped GEMM the exact rows),
    and more experts per device with fewer rows each cost more time for the same FLOPs."""
    from megajax.models.moe import GROUPED_GEMM_TILE
    cfg = load_config(["model/tiny-moe"], ["train.global_batch=8", "train.seq_len=128", "mesh.data=8"])
    plan = make_plan(cfg, 8)
    spec, _ = build_model_spec(plan.cfg, plan.padded_vocab)
    exact = {g["m"] for g in gemm.step_gemms(plan, spec) if g["name"] == "layers/mlp/fc2"}
    tiled = {g["m"] for g in gemm.step_gemms(plan, spec, GROUPED_GEMM_TILE) if g["name"] == "layers/mlp/fc2"}
    assert exact == {128 * 2 // 8} and tiled == {GROUPED_GEMM_TILE}
    assert load_device_kinds(None)["CPU"].grouped_gemm_tile == GROUPED_GEMM_TILE
    assert load_device_kinds(None)["H100"].grouped_gemm_tile == 0
    f = tmp_path / "kinds.yaml"
    grid = [[m, k, n, 0.5] for m in (16, 4096) for k in (16, 4096) for n in (16, 4096)]
    f.write_text(json.dumps({"CPU": {"gemm_efficiency": grid, "grouped_gemm_tile": 0}}))
    plain = planner.estimate(cfg, "8xCPU", str(f))
    f.write_text(json.dumps({"CPU": {"gemm_efficiency": grid}}))
    padded = planner.estimate(cfg, "8xCPU", str(f))
    assert padded.parts["compute"] > plain.parts["compute"]
    ep = planner.estimate(load_config(["model/tiny-moe"], ["train.global_batch=8", "train.seq_len=128",
                                                           "mesh.data=1", "mesh.expert=8"]), "8xCPU", str(f))
    assert ep.parts["compute"] < padded.parts["compute"]  # 256 rows of one expert: no padding
    f.write_text("CPU: {grouped_gemm_tile: -1}\n")
    with pytest.raises(ConfigError, match=r"grouped_gemm_tile = -1: expected a whole number of rows >= 0"):
        load_device_kinds(str(f))


def test_lockstep_stages_on_a_shared_host_compute_the_bubble(tmp_path):
    """With collectives inside the chunks (tensor parallelism) every device runs every tick's halves, an idle
    stage on zeros: on devices sharing a host that work costs the bubble's time; each tick's transfers and
    its own fixed cost are charged per tick."""
    cfg = load_config(["model/tiny"], ["train.global_batch=16", "mesh.data=2", "mesh.tensor=2", "mesh.pipeline=2",
                                       "train.micro_batch=1"])
    lock = planner.estimate(cfg, "8xCPU")
    work = lock.parts["compute"] + lock.parts["memory-bound"]
    assert lock.bubble > 0 and lock.parts["bubble"] == pytest.approx(work * lock.bubble / (1 - lock.bubble))
    f = tmp_path / "kinds.yaml"
    f.write_text("CPU: {tick_overhead_us: 0, collective_latency_us: 0}\n")
    free = planner.estimate(cfg, "8xCPU", str(f))
    c = make_plan(cfg, 8).pipeline
    ticks = build_schedule(c.schedule, c.stages, c.microbatches, c.virtual_stages).ticks
    kind = load_device_kinds(None)["CPU"]
    calls = (lock.parts["pipeline"] - free.parts["pipeline"]) * 1e6
    assert calls == pytest.approx(ticks * (kind.tick_overhead_us + 2 * kind.collective_latency_us))


def test_memory_bound_work_and_the_optimizer_at_the_kinds_bandwidth(tmp_path):
    """The element-wise work and the optimizer's update take bytes / memory bandwidth: half the bandwidth
    doubles both; the distributed optimizer updates 1 / data of the Adam state."""
    cfg = load_config(["model/tiny"], ["train.global_batch=8", "mesh.data=8"])
    base = planner.estimate(cfg, "8xH100")
    f = tmp_path / "kinds.yaml"
    f.write_text("H100: {memory_gbps: 1675}\n")
    half = planner.estimate(cfg, "8xH100", str(f))
    for part in ("memory-bound", "optimizer"):
        assert base.parts[part] > 0 and half.parts[part] == pytest.approx(2 * base.parts[part])
    assert half.parts["compute"] == pytest.approx(base.parts["compute"])
    dist = planner.estimate(load_config(["model/tiny"], ["train.global_batch=8", "mesh.data=8",
                                                         "parallel.distributed_optimizer=true"]), "8xH100")
    assert dist.parts["optimizer"] == pytest.approx(base.parts["optimizer"] / 8, rel=0.05)
    for bad, accepted in (("memory_gbps: 0", "a bandwidth in GB/s > 0"),
                          ("collective_latency_us: -1", "a time in microseconds >= 0"),
                          ("memory_efficiency: 2", r"a share of the memory bandwidth in \(0, 1\]")):
        f.write_text(f"H100: {{{bad}}}\n")
        with pytest.raises(ConfigError, match=f"kind 'H100': {bad.split(':')[0]} = .*: expected {accepted}"):
            load_device_kinds(str(f))


def test_measured_optimizer_and_collective_bandwidths_replace_the_datasheet_figures(tmp_path):
    """`optimizer_gbps` (Adam's update streamed through main memory) times the optimizer's update in place of
    the memory bandwidth, leaving the element-wise work at memory_gbps; `collective_gbps` (a measured bus
    bandwidth) times the transfers inside a node in place of intra_node_gbps x link_efficiency."""
    cfg = load_config(["model/tiny"], ["train.global_batch=8", "mesh.data=2", "mesh.tensor=4"])
    f = tmp_path / "kinds.yaml"
    f.write_text("H100: {collective_latency_us: 0}\n")
    base = planner.estimate(cfg, "8xH100", str(f))
    kind = load_device_kinds(None)["H100"]
    assert kind.optimizer_gbps == 0 and kind.collective_gbps == 0  # not measured: the datasheet's figures
    f.write_text("H100: {collective_latency_us: 0, optimizer_gbps: 335, collective_gbps: 31.5}\n")
    measured = planner.estimate(cfg, "8xH100", str(f))
    # the optimizer at 335 GB/s against 3350 x 0.8, the tensor transfers at 31.5 against 450 x 0.7
    assert measured.parts["optimizer"] == pytest.approx(base.parts["optimizer"] * 3350 * 0.8 / 335)
    assert measured.parts["tensor"] == pytest.approx(base.parts["tensor"] * 450 * 0.7 / 31.5)
    assert measured.parts["memory-bound"] == pytest.approx(base.parts["memory-bound"])
    assert measured.parts["compute"] == pytest.approx(base.parts["compute"])
    for bad in ("optimizer_gbps: -1", "collective_gbps: fast"):
        f.write_text(f"H100: {{{bad}}}\n")
        with pytest.raises(ConfigError, match=f"kind 'H100': {bad.split(':')[0]} = .*: expected a bandwidth in "
                                              r"GB/s >= 0 \(0: not measured"):
            load_device_kinds(str(f))


def test_devices_sharing_a_host_do_not_hide_the_gradient_reduction(tmp_path):
    """Data parallelism's gradient all-reduce overlaps the backward on devices with their own cores (hidden
    while shorter than it); on simulated CPU devices its copies and sums are the computing cores' work and
    count whole."""
    cfg = load_config(["model/tiny"], ["train.global_batch=8", "mesh.data=8"])
    f = tmp_path / "kinds.yaml"
    f.write_text("CPU: {collective_latency_us: 0, collective_gbps: 2.0}\n")
    shared = planner.estimate(cfg, "8xCPU", str(f))
    f.write_text("CPU: {collective_latency_us: 0, collective_gbps: 2.0, shared_host: false}\n")
    apart = planner.estimate(cfg, "8xCPU", str(f))
    assert "data (overlapped)" in apart.parts and "data" not in apart.parts
    reduction = apart.parts["data (overlapped)"]
    assert 0 < reduction < apart.parts["compute"] * 2 / 3  # hidden behind the backward
    assert shared.parts["data"] == pytest.approx(reduction) and "data (overlapped)" not in shared.parts
    assert shared.step_seconds == pytest.approx(apart.step_seconds + reduction)
