"""Adam's state in Megatron-Core torch_dist checkpoints, both ways.

megatron-core's optimizers (FP32Optimizer; Float16OptimizerWithFloat16Params and the distributed
optimizer's `fully_sharded_model_space` form for bf16/fp16 runs) save, beside the model's tensors,
one global tensor per parameter and state under the parameter's own torch_dist key:

    optimizer.state.exp_avg.<key>       torch AdamW's first moment   = optax's mu
    optimizer.state.exp_avg_sq.<key>    its second moment            = optax's nu
    optimizer.state.fp32_param.<key>    the fp32 main parameters (bf16/fp16 runs only)

and, in the common state (common.pt up to megatron-core 0.18, `common_state` from 0.19):

    optimizer: {state: {common_step: tensor(N.)}, param_groups: [...]}   N = optax's count
    opt_param_scheduler: {max_lr, min_lr, lr_warmup_steps, lr_decay_steps, num_steps, ...}

The moments are laid out exactly like the parameters (the same rows: transposes, query groups,
SwiGLU halves, vocabulary padding), so they go through the parameters' own mapping. torch's AdamW
and optax's adamw are the same update (bias correction 1 - beta^N with the step count N, eps added
to sqrt(v_hat), decoupled weight decay lr * wd * p, none on biases and norms): with the count
carried over, the next update is the same. megatron-core keys its param groups by (wd_mult,
lr_mult, is_expert_parallel, is_decoupled_lr): a dense model has two, decayed then not.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megajax.errors import CheckpointError

STATES = ("exp_avg", "exp_avg_sq")  # torch AdamW's, in the order of optax's (mu, nu)
PREFIX = "optimizer.state."
FP32_PARAM = "fp32_param"
MU, NU, ADAM_COUNT, SCHEDULE_COUNT = "opt_state.0.mu.", "opt_state.0.nu.", "opt_state.0.count", "opt_state.2.count"


@dataclass
class AdamState:
    """A megajax run's Adam state as an export reads it: the moments as TensorSources named like the
    parameters, the update count, and the run's optim.* and train.* settings (for the param groups
    and the LR scheduler megatron-core stores with them)."""
    mu: object
    nu: object
    count: int
    optim: dict
    train: dict
    consumed_samples: int


def checkpoint_adam(step_dir: Path, meta: dict) -> AdamState:
    """The Adam state of a megajax checkpoint (CheckpointError naming it when it holds none: an
    imported or parameters-only checkpoint)."""
    from megajax.checkpoint.manager import CheckpointSource
    mu = CheckpointSource(step_dir, prefix=MU)
    count = mu.stored(ADAM_COUNT)
    if not mu.names() or count is None:
        how = " (written by `megajax import`: parameters only)" if meta.get("imported") else ""
        raise CheckpointError(f"--with-optimizer: checkpoint {step_dir} holds no optimizer state{how}; it has "
                              f"no Adam moments ({MU}*) to write. Export it without --with-optimizer, or export "
                              f"a checkpoint saved by training.")
    config = meta.get("config", {})
    return AdamState(mu=mu, nu=CheckpointSource(step_dir, prefix=NU), count=int(count), optim=config.get("optim", {}),
                     train=config.get("train", {}), consumed_samples=int(meta.get("consumed_samples", 0)))


def param_groups(adam: AdamState) -> list[dict]:
    """megatron-core's two dense param groups (decayed, then biases and norms), with the run's Adam
    hyperparameters; `params` are filled by megatron-core from the live optimizer on load."""
    o = adam.optim
    lr = float(o.get("lr", 0.0))
    min_lr = o.get("min_lr")
    return [dict(is_expert_parallel=False, default_config=True, wd_mult=wd_mult, lr_mult=1.0, is_decoupled_lr=False,
                 max_lr=lr, min_lr=None if min_lr is None else float(min_lr), lr=lr,
                 betas=(float(o.get("beta1", 0.9)), float(o.get("beta2", 0.95))), eps=float(o.get("eps", 1e-8)),
                 weight_decay=float(o.get("weight_decay", 0.0)) * wd_mult, amsgrad=False, maximize=False,
                 foreach=None, capturable=False, differentiable=False, fused=None, decoupled_weight_decay=True)
            for wd_mult in (1.0, 0.0)]


def scheduler_state(adam: AdamState) -> dict:
    """megatron-core's OptimizerParamScheduler state for the run's schedule: megatron counts its
    steps in samples (global batch per iteration)."""
    o, t = adam.optim, adam.train
    batch = int(t.get("global_batch", 1))
    lr = float(o.get("lr", 0.0))
    min_lr = o.get("min_lr")
    decay = o.get("decay_steps") or t.get("steps", 0)
    wd = float(o.get("weight_decay", 0.0))
    return {"max_lr": lr, "lr_warmup_steps": int(o.get("warmup_steps", 0)) * batch,
            "num_steps": adam.count * batch, "lr_decay_style": o.get("decay_style", "cosine"),
            "lr_decay_steps": int(decay) * batch, "min_lr": lr / 10 if min_lr is None else float(min_lr),
            "start_wd": wd, "end_wd": wd, "wd_incr_style": "constant", "wd_incr_steps": int(decay) * batch}


def adam_args(args, adam: AdamState) -> None:
    """Megatron args a run continued from the checkpoint reads (as Megatron-LM saves them)."""
    o, t = adam.optim, adam.train
    args.optimizer = "adam"
    args.lr, args.min_lr = float(o.get("lr", 0.0)), o.get("min_lr")
    args.adam_beta1, args.adam_beta2, args.adam_eps = (float(o.get("beta1", 0.9)), float(o.get("beta2", 0.95)),
                                                       float(o.get("eps", 1e-8)))
    args.weight_decay, args.clip_grad = float(o.get("weight_decay", 0.0)), float(o.get("clip_grad", 1.0))
    args.lr_decay_style, args.lr_warmup_iters = o.get("decay_style", "cosine"), int(o.get("warmup_steps", 0))
    args.lr_decay_iters = o.get("decay_steps") or t.get("steps")
    args.global_batch_size, args.seq_length = t.get("global_batch"), t.get("seq_len", args.seq_length)
    args.consumed_train_samples = adam.consumed_samples


def common_optimizer(adam: AdamState, torch) -> dict:
    """The optimizer's entry of the common state: the shared step and the param groups."""
    return {"state": {"common_step": torch.tensor(float(adam.count))}, "param_groups": param_groups(adam)}


