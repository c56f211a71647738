"""`megajax plan`'s step-time estimate against measured steps, on this host's 8 simulated CPU devices.

    python scripts/plan_vs_measured.py --output tests/data/plan_vs_measured.json [--steps 3] [--rounds 2] [--only llama]

For a small Llama and a small MoE, each layout in LAYOUTS (data / FSDP / tensor / pipeline / context /
expert combinations and micro batches on 8 devices) is timed as `megajax bench` times it
(megajax.perf.bench.compiled_step: the train step `megajax train` runs, at XLA's default optimisation),
in its own process with XLA_FLAGS=--xla_force_host_platform_device_count=8: the fastest of a few
steps after a warm-up, by the process's CPU seconds over the host's cores (other work on a shared
host stretches a step's wall time, hardly its CPU time; the wall times are recorded too); and estimated by `megajax plan`'s model (megajax.perf.planner.estimate)
for the kind CPU (megajax/perf/device_kinds.py: host peak / 8 per device) with the matmul table
`megajax bench --gemm-table` measures here (written beside the output), and without it (the
constant efficiency); both with the memory bandwidth and fixed costs that command's probes measure
on the 8 devices (`probes`). `--table-only` measures the table and probes again and keeps the
recorded steps. The JSON holds the device kind's figures, the table, the probes, each layout's
(overrides, estimate with and without the table, measured) and per model and overall the Spearman
rank correlation and the worst estimate / measured ratio (each model's estimates scaled by their
median ratio first: the CPU kind's peak is a rough figure, the ranking is what the plan uses).
tests/test_plan_vs_measured.py recomputes the estimates for the recorded layouts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# model/tiny and model/tiny-moe at half their width and sequence (a step of a few seconds here).
COMMON = ["model.hidden_size=128", "model.ffn_hidden_size=512", "train.seq_len=128", "train.global_batch=8", "data.corpus_max_mb=0.5", "train.sample_tokens=0", "train.eval_every=0",
          "logging.tensorboard=false", "logging.progress=false"]
MODELS = {"llama": "model/tiny", "moe": "model/tiny-moe"}
EXTRA = {"moe": ["model.moe_ffn_hidden_size=256"]}
_PIPE = ["train.micro_batch=1"]
LAYOUTS = {
    "llama": [
        ["mesh.data=8"],
        ["mesh.data=8", "train.micro_batch=1"],
        ["mesh.data=8", "parallel.distributed_optimizer=true"],
        ["mesh.data=8", "parallel.recompute=full"],
        ["mesh.data=1", "mesh.fsdp=8"],
        ["mesh.data=4", "mesh.fsdp=2"],
        ["mesh.data=4", "mesh.tensor=2"],
        ["mesh.data=2", "mesh.tensor=4"],
        ["mesh.data=2", "mesh.tensor=4", "parallel.sequence_parallel=true"],
        ["mesh.data=4", "mesh.pipeline=2", *_PIPE],
        ["mesh.data=2", "mesh.pipeline=4", *_PIPE],
        ["mesh.data=2", "mesh.tensor=2", "mesh.pipeline=2", *_PIPE],
        ["mesh.data=4", "mesh.context=2"],
        ["mesh.data=2", "mesh.context=4"],
        ["mesh.data=2", "mesh.tensor=2", "mesh.context=2"],
    ],
    "moe": [
        ["mesh.data=8"],
        ["mesh.data=8", "train.micro_batch=1"],
        ["mesh.data=1", "mesh.expert=8"],
        ["mesh.data=2", "mesh.expert=4"],
        ["mesh.data=4", "mesh.expert=2"],
        ["mesh.data=1", "mesh.fsdp=8"],
        ["mesh.data=1", "mesh.fsdp=2", "mesh.expert=4"],
        ["mesh.data=4", "mesh.tensor=2"],
        ["mesh.data=1", "mesh.tensor=2", "mesh.expert=4"],
        ["mesh.data=4", "mesh.pipeline=2", *_PIPE],
        ["mesh.data=1", "mesh.context=2", "mesh.expert=4"],
        ["mesh.data=1", "mesh.expert=8", "train.micro_batch=1"],
    ],
}


def spearman(a, b) -> float:
    """Spearman's rank correlation: the Pearson correlation of the ranks (ties get their mean rank)."""
    def ranks(x):
        x = np.asarray(x, dtype=float)
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        for v in np.unique(x):  # ties: the mean of their ranks
            r[x == v] = r[x == v].mean()
        return r
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / np.sqrt((ra * ra).sum() * (rb * rb).sum()))


