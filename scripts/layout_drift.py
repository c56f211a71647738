#!/usr/bin/env python3
"""How far a layout's loss and grad norm stray from one device's, step by step, for a small model in
reduced precision: the measurements behind the hybrid's FP8 bars (docs/models.md, tests/test_hybrid.py).

Trains the model --steps steps on one CPU device (the batch of 8 at once) and on each --layout
(`a=b,c=d` overrides, on --devices of 8 simulated CPU devices), with the FP8 tests' settings (no
warmup, lr 3e-3, Adam eps 1e-8), and prints each layout's relative difference of loss and grad norm per step, and, with
FP8, the largest relative difference of a product's scale after step 1 and whether every replica
holds the same scaling state.

  PYTHONPATH=. python3 scripts/layout_drift.py --model hybrid \\
      --layout mesh.tensor=2,parallel.sequence_parallel=true,mesh.expert=2,mesh.data=2 \\
      --layout mesh.tensor=2,mesh.expert=2,mesh.data=2 --layout mesh.data=8,train.micro_batch=1
  PYTHONPATH=. python3 scripts/layout_drift.py --model mamba-attention --precision bf16 \\
      --layout mesh.data=8,train.micro_batch=1
  PYTHONPATH=. python3 scripts/layout_drift.py --model mamba-attention --devices 1 --layout mesh.data=1,train.micro_batch=1

Models: `hybrid` (pattern M*-EM*-E: Mamba-2, attention, squared-ReLU MLP, 4 experts), `mamba-attention`
(M*M*), `dense` (4 Llama layers), `dense-moe` (4 layers, every second one 4 experts top-2); all of
hidden size 64 and sequence 32, as the tests' small models.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# 8 simulated devices, compiled as the tests compile (their numbers reproduce exactly)
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + (" --xla_force_host_platform_device_count=8"
                                                               " --xla_backend_optimization_level=0"
                                                               " --xla_cpu_use_fusion_emitters=false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

SMALL = ["model.hidden_size=64", "model.num_heads=8", "model.num_kv_heads=4", "model.ffn_hidden_size=128",
         "train.seq_len=32", "train.global_batch=8", "train.log_every=1", "train.sample_tokens=0",
         "logging.tensorboard=false", "logging.progress=false", "data.corpus_max_mb=0.5", "optim.lr=3e-3",
         "train.eval_every=0", "optim.warmup_steps=0"]
MAMBA = ["model.num_layers=null", "model.position_embedding=none", "model.mamba_state_dim=8",
         "model.mamba_head_dim=8", "model.mamba_num_groups=2", "model.mamba_chunk_size=8"]
MODELS = {
    "hybrid": MAMBA + ["model.hybrid_layer_pattern=M*-EM*-E", "model.activation=squared_relu", "model.num_experts=4",
                       "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32"],
    "mamba-attention": MAMBA + ["model.hybrid_layer_pattern=M*M*"],
    "dense": ["model.num_layers=4"],
    "dense-moe": ["model.num_layers=4", "model.num_experts=4", "model.moe_router_topk=2",
                  "model.moe_ffn_hidden_size=32", "model.moe_layer_freq=2"],
}


def steps_of(cfg, devices, steps):
    """(loss and grad norm per step, the FP8 state after step 1, the final FP8 state)."""
    from megajax.train.loop import build_trainer
    tr = build_trainer(cfg, devices)
    state, ok, out, after_one = tr.state, tr.setup.ok_flag(), [], None
    for step in range(steps):
        state, m, ok = tr.step_fn(state, tr.loader.batch(step * cfg.train.global_batch), ok)
        out.append((float(m["loss"]), float(m["grad_norm"])))
        if step == 0:
            after_one = jax.device_get(state.fp8)
    return np.asarray(out), after_one, state.fp8


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="hybrid")
    ap.add_argument("--precision", choices=["fp8", "bf16", "fp32"], default="fp8")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--layout", action="append", required=True, help="overrides a=b,c=d on --devices devices")
    ap.add_argument("--devices", type=int, default=8, help="devices of the layouts (1: e.g. another micro_batch)")
    args = ap.parse_args()
    from megajax.config import load_config
    run_dir = tempfile.mkdtemp()
    common = SMALL + MODELS[args.model] + [f"train.precision={args.precision}", f"train.steps={args.steps}"]

    def cfg(i, *overrides):
        return load_config(overrides=common + [f"train.run_dir={run_dir}/{i}", *overrides])
    one, one_fp8, _ = steps_of(cfg(0, "mesh.data=1"), jax.devices()[:1], args.steps)
    print(f"{args.model} {args.precision}, one device: loss {one[:, 0].round(5).tolist()} "
          f"grad norm {one[:, 1].round(5).tolist()}")
    for i, layout in enumerate(args.layout, 1):
        got, got_fp8, final = steps_of(cfg(i, *layout.split(",")), jax.devices()[:args.devices], args.steps)
        rel = np.abs(got / one - 1)
        print(f"{layout}\n  loss rel {' '.join(f'{v:.2e}' for v in rel[:, 0])}   "
              f"grad norm rel {' '.join(f'{v:.2e}' for v in rel[:, 1])}")
        if args.precision == "fp8":
            flat = lambda t: jax.tree_util.tree_flatten_with_path(t)[0]  # noqa: E731
            scales = [(float(np.max(np.abs(np.asarray(y) / np.asarray(x) - 1))), jax.tree_util.keystr(p))
                      for (p, x), (_, y) in zip(flat(one_fp8), flat(got_fp8)) if "scale" in jax.tree_util.keystr(p)]
            worst = max(scales)
            # a Mamba mixer's products: its fused in_proj and its out_proj (attention's is `o`)
            mamba = max([x for x in scales if "in_product" in x[1] or "['mixer']['out']" in x[1]], default=None)
            replicated = all(all(np.array_equal(np.asarray(s.data), np.asarray(leaf.addressable_shards[0].data))
                                 for s in leaf.addressable_shards) for _, leaf in flat(final))
            print(f"  step-1 scales: worst {worst[0]:.2%} ({worst[1]})"
                  + (f", of a Mamba mixer {mamba[0]:.2%} ({mamba[1]})" if mamba else "")
                  + f"; replicas equal after {args.steps} steps: {replicated}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
