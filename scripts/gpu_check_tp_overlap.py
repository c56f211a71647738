#!/usr/bin/env python
"""GPU check: tensor parallelism 2 with and without the overlap of its collectives with the products
(parallel.tp_comm_overlap: collective matmuls, megajax/parallel/tensor.py, and XLA's scheduler options,
megajax/xla_env.py), timed by `megajax bench` on the same model, batch and devices; the ratio of the two
step times is what `megajax plan`'s device kinds assume as `tp_overlap` until it is measured.

  PYTHONPATH=. python3 scripts/gpu_check_tp_overlap.py --json FILE       # 2 or more GPUs, a few minutes
  PYTHONPATH=. python3 scripts/gpu_check_tp_overlap.py --cpu-smoke --json FILE   # 2 simulated CPU devices

Each run is its own `megajax bench` process: `on` with parallel.tp_comm_overlap=true (megajax sets the XLA
options), `off` with parallel.tp_comm_overlap=false and the options at XLA's defaults in XLA_FLAGS. The
JSON holds each run's step time, tokens/s and the XLA_FLAGS it started with, and `off / on`, the overlap's
speedup. Exit status 77 (the suite's "skipped") with fewer than 2 GPUs, 1 when a run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SKIPPED = 77

# ~1.2B Llama at sequence 2048: tensor 2 with sequence parallelism, the rest of the devices data-parallel.
GPU = ["--config", "model/llama-1b", "train.seq_len=2048", "train.global_batch=8", "data.corpus_max_mb=2",
       "model.attention_impl=cudnn"]
SMOKE = ["--config", "model/llama-1b", "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
         "model.num_kv_heads=2", "model.ffn_hidden_size=128", "model.vocab_size=512", "train.seq_len=64",
         "train.global_batch=4", "data.corpus_max_mb=0.2", "mesh.cpu_devices=2", "model.attention_impl=xla"]
LAYOUT = ["mesh.tensor=2", "mesh.data=-1", "parallel.sequence_parallel=true"]


def gpu_count() -> int:
    """The GPUs JAX sees, asked of a child process (this one keeps no GPU memory)."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    out = subprocess.run([sys.executable, "-c", "import jax; print(sum(d.platform != 'cpu' for d in jax.devices()))"],
                         capture_output=True, text=True, env=env, timeout=120, check=False)
    try:
        return int(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return 0


def bench(mode: str, smoke: bool, work: Path) -> dict:
    """One `megajax bench` run with the overlap on or off: its step time, tokens/s and XLA_FLAGS."""
    from megajax import xla_env
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if mode == "off":
        env["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS"), *xla_env.TP_OVERLAP_OFF]))
    seen = dict(env)
    xla_env.prepare(2 if smoke else 0, seen, tensor_overlap=mode == "on")  # what the child will start with
    out = work / f"{mode}.json"
    steps, warmup = ("1", "1") if smoke else ("5", "2")
    cmd = [sys.executable, "-m", "megajax.cli", "bench", *(SMOKE if smoke else GPU), *LAYOUT,
           f"parallel.tp_comm_overlap={'true' if mode == 'on' else 'false'}", "--steps", steps, "--warmup", warmup,
           "--json", str(out)]
    print("$ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, cwd=ROOT, env=env, check=False)
    if p.returncode != 0 or not out.is_file():
        raise RuntimeError(f"megajax bench ({mode}) exited {p.returncode}")
    r = json.loads(out.read_text())
    return {"step_seconds": r["step_seconds"]["median"], "tokens_per_sec": r["tokens_per_sec"],
            "mfu": r.get("mfu"), "layout": r.get("layout"), "xla_flags": seen.get("XLA_FLAGS", "")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--cpu-smoke", action="store_true", help="2 simulated CPU devices, a toy model")
    args = parser.parse_args()
    result: dict = {"smoke": args.cpu_smoke}
    if not args.cpu_smoke:
        n = gpu_count()
        result["devices"] = n
        if n < 2:
            print(f"tensor parallelism 2 needs 2 GPUs; {n} here", flush=True)
            return SKIPPED
    with tempfile.TemporaryDirectory() as d:
        try:
            for mode in ("on", "off"):
                result[mode] = bench(mode, args.cpu_smoke, Path(d))
        except RuntimeError as e:
            result.update(ok=False, error=str(e))
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
            print(e, file=sys.stderr)
            return 1
    result["speedup"] = result["off"]["step_seconds"] / result["on"]["step_seconds"]
    result["ok"] = True
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(f"tensor 2: {result['on']['step_seconds'] * 1e3:.1f} ms/step with the overlap, "
          f"{result['off']['step_seconds'] * 1e3:.1f} ms without: {result['speedup']:.3f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
