"""FP8 training against bf16 on the same model, data and seed: loss curves, the convergence bar, a plot.

    PYTHONPATH=. python scripts/fp8_vs_bf16.py [--models small] [--recipes delayed] [--steps 60]
        [--json FILE] [--plot FILE] [--resume] [--markdown] [key=value ...]

For each model it trains once in bf16 and once per FP8 recipe (precision.fp8_recipe: delayed,
current, blockwise, mxfp8) on the embedded corpus with the same seed, one CPU device, and prints
each recipe's loss curve against bf16's, the final losses (the mean of the last 10 steps' losses)
and whether the run meets the convergence bar: final loss within 1.5 % of bf16's, no non-finite
loss and no skipped step. Models: `small` (the test suite's small Llama: 2 layers, hidden 64, seq
32, batch 8), `quickstart` (what `make train` trains: the default config), `tiny-moe` and
`tiny-hybrid` (configs/model/). Overrides (key=value) go to every run; precision.* and
model.matmul_impl go to the FP8 runs only.

`--json FILE` writes every curve and the verdicts (rewritten after each run; with `--resume` the
runs already in FILE are kept and not run again); `--plot FILE` draws the curves (PNG, one panel
per model; needs matplotlib). The committed record of the 300-step runs is
docs/fp8/convergence.json with its plot docs/fp8/convergence.png ([docs/fp8-and-kernels.md]).
On CPU the FP8 products are emulated (float8 values computed exactly, products in bf16/fp32), so
step times are a sanity figure, not a speed measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ("delayed", "current", "blockwise", "mxfp8")
BAR = 0.015          # |final fp8 loss / final bf16 loss - 1|
FINAL_WINDOW = 10    # the final loss: the mean of the last this many steps' losses
COMMON = ["train.log_every=1", "train.sample_tokens=0", "logging.tensorboard=false", "logging.progress=false",
          "train.eval_every=0", "checkpoint.async_save=false", "checkpoint.every=0", "mesh.data=1"]
MODELS = {
    "small": ([], ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=8", "model.num_kv_heads=4",
                   "model.ffn_hidden_size=128", "train.seq_len=32", "train.global_batch=8",
                   "data.corpus_max_mb=0.5", "optim.warmup_steps=1", "optim.lr=3e-3"]),
    "quickstart": ([], []),
    "tiny-moe": (["model/tiny-moe"], []),
    "tiny-hybrid": (["model/tiny-hybrid"], []),
}


def run(model: str, precision: str, steps: int, overrides: list[str], run_dir: Path) -> dict:
    from megajax.config import load_config
    from megajax.train.loop import train
    files, extra = MODELS[model]
    cfg = load_config(files=files or None, overrides=COMMON + extra + [
        f"train.steps={steps}", f"train.run_dir={run_dir}", f"train.precision={precision}", *overrides])
    res = train(cfg)
    times = [r["step_time"] for r in res.records][2:]
    return {"losses": [float(x) for x in res.losses], "grad_norms": [float(x) for x in res.grad_norms],
            "skipped_steps": int(res.skipped_steps),
            "median_step_seconds": statistics.median(times) if times else None}


def final_loss(curve: dict) -> float:
    return statistics.fmean(curve["losses"][-FINAL_WINDOW:])


def verdict(curve: dict, bf16: dict) -> dict:
    """The convergence bar for one FP8 curve against bf16's."""
    rel = final_loss(curve) / final_loss(bf16) - 1
    finite = all(math.isfinite(x) for x in curve["losses"] + curve["grad_norms"])
    return {"final_loss": final_loss(curve), "final_rel": rel, "last_rel": curve["losses"][-1] / bf16["losses"][-1] - 1,
            "finite": finite, "skipped_steps": curve["skipped_steps"],
            "ok": finite and curve["skipped_steps"] == 0 and abs(rel) <= BAR}


def summarise(record: dict) -> list[str]:
    lines = [f"{'model':<12} {'recipe':<10} {'final loss':>10} {'bf16':>8} {'rel':>8} {'last rel':>9} "
             f"{'skipped':>7} {'finite':>6}  bar (1.5 %)"]
    for model, runs in record["models"].items():
        if "bf16" not in runs:
            continue
        for recipe in (r for r in RECIPES if r in runs):
            v = verdict(runs[recipe], runs["bf16"])
            runs[recipe]["verdict"] = v
            lines.append(f"{model:<12} {recipe:<10} {v['final_loss']:>10.4f} {final_loss(runs['bf16']):>8.4f} "
                         f"{v['final_rel']:>+8.2%} {v['last_rel']:>+9.2%} {v['skipped_steps']:>7} "
                         f"{str(v['finite']):>6}  {'ok' if v['ok'] else 'FAILS'}")
    return lines


