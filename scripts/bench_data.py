#!/usr/bin/env python3
"""Data-path benchmark: preprocessing throughput and memory, sample-index build, loader samples/s.

    python scripts/bench_data.py [--mb 300] [--workers 1 2] [--tokenizer byte|tokenizer.json] [--dir DIR]

Generates a jsonl corpus of --mb megabytes (Python-like text, deterministic),
runs `megajax preprocess` on it once per worker count in a child process
(wall time, MB/s, MB/s per worker, peak RSS of the main process and of the
largest worker), then builds the GPT sample index for 1e6 samples of 1024
tokens and times the loader producing host batches.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("def class return import from self None True False for while if else elif try except with as "
         "lambda yield pass raise assert global print len range list dict set tuple value index data "
         "result name path file open read write config model layer batch token").split()


def generate(path: Path, mb: float) -> int:
    rng = random.Random(0)
    target, written = int(mb * 2**20), 0
    with open(path, "w") as f:
        while written < target:
            lines = ["    " * rng.randint(0, 3) + " ".join(rng.choices(WORDS, k=rng.randint(3, 12)))
                     for _ in range(rng.randint(5, 80))]
            line = json.dumps({"text": "\n".join(lines)}) + "\n"
            f.write(line)
            written += len(line)
    return written


def run_preprocess(inp: Path, out: Path, tokenizer: str, workers: int) -> dict:
    code = (
        "import resource, sys, time, json\n"
        "from megajax.data.preprocess import preprocess\n"
        "t = time.perf_counter()\n"
        f"preprocess([{str(inp)!r}], ['text'], {tokenizer!r}, {str(out)!r}, append_eod=True, workers={workers}, progress=False)\n"
        "print(json.dumps({'seconds': time.perf_counter() - t,"
        " 'main_rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,"
        " 'worker_rss_mb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=300.0)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokenizer", default="byte")
    ap.add_argument("--dir", default="")
    args = ap.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="megajax-bench-data-"))
    work.mkdir(parents=True, exist_ok=True)
    inp = work / "corpus.jsonl"
    t = time.perf_counter()
    size = generate(inp, args.mb)
    print(f"generated {size / 2**20:.0f} MB jsonl in {time.perf_counter() - t:.1f}s ({inp})")

    print(f"\n{'workers':>7} {'seconds':>8} {'MB/s':>8} {'MB/s/worker':>11} {'main RSS MB':>11} {'worker RSS MB':>13}")
    prefix = None
    for w in args.workers:
        out = work / f"out-w{w}"
        r = run_preprocess(inp, out, args.tokenizer, w)
        mbps = size / 2**20 / r["seconds"]
        print(f"{w:>7} {r['seconds']:>8.1f} {mbps:>8.1f} {mbps / w:>11.1f} {r['main_rss_mb']:>11.0f} "
              f"{r['worker_rss_mb'] if w > 1 else float('nan'):>13.0f}")
        prefix = f"{out}_text_document"

    sys.path.insert(0, str(ROOT))
    from megajax.data.gpt_dataset import GPTDataset
    from megajax.data.indexed import IndexedDataset
    from megajax.data.loader import Loader
    ds = IndexedDataset(prefix)
    print(f"\ndataset: {ds.num_tokens:,} tokens, {ds.num_sequences:,} documents ({ds.dtype.name})")
    cache = work / "cache"
    t = time.perf_counter()
    gpt = GPTDataset(ds, seq_len=1024, seed=0, num_samples=1_000_000, cache_dir=cache)
    print(f"sample index for 1,000,000 samples x 1024 tokens: {time.perf_counter() - t:.2f}s "
          f"({len(gpt):,} samples over the epochs needed)")
    t = time.perf_counter()
    GPTDataset(ds, seq_len=1024, seed=0, num_samples=1_000_000, cache_dir=cache)
    print(f"  from cache: {time.perf_counter() - t:.3f}s")

    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sh = NamedSharding(mesh, P(None, "data", None))
    from megajax.plan import BatchLayout
    layout = BatchLayout(global_batch=64, micro_batch=64, data_parallel=1, accumulation=1, seq_len=1024)
    loader = Loader(gpt, layout=layout,
                    shardings={k: sh for k in ("tokens", "labels", "loss_mask")}, prefetch=0)
    loader.batch(0)
    n, t = 20, time.perf_counter()
    for i in range(1, n + 1):
        jax.block_until_ready(loader.batch(i * 64))
    dt = time.perf_counter() - t
    print(f"loader: {n * 64 / dt:,.0f} samples/s ({n * 64 * 1024 / dt / 1e6:.1f} M tokens/s) "
          f"for global batch 64 x 1024 on one device")
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
