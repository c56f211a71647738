#!/usr/bin/env python3
"""GPU check for pallas_kernels.ssd (the Mamba-2 SSD scan): compiled correctness, then timing.

1. Correctness: y, the final state and the gradients in x, dt, A, B, C and the initial state of the
   compiled kernels (interpret=False) against ssd_reference (fp32, matmuls at 'highest' precision),
   and ssd_chunked's against the same: one and several groups, ragged lengths, head_dim and
   state sizes that need padding, fp32 and bf16, chunks of 64 and 128.
2. Timing: forward and forward+backward of the Pallas kernels and of ssd_chunked under jit, bf16,
   Nemotron-H-like heads (head_dim 64, state 128, 8 groups), 32k tokens per call.

FLOPs: ssd_flops (the chunked form's forward matmuls: C B^T scores per group, scores @ x, chunk
states, state outputs); forward+backward = 3 x forward (each product has two gradient products).
Both implementations are charged the same count, so TFLOP/s compare times at equal work.

  python3 scripts/gpu_check_ssd.py               # one GPU, about a minute
  python3 scripts/gpu_check_ssd.py --cpu-smoke   # CPU, interpret mode, tiny shapes
  python3 scripts/gpu_check_ssd.py --json out.json

Runs from any directory without PYTHONPATH. Exit status 1 when a correctness check fails or errors.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the repository's pallas_kernels, without PYTHONPATH or an install

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.ssd import ssd, ssd_chunked, ssd_flops, ssd_reference  # noqa: E402

print = functools.partial(print, flush=True)  # progress shows up even if the run is cut short

F32, BF16 = jnp.float32, jnp.bfloat16
# Max |got - reference| over max |reference|, per input dtype.
TOLERANCE = {F32: 1e-4, BF16: 5e-2}
FWD_BWD_FACTOR = 3
NAMES = ("y", "final", "dx", "ddt", "dA", "dB", "dC", "dh0")

# (name, batch, seq, heads, head_dim, groups, state, chunk, dtype)
CASES = [
    ("f32 one group chunk 64", 2, 1024, 8, 64, 1, 64, 64, F32),
    ("f32 ragged padded dims", 1, 1000, 6, 48, 3, 40, 64, F32),
    ("bf16 8 groups chunk 128", 2, 2048, 16, 64, 8, 128, 128, BF16),
    ("bf16 ragged chunk 64", 1, 777, 8, 64, 2, 128, 64, BF16),
]
SMOKE_CASES = ("f32 ragged padded dims", "bf16 8 groups chunk 128")


class Results:
    """The tables as they grow; rewritten to --json after every row, so a run cut short leaves them."""

    def __init__(self, path: str | None):
        self.path = Path(path) if path else None
        self.data = {"jax": jax.__version__, "backend": jax.default_backend(),
                     "device": jax.devices()[0].device_kind,
                     "flops_convention": "forward = ssd_flops (chunked form's matmuls); forward+backward = 3 x forward",
                     "correctness": [], "timing": []}

    def add(self, table: str, row: dict) -> None:
        self.data[table].append(row)
        self.save()

    def save(self) -> None:
        if self.path is not None:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data, indent=1) + "\n")
            tmp.replace(self.path)


def _inputs(b, l, h, p, g, n, dtype, seed=0):
    k = iter(jax.random.split(jax.random.key(seed), 9))
    normal = lambda shape, dt=dtype: jax.random.normal(next(k), shape, F32).astype(dt)
    x, bm, cm = normal((b, l, h, p)), normal((b, l, g, n)), normal((b, l, g, n))
    dt = jax.random.uniform(next(k), (b, l, h), F32, 0.01, 0.3)
    a = -jax.random.uniform(next(k), (h,), F32, 0.5, 4.0)
    h0, dy, dfinal = normal((b, h, p, n), F32), normal((b, l, h, p), F32), normal((b, h, p, n), F32)
    return (x, dt, a, bm, cm, h0), (dy, dfinal)


def _outputs_and_grads(f):
    def run(x, dt, a, bm, cm, h0, dy, dfinal):
        out, vjp = jax.vjp(lambda *args: f(*args[:5], initial_state=args[5], return_final_state=True),
                           x, dt, a, bm, cm, h0)
        return (*out, *vjp((dy.astype(out[0].dtype), dfinal)))
    return jax.jit(run)


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-6))


def check_case(case, *, interpret: bool, shrink: int, results: Results) -> bool:
    name, b, l, h, p, g, n, chunk, dtype = case
    if shrink > 1:  # CPU smoke: same structure, tiny sizes
        l, p, n, chunk = max(20, l // shrink), 16, 16, 16
    args, cts = _inputs(b, l, h, p, g, n, dtype)
    t0 = time.perf_counter()
    try:
        got = _outputs_and_grads(lambda *a, **k: ssd(*a, chunk_size=chunk, interpret=interpret, **k))(*args, *cts)
        jax.block_until_ready(got)
        with jax.default_matmul_precision("highest"):
            want = _outputs_and_grads(ssd_reference)(*args, *cts)
            chunked = _outputs_and_grads(lambda *a, **k: ssd_chunked(*a, chunk_size=chunk, **k))(*args, *cts)
    except Exception as e:
        print(f"  ERROR {name}")
        traceback.print_exc()
        results.add("correctness", {"name": name, "ok": False, "error": f"{type(e).__name__}: {e}"[:500]})
        return False
    errs = {k: _rel_err(a, w) for k, a, w in zip(NAMES, got, want)}
    chunked_errs = {k: _rel_err(a, w) for k, a, w in zip(NAMES, chunked, want)}
    tol = TOLERANCE[dtype]
    ok = all(e <= tol for e in errs.values()) and all(e <= tol for e in chunked_errs.values())
    shape = f"b={b} l={l} h={h} p={p} g={g} n={n} chunk={chunk}"
    print(f"  {'ok  ' if ok else 'FAIL'} {name:26s} {shape:44s} kernel max err {max(errs.values()):.1e}, "
          f"chunked {max(chunked_errs.values()):.1e} (tol {tol:.0e}, {time.perf_counter() - t0:.1f}s)")
    if not ok:
        print("    kernel  " + " ".join(f"{k}={e:.1e}" for k, e in errs.items()))
        print("    chunked " + " ".join(f"{k}={e:.1e}" for k, e in chunked_errs.items()))
    results.add("correctness", {"name": name, "shape": shape, "dtype": jnp.dtype(dtype).name, "ok": ok,
                                "kernel_errors": errs, "chunked_errors": chunked_errs, "tolerance": tol,
                                "seconds": time.perf_counter() - t0})
    return ok


# --------------------------------------------------------------------------- timing


def time_call(fn, args, iters: int):
    """(ms per call, None) or (None, reason). Compiles first, one warm-up call."""
    try:
        compiled = jax.jit(fn).lower(*args).compile()
        out = jax.block_until_ready(compiled(*args))
        t0 = time.perf_counter()
        for _ in range(iters):
            out = compiled(*args)
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / iters * 1e3, None
    except Exception as e:  # out of memory, a lowering the backend lacks, ...
        first = (str(e).strip().splitlines() or [""])[0]
        return None, f"{type(e).__name__}: {first[:80]}"


def _cell(ms, flops) -> str:
    return f"{ms:9.2f} {flops / ms / 1e9:8.1f}" if ms is not None else f"{'-':>9} {'-':>8}"


def benchmark(*, tokens: int, seqs, heads: int, head_dim: int, groups: int, state: int, chunks, dtype,
              iters: int, interpret: bool, results: Results):
    print(f"\nTiming: {tokens} tokens per call, heads={heads} head_dim={head_dim} groups={groups} "
          f"state={state} {jnp.dtype(dtype).name}, {iters} timed calls after one warm-up.\n"
          f"FLOPs: ssd_flops (forward); forward+backward = {FWD_BWD_FACTOR} x forward.")
    header = (f"{'seq':>6} {'batch':>5} {'chunk':>5}  {'impl':14s} {'fwd ms':>9} {'TFLOP/s':>8}   "
              f"{'fwd+bwd':>9} {'TFLOP/s':>8}  note")
    print(header + "\n" + "-" * len(header))
    for seq in seqs:
        b = max(1, tokens // seq)
        args, (dy, _) = _inputs(b, seq, heads, head_dim, groups, state, dtype, seed=seq)
        x, dt, a, bm, cm, _ = args
        dy = dy.astype(dtype)
        for chunk in chunks:
            impls = {"pallas ssd": lambda *t, c=chunk: ssd(*t, chunk_size=c, interpret=interpret),
                     "xla chunked": lambda *t, c=chunk: ssd_chunked(*t, chunk_size=c)}
            fwd_flops = ssd_flops(b, seq, heads, head_dim, state, groups, chunk)
            for name, f in impls.items():
                def fwd_bwd(x, dt, a, bm, cm, dy, f=f):
                    _, vjp = jax.vjp(f, x, dt, a, bm, cm)
                    return vjp(dy)
                fwd_ms, note1 = time_call(f, (x, dt, a, bm, cm), iters)
                both_ms, note2 = time_call(fwd_bwd, (x, dt, a, bm, cm, dy), iters)
                note = "; ".join(dict.fromkeys(n for n in (note1, note2) if n))
                print(f"{seq:6d} {b:5d} {chunk:5d}  {name:14s} {_cell(fwd_ms, fwd_flops)}   "
                      f"{_cell(both_ms, FWD_BWD_FACTOR * fwd_flops)}  {note}")
                results.add("timing", {
                    "seq": seq, "batch": b, "chunk": chunk, "impl": name, "fwd_ms": fwd_ms, "fwd_bwd_ms": both_ms,
                    "note": note, "fwd_flops": fwd_flops,
                    "fwd_tflops": None if fwd_ms is None else fwd_flops / fwd_ms / 1e9,
                    "fwd_bwd_tflops": None if both_ms is None else FWD_BWD_FACTOR * fwd_flops / both_ms / 1e9})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="run on CPU in interpret mode with tiny shapes (shakes out bugs)")
    parser.add_argument("--iters", type=int, default=5, help="timed calls per measurement")
    parser.add_argument("--seqs", default="4096,16384", help="comma-separated sequence lengths to time")
    parser.add_argument("--skip-check", action="store_true", help="timing only")
    parser.add_argument("--skip-bench", action="store_true", help="correctness only")
    parser.add_argument("--json", metavar="FILE", help="also write the tables as JSON (rewritten as they grow)")
    args = parser.parse_args(argv)

    if args.cpu_smoke:
        jax.config.update("jax_platforms", "cpu")
    backend = jax.default_backend()
    interpret = args.cpu_smoke
    print(f"jax {jax.__version__}, backend {backend}, device {jax.devices()[0].device_kind}, "
          f"interpret={interpret}")
    if backend == "cpu" and not args.cpu_smoke:
        print("no GPU: use --cpu-smoke to run the interpret-mode smoke test on CPU")
        return 2

    start = time.perf_counter()
    results = Results(args.json)
    ok = True
    if not args.skip_check:
        print("\nCorrectness (kernel and chunked vs reference, max|diff| / max|ref| over y, final state, grads):")
        cases = [c for c in CASES if c[0] in SMOKE_CASES] if args.cpu_smoke else CASES
        passed = [check_case(c, interpret=interpret, shrink=16 if args.cpu_smoke else 1, results=results)
                  for c in cases]
        ok = all(passed)
        print(f"  {sum(passed)}/{len(passed)} cases passed")
    if not args.skip_bench:
        if args.cpu_smoke:
            benchmark(tokens=64, seqs=(64,), heads=2, head_dim=16, groups=1, state=16, chunks=(16,), dtype=F32,
                      iters=1, interpret=True, results=results)
        else:
            benchmark(tokens=32 * 1024, seqs=[int(s) for s in args.seqs.split(",")], heads=64, head_dim=64,
                      groups=8, state=128, chunks=(64, 128), dtype=BF16, iters=args.iters, interpret=False,
                      results=results)
    results.data.update(ok=ok, seconds=time.perf_counter() - start)
    results.save()
    print(f"\n{'PASS' if ok else 'FAIL'}: total {time.perf_counter() - start:.0f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
