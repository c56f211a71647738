"""A run's config with `checkpoint.load`: the model is the checkpoint's.

A checkpoint's meta holds the resolved config it was saved with (a training run's, or the one
`megajax import` wrote from the Hugging Face or Megatron files; a Megatron checkpoint's saved args
and a Hugging Face directory's config.json are read the same way), so a run loading it needs no
`model.*` key: those it does not set come from the checkpoint, and so does `data.tokenizer` when
it is not set (the vocabulary belongs to it). One it sets must agree with the checkpoint, except
the keys that change how the model trains rather than what its parameters compute
(TRAINING_KEYS), the vocabulary keys with `checkpoint.resize_vocab=true`, and
`model.max_position_embeddings` of a RoPE model (no parameter depends on it).
"""

from __future__ import annotations

import dataclasses

from megajax.config import Config, ModelConfig, _build, _deep_merge, finalize, merge_sources
from megajax.errors import CheckpointError

# The optimizer's defaults when checkpoint.load names a released model (a Hugging Face directory, a Megatron
# checkpoint, or one `megajax import` wrote) and the run sets none of these keys: a peak learning rate for
# fine-tuning, not pretraining's 2e-3 (transformers' SFT trainer and torchtune start full fine-tuning at
# 2e-5, LoRA at 2e-4), no weight decay, no warm-up from 0 to waste a short run's first steps.
FINE_TUNING_OPTIM = {"lr": 2e-5, "weight_decay": 0.0, "warmup_steps": 0}
FINE_TUNING_LORA_LR = 2e-4

TRAINING_KEYS = frozenset({"hidden_dropout", "attention_dropout", "init_std", "attention_impl", "matmul_impl",
                           "moe_grouped_gemm_impl",
                           "scan_layers", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_expert_capacity_factor",
                           "moe_router_bias_update_rate", "lora"})
VOCABULARY_KEYS = frozenset({"vocab_size", "make_vocab_size_divisible_by"})


def is_megatron_load(load: str) -> bool:
    """Whether checkpoint.load names a Megatron checkpoint (legacy or torch_dist) rather than a megajax one."""
    from pathlib import Path
    from megajax.checkpoint.manager import find_step_dir
    from megajax.checkpoint.megatron import is_megatron_checkpoint
    return find_step_dir(load) is None and Path(load).expanduser().is_dir() and is_megatron_checkpoint(load)


def is_hf_load(load: str) -> bool:
    """Whether checkpoint.load names a Hugging Face model directory (config.json and safetensors)."""
    from megajax.checkpoint.hf import is_hf_dir
    from megajax.checkpoint.manager import find_step_dir
    return find_step_dir(load) is None and is_hf_dir(load)


def _fine_tuning_defaults(cfg: Config, merged: dict, released: str | None) -> str | None:
    """Sets FINE_TUNING_OPTIM's values on the optim.* keys the run's files and overrides leave unset, when
    checkpoint.load names a `released` model (what it is, else None); the line that says so, or None."""
    if released is None:
        return None
    given = merged.get("optim") if isinstance(merged.get("optim"), dict) else {}
    values = dict(FINE_TUNING_OPTIM, lr=FINE_TUNING_LORA_LR if cfg.model.lora is not None else FINE_TUNING_OPTIM["lr"])
    chosen = {k: v for k, v in values.items() if given.get(k) is None}
    if not chosen:
        return None
    pretraining = {k: getattr(cfg.optim, k) for k in chosen}
    for k, v in chosen.items():
        setattr(cfg.optim, k, v)
    said = ", ".join(f"optim.{k}={v:g}" for k, v in chosen.items())
    return (f"checkpoint.load names a released model ({released}): fine-tuning defaults {said}"
            f"{' (LoRA)' if cfg.model.lora is not None else ''} in place of pretraining's "
            f"{', '.join(f'{v:g}' for v in pretraining.values())}; set any of them to choose.")