def worst_ratio(estimates, measured) -> float:
    """The largest factor between an estimate and its measurement (max(r, 1/r) of estimate / measured),
    the estimates scaled by their median ratio first."""
    r = np.asarray(estimates, float) / np.asarray(measured, float)
    r = r / np.median(r)
    return float(np.max(np.maximum(r, 1 / r)))


PROBES = ("memory_gbps", "memory_efficiency", "optimizer_gbps", "collective_latency_us", "collective_gbps",
          "tick_overhead_us")


def device_kinds_yaml(kind: dict, table_rows, probes: dict | None = None) -> str:
    """The --device-kinds file of the recorded CPU figures (and the table, when given), with the memory
    bandwidth and fixed costs the table's probes measured (`probes`; else the kind's recorded ones)."""
    import yaml
    entry = {k: kind[k] for k in ("memory_gib", "peak_tflops", "node_size", "intra_node_gbps", "inter_node_gbps",
                                  "efficiency", "link_efficiency", "shared_host", "grouped_gemm_tile", *PROBES)
             if k in kind}
    entry.update(probes or {})
    if table_rows:
        entry["gemm_efficiency"] = [list(r) for r in table_rows]
    return yaml.safe_dump({"CPU": entry}, default_flow_style=None)


def estimates(record: dict, use_table: bool) -> list[float]:
    """The planner's step seconds for every recorded layout, from the recorded device figures."""
    from megajax.config import load_config
    from megajax.perf import planner
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "cpu.yaml"
        path.write_text(device_kinds_yaml(record["device_kind"], record["gemm_table"] if use_table else None,
                                          record.get("probes")))
        return [planner.estimate(load_config([r["config"]], r["overrides"]), "8xCPU", str(path)).step_seconds
                for r in record["layouts"]]


def _measure_here(config: str, overrides: list[str], steps: int) -> dict:
    """(in the child process) the train step `megajax bench` times (megajax.perf.bench.compiled_step),
    run `steps` times after a warm-up: each step's wall seconds and the process's CPU seconds (every
    thread's) over it."""
    from megajax.config import load_config
    from megajax.perf.bench import compiled_step
    with tempfile.TemporaryDirectory() as d:
        cfg = load_config([config], [*overrides, f"train.run_dir={d}"])
        built = compiled_step(cfg)
        built.run()
        wall, cpu = [], []
        for _ in range(steps):
            t, p = time.perf_counter(), time.process_time()
            built.run()
            wall.append(time.perf_counter() - t)
            cpu.append(time.process_time() - p)
        built.loader.close()
    # The host's work per step, spread over its cores: what the step takes with the host to itself.
    # Other processes on a shared host stretch the wall time but hardly the CPU time, so the CPU
    # time is the steadier measure (the fastest step: the least disturbed).
    cores = os.cpu_count() or 1
    return {"step_seconds": min(cpu) / cores, "all": [c / cores for c in cpu], "wall": wall,
            "compile_seconds": built.compile_seconds}


