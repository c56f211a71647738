#!/usr/bin/env python3
"""Compile time of a hybrid model's train step against a dense transformer of about the same
parameter count, on this machine (one CPU device, no compilation cache).

Builds the train step exactly as `megajax bench` does (megajax.perf.bench.compiled_step) for the
hybrid and for the dense model, alternately, --repeats times each, and prints each one's median
compile time (tracing, lowering and XLA's compile, each also on its own), the instructions of its
optimised HLO and the hybrid/dense ratio of both. Alternating keeps the ratio fair on a shared machine.

  PYTHONPATH=. python3 scripts/bench_hybrid_compile.py                          # tiny-hybrid
  PYTHONPATH=. python3 scripts/bench_hybrid_compile.py --hybrid model/tiny-mamba2 --repeats 5
  PYTHONPATH=. python3 scripts/bench_hybrid_compile.py model.mamba_ssd_impl=pallas --json out.json

The dense model (--dense-layers, default 8) is a Llama-style transformer of the hybrid's width,
heads and activation whose MLP width is chosen so its parameter count is the hybrid's (to the
nearest multiple of 64). `key=value` overrides apply to the hybrid only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from megajax import xla_env  # noqa: E402

xla_env.prepare(1)  # one CPU device and megajax's CPU code-generation options, as `megajax bench` runs

import jax  # noqa: E402

from megajax.config import load_config  # noqa: E402
from megajax.perf.bench import compiled_step  # noqa: E402
from megajax.train.loop import count_params  # noqa: E402

_INSTRUCTION = re.compile(r"^\s+(ROOT\s+)?[%\w.\-]+\s+=\s", re.M)
PHASES = ("trace", "lower", "compile")  # megajax.perf.bench.CompiledStep.phases
COMMON = ["mesh.cpu_devices=1", "ops.compile_cache=false", "train.global_batch=2", "train.micro_batch=2"]


def instructions(hlo_text: str) -> int:
    """Instructions in an HLO module's text (every computation's, fusions' bodies included)."""
    return len(_INSTRUCTION.findall(hlo_text))


def measure(cfg) -> dict:
    built = compiled_step(cfg)
    built.loader.close()
    return {"seconds": built.compile_seconds, "phases": built.phases,
            "instructions": instructions(built.compiled.as_text()),
            "parameters": count_params(built.setup.spec.abstract_params)}


def dense_overrides(hybrid, layers: int, params: int) -> list[str]:
    """A dense Llama-style model of the hybrid's width with `layers` layers and the MLP width that
    brings its parameter count nearest `params` (the counts are linear in the MLP width)."""
    m = hybrid.model
    base = ["model.hybrid_layer_pattern=null", f"model.num_layers={layers}", f"model.hidden_size={m.hidden_size}",
            f"model.num_heads={m.num_heads}", f"model.num_kv_heads={m.num_kv_heads}",
            f"model.activation={m.activation}", f"train.seq_len={hybrid.train.seq_len}"]
    if m.vocab_size is not None:
        base.append(f"model.vocab_size={m.vocab_size}")

    def count(ffn: int) -> int:
        cfg = load_config(["model/tiny"], COMMON + base + [f"model.ffn_hidden_size={ffn}"])
        from megajax.plan import make_plan
        from megajax.train.setup import build_setup
        return count_params(build_setup(make_plan(cfg, 1)).spec.abstract_params)

    lo, hi = count(64), count(128)
    ffn = max(64, round((64 + (params - lo) * 64 / (hi - lo)) / 64) * 64)
    return base + [f"model.ffn_hidden_size={ffn}"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="key=value overrides of the hybrid")
    p.add_argument("--hybrid", default="model/tiny-hybrid")
    p.add_argument("--dense-layers", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json")
    a = p.parse_args()
    hybrid = load_config([a.hybrid], COMMON + a.overrides)
    first = measure(hybrid)
    dense = load_config(["model/tiny"], COMMON + dense_overrides(hybrid, a.dense_layers, first["parameters"]))
    runs = {"hybrid": [first], "dense": []}
    for i in range(a.repeats):
        runs["dense"].append(measure(dense))
        if i:
            runs["hybrid"].append(measure(hybrid))
    out = {}
    for name, rs in runs.items():
        out[name] = {"compile_seconds": statistics.median(r["seconds"] for r in rs),
                     "all_seconds": [round(r["seconds"], 3) for r in rs],
                     "phases": {k: statistics.median(r["phases"][k] for r in rs) for k in PHASES},
                     "instructions": rs[0]["instructions"], "parameters": rs[0]["parameters"]}
        print(f"{name:7s} {out[name]['parameters']:>10,d} params  compile {out[name]['compile_seconds']:.2f} s "
              f"(runs {out[name]['all_seconds']})  HLO {out[name]['instructions']:,d} instructions")
        print("        " + ", ".join(f"{k} {out[name]['phases'][k]:.2f} s" for k in PHASES))
    out["ratio"] = {"compile": out["hybrid"]["compile_seconds"] / out["dense"]["compile_seconds"],
                    "phases": {k: out["hybrid"]["phases"][k] / out["dense"]["phases"][k] for k in PHASES},
                    "instructions": out["hybrid"]["instructions"] / out["dense"]["instructions"]}
    print(f"hybrid / dense: compile {out['ratio']['compile']:.2f}x, HLO {out['ratio']['instructions']:.2f}x "
          f"({jax.devices()[0].platform}, jax {jax.__version__}); by phase: "
          + ", ".join(f"{k} {out['ratio']['phases'][k]:.2f}x" for k in PHASES))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
