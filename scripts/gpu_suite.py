#!/usr/bin/env python3
"""megajax's GPU suite: every GPU check in one run, each section's results under $OUT as it goes.

  bash scripts/gpu_suite.sh                                  # one GPU, under 8 minutes in all
  CPU_SMOKE=1 bash scripts/gpu_suite.sh                      # the same code paths on CPU, toy sizes
  SECTIONS=env,attention bash scripts/gpu_suite.sh           # some sections only
  OUT=/tmp/results SUITE_BUDGET_S=300 bash scripts/gpu_suite.sh

Run it from anywhere with the machine's Python (`python3`, or $PYTHON); it needs no install and no
package registry: the sections use jax (with its GPU plugin), flax, optax, orbax-checkpoint,
tensorstore, tokenizers, tqdm, pyyaml and numpy, and a section whose optional package is missing
(Megatron-Core) is skipped.

Each section is one command in its own process (a fresh JAX and its own GPU memory) under a time
limit: its output is printed and saved as $OUT/<name>.txt line by line, and it writes
$OUT/<name>.json (when it cannot, the suite writes one with its status). A section that fails,
times out or cannot run here (skipped) does not stop the others. $OUT/summary.json, rewritten after
each section, and the closing table give each section's status, wall time and headline. The suite's
total time is capped (SUITE_BUDGET_S, default 480 s on a GPU and 240 s for CPU_SMOKE); a section gets
what is left when that is less than its own limit.

To add a check, append a Section to SECTIONS: a name, a time limit on the GPU, the command for the
GPU and for CPU_SMOKE=1 (the same code path at toy sizes), and optionally a function saying why it
cannot run here and one that picks the headline out of its JSON.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # megajax itself, for the sections' checks, without an install
SKIPPED = 77  # a section's exit status for "cannot run here" (as automake's test drivers use it)
MIN_SECTION_S = 10  # a section is not started with less time than this left in the budget


@dataclass
class Context:
    out: Path
    smoke: bool
    python: str = sys.executable

    def json(self, name: str) -> str:
        return str(self.out / f"{name}.json")


@dataclass
class Section:
    name: str
    limit_s: float  # on a GPU; CPU_SMOKE uses smoke_limit_s
    command: Callable[[Context], list[str]]
    smoke_limit_s: float = 120
    skip: Callable[[Context], str | None] = lambda ctx: None  # why it cannot run here, or None
    headline: Callable[[dict], str] = lambda result: ""
    env: dict[str, str] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
# Sections

def _env_headline(r: dict) -> str:
    kinds = sorted({d["kind"] for d in r.get("devices", [])})
    return f"jax {r['packages'].get('jax')}, {len(r.get('devices', []))} x {', '.join(kinds)}"


def _attention_headline(r: dict) -> str:
    rows = r.get("correctness", [])
    text = f"{sum(c['ok'] for c in rows)}/{len(rows)} correct"
    timed = [t for t in r.get("timing", []) if t.get("fwd_bwd_tflops")]
    if timed:
        seq = max(t["seq"] for t in timed)
        cells = [f"{t['impl'].split()[0]} {t['fwd_bwd_tflops']:.0f}" for t in timed if t["seq"] == seq]
        text += f"; fwd+bwd TFLOP/s at seq {seq}: " + ", ".join(cells)
    return text


def _fp8_headline(r: dict) -> str:
    rows = r.get("correctness", [])
    text = f"{sum(bool(c.get('ok')) for c in rows)}/{len(rows)} correct"
    hlo = [h for h in (r.get("hlo") or {}).values() if isinstance(h, dict)]
    if hlo and r.get("backend") != "cpu":
        text += f"; cuBLASLt FP8 rewrite {sum(bool(h.get('ok')) for h in hlo)}/{len(hlo)}"
    return text


def _block_fp8_headline(r: dict) -> str:
    rows = r.get("checks", [])
    text = f"{sum(bool(c.get('ok')) for c in rows)}/{len(rows)} correct"
    timed = {t["impl"]: t["tflops"] for t in r.get("timing", []) if t.get("tflops") and t["shape"] == "square"
             and t["m"] == max(x["m"] for x in r["timing"] if x["shape"] == "square")}
    if timed:
        text += "; largest square TFLOP/s: " + ", ".join(f"{k} {v:.0f}" for k, v in timed.items())
    return text


def _ssd_headline(r: dict) -> str:
    rows = r.get("correctness", [])
    text = f"{sum(bool(c.get('ok')) for c in rows)}/{len(rows)} correct"
    timed = [t for t in r.get("timing", []) if t.get("fwd_bwd_tflops")]
    if timed:
        seq = max(t["seq"] for t in timed)
        cells = [f"{t['impl'].split()[0]} c{t['chunk']} {t['fwd_bwd_tflops']:.0f}" for t in timed if t["seq"] == seq]
        text += f"; fwd+bwd TFLOP/s at seq {seq}: " + ", ".join(cells)
    return text


def _composed_headline(r: dict) -> str:
    rows = r.get("checks", [])
    return f"{sum(bool(c.get('ok')) for c in rows)}/{len(rows)} composed paths agree"


def _bench_headline(r: dict) -> str:
    mem = (r.get("memory", {}).get("compiled") or {}).get("total")
    text = (f"{r['tokens_per_sec']:,.0f} tok/s, {r['tflops_per_device']:.1f} TFLOP/s/dev, "
            f"MFU {100 * r['mfu']:.1f}%" if r.get("mfu") is not None else
            f"{r['tokens_per_sec']:,.0f} tok/s, {r['tflops_per_device']:.3f} TFLOP/s/dev, MFU n/a")
    text += f", {r['step_seconds']['median'] * 1e3:.0f} ms/step"
    if mem:
        text += f", {mem / 2**30:.1f} GiB"
    if r.get("baseline"):
        text += f"; megajax/{r['baseline']['name']} {r['baseline']['megajax_over_baseline']:.2f}x"
    return text


# ~1.2B Llama (configs/model/llama-1b.yaml: bf16, seq 4096, selective recompute), 8 x 4096 tokens per
# step in two microbatches; the toy model keeps the same structure (GQA, tied embeddings, bf16).
BENCH_GPU = ["--config", "model/llama-1b", "train.global_batch=8", "train.micro_batch=4", "train.steps=50",
             "data.corpus_max_mb=2"]
BENCH_SMOKE = ["--config", "model/llama-1b", "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
               "model.num_kv_heads=2", "model.ffn_hidden_size=128", "model.vocab_size=512", "train.seq_len=64",
               "train.global_batch=4", "train.micro_batch=2", "train.steps=8", "data.corpus_max_mb=0.2"]


def _bench(name: str, impl: str, *extra: str) -> Callable[[Context], list[str]]:
    def command(ctx: Context) -> list[str]:
        steps, warmup = ("1", "1") if ctx.smoke else (os.environ.get("BENCH_STEPS", "5"), "2")
        # cuDNN attention needs an NVIDIA GPU: on CPU the smoke run takes the XLA core instead.
        core = "xla" if ctx.smoke and impl == "cudnn" else impl
        return [ctx.python, "-m", "megajax.cli", "bench", *(BENCH_SMOKE if ctx.smoke else BENCH_GPU),
                f"model.attention_impl={core}", "--steps", steps, "--warmup", warmup, *extra,
                "--json", ctx.json(name)]
    return command


def _tp_overlap_headline(r: dict) -> str:
    return (f"tensor 2: {r['on']['step_seconds'] * 1e3:.0f} ms/step with the overlap, "
            f"{r['off']['step_seconds'] * 1e3:.0f} without: {r['speedup']:.2f}x")


def _serve_headline(r: dict) -> str:
    modes = r.get("modes", {})
    parts = []
    for name, m in modes.items():
        top = max(m.get("concurrency", []), key=lambda c: c["clients"], default=None)
        if top:
            parts.append(f"{name} {top['tokens_per_s']:,.0f} tok/s at {top['clients']} clients, "
                         f"TTFT p99 {top['ttft_p99_s']:.2f} s")
    return "; ".join(parts)


# `megajax serve` under concurrent streaming clients, static batching against continuous batching.
SERVE_GPU = ["--config", "model/gpt2-125m", "--clients", "1", "4", "16", "--requests", "2", "--new-tokens", "128",
             "--max-batch", "16"]
SERVE_SMOKE = ["--config", "model/tiny", "--override", "model.num_layers=2", "model.hidden_size=64",
               "model.num_heads=4", "model.ffn_hidden_size=128", "train.seq_len=64", "--batching", "continuous",
               "--clients", "1", "2", "--requests", "1", "--new-tokens", "4", "--max-batch", "2", "--skip-staggered",
               "--serve-arg=--prefill-chunk=32"]


def _megatron_missing(ctx: Context) -> str | None:
    from megajax.errors import UserError
    from megajax.perf.baseline import check_baseline
    try:
        check_baseline("megatron", dict(os.environ))
    except UserError as e:
        return str(e)
    return None


SECTIONS = [
    Section("env", 60, lambda ctx: [ctx.python, "scripts/gpu_env.py", "--json", ctx.json("env")],
            smoke_limit_s=30, headline=_env_headline),
    Section("attention", 150, lambda ctx: [ctx.python, "scripts/gpu_check_attention.py", "--json",
                                           ctx.json("attention"), *(["--cpu-smoke"] if ctx.smoke else [])],
            headline=_attention_headline),
    # The Mamba-2 SSD scan's Pallas kernels: correct against the sequential reference, timed against
    # ssd_chunked under jit.
    Section("ssd", 120, lambda ctx: [ctx.python, "scripts/gpu_check_ssd.py", "--json", ctx.json("ssd"),
                                     *(["--cpu-smoke"] if ctx.smoke else [])],
            smoke_limit_s=90, headline=_ssd_headline),
    Section("fp8", 150, lambda ctx: [ctx.python, "scripts/gpu_check_fp8.py", "--out", str(ctx.out / "fp8"),
                                     "--json", ctx.json("fp8"),
                                     *(["--cpu-smoke"] if ctx.smoke else [])], smoke_limit_s=60, headline=_fp8_headline),
    # The composed paths one device runs: the stage loop with flash and with FP8, FP8 through the
    # sequence-parallel products, cuDNN as context parallelism's block kernel.
    Section("composed", 120, lambda ctx: [ctx.python, "scripts/gpu_check_composed.py", "--json", ctx.json("composed"),
                                          *(["--cpu-smoke"] if ctx.smoke else [])],
            smoke_limit_s=120, headline=_composed_headline),
    Section("bench_llama1b_cudnn", 130, _bench("bench_llama1b_cudnn", "cudnn"), headline=_bench_headline),
    # The same step with train.precision=fp8 (delayed scaling, XLA's FP8 GEMMs): its step time
    # against bench_llama1b_cudnn's bf16 one.
    Section("bench_llama1b_fp8", 130, _bench("bench_llama1b_fp8", "cudnn", "train.precision=fp8"),
            headline=_bench_headline),
    Section("bench_llama1b_flash", 130, _bench("bench_llama1b_flash", "flash"), headline=_bench_headline),
    # JAX and PyTorch share the GPU: JAX allocates as it goes instead of taking 75% up front.
    Section("bench_llama1b_megatron", 150, _bench("bench_llama1b_megatron", "cudnn", "--baseline", "megatron"),
            skip=_megatron_missing, headline=_bench_headline, env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}),
    # Tensor parallelism 2 with the overlap of its collectives (parallel.tp_comm_overlap) and without: the
    # measurement `megajax plan`'s tp_overlap assumes until it is taken (2 or more GPUs; else skipped).
    Section("tp_overlap", 300, lambda ctx: [ctx.python, "scripts/gpu_check_tp_overlap.py", "--json",
                                            ctx.json("tp_overlap"), *(["--cpu-smoke"] if ctx.smoke else [])],
            smoke_limit_s=150, headline=_tp_overlap_headline),
    Section("serve", 150, lambda ctx: [ctx.python, "scripts/bench_serve.py", *(SERVE_SMOKE if ctx.smoke else SERVE_GPU),
                                       "--json", ctx.json("serve")], smoke_limit_s=120, headline=_serve_headline,
            env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}),  # the bench process and its server share the GPU
    # The block-scaled FP8 recipes: the blockwise Pallas kernel (compiled) and mxfp8_matmul against
    # their float64 references, timed against the per-tensor FP8 kernel and a bf16 GEMM. Last, so the
    # sections above keep their share of the suite's budget.
    Section("block_fp8", 120, lambda ctx: [ctx.python, "scripts/gpu_check_block_fp8.py", "--json", ctx.json("block_fp8"),
                                           *(["--cpu-smoke"] if ctx.smoke else [])],
            smoke_limit_s=120, headline=_block_fp8_headline),
]


# ----------------------------------------------------------------------------------------------
# Running

def _pump(stream, sinks) -> None:
    for line in iter(stream.readline, b""):
        for sink in sinks:
            sink.write(line)
            sink.flush()


def run_command(cmd: list[str], limit_s: float, log: Path, env: dict[str, str]) -> tuple[int | None, float]:
    """(exit status, or None on timeout; seconds): output to the console and to `log`, line by line.
    On timeout the command's process group gets SIGTERM, then SIGKILL 10 s later."""
    t0 = time.monotonic()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        pump = threading.Thread(target=_pump, args=(proc.stdout, (sys.stdout.buffer, f)), daemon=True)
        pump.start()
        try:
            status: int | None = proc.wait(timeout=max(limit_s, 1))
        except subprocess.TimeoutExpired:
            status = None
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
                except ProcessLookupError:
                    break
        pump.join(timeout=10)
    return status, time.monotonic() - t0


