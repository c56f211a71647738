"""Static Batcher vs continuous Engine on a random model, in one process, without HTTP.

    PYTHONPATH=. python scripts/bench_batching.py [continuous] [static] [--model key=value ...]
        [--decode-steps 8] [--prefill-rows N] [--attention-blocks 4]

Default model: tests/random_model.py's 2-layer llama (hidden 64) with a 256-token context, 8 rows.
Reports per batcher: start time (the engine compiles everything; the static batcher is warmed on
the shapes used), staggered arrivals (one 30-token prompt asking 200 tokens, then 8 prompts of 10
tokens asking 16, 0.2 s later: when the long one and the last short one finish), and tokens/s of
64-token completions for 1 client and for 8 concurrent ones.
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from random_model import random_model  # noqa: E402
from megajax.inference.batcher import Batcher, Job  # noqa: E402
from megajax.inference.engine import Engine  # noqa: E402
from megajax.inference.generate import Generator  # noqa: E402
from megajax.inference.sampling import Sampling  # noqa: E402


def finish_times(events: queue.Queue, n: int) -> dict[int, float]:
    out = {}
    while len(out) < n:
        kind, i, payload = events.get()
        if kind == "error":
            raise RuntimeError(payload)
        if kind == "done":
            out[i] = time.perf_counter()
    return out


def staggered(batcher) -> tuple[float, float]:
    events: queue.Queue = queue.Queue()
    t0 = time.perf_counter()
    batcher.submit([Job(list(range(10, 40)), Sampling(), 200, 0, events)])
    time.sleep(0.2)
    batcher.submit([Job(list(range(50 + i, 60 + i)), Sampling(), 16, 1 + i, events) for i in range(8)])
    t = finish_times(events, 9)
    return t[0] - t0, max(t[i] for i in range(1, 9)) - t0


def tokens_per_s(batcher, clients: int) -> float:
    events: queue.Queue = queue.Queue()
    t0 = time.perf_counter()
    batcher.submit([Job(list(range(20 + i, 40 + i)), Sampling(), 64, i, events) for i in range(clients)])
    finish_times(events, clients)
    return clients * 64 / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("batching", nargs="*", default=["continuous", "static"])
    parser.add_argument("--model", nargs="*", default=[], metavar="KEY=VALUE", help="model overrides")
    parser.add_argument("--decode-steps", type=int, default=8, help="the engine's decode steps per iteration")
    parser.add_argument("--prefill-rows", type=int, default=None, help="the engine's prompts per prefill call")
    parser.add_argument("--attention-blocks", type=int, default=4,
                        help="the engine's KV blocks per attention trip (0: every row gathers its whole table)")
    args = parser.parse_args()
    cfg, _, params = random_model("llama", *args.model, std=0.08, seq_len=256)
    generator = Generator(cfg.model, params, eod_id=None)
    for kind in args.batching:
        t0 = time.perf_counter()
        if kind == "continuous":
            batcher = Engine(generator, 8, block_size=16, prefill_chunk=64, decode_steps=args.decode_steps,
                             prefill_rows=args.prefill_rows,
                             attention_blocks=args.attention_blocks or None, quiet=False)
            while not batcher.ready:
                time.sleep(0.01)
        else:
            batcher = Batcher(generator, 8)
            staggered(batcher), tokens_per_s(batcher, 1), tokens_per_s(batcher, 8)  # compiles its buckets
        kind += f" ({args.decode_steps} decode steps per iteration)" * (kind == "continuous")
        print(f"{kind}: ready in {time.perf_counter() - t0:.1f} s", flush=True)
        long_s, short_s = staggered(batcher)
        print(f"{kind}: staggered: the long request done at {long_s:.2f} s, the last of 8 short ones at "
              f"{short_s:.2f} s", flush=True)
        one, eight = tokens_per_s(batcher, 1), tokens_per_s(batcher, 8)
        print(f"{kind}: tokens/s: 1 client {one:.0f}, 8 concurrent {eight:.0f} ({eight / one:.1f}x)", flush=True)
        batcher.close()


if __name__ == "__main__":
    main()
