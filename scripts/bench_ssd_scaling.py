#!/usr/bin/env python3
"""How the chunked SSD scan's cost grows with the sequence length, on this machine's CPU.

Times the forward and the forward+backward of pallas_kernels.ssd.ssd_chunked (plain jnp, the
path `model.mamba_ssd_impl=chunked` runs) under jit at sequence lengths 1k..8k, batch 1, and
prints the time per token at each length and its ratio to the shortest: a cost linear in L keeps
that ratio near 1 (the quadratic form stays inside chunks; only the chunk count grows).

  python3 scripts/bench_ssd_scaling.py                     # tiny-hybrid's mixer shape
  python3 scripts/bench_ssd_scaling.py --heads 64 --head-dim 64 --state 128 --groups 8 --chunk 128
  python3 scripts/bench_ssd_scaling.py --json out.json

Each figure is the median of --repeats timed calls after one warm-up call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.ssd import ssd_chunked  # noqa: E402


def inputs(length: int, a):
    ks = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(ks[0], (1, length, a.heads, a.head_dim))
    dt = jax.nn.softplus(jax.random.normal(ks[1], (1, length, a.heads)) - 2.0)
    A = -jnp.exp(jax.random.normal(ks[2], (a.heads,)))
    B = jax.random.normal(ks[3], (1, length, a.groups, a.state))
    C = jax.random.normal(ks[4], (1, length, a.groups, a.state))
    return x, dt, A, B, C


def median_ms(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="1024,2048,4096,8192")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--state", type=int, default=16)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", default="")
    a = p.parse_args()

    def loss(x, dt, A, B, C):
        return jnp.sum(ssd_chunked(x, dt, A, B, C, chunk_size=a.chunk) ** 2)

    fwd = jax.jit(lambda *t: ssd_chunked(*t, chunk_size=a.chunk))
    fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    rows = []
    print(f"ssd_chunked, batch 1, heads {a.heads} x head_dim {a.head_dim}, state {a.state}, groups {a.groups}, "
          f"chunk {a.chunk}; {jax.devices()[0].platform}")
    print(f"{'L':>6} {'fwd ms':>9} {'us/token':>9} {'x L0':>6} {'fwd+bwd ms':>11} {'us/token':>9} {'x L0':>6}")
    for length in (int(v) for v in a.lengths.split(",")):
        args = inputs(length, a)
        f, fb = median_ms(fwd, args, a.repeats), median_ms(fwd_bwd, args, a.repeats)
        rows.append({"length": length, "fwd_ms": f, "fwd_bwd_ms": fb,
                     "fwd_us_per_token": f * 1e3 / length, "fwd_bwd_us_per_token": fb * 1e3 / length})
        r0 = rows[0]
        print(f"{length:>6} {f:>9.2f} {rows[-1]['fwd_us_per_token']:>9.3f} "
              f"{rows[-1]['fwd_us_per_token'] / r0['fwd_us_per_token']:>6.2f} {fb:>11.2f} "
              f"{rows[-1]['fwd_bwd_us_per_token']:>9.3f} "
              f"{rows[-1]['fwd_bwd_us_per_token'] / r0['fwd_bwd_us_per_token']:>6.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