def _tail(path: Path, n: int = 5) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return "\n".join(lines[-n:])


def run_section(s: Section, ctx: Context, remaining_s: float, env: dict[str, str]) -> dict:
    txt, out_json = ctx.out / f"{s.name}.txt", Path(ctx.json(s.name))
    out_json.unlink(missing_ok=True)
    limit = min(s.smoke_limit_s if ctx.smoke else s.limit_s, remaining_s)
    row = {"section": s.name, "limit_s": round(limit, 1)}
    reason = s.skip(ctx)
    if reason is None and limit < MIN_SECTION_S:
        reason = f"no time left in the suite's budget ({remaining_s:.0f} s)"
    if reason is not None:
        txt.write_text(f"skipped: {reason}\n")
        print(f"skipped: {reason}", flush=True)
        row.update(status="skipped", seconds=0.0, headline=reason)
    else:
        cmd = s.command(ctx)
        print("$ " + " ".join(cmd), flush=True)
        status, seconds = run_command(cmd, limit, txt, {**env, **s.env})
        row["seconds"] = round(seconds, 1)
        if status is None:
            row.update(status="timeout", headline=f"stopped after its {limit:.0f} s limit")
        elif status == SKIPPED:
            row.update(status="skipped", headline=_tail(txt, 1))
        elif status != 0:
            row.update(status="failed", exit_status=status, headline=_tail(txt, 1))
        elif not out_json.is_file():
            row.update(status="failed", headline=f"exit 0 but no {out_json.name}")
        else:
            row["status"] = "ok"
            try:
                row["headline"] = s.headline(json.loads(out_json.read_text()))
            except Exception as e:  # a headline that cannot be read is a failed section
                row.update(status="failed", headline=f"unreadable {out_json.name}: {type(e).__name__}: {e}")
    if not out_json.is_file():  # every section leaves a JSON, if only its status
        out_json.write_text(json.dumps({**row, "output_tail": _tail(txt, 20)}, indent=1) + "\n")
    return row


