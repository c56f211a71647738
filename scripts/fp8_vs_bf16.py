"""FP8 training against bf16 on the same model, data and seed: loss curves and step times.

    PYTHONPATH=. python scripts/fp8_vs_bf16.py [--steps 60] [--json FILE] [key=value ...]

Trains the test suite's small Llama (2 layers, hidden 64, GQA 8/4 heads, seq 32, batch 8) on the
embedded corpus once with train.precision=bf16 and once with train.precision=fp8 (plus any
overrides, e.g. precision.fp8_recipe=current or model.matmul_impl=pallas), and prints both loss
curves, the relative difference of the last losses and the median step times. On CPU the FP8
products are emulated (float8 values computed exactly, products in bf16/fp32), so the step times
are a sanity figure, not a speed measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMALL = [
    "model.num_layers=2", "model.hidden_size=64", "model.num_heads=8", "model.num_kv_heads=4",
    "model.ffn_hidden_size=128", "train.seq_len=32", "train.global_batch=8",
    "train.log_every=1", "train.sample_tokens=0", "logging.tensorboard=false",
    "logging.progress=false", "data.corpus_max_mb=0.5", "optim.warmup_steps=1", "optim.lr=3e-3",
    "train.eval_every=0", "checkpoint.async_save=false",
]


def run(precision: str, steps: int, overrides: list[str], run_dir: Path) -> dict:
    from megajax.config import load_config
    from megajax.train.loop import train
    cfg = load_config(overrides=SMALL + [f"train.steps={steps}", f"train.run_dir={run_dir}",
                                         f"train.precision={precision}", *overrides])
    res = train(cfg)
    times = [r["step_time"] for r in res.records][2:]
    return {"losses": [float(x) for x in res.losses],
            "median_step_seconds": statistics.median(times) if times else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--json", default="")
    ap.add_argument("overrides", nargs="*", help="config overrides (precision.* and model.matmul_impl go to "
                                                  "the fp8 run only, the others to both)")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    fp8_only = [o for o in args.overrides if o.startswith(("precision.", "model.matmul_impl"))]
    common = [o for o in args.overrides if o not in fp8_only]
    with tempfile.TemporaryDirectory(prefix="megajax-fp8-") as tmp:
        bf16 = run("bf16", args.steps, common, Path(tmp) / "bf16")
        fp8 = run("fp8", args.steps, common + fp8_only, Path(tmp) / "fp8")
    rel = fp8["losses"][-1] / bf16["losses"][-1] - 1
    print(f"{'step':>5} {'bf16 loss':>10} {'fp8 loss':>10} {'rel':>8}")
    for i, (a, b) in enumerate(zip(bf16["losses"], fp8["losses"]), 1):
        if i == 1 or i % 5 == 0 or i == args.steps:
            print(f"{i:>5} {a:>10.4f} {b:>10.4f} {b / a - 1:>+8.2%}")
    diffs = [b / a - 1 for a, b in zip(bf16["losses"], fp8["losses"])]
    worst = max(range(len(diffs)), key=lambda i: abs(diffs[i]))
    print(f"last loss: bf16 {bf16['losses'][-1]:.4f}, fp8 {fp8['losses'][-1]:.4f}: fp8 {rel:+.2%} relative; "
          f"largest difference at any step {diffs[worst]:+.2%} (step {worst + 1})")
    print(f"median step seconds (CPU, emulated FP8): bf16 {bf16['median_step_seconds']:.4f}, "
          f"fp8 {fp8['median_step_seconds']:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"steps": args.steps, "overrides": args.overrides, "bf16": bf16,
                                               "fp8": fp8, "last_loss_rel_diff": rel,
                                               "max_step_rel_diff": diffs[worst]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
