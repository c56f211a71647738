"""The frozen base of a LoRA checkpoint: what a run records of it, and the one check every reader makes.

A LoRA checkpoint holds adapters, not a model: W' = W + s A B needs the W the adapters were trained
on. Every checkpoint of a run with model.lora records that base (`lora_base` in its meta,
`base_reference`): a megajax step directory with the SHA-256 of its file record, a Hugging Face or
Megatron directory with a fingerprint of its files (names, sizes, and sampled bytes of each: a
model saved over the old one at the same place changes it), or the seed of a base initialised from
train.seed. Resuming the run, generating or serving from the checkpoint, and exporting it (merged
or as PEFT) all go through `verified_base`: a base that is gone or has changed since the adapters
were trained is refused, naming it, the same way everywhere.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from megajax.errors import CheckpointError

SAMPLES = 16  # blocks read per file for a directory's fingerprint, spread evenly over it
BLOCK = 4096
HEAD = 1 << 16  # a file's first bytes (a safetensors header: its tensor names, dtypes, shapes, offsets)
MAX_FILES = 100_000  # a directory with more is not a model directory: fingerprinted by its first ones


def base_reference(cfg) -> dict:
    """What a LoRA checkpoint records of its frozen base (`lora_base` in its metadata): checkpoint.load
    resolved (a megajax step directory with the SHA-256 of its file record; a Hugging Face or Megatron
    directory with its fingerprint), or, for a base initialised from train.seed, the seed."""
    from megajax.checkpoint.manager import require_step_dir
    from megajax.checkpoint.stored_model import is_hf_load, is_megatron_load
    load = cfg.checkpoint.load
    if not load:
        return {"seed": cfg.train.seed}
    path = Path(load).expanduser().absolute()
    if is_megatron_load(str(load)):
        return {"path": str(path), "format": "megatron", "fingerprint": fingerprint(path)}
    if is_hf_load(str(load)):
        return {"path": str(path), "format": "hf", "fingerprint": fingerprint(path, hf=True)}
    source = require_step_dir(load, "checkpoint.load", None)
    return {"path": str(source.absolute()), "format": "megajax", "files_sha256": files_digest(source)}


def files_digest(step_dir: Path) -> str | None:
    """SHA-256 of a megajax step's file record (names and sizes, megajax/checkpoint/integrity.py), None
    without one."""
    record = Path(step_dir) / "files.json"
    return hashlib.sha256(record.read_bytes()).hexdigest() if record.is_file() else None


def _model_files(d: Path, hf: bool) -> list[Path]:
    if hf:  # what a Hugging Face model is: its config and its weights
        names = [p for p in d.iterdir() if p.is_file() and (p.name in ("config.json", "model.safetensors.index.json")
                                                            or p.name.endswith(".safetensors"))]
        return sorted(names)
    out = []
    for root, dirs, files in os.walk(d):
        dirs.sort()
        out += [Path(root) / f for f in sorted(files)]
        if len(out) >= MAX_FILES:
            break
    return out[:MAX_FILES]


def fingerprint(path, hf: bool = False) -> str:
    """SHA-256 over a model directory's files (a Hugging Face one's config.json and safetensors; every file
    of a Megatron one): each file's name, size, first 64 KiB and 16 blocks of 4 KiB spread over it. It
    reads about 130 KiB per file, whatever the model's size, and changes when a file is added, removed,
    resized, or another model is saved in its place (its header or its values differ)."""
    d = Path(path)
    h = hashlib.sha256()
    for f in _model_files(d, hf):
        size = f.stat().st_size
        h.update(f"{f.relative_to(d).as_posix()}\0{size}\0".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(HEAD))
            for k in range(SAMPLES):
                fh.seek(size * k // SAMPLES)
                h.update(fh.read(BLOCK))
    return h.hexdigest()


def _seed_text(ref: dict | None) -> str:
    if not ref:
        return "not recorded"
    if "seed" in ref:
        return f"a model initialised from train.seed={ref['seed']}, never saved"
    return f"{ref.get('path')} ({ref.get('format')})"


def verified_base(ref: dict | None, where: str, *, seed_ok: bool = False) -> dict:
    """The base reference `ref` (a LoRA checkpoint's `lora_base`), checked: recorded, still there and
    unchanged since the adapters were trained on it (the file record's SHA-256 of a megajax step, the
    fingerprint of a Hugging Face or Megatron directory). `seed_ok`: a base initialised from train.seed
    is accepted (training re-creates it); readers outside training need a saved base.
    CheckpointError naming `where`, the base and what differs, otherwise."""
    if not ref:
        raise CheckpointError(f"{where}: a checkpoint with model.lora must name its base model (`lora_base` in its "
                              f"metadata); this one does not.")
    if "seed" in ref:
        if seed_ok:
            return ref
        raise CheckpointError(f"{where} holds LoRA adapters whose base is {_seed_text(ref)}; exporting, generating "
                              f"or serving them needs a base saved as a megajax checkpoint or a Hugging Face "
                              f"directory (train the adapters with checkpoint.load=BASE).")
    path = Path(ref["path"])
    if not path.exists():
        raise CheckpointError(f"{where}: its frozen base model {path} does not exist any more; the adapters need "
                              f"the base they were trained on.")
    fmt = ref.get("format")
    if fmt == "megajax":
        from megajax.checkpoint.manager import verify_step
        digest = files_digest(verify_step(path))
        if ref.get("files_sha256") and digest != ref["files_sha256"]:
            raise CheckpointError(f"{where}: its frozen base model {path} has changed since the adapters were trained "
                                  f"(file record SHA-256 {digest}, recorded {ref['files_sha256']}); the adapters "
                                  f"belong to the base they were trained on.")
        return ref
    if fmt in ("hf", "megatron"):
        if fmt == "hf" and not (path / "config.json").is_file():
            raise CheckpointError(f"{where}: its frozen base, the Hugging Face model {path}, is not there any more "
                                  f"(no config.json); the adapters need the base they were trained on.")
        if ref.get("fingerprint"):  # recorded since fingerprints exist
            now = fingerprint(path, hf=fmt == "hf")
            if now != ref["fingerprint"]:
                raise CheckpointError(f"{where}: its frozen base model {path} has changed since the adapters were "
                                      f"trained (its files' fingerprint {now}, recorded {ref['fingerprint']}: "
                                      f"another model, or other weights, saved in its place); the adapters belong "
                                      f"to the base they were trained on.")
        return ref
    raise CheckpointError(f"{where}: its base model's record {ref} names no format megajax knows.")


def base_source(ref: dict | None, where: str) -> tuple[Path, object]:
    """(the base's directory, a TensorSource of its parameters) of a LoRA checkpoint's `lora_base`, verified
    (verified_base): a megajax step directory, or a Hugging Face model directory (read whole into host
    memory). What an export or a PEFT export of the adapters reads."""
    from megajax.checkpoint.manager import CheckpointSource
    ref = verified_base(ref, where)
    if ref["format"] == "hf":
        from megajax.checkpoint.common import resolved_model
        from megajax.checkpoint.hf import import_hf
        from megajax.checkpoint.source import DictSource
        overrides, params = import_hf(ref["path"])
        return Path(ref["path"]), DictSource(params, resolved_model(overrides))
    if ref["format"] != "megajax":
        raise CheckpointError(f"{where} holds LoRA adapters whose base is the Megatron checkpoint {ref['path']}; "
                              f"exporting, generating or serving them needs a base saved as a megajax checkpoint "
                              f"(megajax import --format megatron) or a Hugging Face directory.")
    return Path(ref["path"]), CheckpointSource(ref["path"], key="the adapters' base model")
