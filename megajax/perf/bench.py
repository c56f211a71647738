"""`megajax bench`: what one train step of a config costs, and why.

For one config (or a sweep over one key) this builds the same jitted train
step `megajax train` runs and reports:

- compile time; step time (median and spread over N timed steps after
  warm-up); tokens/s (total and per device); model TFLOP/s per device and
  MFU against the device's peak (megajax/train/flops.py's convention);
- per-device memory from the compiled executable (arguments, outputs,
  temporaries) beside the analytic estimate (parameters, gradients, Adam
  state for the shardings in use; Korthikanti's activations for the
  recompute policy and tensor/sequence parallel sizes), and whether it fits
  the device;
- collectives per step read from the compiled HLO (count and bytes per
  kind) beside the layout's analytic figure (megajax/perf/analytic.py), with the ratio;
- optionally a peer baseline (Hugging Face transformers on PyTorch, or
  Megatron-Core) timed in the same run, interleaved with megajax's steps so
  that both see the same machine load, and the throughput ratio.

`--topology 8xH100` estimates the per-device memory of the config on a
device kind the machine does not have (analytic: XLA cannot compile for a
GPU without its plugin and a device) and says whether it fits.
`--gemm-table FILE.yaml` measures matmul throughput by shape on this machine's
device instead (megajax/perf/gemm.py), for `megajax plan --device-kinds`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from megajax import host_allocator
from megajax.config import Config, load_config
from megajax.errors import ConfigError
from megajax.parallel.pipeline import BRANCH_SCOPES, branch_runs, build_schedule
from megajax.mesh import mesh_text
from megajax.perf import analytic, hlo
from megajax.perf.fit import GIB, advice, compiled_bytes, device_capacity_bytes
from megajax.plan import RunPlan, make_plan
from megajax.precision.policy import precision_policy
from megajax.train.metrics import readable_bytes, readable_percent, readable_rate

KINDS = hlo.KINDS


def _spread(times: list[float]) -> dict[str, Any]:
    qs = sorted(times)

    def pct(p: float) -> float:
        return qs[min(len(qs) - 1, int(round(p * (len(qs) - 1))))]

    return {"median": statistics.median(qs), "min": qs[0], "max": qs[-1], "p10": pct(0.1), "p90": pct(0.9),
            "n": len(qs), "all": times}


def communication_table(plan: RunPlan, compiled, spec) -> dict[str, dict[str, Any]]:
    """Per collective kind: measured count/bytes per step (per device) from the HLO, analytic bytes, ratio."""
    measured = hlo.parse(compiled.as_text())
    rules, sizes = plan.rules, plan.sizes
    local = analytic.tensor_shard_param_bytes(spec.axes, spec.abstract_params, rules.params, sizes)
    experts = analytic.expert_shard_param_bytes(spec.axes, spec.abstract_params, rules.params, sizes)
    shared = (analytic.stage_shared_param_bytes(spec.axes, spec.abstract_params, rules.params, sizes)
              if plan.pipeline is not None else 0)
    gathered = analytic.stage_gathered_param_bytes(spec.axes, spec.abstract_params, rules.params, sizes)
    scattered = analytic.stage_scattered_param_bytes(spec.axes, spec.abstract_params, rules.params, sizes)
    replicated = analytic.stage_tensor_reduced_bytes(spec.axes, spec.abstract_params, rules.params, sizes)
    if plan.cfg.model.lora and "experts" in plan.cfg.model.lora.target_names():
        # The experts' adapters are merged into the frozen expert kernels in the step: XLA reduces the
        # merged kernels' gradient over the data axes (before its products with A and B, whose
        # gradients then need no reduction of their own), as full training reduces the experts'.
        merged = analytic.expert_shard_param_bytes(spec.frozen_axes, spec.abstract_frozen, rules.params, sizes)
        local, experts = local - experts + merged, merged
    sp = plan.cfg.parallel.sequence_parallel and sizes["tensor"] > 1
    lora = (analytic.lora_tensor_reduced_bytes(spec.axes, spec.abstract_params, rules.params, sizes, sp)
            if plan.cfg.model.lora else 0)
    expected = analytic.communication_bytes(plan, local, experts, shared, jax.default_backend(), lora, gathered,
                                            scattered, replicated)
    out = {}
    for kind in KINDS:
        count, nbytes = measured.total(kind)
        ref = expected[kind]
        out[kind] = {"count": count, "bytes": nbytes, "analytic_bytes": ref,
                     "ratio": (nbytes / ref) if ref else (None if nbytes == 0 else math.inf)}
    count = sum(r["count"] for r in out.values())
    nbytes = sum(r["bytes"] for r in out.values())
    ref = sum(r["analytic_bytes"] for r in out.values())
    out["total"] = {"count": count, "bytes": nbytes, "analytic_bytes": ref,
                    "ratio": (nbytes / ref) if ref else (None if nbytes == 0 else math.inf)}
    return out


def matmul_table(plan: RunPlan, compiled, model_flops: float) -> dict[str, Any]:
    """Matrix FLOPs per device per step read from the compiled program (megajax/perf/hlo.py: every
    product, loops by their trip counts), beside the model's (`model_flops`: the MFU convention, 6 x
    matmul parameters + attention per token, no recompute; per device). Through pipeline stages a
    product inside a branch of the stage loop counts as often as the schedule runs that branch,
    averaged over the stages: `flops` what the devices execute (in lockstep, on zeros too where a
    stage has no work of its own), `own_flops` each stage's own work."""
    ops = hlo.matmuls(compiled.as_text())
    flops = own = 0.0
    if plan.pipeline is None:
        flops = own = float(sum(m.flops * m.count for m in ops))
    else:
        c = plan.pipeline
        sc = build_schedule(c.schedule, c.stages, c.microbatches, c.virtual_stages)
        runs, own_runs = branch_runs(sc, analytic.pipeline_lockstep(plan)), branch_runs(sc, False)
        for m in ops:
            branch = next((b for b, scope in BRANCH_SCOPES.items()
                           if re.search(rf"(?<!\w){scope}(?!\w)", m.op_name)), None)
            if branch is None:  # outside the stage loop's branches: as counted
                flops, own = flops + m.flops * m.count, own + m.flops * m.count
                continue
            per_run = m.flops * m.count / sc.ticks  # the branch is counted once per tick of the loop
            flops += per_run * float(np.mean(runs[branch]))
            own += per_run * float(np.mean(own_runs[branch]))
    return {"flops": flops, "own_flops": own, "model_flops": model_flops,
            "ratio": own / model_flops if model_flops else None}