def markdown(record: dict) -> str:
    """The convergence table of docs/fp8-and-kernels.md, from a record."""
    lines = ["| model | recipe | final loss | bf16 final loss | relative | skipped steps | finite | within 1.5 % |",
             "|---|---|---|---|---|---|---|---|"]
    for model, runs in record["models"].items():
        for recipe in (r for r in RECIPES if r in runs and "bf16" in runs):
            v = verdict(runs[recipe], runs["bf16"])
            lines.append(f"| {model} | {recipe} | {v['final_loss']:.4f} | {final_loss(runs['bf16']):.4f} | "
                         f"{v['final_rel']:+.2%} | {v['skipped_steps']} | {'yes' if v['finite'] else 'no'} | "
                         f"{'yes' if v['ok'] else 'no'} |".replace("%", " %"))
    return "\n".join(lines)


def plot(record: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = [m for m, runs in record["models"].items() if "bf16" in runs]
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        runs = record["models"][model]
        for name in ("bf16",) + tuple(r for r in RECIPES if r in runs):
            losses = runs[name]["losses"]
            w = min(FINAL_WINDOW, len(losses))
            smooth = [statistics.fmean(losses[max(0, i - w + 1):i + 1]) for i in range(len(losses))]
            ax.plot(range(1, len(losses) + 1), smooth, label=name, lw=1.6 if name == "bf16" else 1.0,
                    color="black" if name == "bf16" else None)
        ax.set_title(f"{model}: loss ({FINAL_WINDOW}-step mean)")
        ax.set_xlabel("step")
        ax.set_ylim(top=min(ax.get_ylim()[1], 2 * max(final_loss(runs["bf16"]), 1e-9) + 1))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["small"], choices=sorted(MODELS))
    ap.add_argument("--recipes", nargs="+", default=["delayed"], choices=RECIPES)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--json", default="")
    ap.add_argument("--plot", default="")
    ap.add_argument("--resume", action="store_true", help="keep the runs already in --json and run the others")
    ap.add_argument("--markdown", action="store_true", help="print the docs' convergence table too")
    ap.add_argument("overrides", nargs="*", help="config overrides (precision.* and model.matmul_impl go to "
                                                  "the fp8 runs only, the others to all)")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    fp8_only = [o for o in args.overrides if o.startswith(("precision.", "model.matmul_impl"))]
    common = [o for o in args.overrides if o not in fp8_only]
    out = Path(args.json) if args.json else None
    record = {"steps": args.steps, "overrides": args.overrides, "bar": BAR, "final_window": FINAL_WINDOW,
              "models": {}}
    if args.resume and out is not None and out.is_file():
        old = json.loads(out.read_text())
        if old.get("steps") == args.steps and old.get("overrides") == args.overrides:
            record["models"] = old.get("models", {})
    with tempfile.TemporaryDirectory(prefix="megajax-fp8-") as tmp:
        for model in args.models:
            runs = record["models"].setdefault(model, {})
            for name in ("bf16", *args.recipes):
                if name in runs:
                    continue
                precision, extra = ("bf16", common) if name == "bf16" else (
                    "fp8", common + [f"precision.fp8_recipe={name}"] + fp8_only)
                print(f"--- {model} {name} ({args.steps} steps)", flush=True)
                runs[name] = run(model, precision, args.steps, extra, Path(tmp) / f"{model}-{name}")
                if out is not None:
                    summarise(record)
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_text(json.dumps(record, indent=1) + "\n")
    for model in args.models:
        runs = record["models"][model]
        names = ("bf16",) + tuple(r for r in RECIPES if r in runs)
        steps = len(runs["bf16"]["losses"])
        print(f"\n{model}: loss by step\n{'step':>5} " + " ".join(f"{n:>9}" for n in names))
        for i in range(steps):
            if i == 0 or (i + 1) % max(1, steps // 12) == 0 or i == steps - 1:
                print(f"{i + 1:>5} " + " ".join(f"{runs[n]['losses'][i]:>9.4f}" for n in names))
        print("median step seconds (CPU, emulated FP8): " + ", ".join(
            f"{n} {runs[n]['median_step_seconds']:.3f}" for n in names if runs[n]["median_step_seconds"]))
    lines = summarise(record)
    print("\n" + "\n".join(lines))
    if out is not None:
        out.write_text(json.dumps(record, indent=1) + "\n")
    if args.markdown:
        print("\n" + markdown(record))
    if args.plot:
        print(f"plot: {args.plot}" if plot(record, Path(args.plot)) else "plot: skipped (no matplotlib)")
    return 0 if all(v["verdict"]["ok"] for runs in record["models"].values()
                    for k, v in runs.items() if k != "bf16" and "verdict" in v) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
