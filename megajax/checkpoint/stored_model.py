"""A run's config with `checkpoint.load`: the model is the checkpoint's.

A checkpoint's meta holds the resolved config it was saved with (a training run's, or the one
`megajax import` wrote from the Hugging Face or Megatron files), so a run loading it needs no
`model.*` key: those it does not set come from the checkpoint. One it sets must agree with the
checkpoint, except the keys that change how the model trains rather than what its parameters
compute (TRAINING_KEYS), the vocabulary keys with `checkpoint.resize_vocab=true`, and
`model.max_position_embeddings` of a RoPE model (no parameter depends on it).
"""

from __future__ import annotations

import dataclasses

from megajax.config import Config, ModelConfig, _build, _deep_merge, finalize, merge_sources
from megajax.errors import CheckpointError

TRAINING_KEYS = frozenset({"hidden_dropout", "attention_dropout", "init_std", "attention_impl", "matmul_impl",
                           "scan_layers", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_expert_capacity_factor",
                           "moe_router_bias_update_rate"})
VOCABULARY_KEYS = frozenset({"vocab_size", "make_vocab_size_divisible_by"})


def train_config(files: list[str] | None = None, overrides: list[str] | None = None) -> Config:
    """`load_config(files, overrides)`, with the model of checkpoint.load's checkpoint under the keys set.

    CheckpointError naming each `model.*` key set that contradicts the checkpoint, with both values."""
    merged = merge_sources(files, overrides)
    section = merged.get("checkpoint")
    load = section.get("load") if isinstance(section, dict) else None
    if not load:
        return finalize(_build(Config, merged, ""))
    from megajax.checkpoint.manager import find_step_dir, read_meta  # JAX: only when a checkpoint is read
    step_dir = find_step_dir(str(load))  # any step: a run's steps share one model
    stored = read_meta(step_dir).get("config", {}).get("model") if step_dir is not None else None
    if not isinstance(stored, dict):
        return finalize(_build(Config, merged, ""))
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    stored = {k: v for k, v in stored.items() if k in names}  # keys of older versions dropped
    user = merged.get("model") if isinstance(merged.get("model"), dict) else {}
    set_keys = [k for k, v in user.items() if v is not None]
    cfg = _build(Config, _deep_merge(merged, {"model": {**stored, **{k: user[k] for k in set_keys}}}), "")
    theirs = _build(ModelConfig, stored, "model")
    free = set(TRAINING_KEYS) | (VOCABULARY_KEYS if cfg.checkpoint.resize_vocab else set())
    if theirs.position_embedding == "rope":
        free.add("max_position_embeddings")
    clashes = [(k, getattr(cfg.model, k), getattr(theirs, k)) for k in set_keys
               if k in names and k not in free and getattr(cfg.model, k) != getattr(theirs, k)]
    if clashes:
        listed = "; ".join(f"model.{k}={mine!r} but the checkpoint has model.{k}={ckpt!r}" for k, mine, ckpt in clashes)
        raise CheckpointError(f"checkpoint.load = {str(load)!r} ({step_dir}) holds another model than this run "
                              f"sets: {listed}. Leave model.* keys out (the model comes from the checkpoint) or "
                              f"set them to the checkpoint's values"
                              f"{'; a vocabulary change needs checkpoint.resize_vocab=true' if set(k for k, _, _ in clashes) & VOCABULARY_KEYS else ''}.")
    return finalize(cfg)
