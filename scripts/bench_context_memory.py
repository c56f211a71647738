#!/usr/bin/env python3
"""Peak compiled memory per device for a long sequence: context=1 vs context=C.

    python scripts/bench_context_memory.py [--seq 16384] [--context 4] [--impl ring] [--attention xla]

Compiles the train step (nothing runs) on simulated CPU devices for the same
per-device batch: data=2 without context parallelism, data=2 x context=C
with it, and prints XLA's memory analysis of each compiled step per device.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--context", type=int, default=4)
    ap.add_argument("--impl", default="ring")
    ap.add_argument("--attention", default="xla")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args()
    devices = 2 * args.context
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    sys.path.insert(0, str(ROOT))
    import jax
    from megajax.config import load_config
    from megajax.train.loop import build_trainer

    common = [f"train.seq_len={args.seq}", "train.global_batch=2", f"model.num_layers={args.layers}",
              f"model.hidden_size={args.hidden}", "model.num_heads=4", f"model.ffn_hidden_size={4 * args.hidden}",
              "train.eval_every=0", "data.prefetch=0", f"model.attention_impl={args.attention}",
              "train.run_dir=/tmp/megajax-bench-context"]
    print(f"seq {args.seq}, {args.layers} layers, hidden {args.hidden}, global batch 2, fp32, "
          f"attention {args.attention}; bytes per device from the compiled step's memory analysis")
    print(f"{'layout':32s} {'arguments':>10} {'outputs':>10} {'temporaries':>12} {'total GiB':>10}")
    for name, mesh, devs in [("context=1 (data=2)", ["mesh.data=2"], jax.devices()[:2]),
                             (f"context={args.context} (data=2, {args.impl})",
                              ["mesh.data=2", f"mesh.context={args.context}", f"parallel.context_impl={args.impl}"],
                              jax.devices())]:
        import shutil
        shutil.rmtree("/tmp/megajax-bench-context", ignore_errors=True)
        tr = build_trainer(load_config(overrides=common + mesh), devs)
        m = tr.step_fn.memory_analysis()
        gib = lambda x: x / 2**30
        total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
        print(f"{name:32s} {gib(m.argument_size_in_bytes):10.3f} {gib(m.output_size_in_bytes):10.3f} "
              f"{gib(m.temp_size_in_bytes):12.3f} {gib(total):10.3f}")


if __name__ == "__main__":
    main()
