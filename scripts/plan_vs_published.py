"""`megajax plan`'s estimate against published, measured training runs on H100s.

    python scripts/plan_vs_published.py                      # the table: run, published, estimate, ratio
    python scripts/plan_vs_published.py --json out.json --markdown

Each run of tests/data/published_runs.yaml (Megatron-LM's README scaling table, torchtitan's
benchmarks, Megatron-Bridge's and NeMo's performance summaries) is estimated with its own layout
pinned: the mesh sizes, the virtual stages, the micro batch, the recompute policy, the precision and
the batch the source states (what it leaves out: the assumption the row names), planned as `megajax
plan` plans a layout (megajax.perf.planner.plan_cluster with every one of those kept). The estimate's
tokens/s/GPU (global batch x sequence / step seconds / devices) is set against the published figure:
tokens/s/GPU as published, or TFLOP/s/GPU over the FLOPs per token of the source's own convention
(Megatron-LM's num_floating_point_operations for its README table). The planner is analytic: the
whole comparison takes seconds and compiles nothing (tests/test_plan_published.py runs it).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RUNS = ROOT / "tests" / "data" / "published_runs.yaml"
BAND = (0.75, 1.33)  # the estimate / published ratio the comparison asks of every row
# Layout keys of a run and the config keys they set (mesh sizes whole; megajax places them per node).
LAYOUT = {"tensor": "mesh.tensor", "pipeline": "mesh.pipeline", "data": "mesh.data", "fsdp": "mesh.fsdp",
          "context": "mesh.context", "expert": "mesh.expert", "virtual_stages": "parallel.virtual_stages"}


def load_runs(path: Path = RUNS) -> dict:
    return yaml.safe_load(Path(path).read_text())


def megatron_flops_per_token(m, seq_len: int, vocab: int) -> float:
    """Megatron-LM's model FLOPs per token (megatron/training/training.py num_floating_point_operations,
    commit 937571c): 12 L h^2 ((1 + g/a + s/h) (a d / h) + f/h x (3/2 gated) + V / (2 L h))."""
    h, L, a = m.hidden_size, m.num_layers, m.num_heads
    q_ratio = a * m.head_dim / h
    attention = (1 + m.num_kv_heads / a + seq_len / h) * q_ratio
    mlp = m.ffn_hidden_size / h * (1.5 if m.activation == "swiglu" else 1.0)
    return 12 * L * h * h * (attention + mlp + vocab / (2 * L * h))


def overrides(run: dict) -> list[str]:
    """The config overrides of a run: the model's, its shape, the batch, precision and layout."""
    model = run["model"]
    out = list(model.get("overrides", []))
    for key, value in (run.get("shape") or {}).items():
        out.append(f"model.{key}={value}")
    if run.get("shape") and "ffn_hidden_size" not in run["shape"]:
        out.append(f"model.ffn_hidden_size={4 * run['shape']['hidden_size']}")  # GPT's MLP of 4 h
    out += [f"train.global_batch={run['global_batch']}", f"train.seq_len={run['seq_len']}",
            f"train.precision={run['precision']}", f"parallel.recompute={run.get('recompute', 'none')}",
            f"parallel.tp_comm_overlap={str(run.get('tp_comm_overlap', True)).lower()}"]
    if "micro_batch" in run:  # (unstated: the planner's choice among the micro batches that fit)
        out.append(f"train.micro_batch={run['micro_batch']}")
    layout = {"data": 1, **run["layout"]}
    for key, value in layout.items():
        out.append(f"{LAYOUT[key]}={value}")
    if layout.get("virtual_stages", 1) > 1:
        out.append("parallel.pipeline_schedule=interleaved")
    tensor = layout.get("tensor", 1)
    out.append(f"parallel.sequence_parallel={str(tensor > 1).lower()}")
    if layout.get("data", 1) > 1:
        out.append("parallel.distributed_optimizer=true")
    return out


def device_kinds(entries: dict) -> dict:
    """The runs' device kinds as a --device-kinds mapping: an entry `like: KIND` takes that built-in
    kind's figures (its matmul table too) and changes the ones it names."""
    from dataclasses import asdict
    from megajax.perf.device_kinds import DEVICE_KINDS
    out = {}
    for name, entry in entries.items():
        entry = dict(entry)
        base = entry.pop("like", None)
        if base is not None:
            figures = {k: v for k, v in asdict(DEVICE_KINDS[base]).items() if v is not None}
            figures["gemm_efficiency"] = [list(r) for r in figures.get("gemm_efficiency", ())] or None
            entry = {**{k: v for k, v in figures.items() if v is not None}, **entry}
        out[name] = entry
    return out


