"""A model ready to generate: a megajax checkpoint (or a Hugging Face directory) on a mesh.

    generation_config(checkpoint=DIR | hf=DIR, overrides) -> Config      (no JAX devices touched)
    load_model(cfg, checkpoint=DIR | hf=DIR) -> LoadedModel(generator, tokenizer, plan, ...)

The config is the checkpoint's own (model, tokenizer, precision; with LoRA adapters the tokenizer
that goes with them, checkpoint/lora.py adapter_tokenizer), with its mesh: a model
trained with tensor parallelism generates with the same `mesh.tensor` (and `mesh.fsdp`), the
batch over `data` taking the remaining devices; `mesh.*` overrides choose another layout. The
mesh is built through the run plan like training's, and parameters are read straight into
their shardings (Orbax, one process reading only what its devices hold).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import jax

from megajax.config import MESH_AXES, Config, load_config
from megajax.errors import CheckpointError, MeshError

SINGLE_LAYOUT_AXES = ("pipeline", "expert", "context")  # axes generation does not use


@dataclass
class Source:
    """Where the weights come from: a megajax checkpoint (step directory) or a Hugging Face directory."""
    step_dir: Path | None = None
    hf_dir: Path | None = None
    hf_import: tuple | None = None  # import_hf's (model overrides, float32 numpy params)
    adapter: Path | None = None  # LoRA adapters merged in at load: a megajax LoRA checkpoint or a PEFT directory

    @property
    def name(self) -> str:
        """The run's (or Hugging Face directory's) name: `run` for run/checkpoints/200."""
        path = Path(self.step_dir or self.hf_dir).absolute()
        if self.step_dir is not None and path.parent.name == "checkpoints":
            path = path.parent.parent
        return path.name


def find_source(checkpoint: str | None, hf: str | None, step: int | None = None, adapter: str | None = None) -> Source:
    """The (verified) step directory of --checkpoint (its latest step, or `step`: checkpoint.step), or
    the Hugging Face directory --hf, imported; with --adapter DIR (or a --checkpoint holding LoRA
    adapters, whose recorded base is then the model) the adapters to merge in."""
    from megajax.checkpoint.manager import read_meta, require_step_dir
    if bool(checkpoint) == bool(hf):
        raise CheckpointError("give the model as --checkpoint DIR (a megajax run or checkpoint directory) or "
                              "--hf DIR (a Hugging Face model directory), one of them.")
    if adapter is not None and not Path(adapter).is_dir():
        raise CheckpointError(f"--adapter {adapter!r}: not a directory (a megajax LoRA checkpoint or a PEFT adapter "
                              f"directory with adapter_config.json).")
    if adapter is not None and (Path(adapter) / "adapter_config.json").is_file():
        from megajax.checkpoint.peft_files import read_peft_config
        read_peft_config(adapter)  # a PEFT config that cannot be read is refused before the base model is
    if checkpoint:
        step_dir = require_step_dir(checkpoint, "--checkpoint", step)
        meta = read_meta(step_dir)
        ref = meta.get("lora_base")
        if ref is None and not (meta.get("config", {}).get("model") or {}).get("lora"):
            return Source(step_dir=step_dir, adapter=None if adapter is None else Path(adapter))
        if adapter is not None:
            raise CheckpointError(f"--checkpoint {checkpoint} holds LoRA adapters itself; give its base as "
                                  f"--checkpoint and the adapters as --adapter, or this checkpoint alone.")
        from megajax.checkpoint.lora_base import verified_base
        ref = verified_base(ref, f"--checkpoint {checkpoint}")  # the base is there, unchanged, and saved
        if ref["format"] == "hf":  # trained on checkpoint.load=<Hugging Face directory>
            from megajax.checkpoint.hf import import_hf
            d = Path(ref["path"])
            return Source(hf_dir=d, hf_import=import_hf(d), adapter=step_dir)
        if ref["format"] != "megajax":
            raise CheckpointError(f"--checkpoint {checkpoint}: its adapters' base is the Megatron checkpoint "
                                  f"{ref['path']}; import it (megajax import --format megatron), then name it with "
                                  f"--checkpoint and these adapters with --adapter.")
        return Source(step_dir=require_step_dir(ref["path"], "the adapters' base model"), adapter=step_dir)
    if step is not None:
        raise CheckpointError(f"checkpoint.step={step} selects a step of a megajax checkpoint (--checkpoint DIR); "
                              f"a Hugging Face directory (--hf {hf}) has none.")
    from megajax.checkpoint.hf import import_hf
    d = Path(hf).expanduser()
    if not (d / "config.json").is_file():
        raise CheckpointError(f"--hf {hf!r}: not a Hugging Face model directory (no config.json there).")
    return Source(hf_dir=d, hf_import=import_hf(d), adapter=None if adapter is None else Path(adapter))


def _hf_base(source: Source) -> dict:
    """The config an import would record: the model from config.json, the directory's tokenizer."""
    from megajax.checkpoint.common import imported_tokenizer
    from megajax.checkpoint.hf import hf_tokenizer
    model = dict(source.hf_import[0])
    found, known = hf_tokenizer(source.hf_dir)
    # Without a tokenizer megajax can read, the placeholder fails to load, naming data.tokenizer
    # (an override data.tokenizer=PATH replaces it).
    tokenizer, _ = imported_tokenizer(found, model["vocab_size"], known)
    seq_len = min(model.get("max_position_embeddings") or 2048, 2048)
    return {"model": model, "data": {"tokenizer": tokenizer}, "train": {"seq_len": seq_len}}


