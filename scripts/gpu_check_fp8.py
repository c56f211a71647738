#!/usr/bin/env python
"""GPU check for pallas_kernels.fp8_matmul: compiled correctness, the cuBLASLt FP8 rewrite, timing.

1. Correctness: the compiled kernel (interpret=False) against fp8_matmul_reference
   (float64 from the same float8 values): same and mixed float8 types, both operand
   layouts, ragged shapes, every output dtype, the amax output. The error is reported over
   sum|a||b| * scale, which shows the accumulation precision the tensor cores delivered.
2. XLA's FP8 rewrite: the compiled HLO of fp8_matmul_xla, and of fp8_linear(impl="xla")
   forward + backward, must contain the cuBLASLt FP8 custom call `__cublas$lt$matmul$f8`
   (1 and 3 of them).
3. Timing (TFLOP/s = 2*M*N*K / time): the Pallas kernel (b stored [N, K] and [K, N]), XLA's
   FP8 GEMM (b [N, K], the layout cuBLASLt takes without a transpose) and a bf16 GEMM, at
   4096/8192/16384 squares and Llama-3-8B's projections with M = 8192 tokens; then
   fp8_linear forward + backward (pallas, xla) against bf16 autodiff.

  PYTHONPATH=. python3 scripts/gpu_check_fp8.py --out DIR      # one GPU, about 2-3 minutes
  PYTHONPATH=. python3 scripts/gpu_check_fp8.py --cpu-smoke    # CPU, interpret mode, toy sizes

Results go to DIR/fp8_check.json (rewritten after every step) and DIR/fp8_check.txt.
Exit status 1 when a correctness or HLO check fails or errors; 2 without a GPU (unless
--cpu-smoke).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import (
    Fp8Scales, default_formats, fp8_linear, fp8_matmul, fp8_matmul_reference, fp8_matmul_xla,
    quantize)

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
CUBLASLT_FP8 = "__cublas$lt$matmul$f8"
U_OUT = {jnp.dtype(F32): 2.0 ** -24, jnp.dtype(BF16): 2.0 ** -8, jnp.dtype(F16): 2.0 ** -11}
# Accumulation error allowed over sum|a||b| * scale: fp32 accumulation gives ~K * 2^-24; a
# reduced-precision tensor-core accumulator (Hopper's FP8 MMA keeps fewer bits) up to ~2^-10.
ACC_TOL = 2.0 ** -9

# (name, a type "e4m3"/"e5m2", b type, M, N, K, transpose_a, transpose_b, out dtype)
CASES = [
    ("e4m3 x e4m3 ragged bf16", "e4m3", "e4m3", 1000, 700, 3000, False, False, BF16),
    ("e4m3 x e4m3 b^T large tiles f32", "e4m3", "e4m3", 4096, 4096, 1024, False, True, F32),
    ("e5m2 x e4m3 b^T ragged f32 (dx)", "e5m2", "e4m3", 513, 1025, 2048, False, True, F32),
    ("e4m3 x e5m2 a^T f32 (dw)", "e4m3", "e5m2", 1000, 256, 4096, True, False, F32),
    ("e5m2 x e5m2 f16", "e5m2", "e5m2", 640, 384, 1000, False, False, F16),
    ("small M e4m3 bf16", "e4m3", "e4m3", 16, 4096, 4096, False, True, BF16),
]
SQUARES = (4096, 8192, 16384)
TOKENS = 8192
LLAMA3_8B = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate/up", 4096, 28672),
             ("down", 14336, 4096)]                     # (name, K, N) of y[M, N] = x[M, K] w


class Report:
    """Prints each line, appends it to DIR/fp8_check.txt and rewrites DIR/fp8_check.json."""

    def __init__(self, out: pathlib.Path, json_path: pathlib.Path | None = None):
        out.mkdir(parents=True, exist_ok=True)
        self.txt, self.json_path = out / "fp8_check.txt", json_path or out / "fp8_check.json"
        self.txt.write_text("")
        self.data = {"correctness": [], "hlo": {}, "timing": [], "linear": [], "ok": None}

    def line(self, text: str = ""):
        print(text, flush=True)
        with self.txt.open("a") as f:
            f.write(text + "\n")

    def save(self):
        self.json_path.write_text(json.dumps(self.data, indent=1, default=str))


def _types():
    fmt = default_formats()
    return {"e4m3": fmt.fwd, "e5m2": fmt.bwd}


def _fp8(key, shape, dtype, std=4.0):
    return quantize(jax.random.normal(key, shape, F32) * std, 1.0, dtype)


# --------------------------------------------------------------------------- correctness


def check_case(case, rep: Report, *, interpret: bool, shrink: int) -> bool:
    name, ta_name, tb_name, m, n, k, ta, tb, out_dt = case
    m, n, k = (max(1, m // shrink), max(1, n // shrink), max(1, k // shrink))
    types = _types()
    ka, kb = jax.random.split(jax.random.key(m * n + k))
    a = _fp8(ka, (k, m) if ta else (m, k), types[ta_name])
    b = _fp8(kb, (n, k) if tb else (k, n), types[tb_name])
    sa, sb = 0.37, 1.0 / 48
    t0 = time.perf_counter()
    entry = dict(name=name, m=m, n=n, k=k, a=str(a.dtype), b=str(b.dtype),
                 out=jnp.dtype(out_dt).name)
    try:
        run = jax.jit(lambda a, b: fp8_matmul(a, b, sa, sb, out_dtype=out_dt, return_amax=True,
                                              transpose_a=ta, transpose_b=tb, interpret=interpret))
        out, amax = jax.block_until_ready(run(a, b))
        want = fp8_matmul_reference(a, b, sa, sb, transpose_a=ta, transpose_b=tb)
        a64 = np.abs(np.asarray(a.astype(F32), np.float64))
        b64 = np.abs(np.asarray(b.astype(F32), np.float64))
        sums = (a64.T if ta else a64) @ (b64.T if tb else b64) * sa * sb
        got = np.asarray(out, np.float64)
        err = np.abs(got - want) - U_OUT[jnp.dtype(out_dt)] * np.abs(got)   # less the output cast
        acc_err = float(np.max(np.maximum(err, 0.0) / np.maximum(sums, 1e-30)))
        amax_ok = float(amax) == float(np.max(np.abs(np.asarray(out, np.float32))))
        ok = bool(np.all(np.isfinite(got))) and acc_err <= ACC_TOL and amax_ok
        entry.update(acc_err=acc_err, tolerance=ACC_TOL, amax_ok=amax_ok, ok=ok)
    except Exception:
        rep.line(f"  ERROR {name}")
        rep.line(traceback.format_exc())
        entry.update(ok=False, error=traceback.format_exc(limit=3))
        rep.data["correctness"].append(entry)
        return False
    rep.data["correctness"].append(entry)
    rep.line(f"  {'ok  ' if ok else 'FAIL'} {name:34s} M={m:<5d} N={n:<5d} K={k:<5d} "
             f"acc err {acc_err:.1e} (tol {ACC_TOL:.0e}) amax {'ok' if amax_ok else 'WRONG'}"
             f"  {time.perf_counter() - t0:.1f}s")
    return ok


# --------------------------------------------------------------------------- HLO


def _count_fp8_gemms(fn, *args) -> int:
    text = jax.jit(fn).lower(*args).compile().as_text()
    return text.count(f'custom_call_target="{CUBLASLT_FP8}"')


def check_hlo(rep: Report, *, on_gpu: bool, size: int) -> bool:
    types = _types()
    a = jax.ShapeDtypeStruct((size, size), types["e4m3"])
    b = jax.ShapeDtypeStruct((size, size), types["e4m3"])
    s = jax.ShapeDtypeStruct((), F32)
    x = jax.ShapeDtypeStruct((2, size, size), BF16)
    w = jax.ShapeDtypeStruct((size, size), BF16)
    ct = jax.ShapeDtypeStruct((2, size, size), BF16)

    def product(a, b, sa, sb):
        return fp8_matmul_xla(a, b, sa, sb, out_dtype=BF16)

    def linear_fwd_bwd(x, w, ct):
        y, vjp = jax.vjp(lambda x, w: fp8_linear(x, w, impl="xla"), x, w)
        return y, vjp(ct)

    ok = True
    for name, fn, args, want in [("fp8_matmul_xla", product, (a, b, s, s), 1),
                                 ("fp8_linear xla fwd+bwd", linear_fwd_bwd, (x, w, ct), 3)]:
        try:
            found = _count_fp8_gemms(fn, *args)
        except Exception:
            rep.line(f"  ERROR compiling {name}")
            rep.line(traceback.format_exc())
            rep.data["hlo"][name] = dict(ok=False, error=traceback.format_exc(limit=3))
            ok = False
            continue
        passed = found >= want if on_gpu else None
        rep.data["hlo"][name] = dict(fp8_custom_calls=found, expected=want, ok=passed)
        verdict = {True: "ok  ", False: "FAIL", None: "n/a "}[passed]
        rep.line(f"  {verdict} {name:26s} {found} x {CUBLASLT_FP8} in the compiled HLO "
                 f"(expected {want}{'' if on_gpu else '; not checked on CPU'})")
        ok = ok and passed is not False
    return ok


# --------------------------------------------------------------------------- timing


def time_call(fn, args, *, min_seconds: float, max_iters: int):
    """(ms per call, output) of a compiled fn, or (None, reason)."""
    try:
        compiled = jax.jit(fn).lower(*args).compile()
        out = jax.block_until_ready(compiled(*args))           # warm-up
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        once = time.perf_counter() - t0
        iters = int(min(max_iters, max(3, math.ceil(min_seconds / max(once, 1e-6)))))
        t0 = time.perf_counter()
        for _ in range(iters):
            out = compiled(*args)
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / iters * 1e3, out
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        return None, f"{type(e).__name__}: {first[:80]}"


def _rel_diff(x, y) -> float:
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    return float(np.max(np.abs(x - y)) / max(float(np.max(np.abs(y))), 1e-30))


def benchmark(rep: Report, shapes, *, interpret: bool, min_seconds: float, max_iters: int):
    types = _types()
    e4 = types["e4m3"]
    impls = {
        "pallas fp8 b[N,K]": lambda a, b, bt, sa, sb: fp8_matmul(
            a, bt, sa, sb, out_dtype=BF16, transpose_b=True, interpret=interpret),
        "pallas fp8 b[K,N]": lambda a, b, bt, sa, sb: fp8_matmul(
            a, b, sa, sb, out_dtype=BF16, interpret=interpret),
        "xla fp8 b[N,K]": lambda a, b, bt, sa, sb: fp8_matmul_xla(
            a, bt, sa, sb, out_dtype=BF16, transpose_b=True),
        "bf16 b[K,N]": None,
    }
    rep.line(f"\nTiming: bf16 output, {min_seconds:.2f}s of calls per entry after a warm-up; "
             "TFLOP/s = 2*M*N*K / time.")
    header = f"{'shape':>14} {'M':>6} {'N':>6} {'K':>6}  " + "  ".join(
        f"{name:>18}" for name in impls) + "  pallas vs xla"
    rep.line(header + "\n" + "-" * len(header))
    for label, m, n, k in shapes:
        key = jax.random.key(m + n + k)
        ka, kb = jax.random.split(key)
        a, b = _fp8(ka, (m, k), e4), _fp8(kb, (k, n), e4)
        bt = jnp.asarray(b.T)                                   # [N, K], stored so
        a16, b16 = a.astype(BF16), b.astype(BF16)
        sa, sb = jnp.float32(0.5), jnp.float32(0.25)
        flops = 2.0 * m * n * k
        cells, outs = [], {}
        for name, fn in impls.items():
            if fn is None:
                ms, out = time_call(lambda a, b: a @ b, (a16, b16), min_seconds=min_seconds,
                                    max_iters=max_iters)
            else:
                ms, out = time_call(fn, (a, b, bt, sa, sb), min_seconds=min_seconds,
                                    max_iters=max_iters)
            entry = dict(shape=label, m=m, n=n, k=k, impl=name, ms=ms,
                         tflops=None if ms is None else flops / ms / 1e9)
            if ms is None:
                entry["error"] = out
                cells.append(f"{'failed':>18}")
            else:
                outs[name] = out
                cells.append(f"{ms:8.3f}ms {entry['tflops']:6.0f}T")
            rep.data["timing"].append(entry)
            rep.save()
        diff = (f"{_rel_diff(outs['pallas fp8 b[N,K]'], outs['xla fp8 b[N,K]']):.1e}"
                if "pallas fp8 b[N,K]" in outs and "xla fp8 b[N,K]" in outs else "-")
        rep.line(f"{label:>14} {m:6d} {n:6d} {k:6d}  " + "  ".join(cells) + f"  {diff:>13}")
        errors = [e for e in rep.data["timing"][-len(impls):] if "error" in e]
        for e in errors:
            rep.line(f"{'':16}{e['impl']}: {e['error']}")


def benchmark_linear(rep: Report, *, tokens: int, k: int, n: int, interpret: bool,
                     min_seconds: float, max_iters: int):
    """fp8_linear forward + backward (current scaling) against bf16 autodiff."""
    kx, kw, kg = jax.random.split(jax.random.key(7), 3)
    x = jax.random.normal(kx, (tokens, k), BF16)
    w = (jax.random.normal(kw, (k, n), F32) / math.sqrt(k)).astype(BF16)
    ct = jax.random.normal(kg, (tokens, n), BF16)

    def step(f):
        def run(x, w, ct):
            y, vjp = jax.vjp(f, x, w)
            return (y, *vjp(ct))
        return run

    impls = {"fp8 pallas": lambda x, w: fp8_linear(x, w, Fp8Scales(), impl="pallas",
                                                   formats=default_formats(), interpret=interpret),
             "fp8 xla": lambda x, w: fp8_linear(x, w, Fp8Scales(), impl="xla",
                                                formats=default_formats()),
             "bf16": lambda x, w: x @ w}
    flops = 3 * 2.0 * tokens * k * n
    rep.line(f"\nfp8_linear forward + backward, x [{tokens}, {k}] w [{k}, {n}] bf16, current "
             "scaling; error of y / dx / dw against bf16 autodiff (max|diff| / max|bf16|):")
    results = {}
    for name, f in impls.items():
        ms, out = time_call(step(f), (x, w, ct), min_seconds=min_seconds, max_iters=max_iters)
        entry = dict(impl=name, tokens=tokens, k=k, n=n, ms=ms,
                     tflops=None if ms is None else flops / ms / 1e9)
        if ms is None:
            entry["error"] = out
        else:
            results[name] = out
        rep.data["linear"].append(entry)
        rep.save()
    for name, entry in zip(impls, rep.data["linear"][-len(impls):]):
        if entry["ms"] is None:
            rep.line(f"  {name:11s} failed: {entry['error']}")
            continue
        errs = ""
        if name != "bf16" and "bf16" in results:
            e = [_rel_diff(g, r) for g, r in zip(results[name], results["bf16"])]
            entry["rel_err_vs_bf16"] = dict(zip(("y", "dx", "dw"), e))
            errs = "  y {:.1e} dx {:.1e} dw {:.1e}".format(*e)
        rep.line(f"  {name:11s} {entry['ms']:8.3f} ms {entry['tflops']:7.0f} TFLOP/s{errs}")
    rep.save()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="run every path on CPU in interpret mode at toy sizes")
    parser.add_argument("--out", default="fp8-check",
                        help="directory for the JSON and text results")
    parser.add_argument("--json", help="where the JSON goes (default: DIR/fp8_check.json)")
    parser.add_argument("--skip-bench", action="store_true", help="correctness and HLO only")
    args = parser.parse_args(argv)

    if args.cpu_smoke:
        jax.config.update("jax_platforms", "cpu")
    backend = jax.default_backend()
    rep = Report(pathlib.Path(args.out), pathlib.Path(args.json) if args.json else None)
    rep.data.update(jax=jax.__version__, backend=backend, device=jax.devices()[0].device_kind,
                    interpret=args.cpu_smoke, formats=[str(t) for t in default_formats()])
    rep.line(f"jax {jax.__version__}, backend {backend}, device {jax.devices()[0].device_kind}, "
             f"float8 {default_formats().fwd.name}/{default_formats().bwd.name}, "
             f"interpret={args.cpu_smoke}")
    if backend == "cpu" and not args.cpu_smoke:
        rep.line("no GPU: use --cpu-smoke to run the interpret-mode smoke test on CPU")
        return 2
    start = time.perf_counter()
    smoke = args.cpu_smoke

    rep.line("\nCorrectness (compiled kernel vs float64 reference; accumulation error over "
             "sum|a||b|*scale, less the output cast):")
    results = [check_case(c, rep, interpret=smoke, shrink=32 if smoke else 1) for c in CASES]
    ok = all(results)
    rep.save()

    rep.line(f"\nXLA's FP8 GEMM rewrite ({CUBLASLT_FP8}):")
    ok = check_hlo(rep, on_gpu=not smoke, size=64 if smoke else 4096) and ok
    rep.save()

    if not args.skip_bench:
        if smoke:
            shapes = [("square", 128, 128, 128), ("llama qkv/64", 128, 96, 64)]
            budget = dict(min_seconds=0.0, max_iters=1)
        else:
            shapes = [("square", s, s, s) for s in SQUARES] + [
                (f"8B {name}", TOKENS, n, k) for name, k, n in LLAMA3_8B]
            budget = dict(min_seconds=0.25, max_iters=200)
        benchmark(rep, shapes, interpret=smoke, **budget)
        lin = dict(tokens=64, k=64, n=96) if smoke else dict(tokens=TOKENS, k=4096, n=4096)
        benchmark_linear(rep, interpret=smoke, **lin, **budget)

    rep.data["ok"] = ok
    rep.data["seconds"] = time.perf_counter() - start
    rep.save()
    rep.line(f"\n{'PASS' if ok else 'FAIL'}: total {time.perf_counter() - start:.0f}s "
             f"(results in {rep.json_path} and {rep.txt})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
