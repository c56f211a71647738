"""AdamW with Megatron's conventions.

- learning rate: linear warmup from 0, then cosine/linear/constant decay to
  `min_lr` at `decay_steps`, `min_lr` after;
- no weight decay on biases and normalisation parameters;
- global-norm clipping is done in the train step (which also reports the
  pre-clip norm, as Megatron logs it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from megajax.config import OptimConfig


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    warmup = cfg.warmup_steps
    decay_steps = cfg.decay_steps or total_steps

    def schedule(count):
        step = jnp.asarray(count, jnp.float32)
        warm = cfg.lr * step / max(warmup, 1)
        ratio = jnp.clip((step - warmup) / max(decay_steps - warmup, 1), 0.0, 1.0)
        if cfg.decay_style == "cosine":
            decayed = cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (jnp.cos(jnp.pi * ratio) + 1.0)
        elif cfg.decay_style == "linear":
            decayed = cfg.lr - (cfg.lr - cfg.min_lr) * ratio
        else:
            decayed = jnp.asarray(cfg.lr, jnp.float32)
        return jnp.where(step < warmup, warm, decayed)

    return schedule


def decay_mask(params: dict) -> dict:
    """True where weight decay applies: not biases, not norm parameters."""
    def mask(path, _):
        names = [getattr(k, "key", str(k)) for k in path]
        return not (names[-1] == "bias" or any("norm" in n for n in names))
    return jax.tree_util.tree_map_with_path(mask, params)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    # State layout: (ScaleByAdamState, masked decay state, ScaleByScheduleState).
    return optax.chain(
        optax.scale_by_adam(b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps),
        optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask),
        optax.scale_by_learning_rate(lr_schedule(cfg, total_steps)),
    )


def update_count(opt_state) -> jax.Array:
    """Number of optimizer updates applied (skipped steps do not count)."""
    return opt_state[0].count