def compare(path: Path = RUNS) -> list[dict]:
    """Every run estimated with its layout pinned: [{name, published, estimate, ratio, ...}] (tokens/s/GPU)."""
    from megajax.config import load_config
    from megajax.perf import planner
    doc = load_runs(path)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        kinds = Path(d) / "kinds.yaml"
        kinds.write_text(yaml.safe_dump(device_kinds(doc.get("devices") or {})))
        for run in doc["runs"]:
            over = overrides(run)
            cfg = load_config([run["model"]["config"]], over)
            keep = planner.kept_keys(over)
            report = planner.plan_cluster(cfg, run["cluster"], str(kinds), top=1, keep=keep)
            best = (report["ranked"] or report["smallest"])[0]
            devices = report["devices"]
            estimate = run["global_batch"] * run["seq_len"] / best.step_seconds / devices
            published = run["published"]
            if "tokens_per_gpu" in published:
                measured = float(published["tokens_per_gpu"])
            else:
                assert published["flops"] == "megatron", published
                per_token = megatron_flops_per_token(cfg.model, run["seq_len"], cfg.model.vocab_size)
                measured = published["tflops_per_gpu"] * 1e12 / per_token
            rows.append({"name": run["name"], "cluster": run["cluster"], "layout": best.label(),
                         "published": measured, "published_as": published, "estimate": estimate,
                         "ratio": estimate / measured, "fits": best.fits, "mfu": best.mfu,
                         "memory_gib": best.memory["total"] / 2**30,
                         "parts": {k: round(v, 4) for k, v in best.parts.items()},
                         "step_seconds": best.step_seconds, "source": run["source"],
                         "assumed": run.get("assumed", []), "outside": run.get("outside")})
    return rows


def unexpected(rows: list[dict]) -> list[str]:
    """The rows that disagree with the data file: outside the band though not marked so, or marked as
    outside on one side but not there."""
    bad = []
    for r in rows:
        inside = BAND[0] <= r["ratio"] <= BAND[1]
        mark = r["outside"]
        if mark is None and not inside:
            bad.append(f"{r['name']}: estimate / published {r['ratio']:.2f}, outside {BAND[0]}-{BAND[1]}")
        elif mark is not None and not (r["ratio"] > BAND[1] if mark["side"] == "high" else r["ratio"] < BAND[0]):
            bad.append(f"{r['name']}: estimate / published {r['ratio']:.2f}, marked outside ({mark['side']})")
    return bad


def table(rows: list[dict], markdown: bool = False) -> str:
    if markdown:
        lines = ["| run | GPUs | layout | published tok/s/GPU | estimate | ratio |",
                 "| --- | ---: | --- | ---: | ---: | ---: |"]
        for r in rows:
            flag = "" if r["outside"] is None else " (outside)"
            lines.append(f"| {r['name']} | {r['cluster'].split('x')[0]} | {r['layout'].split(';')[0]} | "
                         f"{r['published']:,.0f} | {r['estimate']:,.0f} | {r['ratio']:.2f}{flag} |")
        return "\n".join(lines)
    lines = [f"{'run':<42}{'published':>10}{'estimate':>10}{'ratio':>7}  fits  where the estimate's time goes"]
    for r in rows:
        parts = sorted(((k, v) for k, v in r["parts"].items() if v > 0), key=lambda kv: -kv[1])[:5]
        lines.append(f"{r['name']:<42}{r['published']:>10,.0f}{r['estimate']:>10,.0f}{r['ratio']:>7.2f}  "
                     f"{'yes ' if r['fits'] else 'no  '}  " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in parts))
    inside = sum(BAND[0] <= r["ratio"] <= BAND[1] for r in rows)
    lines.append(f"{inside} of {len(rows)} within {BAND[0]}-{BAND[1]}x; outside, as the data file explains:")
    lines += [f"  {r['name']}: {' '.join(r['outside']['why'].split())}" for r in rows if r["outside"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=str(RUNS), help="the runs (default tests/data/published_runs.yaml)")
    ap.add_argument("--json", help="write the rows as JSON")
    ap.add_argument("--markdown", action="store_true", help="print docs/performance.md's table")
    args = ap.parse_args(argv)
    rows = compare(Path(args.runs))
    print(table(rows, args.markdown))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    bad = unexpected(rows)
    for line in bad:
        print(f"unexpected: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