def memory_table(plan: RunPlan, compiled, spec, device) -> dict[str, Any]:
    est = analytic.memory_estimate(plan, spec)
    comp = compiled_bytes(compiled)
    capacity, source = device_capacity_bytes(device, plan.cfg.train.device_memory_gib)
    needed = comp["total"] if comp else est["total"]
    out = {"compiled": comp, "analytic": est, "capacity": capacity, "capacity_source": source,
           "fits": None if capacity is None else needed <= capacity}
    if out["fits"] is False:
        out["advice"] = advice(plan, spec=spec).phrases(needed, capacity)
    return out


def _timed(step, n: int, cpu: list[float] | None = None) -> list[float]:
    """Each of n steps' wall seconds; with `cpu`, each step's host work appended to it: the process's
    CPU seconds (every thread's) over the host's cores. Other processes on a shared host stretch it less
    than the wall time, though a thread that spins while it waits for a descheduled one adds to it."""
    out, cores = [], os.cpu_count() or 1
    for _ in range(n):
        t, c = time.perf_counter(), time.process_time()
        step()
        out.append(time.perf_counter() - t)
        if cpu is not None:
            cpu.append((time.process_time() - c) / cores)
    return out


@dataclasses.dataclass
class CompiledStep:
    """The train step of a config compiled on one batch, ready to run (`run()`: one step, waited
    for); what `bench_one` times and scripts/profile_step.py traces."""
    plan: RunPlan
    setup: Any  # megajax.train.setup.Setup
    compiled: Any  # the compiled train step
    compile_seconds: float
    batch: dict
    loader: Any
    held: dict  # the state and the ok flag, replaced by every step (both donated)
    # compile_seconds in its phases: Python tracing to a jaxpr ("trace"), lowering to StableHLO
    # ("lower") and XLA's compile, its HLO passes and code generation ("compile")
    phases: dict = dataclasses.field(default_factory=dict)

    def run(self) -> None:
        self.held["state"], metrics, self.held["ok"] = self.compiled(self.held["state"], self.batch, self.held["ok"])
        jax.block_until_ready(metrics)


