"""What a resumed run changed from the checkpoint it resumes, and what each change does.

A resume may change the step count, the learning-rate schedule, the batch or the mesh on
purpose; none of it should pass silently. `describe_changes` compares the checkpoint's saved
config and mesh with the run's and returns one line (or None when nothing that matters changed).
"""

from __future__ import annotations

import copy

from megajax.config import Config, OptimConfig, _build
from megajax.mesh import mesh_text
from megajax.train.optimizer import lr_schedule

SCHEDULE_KEYS = ("lr", "min_lr", "warmup_steps", "decay_style", "decay_steps")


def _lr_at(optim: OptimConfig, steps: int, step: int) -> float:
    return float(lr_schedule(optim, steps)(step))


def describe_changes(saved: dict, saved_mesh: dict[str, int] | None, cfg: Config, mesh: dict[str, int],
                     step: int, consumed: int) -> str | None:
    """One line naming each change of train.steps, the LR schedule, the batch and the mesh between a
    checkpoint (its saved config dict and mesh sizes) and this run, resumed at `step`."""
    old_train, old_optim_d = saved.get("train", {}), saved.get("optim", {})
    old_optim = _build(OptimConfig, copy.deepcopy(old_optim_d), "optim")
    t, o = cfg.train, cfg.optim
    parts = []
    old_steps = int(old_train.get("steps", t.steps))
    if old_steps != t.steps:
        follows = "" if o.decay_steps else (f" and the learning rate reaches its minimum at step {t.steps} "
                                            f"instead of {old_steps}")
        parts.append(f"train.steps {old_steps} -> {t.steps}: the run now ends at step {t.steps}{follows}")
    changed = [k for k in SCHEDULE_KEYS if getattr(old_optim, k) != getattr(o, k)]
    if changed or (old_steps != t.steps and not o.decay_steps):
        before, after = _lr_at(old_optim, old_steps, step), _lr_at(o, t.steps, step)
        keys = "".join(f"; optim.{k} {getattr(old_optim, k)} -> {getattr(o, k)}" for k in changed)
        if before != after or changed:
            parts.append(f"the learning rate of step {step + 1} is {after:.3e} (it would have been "
                         f"{before:.3e}){keys}")
    for key in ("global_batch", "micro_batch"):
        old, new = old_train.get(key), getattr(t, key)
        if old is not None and old != new:
            what = (f"each step now reads {new} samples; the data continues from sample {consumed:,}"
                    if key == "global_batch" else "the same global batch, accumulated in other pieces")
            parts.append(f"train.{key} {old} -> {new}: {what}")
    if saved_mesh is not None and {a: n for a, n in saved_mesh.items() if n > 1} != {
            a: n for a, n in mesh.items() if n > 1}:
        parts.append(f"mesh {mesh_text(saved_mesh)} -> {mesh_text(mesh)}: the checkpoint is resharded onto "
                     f"the new mesh (same values)")
    if not parts:
        return None
    return f"megajax: note: this resume changes what step {step} was saved with: " + "; ".join(parts) + "."
