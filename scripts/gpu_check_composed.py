#!/usr/bin/env python
"""GPU check for the composed code paths one device can exercise, each against its plain twin:

1. The pipeline's stage loop (manual over every mesh axis, megajax/parallel/pipeline.py) on one
   device, as a 1-stage 1F1B schedule over 2 microbatches, with the flash kernel compiled (Triton)
   and then with FP8 products (XLA's FP8 GEMMs): one train step's loss and grad norm against the
   plain step of the same model, kernel and precision on the same device.
2. FP8 products through the sequence-parallel code path (megajax/parallel/tensor.py: shard_map
   over `tensor` of size 1, the input gathered, the output reduce-scattered): values and gradients
   equal the plain FP8 product's.
3. cuDNN attention as context parallelism's block kernel (GPU only): out and log-sum-exp against
   plain attention, and the gradients of a loss of both (`lse_differentiable` supplies the part
   cuDNN's VJP leaves out).

  PYTHONPATH=. python3 scripts/gpu_check_composed.py --json FILE     # one GPU, about a minute
  PYTHONPATH=. python3 scripts/gpu_check_composed.py --cpu-smoke     # CPU, interpret mode, no cuDNN

Exit status 1 when a check fails, 2 without a GPU (unless --cpu-smoke).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

SMALL = ["model.num_layers=2", "model.hidden_size=256", "model.num_heads=4", "model.num_kv_heads=2",
         "model.ffn_hidden_size=512", "model.vocab_size=512", "train.seq_len=256", "train.global_batch=4",
         "train.micro_batch=2", "data.tokenizer=byte", "model.max_position_embeddings=256"]
SMOKE = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2",
         "model.ffn_hidden_size=128", "model.vocab_size=512", "train.seq_len=64", "train.global_batch=4",
         "train.micro_batch=2", "data.tokenizer=byte"]


def one_step(cfg, pipelined: bool) -> tuple[float, float]:
    """(loss, grad norm) of one train step on one device, through a 1-stage pipeline or plainly."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from megajax.plan import PipelineChoice, make_plan
    from megajax.train.setup import build_setup
    from megajax.train.step import make_train_step

    plan = make_plan(cfg, 1)
    setup = build_setup(plan, jax.devices()[:1])
    choice = PipelineChoice("1f1b", 1, 1, plan.batch.accumulation) if pipelined else None
    step = jax.jit(make_train_step(plan.cfg, setup.spec, setup.tx, setup.scaler, setup.schedule, setup.mesh,
                                   plan.rules, choice))
    rng = np.random.default_rng(0)
    shape = plan.batch.shape
    tokens = rng.integers(0, plan.cfg.model.vocab_size, shape + (1,)).astype(np.int32)[..., 0]
    batch = {"tokens": tokens, "labels": np.roll(tokens, -1, axis=-1), "loss_mask": np.ones(shape, np.float32)}
    batch = {k: jax.device_put(v, NamedSharding(setup.mesh, P())) for k, v in batch.items()}
    _, metrics = step(setup.fresh_state(), batch)
    return float(metrics["loss"]), float(metrics["grad_norm"])


def check_stage_loop(smoke: bool, precision: str) -> dict:
    from megajax.config import load_config
    overrides = [*(SMOKE if smoke else SMALL), "model.attention_impl=flash", f"train.precision={precision}"]
    plain = one_step(load_config(overrides=overrides), pipelined=False)
    staged = one_step(load_config(overrides=overrides), pipelined=True)
    # One rounding of the compute dtype apart (the stage loop recomputes the forward in its backward).
    tol = 2.0 ** -7
    ok = all(abs(a - b) <= tol * abs(b) for a, b in zip(staged, plain))
    return {"check": f"stage loop, flash, {precision}", "plain": plain, "staged": staged, "ok": ok}