def compiled_step(cfg: Config) -> CompiledStep:
    """Plans `cfg` on the visible devices (no evaluation), builds its state and first batch and
    compiles its train step (timed). Close `loader` when done."""
    from megajax.data.loader import build_run_datasets
    from megajax.train.setup import build_setup

    cfg = copy.deepcopy(cfg)
    cfg.train.eval_every = 0
    plan = make_plan(cfg, jax.device_count())
    setup = build_setup(plan)
    train_ds, _, _ = build_run_datasets(plan.cfg, plan.tokenizer)
    loader = setup.loader(train_ds, prefetch=0)
    batch = loader.batch(0)
    held = {"state": setup.fresh_state(), "ok": setup.ok_flag()}
    # The initialisation runs asynchronously; timed beside it, the compile would also count the
    # random draws of every parameter (seconds for the 64-expert tiny-moe's 102 M on 2 CPU cores).
    jax.block_until_ready(held)
    t0 = time.perf_counter()
    images = getattr(loader, "images_shape", None) is not None  # a vision-language model on image-text shards
    traced = setup.train_step(images=images).trace(held["state"], batch, held["ok"])
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    return CompiledStep(plan, setup, compiled, t3 - t0, batch, loader, held,
                        phases={"trace": t1 - t0, "lower": t2 - t1, "compile": t3 - t2})


