"""What a resumed run changed from the checkpoint it resumes, and what each change does.

A resume may change the step count, the learning-rate schedule, the batch or the mesh on
purpose; none of it should pass silently. `describe_changes` compares the checkpoint's saved
config and mesh with the run's and returns one line (or None when nothing that matters changed).
A change that would lose trained state or change the model is refused instead: a LoRA run's
adapters (`refuse_lora_changes`).
"""

from __future__ import annotations

import copy
import dataclasses

from megajax.config import Config, LoraConfig, ModelConfig, OptimConfig, _build
from megajax.errors import CheckpointError
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
    old_lora = (saved.get("model") or {}).get("lora") or {}
    if cfg.model.lora is not None and old_lora.get("dropout", cfg.model.lora.dropout) != cfg.model.lora.dropout:
        parts.append(f"model.lora.dropout {old_lora['dropout']} -> {cfg.model.lora.dropout}: the adapters' inputs "
                     f"are dropped at the new rate from step {step + 1} (the parameters are the same)")
    old_load, new_load = (saved.get("checkpoint") or {}).get("load"), cfg.checkpoint.load
    if new_load and new_load != old_load and cfg.model.lora is None:  # a LoRA run's base: refused (setup.py)
        parts.append(f"checkpoint.load {old_load!r} -> {new_load!r}: not read, the run continues from its own "
                     f"step {step} (checkpoint.load names where a new run starts; use another train.run_dir to "
                     f"start from {new_load})")
    if saved_mesh is not None and {a: n for a, n in saved_mesh.items() if n > 1} != {
            a: n for a, n in mesh.items() if n > 1}:
        parts.append(f"mesh {mesh_text(saved_mesh)} -> {mesh_text(mesh)}: the checkpoint is resharded onto "
                     f"the new mesh (same values)")
    if not parts:
        return None
    return f"megajax: note: this resume changes what step {step} was saved with: " + "; ".join(parts) + "."


def _lora_text(lo: LoraConfig) -> str:
    return f"rank {lo.rank}, alpha {lo.alpha:g}, targets [{','.join(lo.targets)}]"


def refuse_lora_changes(saved: dict, m: ModelConfig, where) -> None:
    """CheckpointError when a resume would change the adapters of a LoRA run (model.lora): their rank,
    alpha or targets (a target left out drops its trained adapters, one added starts from zero, another
    rank or alpha changes what the adapters compute), or LoRA switched on or off (a full run's state
    holds no adapters; a LoRA run's holds no trained base). `saved`: the checkpoint's saved config.
    model.lora.dropout may change: it changes training, not the parameters (describe_changes notes it)."""
    stored = (saved.get("model") or {}).get("lora")
    known = {f.name for f in dataclasses.fields(LoraConfig)}  # keys of other versions left out
    old = None if stored is None else _build(LoraConfig, {k: copy.deepcopy(v) for k, v in stored.items()
                                                          if k in known}, "model.lora")
    new = m.lora
    if old is None and new is None:
        return
    merged = (f"export the adapted model merged (megajax export --format hf --merge-lora --checkpoint {where} "
              f"--output DIR) and start another train.run_dir with checkpoint.load=DIR")
    if old is None:
        raise CheckpointError(f"{where} holds a full model's training state (model.lora unset), and this run sets "
                              f"model.lora ({_lora_text(new)}): a resume continues the run it resumes. To train "
                              f"adapters on this model, start another train.run_dir with checkpoint.load={where} "
                              f"and model.lora.*.")
    if new is None:
        raise CheckpointError(f"{where} holds LoRA adapters ({_lora_text(old)}) on a frozen base, and this run has "
                              f"model.lora unset: resumed as full training the trained adapters would be dropped. "
                              f"Resume with the checkpoint's model.lora.*, or, to train the whole model on from "
                              f"the adapted one, {merged}.")
    changes = []
    if old.rank != new.rank:
        changes.append(f"model.lora.rank {old.rank} -> {new.rank} (the trained A and B have rank {old.rank})")
    if old.alpha != new.alpha:
        changes.append(f"model.lora.alpha {old.alpha:g} -> {new.alpha:g} (the adapters' scale alpha / rank, and so "
                       f"the model, would change)")
    before, after = set(old.target_names()), set(new.target_names())
    if before != after:
        dropped, added = sorted(before - after), sorted(after - before)
        what = ([f"the trained adapters of {', '.join(dropped)} would be dropped"] if dropped else []) + \
            ([f"adapters of {', '.join(added)} would start from zero beside trained ones"] if added else [])
        changes.append(f"model.lora.targets [{','.join(old.targets)}] -> [{','.join(new.targets)}] "
                       f"({'; '.join(what)})")
    if changes:
        raise CheckpointError(f"{where}: this resume changes the run's adapters: {'; '.join(changes)}. Resume with "
                              f"the checkpoint's model.lora.* ({_lora_text(old)}); for other adapters start "
                              f"another train.run_dir (checkpoint.load=the same base), or {merged} to train new "
                              f"adapters on the adapted model.")