def common_step(common: dict) -> int | None:
    """The Adam step count of a torch_dist checkpoint's common state (one optimizer, or a chained
    optimizer's several, whose steps megatron-core keeps equal), None when it has none."""
    optimizer = common.get("optimizer")
    if not isinstance(optimizer, dict):
        return None
    parts = [optimizer] if "state" in optimizer else [v for v in optimizer.values() if isinstance(v, dict)]
    steps = {float(p["state"]["common_step"]) for p in parts
             if isinstance(p.get("state"), dict) and p["state"].get("common_step") is not None}
    return int(steps.pop()) if len(steps) == 1 else None


class PrefixedCheckpoint:
    """The keys of a DistCheckpoint under `prefix` (e.g. `optimizer.state.exp_avg.`), named without
    it: the model's keys, as torch_dist's layer and expert readers expect them."""

    def __init__(self, ckpt, prefix: str):
        self._ckpt, self._prefix, self.step = ckpt, prefix, ckpt.step
        self.meta = {k[len(prefix):]: v for k, v in ckpt.meta.items() if k.startswith(prefix)}

    def keys(self) -> list[str]:
        return [k for k, v in self.meta.items() if hasattr(v, "chunks")]

    def shape(self, key: str) -> tuple[int, ...]:
        return self._ckpt.shape(self._prefix + key)

    def read(self, key: str, index: int | None = None) -> np.ndarray:
        return self._ckpt.read(self._prefix + key, index)
