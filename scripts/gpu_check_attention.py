#!/usr/bin/env python3
"""GPU check for pallas_kernels.flash_attention: compiled correctness, then timing.

1. Correctness: forward and dq/dk/dv of the compiled kernel (interpret=False) against
   flash_attention_reference (fp32 matmuls at 'highest' precision) on random data:
   MHA/GQA/MQA, causal and not, segment ids, sliding window, ragged lengths,
   fp32/bf16/fp16, head_dim 64/128/256, default and explicit block sizes.
2. Timing: forward and forward+backward at 32k tokens per call, 32 query heads,
   8 kv heads, head_dim 128, bf16, causal, seq 2k/4k/8k/16k: the Pallas kernel,
   cuDNN (jax.nn.dot_product_attention(implementation='cudnn')) and the XLA
   reference; a program whose XLA buffers would not fit in device memory is skipped.

FLOPs (FlashAttention's convention, the same for every implementation so that TFLOP/s compare
times at equal work): forward = 4*b*s*s*h*d / 2 for causal attention (QK^T and PV over the lower
triangle); backward = 2.5 x forward (dV, dP, dQ, dK plus recomputing QK^T); forward+backward =
3.5 x forward. The Pallas backward, split into a dq and a dk/dv kernel that each recompute QK^T
and dP, executes 3.5 x forward by itself (4.5 x in all), so its hardware FLOP/s are higher than shown.

  python3 scripts/gpu_check_attention.py               # one GPU, a few minutes
  python3 scripts/gpu_check_attention.py --cpu-smoke   # CPU, interpret mode, tiny shapes
  python3 scripts/gpu_check_attention.py --json out.json   # also the tables as JSON, rewritten as they grow

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

from pallas_kernels import flash_attention, flash_attention_reference  # noqa: E402

print = functools.partial(print, flush=True)  # progress shows up even if the run is cut short

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
# Max |kernel - reference| over max |reference|, per dtype of the inputs.
TOLERANCE = {F32: 1e-4, BF16: 3e-2, F16: 1e-2}
# Forward+backward FLOPs over forward FLOPs (FlashAttention's count: backward = 2.5 x forward).
FWD_BWD_FACTOR = 3.5


class Results:
    """The tables as they grow; rewritten to --json after every row, so a run cut short leaves them."""

    def __init__(self, path: str | None):
        self.path = Path(path) if path else None
        self.data = {"jax": jax.__version__, "backend": jax.default_backend(),
                     "device": jax.devices()[0].device_kind, "flops_convention":
                     "forward = 4*b*s*s*h*d/2 (causal); forward+backward = 3.5 x forward",
                     "correctness": [], "timing": [], "comparisons": []}

    def add(self, table: str, row: dict) -> None:
        self.data[table].append(row)
        self.save()

    def save(self) -> None:
        if self.path is not None:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data, indent=1) + "\n")
            tmp.replace(self.path)

# (name, batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype, causal, segments, window, blocks)
CASES = [
    ("mha causal f32 d64", 2, 512, 512, 4, 4, 64, F32, True, None, None, {}),
    ("gqa causal ragged bf16 d128", 2, 1000, 1000, 8, 2, 128, BF16, True, None, None, {}),
    ("mqa non-causal q/kv segments ragged f16 d64", 2, 300, 700, 8, 1, 64, F16, False, "pair",
     None, {}),
    ("gqa segments + window bf16 d128", 1, 1024, 1024, 8, 2, 128, BF16, True, "shared", 256, {}),
    ("gqa causal bf16 d256", 1, 512, 512, 4, 2, 256, BF16, True, None, None, {}),
    ("mqa non-causal ragged f32 d256", 1, 200, 200, 2, 1, 256, F32, False, None, None, {}),
    ("packed documents f16 d128", 1, 2048, 2048, 8, 8, 128, F16, True, "shared", None, {}),
    ("explicit blocks window ragged bf16 d64", 1, 333, 333, 4, 2, 64, BF16, True, None, 100,
     dict(block_q=32, block_k=64, block_q_dq=64, block_k_dq=32, block_q_dkv=16, block_k_dkv=32)),
]
# The CPU smoke test runs two cases that between them take every branch (separate q/kv segment
# ids, ragged lengths, GQA, sliding window): interpret mode compiles slowly.
SMOKE_CASES = ("mqa non-causal q/kv segments ragged f16 d64", "gqa segments + window bf16 d128")


def _segments(rng, b, s, n_docs):
    """[b, s] sorted document ids with random boundaries."""
    ids = np.zeros((b, s), np.int32)
    for r in range(b):
        cuts = np.sort(rng.choice(np.arange(1, s), size=min(n_docs - 1, s - 1), replace=False))
        ids[r, cuts] = 1
    return jnp.asarray(np.cumsum(ids, axis=1), jnp.int32)


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-6))


def _out_and_grads(f):
    def run(q, k, v, do):
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(do))
    return jax.jit(run)


def check_case(case, *, interpret: bool, shrink: int, results: Results) -> bool:
    name, b, sq, sk, h, g, d, dtype, causal, seg_kind, window, blocks = case
    if shrink > 1:  # CPU smoke: same structure, tiny lengths
        sq, sk = max(16, sq // shrink), max(16, sk // shrink)
        window = None if window is None else max(2, window // shrink)
        blocks = {k: 16 for k in blocks}
    rng = np.random.default_rng(0)
    q, k, v, do = (jnp.asarray(rng.standard_normal(s, np.float32), dtype) for s in
                   [(b, sq, h, d), (b, sk, g, d), (b, sk, g, d), (b, sq, h, d)])
    if seg_kind == "shared":
        seg = _segments(rng, b, sq, 4)
    elif seg_kind == "pair":
        seg = (_segments(rng, b, sq, 3), _segments(rng, b, sk, 3))
    else:
        seg = None
    sem = dict(causal=causal, segment_ids=seg, sliding_window=window)
    t0 = time.perf_counter()
    try:
        got = _out_and_grads(lambda q, k, v: flash_attention(
            q, k, v, **sem, **blocks, interpret=interpret))(q, k, v, do)
        jax.block_until_ready(got)
        with jax.default_matmul_precision("highest"):
            want = _out_and_grads(lambda q, k, v: flash_attention_reference(q, k, v, **sem))(
                q, k, v, do)
    except Exception as e:
        print(f"  ERROR {name}")
        traceback.print_exc()
        results.add("correctness", {"name": name, "ok": False, "error": f"{type(e).__name__}: {e}"[:500]})
        return False
    errs = {n: _rel_err(a, w) for n, a, w in zip(("out", "dq", "dk", "dv"), got, want)}
    ok = all(e <= TOLERANCE[dtype] for e in errs.values())
    shape = f"b={b} sq={sq} sk={sk} h={h} kv={g} d={d}"
    print(f"  {'ok  ' if ok else 'FAIL'} {name:45s} {shape:34s} " +
          " ".join(f"{n}={e:.1e}" for n, e in errs.items()) +
          f"  (tol {TOLERANCE[dtype]:.0e}, {time.perf_counter() - t0:.1f}s)")
    results.add("correctness", {"name": name, "shape": shape, "dtype": jnp.dtype(dtype).name, "ok": ok,
                                "errors": errs, "tolerance": TOLERANCE[dtype],
                                "seconds": time.perf_counter() - t0})
    return ok


# --------------------------------------------------------------------------- timing


def _memory_budget() -> float | None:
    try:
        stats = jax.devices()[0].memory_stats() or {}
        return 0.9 * (stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    except Exception:
        return None


def _needed_bytes(compiled) -> float | None:
    try:
        m = compiled.memory_analysis()
        return float(m.temp_size_in_bytes + m.output_size_in_bytes)
    except Exception:
        return None


def time_call(fn, args, iters: int):
    """(ms per call, last output) or (None, reason). Compiles first, skips what cannot fit."""
    try:
        compiled = jax.jit(fn).lower(*args).compile()
        need, budget = _needed_bytes(compiled), _memory_budget()
        if need is not None and budget is not None and need > budget:
            return None, f"skip: needs {need / 2**30:.0f} GiB"
        out = jax.block_until_ready(compiled(*args))          # warm-up
        t0 = time.perf_counter()
        for _ in range(iters):
            out = compiled(*args)
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / iters * 1e3, out
    except Exception as e:  # cuDNN unsupported here, out of memory, ...
        first = (str(e).strip().splitlines() or [""])[0]
        return None, f"{type(e).__name__}: {first[:60]}"


def _fwd_bwd(f):
    def run(q, k, v, do):
        _, vjp = jax.vjp(f, q, k, v)
        return vjp(do)
    return run


def _cell(ms, flops) -> str:
    return f"{ms:9.2f} {flops / ms / 1e9:8.1f}" if ms is not None else f"{'-':>9} {'-':>8}"


def benchmark(*, tokens: int, seqs, heads: int, kv_heads: int, head_dim: int, dtype,
              iters: int, interpret: bool, results: Results):
    impls = {
        "pallas flash": lambda q, k, v: flash_attention(q, k, v, causal=True, interpret=interpret),
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                              implementation="cudnn"),
        "xla reference": lambda q, k, v: flash_attention_reference(q, k, v, causal=True),
    }
    print(f"\nTiming: {tokens} tokens per call, heads={heads} kv_heads={kv_heads} "
          f"head_dim={head_dim} {jnp.dtype(dtype).name} causal, {iters} timed calls after one "
          "warm-up.\nFLOPs: forward = 0.5 * 4*b*s*s*h*d (causal half of QK^T and PV); "
          f"forward+backward = {FWD_BWD_FACTOR} * forward (backward = 2.5 * forward, recompute included).")
    header = (f"{'seq':>6} {'batch':>5}  {'impl':14s} {'fwd ms':>9} {'TFLOP/s':>8}   "
              f"{'fwd+bwd':>9} {'TFLOP/s':>8}  note")
    print(header + "\n" + "-" * len(header))
    for s in seqs:
        b = max(1, tokens // s)
        key = jax.random.key(s)
        kq, kk, kv, kd = jax.random.split(key, 4)
        q = jax.random.normal(kq, (b, s, heads, head_dim), dtype)
        k = jax.random.normal(kk, (b, s, kv_heads, head_dim), dtype)
        v = jax.random.normal(kv, (b, s, kv_heads, head_dim), dtype)
        do = jax.random.normal(kd, (b, s, heads, head_dim), dtype)
        fwd_flops = 0.5 * 4 * b * s * s * heads * head_dim
        outputs = {}
        for name, f in impls.items():
            fwd_ms, fwd_out = time_call(f, (q, k, v), iters)
            both_ms, both_out = time_call(_fwd_bwd(f), (q, k, v, do), iters)
            notes = [x for x in (fwd_out, both_out) if isinstance(x, str)]
            if fwd_ms is not None:
                outputs[name] = fwd_out
            note = "; ".join(dict.fromkeys(notes))
            print(f"{s:6d} {b:5d}  {name:14s} {_cell(fwd_ms, fwd_flops)}   "
                  f"{_cell(both_ms, FWD_BWD_FACTOR * fwd_flops)}  {note}")
            results.add("timing", {
                "seq": s, "batch": b, "impl": name, "fwd_ms": fwd_ms, "fwd_bwd_ms": both_ms, "note": note,
                "fwd_tflops": None if fwd_ms is None else fwd_flops / fwd_ms / 1e9,
                "fwd_bwd_tflops": None if both_ms is None else FWD_BWD_FACTOR * fwd_flops / both_ms / 1e9})
        if "pallas flash" in outputs:
            for other in ("cudnn", "xla reference"):
                if other in outputs:
                    err = _rel_err(outputs["pallas flash"], outputs[other])
                    print(f"{'':14s}pallas flash vs {other} output: max rel diff {err:.1e}")
                    results.add("comparisons", {"seq": s, "against": other, "max_rel_diff": err})
                    break


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="run on CPU in interpret mode with tiny shapes (shakes out bugs)")
    parser.add_argument("--iters", type=int, default=5, help="timed calls per measurement")
    parser.add_argument("--seqs", default="2048,4096,8192,16384",
                        help="comma-separated sequence lengths to time")
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
        print("\nCorrectness (compiled kernel vs reference, max|diff| / max|ref|):")
        t0 = time.perf_counter()
        cases = [c for c in CASES if c[0] in SMOKE_CASES] if args.cpu_smoke else CASES
        passed = [check_case(c, interpret=interpret, shrink=16 if args.cpu_smoke else 1, results=results)
                  for c in cases]
        ok = all(passed)
        print(f"  {sum(passed)}/{len(passed)} cases passed in {time.perf_counter() - t0:.0f}s")
    if not args.skip_bench:
        if args.cpu_smoke:
            benchmark(tokens=64, seqs=(32,), heads=4, kv_heads=2, head_dim=32, dtype=F32,
                      iters=1, interpret=True, results=results)
        else:
            benchmark(tokens=32 * 1024, seqs=[int(s) for s in args.seqs.split(",")], heads=32,
                      kv_heads=8, head_dim=128, dtype=BF16, iters=args.iters, interpret=False,
                      results=results)
    results.data.update(ok=ok, seconds=time.perf_counter() - start)
    results.save()
    print(f"\n{'PASS' if ok else 'FAIL'}: total {time.perf_counter() - start:.0f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
