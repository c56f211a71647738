"""Orbax checkpoints of the full train state: async saves, exact resume, restore onto any mesh.

Layout: `<run_dir>/checkpoints/<step>/{state,meta}`. `state` is the
TrainState (parameters, optimizer state, step, loss scale, RNG) written by
Orbax; `meta` is JSON: step, consumed samples (the data position), the
resolved config, the mesh it was saved on. Orbax writes each save to a
temporary directory and renames it on commit, so an interrupted save never
damages the last good checkpoint; the last `checkpoint.keep` are kept.

Restoring reads each array with TensorStore straight into the target
sharding (`make_array_from_callback`: every process reads only the pieces
its devices hold), so a checkpoint restores onto any mesh. Dimensions that
differ only by vocabulary padding (which depends on the tensor size) are
cropped or zero-padded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np

from megajax.checkpoint.source import flatten
from megajax.config import Config, ModelConfig, _build, finalize
from megajax.errors import CheckpointError

STATE, META = "state", "meta"
CHUNK_BYTES = 16 * 2**20


def _key_name(entry) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def leaf_names(tree: Any) -> list[str]:
    """Orbax's '.'-joined storage name of every leaf of a pytree, in flattening order."""
    return [".".join(_key_name(e) for e in path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


class Checkpointer:
    """Saves train states under `directory/<step>` (async), keeps the last `keep`."""

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
        import orbax.checkpoint as ocp
        self.directory = Path(directory).absolute()
        self._ocp = ocp
        self._manager = ocp.CheckpointManager(
            self.directory, item_names=(STATE, META),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                                 create=True))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: Any, meta: dict, *, wait: bool = False) -> None:
        ocp = self._ocp
        # Chunks of at most CHUNK_BYTES, so that exporters and restores read a layer (a piece of a
        # stacked tensor) without loading the whole tensor.
        save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES), state)
        self._manager.save(step, args=ocp.args.Composite(**{
            STATE: ocp.args.StandardSave(state, save_args=save_args), META: ocp.args.JsonSave(meta)}),
            force=True)
        if wait:
            self._manager.wait_until_finished()

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


# ----------------------------------------------------------------------------
# Finding and reading checkpoints
# ----------------------------------------------------------------------------

def _committed_steps(directory: Path) -> list[int]:
    steps = []
    for d in directory.iterdir() if directory.is_dir() else []:
        if d.name.isdigit() and (d / STATE).is_dir() and (d / META).is_dir():
            steps.append(int(d.name))
    return sorted(steps)


def find_step_dir(path: str | Path) -> Path | None:
    """A step directory from a run directory (latest step), its checkpoints/ directory, or a step directory."""
    path = Path(path)
    if (path / STATE).is_dir() and (path / META).is_dir():
        return path
    for directory in (path / "checkpoints", path):
        steps = _committed_steps(directory)
        if steps:
            return directory / str(steps[-1])
    return None


def require_step_dir(path: str | Path, key: str) -> Path:
    step_dir = find_step_dir(path)
    if step_dir is None:
        raise CheckpointError(f"{key} = {str(path)!r}: no megajax checkpoint there (expected a run directory "
                              f"with checkpoints/<step>/, a checkpoints/ directory, or one step's directory "
                              f"holding state/ and meta/).")
    return step_dir


def read_meta(step_dir: Path) -> dict:
    files = [p for p in (step_dir / META).iterdir() if p.is_file() and p.name != "commit_success.txt"]
    for f in files:
        try:
            return json.loads(f.read_text())
        except ValueError:
            continue
    raise CheckpointError(f"checkpoint {step_dir}: its meta/ holds no readable JSON metadata.")


def model_config_of(step_dir: Path) -> ModelConfig:
    """The (resolved) model config a checkpoint was saved with."""
    meta = read_meta(step_dir)
    cfg = _build(Config, meta["config"], "")
    finalize(cfg)
    return cfg.model


class StoredArrays:
    """TensorStore views of the arrays of a checkpoint's state, by storage name."""

    def __init__(self, step_dir: Path):
        import tensorstore as ts
        self.step_dir, self._ts, self._open = step_dir, ts, {}
        meta_file = step_dir / STATE / "_METADATA"
        try:
            tree = json.loads(meta_file.read_text())["tree_metadata"]
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"checkpoint {step_dir}: cannot read {meta_file} ({e}); the save may "
                                  f"not have completed.") from None
        self.names = {".".join(k["key"] for k in v["key_metadata"]) for v in tree.values()}

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def array(self, name: str):
        if name not in self._open:
            spec = {"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{self.step_dir / STATE}",
                                                  "path": name}}
            try:
                self._open[name] = self._ts.open(spec, read=True).result()
            except Exception as e:  # TensorStore raises ValueError with the storage detail
                raise CheckpointError(f"checkpoint {self.step_dir}: cannot open array {name} ({e}).") from None
        return self._open[name]

    def read(self, name: str, index: tuple = ()) -> np.ndarray:
        return self.array(name)[index].read().result()