def measure(config: str, overrides: list[str], steps: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    out = subprocess.run([sys.executable, __file__, "--child", config, str(steps), *overrides], env=env,
                         capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{config} {' '.join(overrides)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(record: dict) -> dict:
    out = {}
    rows = record["layouts"]
    for name in [*MODELS, "all"]:
        sel = [r for r in rows if name == "all" or r["model"] == name]
        if len(sel) < 3:
            continue
        meas = [r["measured"] for r in sel]
        out[name] = {key: {"spearman": spearman([r[key] for r in sel], meas),
                           "worst_ratio": worst_ratio([r[key] for r in sel], meas)}
                     for key in ("estimate", "estimate_constant")}
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        config, steps, overrides = sys.argv[2], int(sys.argv[3]), sys.argv[4:]
        print(json.dumps(_measure_here(config, overrides, steps)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output", default="tests/data/plan_vs_measured.json")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--only", choices=list(MODELS), help="measure one model's layouts again, keep the other's")
    ap.add_argument("--rounds", type=int, default=2,
                    help="times every layout is measured, in turn over all layouts; measured = the rounds' mean")
    ap.add_argument("--estimate-only", action="store_true",
                    help="measure nothing: the estimates and summary of --output's recorded layouts again")
    ap.add_argument("--table-only", action="store_true",
                    help="measure the table (megajax bench --gemm-table: the products and the probes) again, keep "
                         "--output's recorded steps, and estimate them again")
    args = ap.parse_args()
    if args.estimate_only:
        record = json.loads(Path(args.output).read_text())
        finish(record, args.output)
        return 0
    import dataclasses
    from megajax.perf.device_kinds import load_device_kinds
    kind = dataclasses.asdict(load_device_kinds(None)["CPU"])
    if args.table_only:
        record = json.loads(Path(args.output).read_text())
        record.update(device_kind=kind, **measure_table(args.output))
        record["table_command"] = "python " + " ".join(sys.argv)
        finish(record, args.output)
        return 0
    record = {"command": "python " + " ".join(sys.argv), "device_kind": kind, **measure_table(args.output),
              "note": ("measured: the mean over --rounds of a round's step, a step's CPU seconds (every thread of "
                       "the process) / the host's cores, the fastest of --steps after a warm-up (runs: each round's; "
                       "measured_all: each step's of the last round); wall: the last round's wall seconds per step "
                       "on the shared host"),
              "layouts": []}
    if args.only and Path(args.output).exists():  # the other model's recorded layouts are kept
        record["layouts"] = [r for r in json.loads(Path(args.output).read_text())["layouts"] if r["model"] != args.only]
    todo = [(model, config, overrides) for model, config in MODELS.items() if not (args.only and model != args.only)
            for overrides in LAYOUTS[model]]
    rows = {}
    for _ in range(args.rounds):  # round after round over every layout: a slow spell of the host hits all
        for model, config, overrides in todo:
            ov = [*COMMON, *EXTRA.get(model, []), *overrides]
            m = measure(config, ov, args.steps)
            r = rows.setdefault((model, tuple(overrides)), {"model": model, "config": config, "overrides": ov,
                                                             "layout": overrides, "runs": []})
            r["runs"].append(m["step_seconds"])
            r.update(measured=sum(r["runs"]) / len(r["runs"]), measured_all=m["all"], wall=m["wall"],
                     compile_seconds=m["compile_seconds"])
            print(f"{model:5} {' '.join(overrides):70} {m['step_seconds']:.3f} s", flush=True)
            partial = {**record, "layouts": [*record["layouts"], *rows.values()]}
            Path(args.output).with_suffix(".partial.json").write_text(json.dumps(partial, indent=1) + "\n")
    record["layouts"] += list(rows.values())
    finish(record, args.output)
    Path(args.output).with_suffix(".partial.json").unlink(missing_ok=True)
    return 0


def measure_table(output: str) -> dict:
    """`megajax bench --gemm-table` (written beside `output`) in its own process with the 8 devices: the
    products on the first device (all of the host's cores), the memory bandwidth and fixed costs on all
    of them at once. {gemm_table: rows, probes: the measured device figures}."""
    import yaml
    table = Path(output).with_suffix(".gemm.yaml")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    subprocess.run([sys.executable, "-m", "megajax.cli", "bench", "--gemm-table", str(table)], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    entry = yaml.safe_load(table.read_text())["CPU"]
    return {"gemm_table": entry["gemm_efficiency"], "probes": {k: entry[k] for k in PROBES if k in entry}}


def finish(record: dict, output: str) -> None:
    """The planner's estimates (with the table and without) and the summary, written to `output`."""
    for key, use in (("estimate", True), ("estimate_constant", False)):
        for r, e in zip(record["layouts"], estimates(record, use)):
            r[key] = e
    record["summary"] = summary(record)
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record["summary"], indent=1))


if __name__ == "__main__":
    sys.exit(main())
