#!/usr/bin/env python3
"""Export memory benchmark: peak host memory of export_hf / export_megatron against the model size.

    python scripts/bench_export.py [--layers 12] [--hidden 1024] [--ffn 4096] [--vocab 32000]
                                   [--format hf megatron] [--dtype bf16] [--tensor-parallel 2]
                                   [--from-checkpoint]

Builds a Llama-style model with random float32 parameters (shapes from
megajax/models/layout.py) in a DictSource, then runs each export in a fresh child process that first builds
the same parameters, resets the kernel's peak-RSS counter (`echo 5 >
/proc/self/clear_refs` resets VmHWM) and reports VmHWM - VmRSS measured just
before the export: the memory the export itself added on top of the model it
reads (libraries the export imports are imported before the measurement).

With --from-checkpoint, one child writes the parameters as an Orbax checkpoint
(as `megajax import` does) and exits; each measuring child then only opens it
(CheckpointSource: Orbax metadata, no array read) before the measurement, so
the figure is what streaming from disk adds, the model never being in memory.
Linux only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def _model(a: argparse.Namespace):
    from megajax.config import ModelConfig
    m = ModelConfig(family="llama", num_layers=a.layers, hidden_size=a.hidden, num_heads=a.hidden // 64,
                    num_kv_heads=a.hidden // 64 // 4 or 1, ffn_hidden_size=a.ffn, vocab_size=a.vocab,
                    max_position_embeddings=2048)
    m.resolve(2048)
    return m


def _params(m) -> dict:
    import numpy as np

    from megajax.models.layout import param_shapes
    rng = np.random.default_rng(0)
    return {n: rng.standard_normal(s, dtype=np.float32) * 0.02
            for n, s in param_shapes(m, m.padded_vocab_size()).items()}


def write_checkpoint(a: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    from megajax.checkpoint.manager import write_params_checkpoint
    from megajax.checkpoint.source import unflatten
    from megajax.config import Config, finalize
    cfg = Config(model=_model(a))
    cfg.train.seq_len = 2048
    finalize(cfg)
    write_params_checkpoint(unflatten(_params(cfg.model)), cfg, a.write_checkpoint)


def child(a: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    import math

    from megajax.checkpoint.source import DictSource, unflatten
    if a.checkpoint:
        # Stream from the Orbax checkpoint on disk: the model is never in memory.
        from megajax.checkpoint.manager import CheckpointSource
        source = CheckpointSource(a.checkpoint)
        shapes = {n: source.shape(n) for n in source.names()}
        model_bytes = sum(4 * math.prod(s) for s in shapes.values())
        largest = max(4 * math.prod(s[1:] if n.startswith("layers/") else s) for n, s in shapes.items())
    else:
        m = _model(a)
        params = _params(m)
        model_bytes = sum(x.nbytes for x in params.values())
        largest = max(x.nbytes // (x.shape[0] if n.startswith("layers/") else 1) for n, x in params.items())
        source = DictSource(unflatten(params), m)
    # Import the libraries first: their code and data pages are not the export's doing.
    import tokenizers  # noqa: F401
    if a.child == "megatron":
        import torch  # noqa: F401
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    t = time.perf_counter()
    out = Path(a.out)
    if a.child == "hf":
        from megajax.checkpoint.hf import export_hf
        export_hf(source, out, tokenizer_spec="byte", dtype=a.dtype)
    else:
        from megajax.checkpoint.megatron import export_megatron
        export_megatron(source, out, tensor_parallel=a.tensor_parallel, dtype=a.dtype)
    seconds = time.perf_counter() - t
    peak = _status_kib("VmHWM")
    written = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(json.dumps({"format": a.child, "dtype": a.dtype, "model_mb": model_bytes / 2**20,
                      "largest_tensor_mb": largest / 2**20, "written_mb": written / 2**20,
                      "rss_before_mb": before / 1024, "peak_rss_mb": peak / 1024,
                      "export_added_mb": (peak - before) / 1024, "seconds": seconds}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--format", nargs="+", default=["hf", "megatron"])
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--tensor-parallel", type=int, default=2)
    p.add_argument("--from-checkpoint", action="store_true",
                   help="export from an Orbax checkpoint on disk (CheckpointSource) instead of memory")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    p.add_argument("--write-checkpoint", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.write_checkpoint:
        return write_checkpoint(a)
    if a.child:
        return child(a)
    model = ["--layers", str(a.layers), "--hidden", str(a.hidden), "--ffn", str(a.ffn), "--vocab", str(a.vocab)]

    def run(*args: str) -> str:
        r = subprocess.run([sys.executable, __file__, *args, *model], capture_output=True, text=True)
        if r.returncode:
            sys.exit(r.stderr)
        return r.stdout

    with tempfile.TemporaryDirectory(prefix="megajax-bench-export-") as tmp:
        source = []
        if a.from_checkpoint:
            run("--write-checkpoint", f"{tmp}/orbax")
            source = ["--checkpoint", f"{tmp}/orbax"]
        for fmt in a.format:
            out = run("--child", fmt, "--out", f"{tmp}/{fmt}", "--dtype", a.dtype,
                      "--tensor-parallel", str(a.tensor_parallel), *source)
            print(out.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