def _fit(stored_shape: tuple, target_shape: tuple, name: str, where: Path) -> None:
    if len(stored_shape) != len(target_shape):
        raise CheckpointError(f"checkpoint {where}: {name} has shape {stored_shape} but this run expects "
                              f"{target_shape}; the model config differs from the checkpoint's.")
    for d, (s, t) in enumerate(zip(stored_shape, target_shape)):
        if s != t and not _is_vocab_dim(name, d):
            raise CheckpointError(f"checkpoint {where}: {name} has shape {tuple(stored_shape)} but this run "
                                  f"expects {tuple(target_shape)} (dim {d}); the model config differs from "
                                  f"the checkpoint's.")


def _is_vocab_dim(name: str, dim: int) -> bool:
    return (name.endswith("embed.embedding") and dim == 0) or (name.endswith("output") and dim == 1)


def read_into(stored: StoredArrays, name: str, target: jax.ShapeDtypeStruct) -> jax.Array:
    """One stored array placed with target.sharding; vocabulary padding cropped or zero-filled."""
    arr = stored.array(name)
    stored_shape = tuple(arr.shape)
    _fit(stored_shape, tuple(target.shape), name, stored.step_dir)

    def piece(index):
        index = tuple(index) + (slice(None),) * (len(target.shape) - len(index))
        want = [range(*i.indices(n)) for i, n in zip(index, target.shape)]
        out = np.zeros([len(r) for r in want], target.dtype)
        have = tuple(slice(r.start, min(r.stop, s)) for r, s in zip(want, stored_shape))
        if all(h.stop > h.start for h in have):
            data = np.asarray(arr[have].read().result())
            out[tuple(slice(0, h.stop - h.start) for h in have)] = data.astype(target.dtype)
        return out

    if not target.shape:
        return jax.device_put(np.asarray(arr.read().result(), target.dtype), target.sharding)
    return jax.make_array_from_callback(tuple(target.shape), target.sharding, piece)


def restore_state(step_dir: Path, target: Any) -> Any:
    """The checkpoint's train state laid out like `target` (a pytree of ShapeDtypeStructs with shardings)."""
    stored = StoredArrays(step_dir)
    names = leaf_names(target)
    missing = [n for n in names if n not in stored]
    if missing:
        raise CheckpointError(f"checkpoint {step_dir}: lacks {len(missing)} arrays this run needs, e.g. "
                              f"{missing[:3]}; it was saved with a different model, optimizer or precision "
                              f"(train.precision decides whether a loss scale is stored).")
    leaves, treedef = jax.tree.flatten(target)
    return jax.tree.unflatten(treedef, [read_into(stored, n, t) for n, t in zip(names, leaves)])


def restore_params(step_dir: Path, target_params: dict) -> dict:
    """Only the parameters (for fine-tuning with a fresh optimizer)."""
    stored = StoredArrays(step_dir)
    out = {}
    for name, t in flatten(target_params):
        key = "params." + name.replace("/", ".")
        if key not in stored:
            raise CheckpointError(f"checkpoint {step_dir}: has no parameter {name}; it was saved for a "
                                  f"different model.")
        out[name] = read_into(stored, key, t)
    from megajax.checkpoint.source import unflatten
    return unflatten(out)


class CheckpointSource:
    """TensorSource over a checkpoint's parameters, reading one tensor (or one layer) at a time."""

    def __init__(self, path: str | Path, key: str = "--checkpoint"):
        self.step_dir = require_step_dir(path, key)
        self.model = model_config_of(self.step_dir)
        self._stored = StoredArrays(self.step_dir)
        self._names = sorted(n[len("params."):].replace(".", "/") for n in self._stored.names
                             if n.startswith("params."))

    def names(self) -> list[str]:
        return list(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._stored.array("params." + name.replace("/", ".")).shape)

    def get(self, name: str, layer: int | None = None) -> np.ndarray:
        index = (layer,) if layer is not None else ()
        return np.asarray(self._stored.read("params." + name.replace("/", "."), index), np.float32)


def write_params_checkpoint(params: dict, cfg: Config, out_dir: str | Path, *, step: int = 0) -> Path:
    """An Orbax checkpoint holding only parameters (e.g. imported from Hugging Face or Megatron),
    for `checkpoint.load`. Written as `<out_dir>/checkpoints/<step>/`; returns that directory."""
    out_dir = Path(out_dir)
    if find_step_dir(out_dir) is not None:
        raise CheckpointError(f"--output {out_dir} already holds a megajax checkpoint; choose an empty "
                              f"directory.")
    device = jax.local_devices()[0]
    arrays = jax.tree.map(lambda x: jax.device_put(np.asarray(x, np.float32), device), params)
    ckpt = Checkpointer(out_dir / "checkpoints", keep=1, async_save=False)
    try:
        ckpt.save(step, {"params": arrays}, {"step": step, "consumed_samples": 0, "config": cfg.to_dict(),
                                              "imported": True}, wait=True)
    finally:
        ckpt.close()
    return out_dir / "checkpoints" / str(step)
