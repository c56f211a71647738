"""AdamW with Megatron's conventions, assembled from optax's own pieces.

- learning rate (Megatron-Core's OptimizerParamScheduler, step counted in
  applied updates): linear warmup from 0 to `lr` over `warmup_steps`, then
  cosine / linear decay to `min_lr` at `decay_steps` and `min_lr` after, or
  `lr` throughout for `constant` (which ignores `min_lr`, as Megatron does).
  Built from `optax.linear_schedule`, `optax.cosine_decay_schedule` and
  `optax.join_schedules`, which compute exactly these formulas;
- AdamW is `optax.adamw` (Adam, then decoupled weight decay, then the
  learning rate: p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p), as
  Megatron's fused AdamW), with no weight decay on biases and normalisation
  parameters;
- global-norm clipping is done in the train step, not with
  `optax.clip_by_global_norm`: Megatron scales by max_norm / (norm + 1e-6)
  (optax by max_norm / norm), and the step reports the pre-clip norm, as
  Megatron logs it;
- parameters held in a 16-bit dtype (precision.param_dtype=compute) get an fp32
  master copy (Megatron's main params), the last part of the optimizer state
  (`MasterParams`, split like the moments): AdamW updates the copy, and the
  parameters become its rounding (`apply_update`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from megajax.config import OptimConfig


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Megatron's learning rate after `count` applied updates."""
    warmup = cfg.warmup_steps
    decay_steps = cfg.decay_steps or total_steps
    min_lr = cfg.min_lr if cfg.min_lr is not None else cfg.lr / 10
    span = decay_steps - warmup  # steps of decay after the warmup
    if cfg.decay_style == "constant":
        after = optax.constant_schedule(cfg.lr)
    elif span <= 0:
        # decay_steps <= warmup_steps (Megatron refuses this): lr at the end of the warmup, min_lr after.
        after = optax.join_schedules([optax.constant_schedule(cfg.lr), optax.constant_schedule(min_lr)], [1])
    elif cfg.decay_style == "cosine":
        # lr * ((1 - a) * c + a) with a = min_lr / lr is Megatron's min_lr + c * (lr - min_lr).
        alpha = min_lr / cfg.lr if cfg.lr > 0 else 0.0
        after = optax.cosine_decay_schedule(cfg.lr, span, alpha=alpha)
    else:
        after = optax.linear_schedule(cfg.lr, min_lr, span)
    if warmup <= 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warmup), after], [warmup])


def decay_mask(params: dict) -> dict:
    """True where weight decay applies: not biases, not norm parameters."""
    def mask(path, _):
        names = [getattr(k, "key", str(k)) for k in path]
        return not (names[-1] == "bias" or any("norm" in n for n in names))
    return jax.tree_util.tree_map_with_path(mask, params)


def trainable_mask(frozen: Callable[[str], bool]) -> Callable[[dict], dict]:
    """params -> tree of bools, True where a parameter trains: `frozen` takes its '/'-joined path."""
    def mask(params: dict) -> dict:
        return jax.tree_util.tree_map_with_path(
            lambda path, _: not frozen("/".join(str(getattr(k, "key", k)) for k in path)), params)
    return mask


class MasterParams(NamedTuple):
    """The fp32 master copy of parameters held in a 16-bit dtype: the optimizer state's last part."""
    master: optax.Params


def with_master_params(tx: optax.GradientTransformationExtraArgs) -> optax.GradientTransformationExtraArgs:
    """`tx` on an fp32 master copy of the parameters: the state is (*tx's state, MasterParams), `init`
    takes the fp32 parameters (the model's initialisation), and `update` returns the updates of the
    master, which the new state already holds (the parameters then take its rounding: apply_update)."""
    def init(params):
        return (*tx.init(params), MasterParams(params))

    def update(updates, state, params=None, **extra):
        *inner, copy = state
        updates, inner = tx.update(updates, tuple(inner), copy.master, **extra)
        return updates, (*inner, MasterParams(optax.apply_updates(copy.master, updates)))

    return optax.GradientTransformationExtraArgs(init, update)


def master_of(opt_state) -> dict | None:
    """The fp32 master parameters an optimizer state holds (with_master_params), or None."""
    last = opt_state[-1] if isinstance(opt_state, tuple) and opt_state else None
    return last.master if isinstance(last, MasterParams) else None


def apply_update(tx: optax.GradientTransformation, grads, opt_state, params, **extra):
    """(new parameters, new optimizer state) of one update: params + updates, or, with a master copy,
    the new master rounded to the parameters' dtypes."""
    updates, new_opt = tx.update(grads, opt_state, params, **extra)
    master = master_of(new_opt)
    if master is None:
        return optax.apply_updates(params, updates), new_opt
    return jax.tree.map(lambda m, p: m.astype(p.dtype), master, params), new_opt


def make_optimizer(cfg: OptimConfig, total_steps: int, frozen: Callable[[str], bool] | None = None,
                   master_params: bool = False) -> optax.GradientTransformationExtraArgs:
    """AdamW; with `frozen` (a predicate over parameter paths, e.g. model.vision.freeze's) AdamW runs on
    the other parameters alone (optax.masked: the frozen ones have no moments), and the frozen ones'
    updates are zero.

    `update(grads, state, params, learning_rate=lr)` takes the step's learning rate from the caller
    (lr_schedule's value at this update's count, which the train step computes anyway): the same
    numbers, but the schedule's scalar arithmetic is then one input of the update rather than a copy
    in each parameter's update loop, where XLA's fusion puts it (the tiny hybrid's 32 parameters:
    32 copies). Without it the schedule is evaluated from the state's count.

    `master_params`: the parameters are held in a 16-bit dtype, and AdamW runs on an fp32 master copy
    of them (with_master_params)."""
    def build(schedule: optax.Schedule) -> optax.GradientTransformation:
        # State layout: (ScaleByAdamState, masked decay state, ScaleByScheduleState).
        adamw = optax.adamw(schedule, b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps,
                            weight_decay=cfg.weight_decay, mask=decay_mask)
        if frozen is None:
            return adamw
        trains = trainable_mask(frozen)
        return optax.chain(optax.masked(adamw, trains),
                           optax.masked(optax.set_to_zero(), lambda p: jax.tree.map(lambda t: not t, trains(p))))

    scheduled = build(lr_schedule(cfg, total_steps))

    def update(updates, state, params=None, *, learning_rate: jax.Array | None = None, **_):
        tx = scheduled if learning_rate is None else build(lambda count: learning_rate)
        return tx.update(updates, state, params)

    tx = optax.GradientTransformationExtraArgs(scheduled.init, update)
    return with_master_params(tx) if master_params else tx


def update_count(opt_state) -> jax.Array:
    """Number of optimizer updates applied (skipped steps do not count): Adam's count."""
    adam = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
            if isinstance(s, optax.ScaleByAdamState)]
    return adam[0].count


def clip_coefficient(norm: jax.Array, max_norm: float) -> jax.Array:
    """Megatron's clipping factor for gradients of global norm `norm`: max_norm / (norm + 1e-6) when
    that is below 1, else 1; `max_norm` 0 turns clipping off (1)."""
    if max_norm <= 0:
        return jnp.ones((), jnp.float32)
    return jnp.minimum(1.0, max_norm / (norm + 1e-6))