def check_fp8_sequence_parallel() -> dict:
    from jax.sharding import AxisType
    from megajax.config import load_config
    from megajax.mesh import make_rules
    from megajax.parallel.tensor import tensor_parallel_ops
    from megajax.precision.fp8 import Fp8Dot
    from megajax.precision.policy import precision_policy

    cfg = load_config(overrides=["train.precision=fp8", "parallel.sequence_parallel=true"])
    names = ("pipeline", "data", "fsdp", "expert", "context", "tensor")
    mesh = jax.make_mesh((1,) * 6, names, axis_types=(AxisType.Auto,) * 6, devices=jax.devices()[:1])
    ops = tensor_parallel_ops(mesh, make_rules(cfg).activations, sequence_parallel=True)
    policy = precision_policy(cfg).fp8
    plain, through = Fp8Dot(policy), Fp8Dot(policy, layout=lambda d: ops.layout("column", d))
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(2, 64, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(128, 256)) * 0.05, jnp.bfloat16)
    dn = (((2,), (0,)), ((), ()))
    loss = lambda dot: (lambda x, w: jnp.sum(dot(x, w, dn).astype(jnp.float32) ** 2))
    want = jax.jit(jax.value_and_grad(loss(plain), argnums=(0, 1)))(x, w)
    got = jax.jit(jax.value_and_grad(loss(through), argnums=(0, 1)))(x, w)
    ok = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    return {"check": "FP8 product through the sequence-parallel path", "ok": ok}


def check_cudnn_block() -> dict:
    from megajax.models.attention import cudnn_attention_block, xla_attention_with_lse
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.normal(size=(2, 512, 8, 64)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=(2, 512, 2, 64)), jnp.bfloat16) for _ in range(2))
    w_out = jnp.asarray(rng.normal(size=(2, 512, 8, 64)), jnp.float32)
    w_lse = jnp.asarray(rng.normal(size=(2, 8, 512)), jnp.float32)
    # Packed documents (segment ids: cuDNN's mask form, an additive bias): documents of 100, 156,
    # 200 and 56 tokens in row 0, one of 512 in row 1.
    seg = jnp.asarray(np.stack([np.repeat(np.arange(4), [100, 156, 200, 56]), np.zeros(512, int)]), jnp.int32)
    out = {}
    for causal, documents in ((True, False), (False, False), (True, True)):
        ids = {"q_segment_ids": seg, "kv_segment_ids": seg} if documents else {}

        def objective(block):
            def f(q, k, v):
                o, lse = block(q, k, v, causal=causal, **ids)
                return jnp.sum(o.astype(jnp.float32) * w_out) + jnp.sum(lse * w_lse)
            return f
        got = jax.jit(jax.value_and_grad(objective(cudnn_attention_block), argnums=(0, 1, 2)))(q, k, v)
        want = jax.jit(jax.value_and_grad(objective(xla_attention_with_lse), argnums=(0, 1, 2)))(q, k, v)
        errors = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) /
                        (float(jnp.max(jnp.abs(b.astype(jnp.float32)))) + 1e-30))
                  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
        out[("causal" if causal else "full") + ("_documents" if documents else "")] = errors
    ok = all(e <= 2.0 ** -5 for errs in out.values() for e in errs)  # bf16 kernels, relative to the largest
    return {"check": "cuDNN block: out, lse and their gradients (with packed documents too)", "relative_errors": out,
            "ok": ok}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--cpu-smoke", action="store_true", help="the same paths on CPU at toy sizes (no cuDNN)")
    args = parser.parse_args()
    backend = jax.default_backend()
    if backend == "cpu" and not args.cpu_smoke:
        print("no GPU: use --cpu-smoke to run the composed paths on CPU")
        return 2
    # The CPU smoke run keeps one stage-loop check (flash and FP8 together): each compiles two steps.
    checks = ([] if args.cpu_smoke else [lambda: check_stage_loop(False, "bf16")]) + [
        lambda: check_stage_loop(args.cpu_smoke, "fp8"), check_fp8_sequence_parallel]
    if backend == "gpu" and "rocm" not in getattr(jax.devices()[0].client, "platform_version", "").lower():
        checks.append(check_cudnn_block)  # cuDNN: NVIDIA only
    results = []
    for check in checks:
        try:
            r = check()
        except Exception as e:  # a failed check is reported, the others still run
            r = {"check": getattr(check, "__name__", "check"), "ok": False, "error": repr(e),
                 "traceback": traceback.format_exc()[-2000:]}
        print(("ok   " if r["ok"] else "FAIL ") + json.dumps({k: v for k, v in r.items() if k != "traceback"}),
              flush=True)
        results.append(r)
    report = {"backend": backend, "checks": results, "ok": all(r["ok"] for r in results)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
