#!/usr/bin/env python3
"""Generation speed: megajax's cached decoding against transformers' `generate` on the same weights.

    PYTHONPATH=. python scripts/bench_generate.py [--model model/tiny model/gpt2-125m] [--batch 1 8]
        [--prompt-len 32] [--new-tokens 64] [--rounds 3] [--torch-threads 1] [--json FILE]

For each model config (random weights: the model's own initialisation at train.seed), the
parameters are exported with `export_hf` (--dtype, fp32 by default) and loaded with
`AutoModelForCausalLM` in that dtype, so both sides run the same weights in the same dtype on this
CPU, greedy, on the same random prompts (all of `--prompt-len` tokens), producing exactly
`--new-tokens` tokens (no end-of-document stop).

  time to first token (TTFT): megajax: prefill + first token (compiled beforehand); transformers:
      generate(max_new_tokens=1).
  decode tokens/s: batch x (new tokens - 1) / (time for all new tokens - TTFT).

megajax and transformers alternate within each round so both see the same machine load; the
median of the rounds is reported, with the fraction of generated tokens on which the two agree.
torch runs with --torch-threads (on a loaded machine more threads can be much slower; try 1 and 2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def build(config: str):
    """(cfg, params) of a config with random weights, on one device."""
    import jax

    from megajax.config import load_config
    from megajax.train.state import build_model_spec
    cfg = load_config([config], ["model.hidden_dropout=0", "model.attention_dropout=0"])
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = 257  # the byte tokenizer's
    _, init = build_model_spec(cfg, cfg.model.padded_vocab_size())
    return cfg, jax.jit(init)()


def hf_model(cfg, params, out: Path, torch, dtype: str):
    import numpy as np
    import transformers

    from megajax.checkpoint.hf import export_hf
    from megajax.checkpoint.source import DictSource
    import jax
    export_hf(DictSource(jax.tree.map(np.asarray, params), cfg.model), out, tokenizer_spec="byte", dtype=dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    return model.eval()


def time_megajax(gen, prompts, n):
    from megajax.inference.sampling import Sampling
    done, t = gen.generate(prompts, Sampling(), n)
    assert all(len(c.completion_ids) == n for c in done)
    return t.time_to_first_token_s, t.decode_tokens_per_s, [c.completion_ids for c in done]


def time_hf(model, prompts, n, torch):
    ids = torch.tensor(prompts, dtype=torch.long)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        total = time.perf_counter() - t0
    return ttft, len(prompts) * (n - 1) / (total - ttft), out[:, ids.shape[1]:].tolist()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", nargs="+", default=["model/tiny", "model/gpt2-125m"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="export dtype; both sides compute in it (megajax: bf16 products, fp32 accumulation)")
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args()

    import jax.numpy as jnp
    import numpy as np
    import torch

    from megajax.inference.generate import Generator
    torch.set_num_threads(a.torch_threads)
    rows = []
    print(f"{'model':18} {'batch':>5} {'TTFT ms':>9} {'(HF)':>9} {'decode tok/s':>13} {'(HF)':>9} {'ratio':>6} "
          f"{'agree':>6}", flush=True)
    for config in a.model:
        cfg, params = build(config)
        with tempfile.TemporaryDirectory() as tmp:
            hf = hf_model(cfg, params, Path(tmp) / "hf", torch, a.dtype)
            dtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16}[a.dtype]
            gen = Generator(cfg.model, params, eod_id=None, dtype=dtype)
            rng = np.random.default_rng(0)
            for b in a.batch:
                prompts = rng.integers(0, cfg.model.vocab_size, (b, a.prompt_len)).tolist()
                time_megajax(gen, prompts, a.new_tokens)  # compile
                ours, theirs, agree = [], [], []
                for _ in range(a.rounds):
                    ttft, tps, toks = time_megajax(gen, prompts, a.new_tokens)
                    ours.append((ttft, tps))
                    ttft, tps, hf_toks = time_hf(hf, prompts, a.new_tokens, torch)
                    theirs.append((ttft, tps))
                    agree.append(np.mean(np.asarray(toks) == np.asarray(hf_toks)))
                row = dict(model=config, batch=b, prompt_len=a.prompt_len, new_tokens=a.new_tokens,
                           ttft_s=statistics.median(x[0] for x in ours),
                           decode_tokens_per_s=statistics.median(x[1] for x in ours),
                           hf_ttft_s=statistics.median(x[0] for x in theirs),
                           hf_decode_tokens_per_s=statistics.median(x[1] for x in theirs),
                           token_agreement=float(np.mean(agree)), torch_threads=a.torch_threads, dtype=a.dtype,
                           compile_s=gen.compile_s)
                row["decode_ratio"] = row["decode_tokens_per_s"] / row["hf_decode_tokens_per_s"]
                rows.append(row)
                print(f"{config:18} {b:5d} {row['ttft_s'] * 1e3:9.1f} {row['hf_ttft_s'] * 1e3:9.1f} "
                      f"{row['decode_tokens_per_s']:13,.0f} {row['hf_decode_tokens_per_s']:9,.0f} "
                      f"{row['decode_ratio']:6.2f} {row['token_agreement']:6.2f}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
