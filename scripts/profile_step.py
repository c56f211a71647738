#!/usr/bin/env python3
"""Where one compiled train step's time goes: a profile of the step as `megajax bench` builds it.

    PYTHONPATH=. python scripts/profile_step.py [--config FILE ...] [key=value ...] [--steps 3] [--top 30]
        [--trace-dir DIR]

Compiles the train step for the config (as `megajax bench` does), runs a few steps, then traces
`--steps` more with `jax.profiler` and sums the trace per operation. It prints

- the median step time outside the profiler;
- the step's wall time by how many operations ran at once: 0 (the executor waiting between
  operations: dispatch, loop conditions), 1, 2 or more (with 2 cores, two at once share them);
- the operations' summed time by kind: matrix products (XLA:CPU's GEMM fusions and dots), loops
  (their own overhead, without what they run), collectives and rendezvous, everything else
  (elementwise fusions, copies, reductions);
- the `--top` operations with their output shape and the JAX operation they come from.

Times of operations that overlap are each counted in full, so the kinds add up to more than the
step. With simulated devices (mesh.cpu_devices > 1) every device runs its own copy of the
program on its own thread, and the sums are over all of them.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megajax import host_allocator  # noqa: E402

if __name__ == "__main__":  # as the megajax command does: huge-page malloc, set when a process starts
    host_allocator.reexec_with_huge_pages(sys.argv[1:], [sys.executable, str(Path(__file__).resolve())])

# Frames of the trace that are not operations of the program; the waits for other devices at a
# collective are counted as such, beside the operations, but not in the wall-time sweep.
WAITS = ("Wait", "Rendezvous")
HOST_EVENTS = ("$", "ThunkExecutor", "SlinkyThreadPool", "PjRt", "jit", "Execute") + WAITS


def kind_of(name: str) -> str:
    if name.startswith(("ynn_fusion", "dot", "xnn_fusion", "onednn")) or "dot" in name.split(".")[0]:
        return "matrix products"
    if name.startswith(("while", "conditional", "call")):
        return "loops and calls"
    if name.startswith(("all-", "all_", "reduce-scatter", "collective-permute") + WAITS):
        return "collectives, rendezvous"
    return "other (elementwise, copies, reductions)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", action="append", default=[], help="config file(s), as megajax bench")
    ap.add_argument("--steps", type=int, default=3, help="steps traced (default 3)")
    ap.add_argument("--top", type=int, default=30, help="operations listed (default 30)")
    ap.add_argument("--trace-dir", help="keep the trace here (default: a temporary directory)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides, as megajax bench")
    args = ap.parse_args()

    from megajax import xla_env
    from megajax.config import load_config
    cfg = load_config(args.config, args.overrides)
    xla_env.prepare(cfg.mesh.cpu_devices)
    import jax

    from megajax.perf.bench import compiled_step

    built = compiled_step(cfg)
    step = built.run
    for _ in range(2):
        step()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    built.loader.close()

    trace_dir = Path(args.trace_dir or tempfile.mkdtemp(prefix="megajax-profile-"))
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        for _ in range(args.steps):
            step()
    found = glob.glob(str(trace_dir / "**" / "perfetto_trace.json.gz"), recursive=True)
    if not found:
        print(f"profile_step: no perfetto trace under {trace_dir}", file=sys.stderr)
        return 1
    events = json.load(gzip.open(max(found, key=os.path.getmtime)))
    events = events["traceEvents"] if isinstance(events, dict) else events
    ops = [e for e in events if e.get("ph") == "X" and "dur" in e]
    program = [e for e in ops if not e["name"].startswith(HOST_EVENTS)]
    n = args.steps

    print(f"step       median {1e3 * statistics.median(times):.1f} ms outside the profiler "
          f"({jax.device_count()} {jax.devices()[0].platform} devices; host allocator: {host_allocator.described()})")
    # Wall time by the number of operations running at once (a sweep over their start and end).
    points = sorted([(e["ts"], 1) for e in program] + [(e["ts"] + e["dur"], -1) for e in program])
    running, last, by_count = 0, points[0][0] if points else 0, collections.Counter()
    for t, d in points:
        by_count[min(running, 2)] += t - last
        running, last = running + d, t
    span = sum(by_count.values()) / 1e3 / n
    print(f"wall       {span:.1f} ms per step traced: " + ", ".join(
        f"{label} {by_count[k] / 1e3 / n:.1f} ms" for k, label in
        ((0, "idle between operations"), (1, "one operation"), (2, "two or more at once"))))
    kinds, total, count = collections.Counter(), collections.Counter(), collections.Counter()
    for e in program + [e for e in ops if e["name"].startswith(WAITS)]:
        kinds[kind_of(e["name"])] += e["dur"] / 1e3 / n
        total[e["name"]] += e["dur"] / 1e3 / n
        count[e["name"]] += 1
    print("by kind    " + "; ".join(f"{k} {v:.1f} ms" for k, v in kinds.most_common()))

    hlo = built.compiled.as_text()
    print(f"\n{'ms/step':>9}  {'runs':>5}  {'operation':<36}{'output':<30}from")
    for name, ms in total.most_common(args.top):
        m = re.search(r"%" + re.escape(name) + r" = (\S+) .*?op_name=\"([^\"]*)\"", hlo)
        shape, origin = (m.group(1), m.group(2)) if m else ("", "")
        origin = re.sub(r"^jit\([^)]*\)/", "", origin)
        print(f"{ms:9.1f}  {count[name] / n:5.0f}  {name[:35]:<36}{shape[:29]:<30}{origin[-70:]}")
    if not args.trace_dir:
        import shutil
        shutil.rmtree(trace_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