def train_config(files: list[str] | None = None, overrides: list[str] | None = None,
                 notes: list[str] | None = None) -> Config:
    """`load_config(files, overrides)`, with the model of checkpoint.load's checkpoint under the keys set,
    and, for a released model, the optimizer's fine-tuning defaults (FINE_TUNING_OPTIM) under the optim.*
    keys the run leaves unset (a line saying so appended to `notes`).

    CheckpointError naming each `model.*` key set that contradicts the checkpoint, with both values."""
    merged = merge_sources(files, overrides)
    section = merged.get("checkpoint")
    load = section.get("load") if isinstance(section, dict) else None
    if not load:
        return finalize(_build(Config, merged, ""))
    from megajax.checkpoint.manager import find_step_dir, read_meta  # JAX: only when a checkpoint is read
    step_dir = find_step_dir(str(load))  # any step: a run's steps share one model
    meta = read_meta(step_dir) if step_dir is not None else {}
    saved = meta.get("config", {})
    if "lora_base" in meta or (saved.get("model") or {}).get("lora"):
        raise CheckpointError(f"checkpoint.load = {str(load)!r} ({step_dir}) holds LoRA adapters, not a whole model "
                              f"(checkpoint.load names the model a run starts from). To train these adapters on, "
                              f"resume their run (its train.run_dir); to start from the adapted model, export it "
                              f"merged (megajax export --format hf --merge-lora --checkpoint {load} --output DIR) "
                              f"and set checkpoint.load=DIR; to train other adapters on the same base, set "
                              f"checkpoint.load to that base ({(meta.get('lora_base') or {}).get('path', 'the base')}).")
    released = "a checkpoint megajax import wrote" if meta.get("imported") else None
    if step_dir is None and is_megatron_load(str(load)):  # the model from its saved args
        from megajax.checkpoint.megatron import megatron_config
        from megajax.config import CheckpointConfig
        trust = _build(CheckpointConfig, {"trust_load": section.get("trust_load", False)}, "checkpoint").trust_load
        model, tokenizer = megatron_config(str(load), trust=trust)
        saved, step_dir = {"model": model, "data": {"tokenizer": tokenizer}}, f"a Megatron checkpoint's args"
        released = "a Megatron checkpoint"
    elif step_dir is None and is_hf_load(str(load)):  # the model from its config.json, the tokenizer beside it
        from megajax.checkpoint.common import imported_tokenizer
        from megajax.checkpoint.hf import hf_model_overrides, hf_tokenizer
        model = hf_model_overrides(str(load))
        found, known = hf_tokenizer(str(load))
        tokenizer, _ = imported_tokenizer(found, model["vocab_size"], known)  # a placeholder fails naming it
        saved, step_dir = {"model": model, "data": {"tokenizer": tokenizer}}, "a Hugging Face model's config.json"
        released = "a Hugging Face model directory"
    stored = saved.get("model")
    if not isinstance(stored, dict):
        return finalize(_build(Config, merged, ""))
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    stored = {k: v for k, v in stored.items() if k in names}  # keys of older versions dropped
    user = merged.get("model") if isinstance(merged.get("model"), dict) else {}
    set_keys = [k for k, v in user.items() if v is not None]
    inherited: dict = {"model": {**stored, **{k: user[k] for k in set_keys}}}
    # The vocabulary goes with the tokenizer: the checkpoint's unless the run names another, whose
    # vocabulary is then compared with the checkpoint's when it is read (checkpoint/vocab.py).
    data = merged.get("data") if isinstance(merged.get("data"), dict) else {}
    stored_tokenizer = saved.get("data", {}).get("tokenizer")
    if data.get("tokenizer") is None and stored_tokenizer:
        inherited["data"] = {"tokenizer": stored_tokenizer}
    elif data.get("tokenizer") != stored_tokenizer and "vocab_size" not in set_keys and stored_tokenizer is not None:
        inherited["model"].pop("vocab_size", None)
    cfg = _build(Config, _deep_merge(merged, inherited), "")
    theirs = _build(ModelConfig, stored, "model")
    free = set(TRAINING_KEYS) | (VOCABULARY_KEYS if cfg.checkpoint.resize_vocab else set())
    if theirs.position_embedding == "rope":
        free.add("max_position_embeddings")
    clashes = [(k, getattr(cfg.model, k), getattr(theirs, k)) for k in set_keys
               if k in names and k not in free and getattr(cfg.model, k) != getattr(theirs, k)]
    if clashes:
        listed = "; ".join(f"model.{k}={mine!r} but the checkpoint has model.{k}={ckpt!r}" for k, mine, ckpt in clashes)
        vocabulary = any(k in VOCABULARY_KEYS for k, _, _ in clashes)
        raise CheckpointError(f"checkpoint.load = {str(load)!r} ({step_dir}) holds another model than this run "
                              f"sets: {listed}. Leave model.* keys out (the model comes from the checkpoint) or "
                              f"set them to the checkpoint's values"
                              f"{'; another vocabulary needs checkpoint.resize_vocab=true' if vocabulary else ''}.")
    note = _fine_tuning_defaults(cfg, merged, released)
    if note is not None and notes is not None:
        notes.append(note)
    return finalize(cfg)