def summary_table(rows: list[dict], total_s: float) -> str:
    lines = [f"{'section':<26}{'status':<9}{'wall s':>8}  headline", "-" * 100]
    for r in rows:
        head = (r.get("headline") or "").replace("\n", " ")
        lines.append(f"{r['section']:<26}{r['status']:<9}{r.get('seconds', 0):>8.1f}  {head[:160]}")
    lines.append(f"{'total':<35}{total_s:>8.1f}")
    return "\n".join(lines)


def main() -> int:
    smoke = os.environ.get("CPU_SMOKE", "") not in ("", "0")
    out = Path(os.environ.get("OUT") or "gpu_results").absolute()
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(out=out, smoke=smoke)
    wanted = [w for w in os.environ.get("SECTIONS", "").split(",") if w]
    unknown = sorted(set(wanted) - {s.name for s in SECTIONS})
    if unknown:
        print(f"SECTIONS: unknown {', '.join(unknown)}; known: {', '.join(s.name for s in SECTIONS)}",
              file=sys.stderr)
        return 2
    sections = [s for s in SECTIONS if not wanted or s.name in wanted]
    budget = float(os.environ.get("SUITE_BUDGET_S") or (240 if smoke else 480))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    if smoke:
        # Toy sizes spend their time compiling: XLA's CPU backend without its LLVM optimisations and
        # with its elemental emitters rather than the MLIR fusion emitters compiles them ~2-3x faster
        # and runs the same code paths.
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS"), "--xla_backend_optimization_level=0",
                                                  "--xla_cpu_use_fusion_emitters=false"]))
    print(f"megajax GPU suite{' (CPU_SMOKE: CPU, toy sizes)' if smoke else ''}: {len(sections)} sections, "
          f"budget {budget:.0f} s, results in {out}", flush=True)
    start, rows = time.monotonic(), []
    for i, s in enumerate(sections, 1):
        remaining = budget - (time.monotonic() - start)
        print(f"\n=== [{i}/{len(sections)}] {s.name} ===", flush=True)
        rows.append(run_section(s, ctx, remaining, env))
        print(f"=== {s.name}: {rows[-1]['status']} in {rows[-1].get('seconds', 0):.1f} s", flush=True)
        total = time.monotonic() - start
        (out / "summary.json").write_text(json.dumps(
            {"smoke": smoke, "budget_s": budget, "total_s": round(total, 1), "sections": rows}, indent=1) + "\n")
    total = time.monotonic() - start
    table = summary_table(rows, total)
    (out / "summary.txt").write_text(table + "\n")
    print("\n" + table, flush=True)
    return 0 if all(r["status"] in ("ok", "skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