def generation_config(source: Source, overrides: Sequence[str] = ()) -> Config:
    """The config a generation runs with (see the module docstring); `overrides` are key=value."""
    if source.step_dir is not None:
        from megajax.checkpoint.manager import read_meta
        base = copy.deepcopy(read_meta(source.step_dir)["config"])
    else:
        base = _hf_base(source)
    if source.adapter is not None:  # the adapters' tokenizer (a fine-tuning's chat template), else the base's
        from megajax.checkpoint.lora import adapter_tokenizer
        tokenizer = adapter_tokenizer(source.adapter)
        if tokenizer is not None:
            base.setdefault("data", {})["tokenizer"] = tokenizer
    saved = base.get("mesh", {})
    base["mesh"] = {"data": -1, "fsdp": saved.get("fsdp", 1), "tensor": saved.get("tensor", 1),
                    "cpu_devices": saved.get("cpu_devices", 0)}
    base.setdefault("parallel", {})["sequence_parallel"] = False  # one token per step: nothing to split
    base.setdefault("checkpoint", {}).update(load="", step=None)  # the run's own, not this read's
    return load_config(base=base, overrides=list(overrides))


@dataclass
class LoadedModel:
    generator: Any  # megajax.inference.generate.Generator
    tokenizer: Any
    cfg: Config
    mesh_text: str
    name: str  # the run's name (the served model's id)
    path: str  # the step (or Hugging Face) directory read
    notes: list[str] = field(default_factory=list)


def _plan(cfg: Config, devices: list, user_mesh: bool):
    """The run plan on `devices`; when the checkpoint's own layout does not fit them (and the user
    chose none), data parallelism over all of them instead, with a note."""
    from megajax.plan import make_plan
    cfg = copy.deepcopy(cfg)
    for axis in SINGLE_LAYOUT_AXES:
        if getattr(cfg.mesh, axis) != 1:
            raise MeshError(f"mesh.{axis}={getattr(cfg.mesh, axis)}: generation does not use {axis} "
                            f"parallelism; set mesh.{axis}=1 (the batch goes over data, heads over tensor).")
    cfg.train.global_batch, cfg.train.micro_batch = len(devices), None  # no training batch: any layout fits
    try:
        return make_plan(cfg, len(devices)), []
    except MeshError as e:
        if user_mesh:
            raise
        kept = {a: getattr(cfg.mesh, a) for a in ("tensor", "fsdp") if getattr(cfg.mesh, a) != 1}
        for a in MESH_AXES:
            setattr(cfg.mesh, a, -1 if a == "data" else 1)
        note = (f"note: the checkpoint's layout ({', '.join(f'mesh.{a}={v}' for a, v in kept.items())}) does not "
                f"fit {len(devices)} devices ({e}); generating with data parallelism over all of them.")
        return make_plan(cfg, len(devices)), [note]


def load_model(cfg: Config, source: Source, *, devices: list | None = None, user_mesh: bool = False) -> LoadedModel:
    """Builds the mesh, reads the parameters into their shardings and returns a ready Generator."""
    from megajax.checkpoint.manager import restore_expert_bias, restore_params
    from megajax.inference.generate import Generator, generation_model
    from megajax.mesh import even_sharding, mesh_from_sizes, tree_shardings
    from megajax.models.layout import split_expert_bias
    from megajax.precision.policy import precision_policy
    devices = list(devices if devices is not None else jax.devices())
    plan, notes = _plan(cfg, devices, user_mesh)
    mesh = mesh_from_sizes(plan.ici, plan.dcn, devices)
    dtype = precision_policy(plan.cfg).inference_dtype
    _, axes, abstract = generation_model(plan.model, plan.padded_vocab, dtype)
    # whole over an axis that does not divide a dim (a train state stores such a split padded)
    shardings = jax.tree.map(lambda sh, a: even_sharding(sh, a.shape), tree_shardings(mesh, axes, plan.rules.params),
                             abstract)
    if source.step_dir is not None:
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
        params, note = restore_params(source.step_dir, target, plan.cfg)
        notes += [note] if note else []
        expert_bias = restore_expert_bias(source.step_dir, plan.cfg)
    else:
        # the routers' expert bias (DeepSeek-V3's e_score_correction_bias) is imported beside the
        # parameters (layout.EXPERT_BIAS); Mixtral and Qwen3-MoE have none
        numpy_params, expert_bias = split_expert_bias(source.hf_import[1])
        params = jax.tree.map(lambda x, s: jax.device_put(x, s), numpy_params, shardings)
    if source.adapter is not None:
        from megajax.checkpoint.lora import merge_adapter
        params, note = merge_adapter(params, source.adapter, plan.model, base=source.step_dir or source.hf_dir)
        notes.append(note)
    generator = Generator(plan.model, params, padded_vocab_size=plan.padded_vocab, dtype=dtype, mesh=mesh,
                          rules=plan.rules.activations, eod_id=getattr(plan.tokenizer, "eod_id", None),
                          expert_bias=expert_bias)
    return LoadedModel(generator=generator, tokenizer=plan.tokenizer, cfg=plan.cfg, mesh_text=plan.mesh_text(),
                       name=source.name, path=str(source.step_dir or source.hf_dir), notes=notes)