def bench_one(cfg: Config, steps: int = 10, warmup: int = 2, baseline: str | None = None,
              rounds: int = 3) -> dict[str, Any]:
    """Builds the train step for `cfg`, times it and accounts for its memory and communication."""
    from megajax.train.flops import peak_tflops_per_device
    from megajax.train.loop import count_params

    if baseline:  # before anything is built: a baseline that cannot run here fails at once
        from megajax.perf.baseline import check_baseline
        check_baseline(baseline)
    built = compiled_step(cfg)
    plan, setup, step_fn, compile_seconds, loader = (built.plan, built.setup, built.compiled, built.compile_seconds,
                                                     built.loader)
    cfg, sizes, layout = plan.cfg, plan.sizes, plan.batch
    n_dev = setup.mesh.devices.size
    device = setup.mesh.devices.flat[0]
    megajax_step = built.run

    _timed(megajax_step, warmup)
    base, ours_cpu = None, []
    if baseline:
        from megajax.perf.baseline import BASELINES
        base_step, base_desc = BASELINES[baseline](cfg)
        _timed(base_step, warmup)
        ours, theirs, base_cpu = [], [], []
        per = max(1, steps // rounds)
        for _ in range(rounds):  # interleaved, so both see the same load on a shared machine
            ours += _timed(megajax_step, per, ours_cpu)
            theirs += _timed(base_step, per, base_cpu)
        base = {"name": baseline, "description": base_desc, "step_seconds": _spread(theirs),
                "cpu_step_seconds": _spread(base_cpu)}
    else:
        ours = _timed(megajax_step, steps, ours_cpu)
    loader.close()

    timing = _spread(ours)
    tokens = layout.tokens
    tps = tokens / timing["median"]
    peak, peak_source = peak_tflops_per_device(getattr(device, "device_kind", ""), device.platform,
                                               precision_policy(cfg).peak_flops_key, jax.local_device_count(),
                                               cfg.train.peak_tflops)
    tflops = setup.flops_per_step / timing["median"] / n_dev / 1e12
    report = {
        "model": {"family": cfg.model.family, "parameters": count_params(setup.spec.abstract_params),
                  "layers": cfg.model.num_layers, "hidden": cfg.model.hidden_size, "heads": cfg.model.num_heads,
                  "kv_heads": cfg.model.num_kv_heads, "ffn": cfg.model.ffn_hidden_size,
                  "vocab": plan.padded_vocab},
        "layout": {"devices": n_dev, "platform": device.platform, "device_kind": getattr(device, "device_kind", ""),
                   "mesh": dict(sizes), "sequence_parallel": cfg.parallel.sequence_parallel,
                   "distributed_optimizer": cfg.parallel.distributed_optimizer,
                   "recompute": cfg.parallel.recompute, "precision": cfg.train.precision,
                   "global_batch": layout.global_batch, "micro_batch": layout.micro_batch,
                   "accumulation": layout.accumulation, "seq_len": layout.seq_len},
        "host_allocator": host_allocator.described(),
        "compile_seconds": compile_seconds,
        "compile_phases": built.phases,  # trace, lower, compile (XLA): seconds, summing to compile_seconds
        "step_seconds": timing,
        "cpu_step_seconds": _spread(ours_cpu),  # host work per step: CPU seconds over the host's cores
        "tokens_per_sec": tps,
        "tokens_per_sec_per_device": tps / n_dev,
        "tflops_per_device": tflops,
        "peak_tflops": peak, "peak_source": peak_source,
        "mfu": tflops / peak if peak and not math.isnan(peak) else None,
        "memory": memory_table(plan, step_fn, setup.spec, device),
        "communication": communication_table(plan, step_fn, setup.spec),
        "matmuls": matmul_table(plan, step_fn, setup.flops_per_step / n_dev),
    }
    if plan.pipeline is not None:
        c = plan.pipeline
        sc = build_schedule(c.schedule, c.stages, c.microbatches, c.virtual_stages)
        report["pipeline"] = {"schedule": sc.name, "stages": sc.stages, "virtual_stages": sc.virtual,
                              "microbatches": sc.microbatches, "ticks": sc.ticks,
                              "bubble_fraction": sc.bubble_fraction, "stash_slots": sc.stash,
                              "stash_bytes_analytic": analytic.pipeline_stash_bytes(plan)}
    if base is not None:
        base["tokens_per_sec"] = tokens / base["step_seconds"]["median"]
        base["megajax_over_baseline"] = tps / base["tokens_per_sec"]
        base["megajax_over_baseline_cpu"] = base["cpu_step_seconds"]["median"] / report["cpu_step_seconds"]["median"]
        report["baseline"] = base
    return report


# ----------------------------------------------------------------------------------------------
# Ahead of time: a device kind this machine does not have.

def parse_topology(text: str) -> tuple[int, str, float]:
    """(count, KIND, GiB per device) of --topology COUNTxKIND: the kinds `megajax plan --cluster` knows
    (megajax/perf/device_kinds.py)."""
    from megajax.perf.device_kinds import load_device_kinds, parse_cluster
    count, name, kind = parse_cluster(text, load_device_kinds(None), "--topology")
    return count, name, kind.memory_gib


def topology_estimate(cfg: Config, topology: str) -> dict[str, Any]:
    """Analytic per-device memory of `cfg` on COUNT devices of KIND, and whether it fits."""
    from megajax.train.state import build_model_spec
    count, kind, gib = parse_topology(topology)
    plan = make_plan(cfg, count)
    sizes, micro = plan.sizes, plan.batch.micro_batch
    spec, _ = build_model_spec(plan.cfg, plan.padded_vocab)
    est = analytic.memory_estimate(plan, spec)
    cap = int(gib * GIB)
    out = {"topology": topology, "device_kind": kind, "capacity": cap, "mesh": sizes, "micro_batch": micro,
           "analytic": est, "fits": est["total"] <= cap,
           "method": "analytic (parameters, gradients, Adam state for the shardings; Korthikanti activations); "
                     "no compile: XLA compiles for a GPU only with its plugin and a device present"}
    if not out["fits"]:
        out["advice"] = advice(plan, spec=spec).phrases(est["total"], cap)
    return out


# ----------------------------------------------------------------------------------------------
# Reports

def _gib(x) -> str:
    return "-" if x is None else f"{x / GIB:.3f}"


def _scaled(x, scale: float) -> str:
    return "-" if x is None else f"{x / scale:.3f}"


def _mib(x) -> str:
    return "-" if x is None else f"{x / 2**20:.2f}"


def _matmul_line(mm: dict[str, Any]) -> str:
    """The compiled step's matrix FLOPs per device against the model's (no recompute)."""
    line = f"matmuls    {mm['own_flops'] / 1e9:,.3f} GFLOP per device per step in the compiled program"
    if mm["flops"] != mm["own_flops"]:
        line += f" ({mm['flops'] / 1e9:,.3f} executed, the stages in lockstep)"
    if mm["ratio"]:
        line += f"; {mm['ratio']:.3f} x the model's {mm['model_flops'] / 1e9:,.3f} (6 N + attention, no recompute)"
    return line


def format_report(r: dict[str, Any]) -> str:
    lay, mod, t = r["layout"], r["model"], r["step_seconds"]
    mesh = mesh_text(lay["mesh"])
    lines = [
        f"model      {mod['family']} {mod['parameters'] / 1e6:.2f}M params, {mod['layers']} layers, hidden "
        f"{mod['hidden']}, heads {mod['heads']}/{mod['kv_heads']}, ffn {mod['ffn']}, vocab {mod['vocab']}",
        f"layout     {lay['devices']} {lay['platform']} devices, mesh {mesh}"
        f"{', sequence parallel' if lay['sequence_parallel'] else ''}"
        f"{', distributed optimizer' if lay['distributed_optimizer'] else ''}; recompute {lay['recompute']}; "
        f"{lay['precision']}; batch {lay['global_batch']} = micro {lay['micro_batch']} x accum "
        f"{lay['accumulation']} x dp; seq {lay['seq_len']}",
        *([f"host       {r['host_allocator']}"] if lay["platform"] == "cpu" and "host_allocator" in r else []),
        *([f"pipeline   {r['pipeline']['schedule']}, {r['pipeline']['stages']} stages x "
           f"{r['pipeline']['virtual_stages']} chunks, {r['pipeline']['microbatches']} microbatches in "
           f"{r['pipeline']['ticks']} ticks; bubble {100 * r['pipeline']['bubble_fraction']:.1f}%; "
           f"the residuals of {r['pipeline']['stash_slots']} microbatches stashed per device "
           f"({readable_bytes(r['pipeline']['stash_bytes_analytic'])} analytic)"] if "pipeline" in r else []),
        f"compile    {r['compile_seconds']:.2f} s",
        f"step       median {t['median'] * 1e3:.1f} ms (min {t['min'] * 1e3:.1f}, p90 {t['p90'] * 1e3:.1f}, "
        f"max {t['max'] * 1e3:.1f}; {t['n']} steps)",
        *([f"host work  median {r['cpu_step_seconds']['median'] * 1e3:.1f} ms of CPU per step over the host's cores "
           f"(min {r['cpu_step_seconds']['min'] * 1e3:.1f}; every thread's, waiting threads that spin included)"]
          if lay["platform"] == "cpu" and "cpu_step_seconds" in r else []),
        f"throughput {r['tokens_per_sec']:,.0f} tokens/s, {r['tokens_per_sec_per_device']:,.0f} per device; "
        f"{readable_rate(r['tflops_per_device'] * 1e12)} per device"
        + (f"; MFU {readable_percent(r['mfu'])} of a {readable_rate(r['peak_tflops'] * 1e12)} peak "
           f"({r['peak_source']})" if r["mfu"] else ""),
        *([_matmul_line(r["matmuls"])] if "matmuls" in r else []),
    ]
    mem = r["memory"]
    c, a = mem["compiled"] or {}, mem["analytic"]
    largest = max([v for v in (c.get("total"), a["total"]) if v is not None] or [0])
    unit, scale = ("GiB", GIB) if largest >= GIB / 4 else ("MiB", 2**20)
    lines += ["", f"memory per device ({unit}){' ' * (10 - len(unit))}compiled   analytic"]
    rows = [("parameters", None, a["params"]), ("gradients", None, a["grads"]),
            ("optimizer state", None, a["optimizer"]), ("activations (layers)", None, a["activations"]),
            ("logits + gradient", None, a["logits"]),
            ("arguments", c.get("arguments"), None), ("outputs", c.get("outputs"), None),
            ("temporaries", c.get("temporaries"), None), ("aliased (donated)", c.get("aliased"), None),
            ("total", c.get("total"), a["total"])]
    for name, comp, ana in rows:
        lines.append(f"  {name:<28}{_scaled(comp, scale):>9}  {_scaled(ana, scale):>9}")
    if mem["capacity"] is not None:
        lines.append(f"  capacity {readable_bytes(mem['capacity'])} ({mem['capacity_source']}): "
                     f"{'fits' if mem['fits'] else 'does NOT fit'}")
        if mem.get("advice"):
            lines.append("  try " + " or ".join(mem["advice"]))
    lines += ["", "communication per step, per device   count    MiB measured   MiB analytic   ratio"]
    for kind, row in r["communication"].items():
        ratio = row["ratio"]
        txt = "-" if ratio is None else ("inf" if math.isinf(ratio) else f"{ratio:.2f}")
        lines.append(f"  {kind:<34}{row['count']:>6}  {_mib(row['bytes']):>13}  {_mib(row['analytic_bytes']):>13}"
                     f"  {txt:>6}")
    verdict = communication_verdict(r["communication"])
    lines.append(f"  {verdict}")
    if "baseline" in r:
        b = r["baseline"]
        bt = b["step_seconds"]
        lines += ["", f"baseline   {b['description']}",
                  f"           median {bt['median'] * 1e3:.1f} ms/step (min {bt['min'] * 1e3:.1f}, max "
                  f"{bt['max'] * 1e3:.1f}), {b['tokens_per_sec']:,.0f} tokens/s; megajax / {b['name']} = "
                  f"{b['megajax_over_baseline']:.2f}x (interleaved in this run, the same host allocator)"]
        if lay["platform"] == "cpu" and "megajax_over_baseline_cpu" in b:
            lines.append(f"           host work median {b['cpu_step_seconds']['median'] * 1e3:.1f} ms of CPU per step; "
                         f"megajax / {b['name']} by host work = {b['megajax_over_baseline_cpu']:.2f}x")
    return "\n".join(lines)


def communication_verdict(comm: dict[str, dict[str, Any]], low: float = 0.9, high: float = 1.25) -> str:
    """One line: whether every kind is within [low, high] of the analytic figure."""
    if all(row["bytes"] == 0 and row["analytic_bytes"] == 0 for row in comm.values()):
        return "no collectives (and none expected)"
    off = []
    for kind, row in comm.items():
        if kind == "total":
            continue
        if row["analytic_bytes"] == 0 and row["bytes"] == 0:
            continue
        r = row["ratio"]
        if r is None or not low <= r <= high:
            off.append(f"{kind} {'inf' if r is not None and math.isinf(r) else f'{r:.2f}'}")
    if not off:
        return f"every kind within [{low}, {high}] of the analytic figure"
    return f"outside [{low}, {high}] of the analytic figure: " + ", ".join(off)


def format_topology(r: dict[str, Any]) -> str:
    a = r["analytic"]
    mesh = mesh_text(r["mesh"])
    lines = [f"topology   {r['topology']} (mesh {mesh}, micro batch {r['micro_batch']}); {r['method']}",
             f"per device params {_gib(a['params'])} + grads {_gib(a['grads'])} + optimizer {_gib(a['optimizer'])} "
             f"+ activations {_gib(a['activations'])} + logits {_gib(a['logits'])} = {_gib(a['total'])} GiB of {_gib(r['capacity'])}: "
             f"{'fits' if r['fits'] else 'does NOT fit'}"]
    if r.get("advice"):
        lines.append("try " + " or ".join(r["advice"]))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Sweeps

def parse_sweep(text: str) -> tuple[str, list[str]]:
    key, sep, values = text.partition("=")
    vals = [v for v in values.split(",") if v != ""]
    if not sep or not key or not vals:
        raise ConfigError(f"--sweep {text!r}: expected key=v1,v2,... such as train.seq_len=128,256,512.")
    return key, vals


def sweep(files: list[str], overrides: list[str], key: str, values: list[str], **kw) -> list[dict[str, Any]]:
    """bench_one for each value of `key` (the override comes last, so it wins)."""
    points = []
    for v in values:
        r = bench_one(load_config(files, [*overrides, f"{key}={v}"]), **kw)
        r["sweep"] = {"key": key, "value": v}
        points.append(r)
    return points


def plot_sweep(points: list[dict[str, Any]], path: Path) -> Path | None:
    """PNG of step time, tokens/s and per-device memory against the swept value; None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    key = points[0]["sweep"]["key"]
    labels = [p["sweep"]["value"] for p in points]
    x = list(range(len(points)))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    axes[0].plot(x, [p["step_seconds"]["median"] * 1e3 for p in points], "o-")
    axes[0].set_ylabel("step time, median (ms)")
    axes[1].plot(x, [p["tokens_per_sec"] for p in points], "o-")
    axes[1].set_ylabel("tokens/s")
    comp = [(p["memory"]["compiled"] or {}).get("total") for p in points]
    if all(c is not None for c in comp):
        axes[2].plot(x, [c / GIB for c in comp], "o-", label="compiled")
        axes[2].plot(x, [p["memory"]["compiled"]["temporaries"] / GIB for p in points], "^-",
                     label="compiled temporaries")
    axes[2].plot(x, [p["memory"]["analytic"]["total"] / GIB for p in points], "s--", label="analytic")
    axes[2].set_ylabel("memory per device (GiB)")
    axes[2].legend()
    for ax in axes:
        ax.set_xticks(x, labels)
        ax.set_xlabel(key)
        ax.grid(alpha=0.3)
    fig.suptitle(f"megajax bench: sweep over {key}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_sweep(points: list[dict[str, Any]]) -> str:
    key = points[0]["sweep"]["key"]
    lines = [f"{key:>24}  compile s  step ms  tokens/s  TFLOP/s/dev  mem GiB (compiled / analytic)  "
             f"temporaries MiB"]
    for p in points:
        comp = (p["memory"]["compiled"] or {}).get("total")
        temps = (p["memory"]["compiled"] or {}).get("temporaries")
        lines.append(f"{p['sweep']['value']:>24}  {p['compile_seconds']:9.2f}  {p['step_seconds']['median'] * 1e3:7.1f}"
                     f"  {p['tokens_per_sec']:8,.0f}  {p['tflops_per_device']:11.4f}  {_gib(comp)} / "
                     f"{_gib(p['memory']['analytic']['total'])}  {_mib(temps):>15}"
                     + (f"  (pipeline bubble {100 * p['pipeline']['bubble_fraction']:.1f}%)" if "pipeline" in p else ""))
    return "\n".join(lines)


def write_json(obj: Any, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    text = json.dumps(_finite(obj), indent=2, default=str)
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(text + "\n")
        tmp.replace(path)
    finally:  # an interrupted write leaves no temporary file
        tmp.unlink(missing_ok=True)


def _finite(o: Any) -> Any:
    if isinstance(o, float):
        return None if (math.isinf(o) or math.isnan(o)) else o
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o
