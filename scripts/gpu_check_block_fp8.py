#!/usr/bin/env python3
"""GPU check for the block-scaled FP8 recipes (precision.fp8_recipe blockwise and mxfp8).

1. Correctness: the compiled blockwise kernel (pallas_kernels/blockwise_fp8.py, interpret=False)
   against blockwise_matmul_reference (float64 from the same float8 values and factors) on ragged
   shapes and every output dtype, the error over sum|a||b| x factors (the accumulation precision
   the tensor cores and the per-block fp32 promotion delivered); mxfp8_matmul (native where the
   GPU has it, Blackwell) against mxfp8_matmul_reference; the blockwise linear's forward and both
   backward products (pallas) against its xla path.
2. Timing, TFLOP/s = 2*M*N*K / time: the blockwise kernel, its dequantize-then-dot xla path,
   mxfp8_matmul, the per-tensor FP8 Pallas kernel (fp8_matmul) and a bf16 GEMM, at 4096 and 8192
   squares and Llama-3-8B's projections with M = 8192 tokens (operands already quantized).

  PYTHONPATH=. python3 scripts/gpu_check_block_fp8.py --json FILE      # one GPU, about 1-2 minutes
  PYTHONPATH=. python3 scripts/gpu_check_block_fp8.py --cpu-smoke      # CPU, interpret mode, toy sizes

Exit status 1 when a correctness check fails or errors; 2 without a GPU (unless --cpu-smoke).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # no install needed

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import (  # noqa: E402
    MXFP8, block_scaled_linear, blockwise_matmul, blockwise_matmul_reference, blockwise_matmul_xla,
    fp8_matmul, mxfp8_matmul, mxfp8_matmul_reference, native_mxfp8, quantize_rows)
from pallas_kernels._common import on_rocm  # noqa: E402
from pallas_kernels.block_scaling import BLOCKWISE, BLOCKWISE_FNUZ, MXFP8_FNUZ  # noqa: E402

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
U_OUT = {jnp.dtype(F32): 2.0 ** -24, jnp.dtype(BF16): 2.0 ** -8, jnp.dtype(F16): 2.0 ** -11}
ACC_TOL = 2.0 ** -12   # fp32 promotion every 128 of K: far below a 14-bit accumulator's 2^-9
CASES = [(1000, 700, 3000, BF16), (4096, 4096, 1024, F32), (513, 1025, 2048, F32), (16, 4096, 4096, BF16),
         (640, 384, 1000, F16)]
SQUARES = (4096, 8192)
TOKENS = 8192
LLAMA3_8B = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate/up", 4096, 28672), ("down", 14336, 4096)]


def _operands(key, m, n, k, fmt):
    ka, kb, ks = jax.random.split(key, 3)
    a = quantize_rows(jax.random.normal(ka, (m, k), F32) * 3, fmt)
    b = quantize_rows(jax.random.normal(kb, (n, k), F32), fmt)
    return a, b


def check_blockwise(m, n, k, out_dtype, fmt, *, interpret: bool) -> dict:
    a, b = _operands(jax.random.key(m + n + k), m, n, k, fmt)
    entry = dict(check="blockwise kernel", m=m, n=n, k=k, out=jnp.dtype(out_dtype).name)
    got = jax.jit(lambda *o: blockwise_matmul(*o, out_dtype=out_dtype, interpret=interpret))(
        a.values, a.scales, b.values, b.scales)
    want = blockwise_matmul_reference(a.values, a.scales, b.values, b.scales)
    real = lambda q: np.abs(np.asarray(q.values.astype(F32), np.float64)) * np.repeat(
        np.asarray(q.scales, np.float64), 128, axis=1)[:, :k]
    sums = real(a) @ real(b).T
    g = np.asarray(got.astype(F32), np.float64)
    err = np.maximum(np.abs(g - want) - U_OUT[jnp.dtype(out_dtype)] * np.abs(g), 0) / np.maximum(sums, 1e-30)
    entry.update(acc_err=float(err.max()), tolerance=ACC_TOL)
    entry["ok"] = bool(np.all(np.isfinite(g)) and entry["acc_err"] <= ACC_TOL)
    return entry


def check_mxfp8(m, n, k, fmt) -> dict:
    a, b = _operands(jax.random.key(m * n + k), m, n, k, fmt)
    native = native_mxfp8()
    got = jax.jit(lambda *o: mxfp8_matmul(*o, out_dtype=F32))(a.values, a.scales, b.values, b.scales)
    want = mxfp8_matmul_reference(a.values, a.scales, b.values, b.scales)
    err = float(np.max(np.abs(np.asarray(got, np.float64) - want)) / max(float(np.max(np.abs(want))), 1e-30))
    return dict(check=f"mxfp8_matmul ({'native' if native else 'emulated'})", m=m, n=n, k=k, out="float32",
                rel_err=err, ok=bool(np.isfinite(err) and err <= 2.0 ** -10))


def check_linear(tokens, k, n, *, interpret: bool) -> dict:
    kx, kw, kg = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (tokens, k), BF16)
    w = (jax.random.normal(kw, (k, n), F32) / math.sqrt(k)).astype(BF16)
    g = jax.random.normal(kg, (tokens, n), BF16)

    def run(impl):
        y, vjp = jax.vjp(lambda x, w: block_scaled_linear(x, w, recipe="blockwise", impl=impl,
                                                          interpret=interpret if impl == "pallas" else None), x, w)
        return (y, *vjp(g))
    got, want = jax.jit(lambda: run("pallas"))(), jax.jit(lambda: run("xla"))()
    errs = [float(jnp.max(jnp.abs(a.astype(F32) - b.astype(F32))) / jnp.max(jnp.abs(b.astype(F32))))
            for a, b in zip(got, want)]
    return dict(check="blockwise linear fwd+bwd pallas vs xla", m=tokens, n=n, k=k, out="bfloat16",
                rel_err=dict(zip(("y", "dx", "dw"), errs)), ok=all(e <= 2.0 ** -7 for e in errs))


def time_call(fn, args, *, min_seconds: float, max_iters: int):
    """ms per call of the compiled fn, or (None, the reason)."""
    try:
        compiled = jax.jit(fn).lower(*args).compile()
        jax.block_until_ready(compiled(*args))
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        iters = int(min(max_iters, max(3, math.ceil(min_seconds / max(time.perf_counter() - t0, 1e-6)))))
        t0 = time.perf_counter()
        for _ in range(iters):
            out = compiled(*args)
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / iters * 1e3, None
    except Exception as e:
        return None, f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:80]}"


def benchmark(shapes, fmt, mx_fmt, *, interpret: bool, min_seconds: float, max_iters: int, line) -> list[dict]:
    rows = []
    impls = {
        "blockwise pallas": lambda a, b, ma, mb, p, q: blockwise_matmul(a.values, a.scales, b.values, b.scales,
                                                                         out_dtype=BF16, interpret=interpret),
        "blockwise xla": lambda a, b, ma, mb, p, q: blockwise_matmul_xla(a.values, a.scales, b.values, b.scales,
                                                                          out_dtype=BF16),
        "mxfp8": lambda a, b, ma, mb, p, q: mxfp8_matmul(ma.values, ma.scales, mb.values, mb.scales, out_dtype=BF16),
        "per-tensor fp8 pallas": lambda a, b, ma, mb, p, q: fp8_matmul(a.values, b.values, 1.0, 1.0, out_dtype=BF16,
                                                                       transpose_b=True, interpret=interpret),
        "bf16": lambda a, b, ma, mb, p, q: p @ q.T,
    }
    line(f"{'shape':>12} {'M':>6} {'N':>6} {'K':>6}  " + "  ".join(f"{k:>21}" for k in impls) + "   (ms, TFLOP/s)")
    for label, m, n, k in shapes:
        a, b = _operands(jax.random.key(m + 7 * n + k), m, n, k, fmt)
        ma, mb = _operands(jax.random.key(m + 7 * n + k), m, n, k, mx_fmt)
        p, q = a.values.astype(BF16), b.values.astype(BF16)
        cells = []
        for name, fn in impls.items():
            ms, why = time_call(fn, (a, b, ma, mb, p, q), min_seconds=min_seconds, max_iters=max_iters)
            tflops = None if ms is None else 2.0 * m * n * k / ms / 1e9
            rows.append(dict(shape=label, m=m, n=n, k=k, impl=name, ms=ms, tflops=tflops, error=why))
            cells.append(f"{'failed':>21}" if ms is None else f"{ms:9.3f}ms {tflops:8.1f}T")
        line(f"{label:>12} {m:6d} {n:6d} {k:6d}  " + "  ".join(cells))
        for r in rows[-len(impls):]:
            if r["error"]:
                line(f"{'':14}{r['impl']}: {r['error']}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="every path on CPU in interpret mode at toy sizes")
    ap.add_argument("--json", default="block_fp8_check.json")
    ap.add_argument("--skip-bench", action="store_true", help="correctness only")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        jax.config.update("jax_platforms", "cpu")
    smoke, backend = args.cpu_smoke, jax.default_backend()
    out = pathlib.Path(args.json)
    data = dict(jax=jax.__version__, backend=backend, device=jax.devices()[0].device_kind, interpret=smoke,
                native_mxfp8=native_mxfp8(), checks=[], timing=[], ok=None)
    save = lambda: out.write_text(json.dumps(data, indent=1, default=str))
    print(f"jax {jax.__version__}, backend {backend}, device {data['device']}, native mxfp8 {data['native_mxfp8']}",
          flush=True)
    if backend == "cpu" and not smoke:
        print("no GPU: use --cpu-smoke to run the interpret-mode smoke test on CPU")
        return 2
    rocm = not smoke and on_rocm()
    fmt, mx_fmt = (BLOCKWISE_FNUZ, MXFP8_FNUZ) if rocm else (BLOCKWISE, MXFP8)
    start, shrink = time.perf_counter(), 16 if smoke else 1
    print("\nCorrectness (compiled; accumulation error over sum|a||b| x factors, less the output cast):")
    checks = [lambda c=c: check_blockwise(max(1, c[0] // shrink), max(1, c[1] // shrink), max(1, c[2] // shrink),
                                          c[3], fmt, interpret=smoke) for c in CASES]
    checks += [lambda: check_mxfp8(*((64, 48, 100) if smoke else (1024, 768, 2000)), mx_fmt),
               lambda: check_linear(*((64, 96, 160) if smoke else (4096, 4096, 2048)), interpret=smoke)]
    for check in checks:
        try:
            entry = check()
        except Exception:
            entry = dict(check="(error)", ok=False, error=traceback.format_exc(limit=4))
            print(entry["error"])
        data["checks"].append(entry)
        save()
        print(f"  {'ok  ' if entry['ok'] else 'FAIL'} " + ", ".join(f"{k}={v}" for k, v in entry.items()
                                                                     if k not in ("ok", "error")), flush=True)
    ok = all(c["ok"] for c in data["checks"])
    if not args.skip_bench:
        shapes = ([("square", 128, 128, 256)] if smoke else
                  [("square", s, s, s) for s in SQUARES] + [(f"8B {nm}", TOKENS, n, k) for nm, k, n in LLAMA3_8B])
        budget = dict(min_seconds=0.0, max_iters=1) if smoke else dict(min_seconds=0.25, max_iters=100)
        print("\nTiming (bf16 output; operands already quantized):")
        data["timing"] = benchmark(shapes, fmt, mx_fmt, interpret=smoke, line=lambda s: print(s, flush=True), **budget)
    data.update(ok=ok, seconds=time.perf_counter() - start)
    save()
    print(f"\n{'PASS' if ok else 'FAIL'}: {data['seconds']:.0f}s (results in {out})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
