"""Orbax checkpoints of the full train state: async saves, exact resume, restore onto any mesh.

Layout: `<run_dir>/checkpoints/<step>/{state,meta}`. `state` is the
TrainState (parameters, optimizer state, step, loss scale, RNG) written by
Orbax; `meta` is JSON: step, consumed samples (the data position), the
resolved config, the mesh it was saved on. Orbax writes each save to a
temporary directory and renames it on commit, so an interrupted save never
damages the last good checkpoint; the last `checkpoint.keep` are kept.

Restoring goes through Orbax's public API with the target's shardings
(`PyTreeRestore` with one `ArrayRestoreArgs` per array carrying its
`NamedSharding`): every process reads only the pieces its devices hold, so a
checkpoint restores onto any mesh and any device count. Stored shapes depend
on the model alone (the vocabulary is padded independently of the mesh), so
such a restore is a plain read, except for the dims FSDP or the distributed
optimizer split over a data-parallel size that does not divide them: those are
stored zero-padded (megajax/mesh.py PADDED_AXES), the metadata records their
logical shapes (LOGICAL_SHAPES), and a restore crops or zero-pads them to its
own split as a reader crops them. The one sanctioned change is the vocabulary:
a checkpoint saved with another vocabulary is refused, naming both, unless
`checkpoint.resize_vocab` asks for its rows to be cropped or zero-padded.

Paths may be relative to the current directory: they are made absolute
before Orbax or TensorStore sees them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
from pathlib import Path
from typing import Any

import jax
import numpy as np

from megajax.checkpoint.integrity import check, read_failed, step_number, write_record
from megajax.checkpoint.vocab import VocabResize, check_vocabulary, zero_rows_from
from megajax.config import Config, ModelConfig, _build, finalize
from megajax.errors import CheckpointError
from megajax.mesh import padded_struct
from megajax.models.layout import expert_bias_rows, split_expert_bias

EXPERT_BIAS_STORED = "moe_expert_bias"  # TrainState.moe_expert_bias's stored name

STATE, META = "state", "meta"
CHUNK_BYTES = 16 * 2**20


def _key_name(entry) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _path_name(path) -> str:
    return ".".join(_key_name(e) for e in path)


def leaf_names(tree: Any) -> list[str]:
    """Orbax's '.'-joined storage name of every leaf of a pytree, in flattening order."""
    return [_path_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _save_args(ocp, path, x):
    """Chunks of at most CHUNK_BYTES and, for stacked `layers` tensors [layers, ...], of one layer
    each (Orbax's `shard_axes=(0,)` splits dim 0 first), so that reading one layer decodes that
    layer's chunks only. (Left to Orbax, the size limit alone splits the larger dims and keeps
    every layer in each chunk: a layer read would decode the whole tensor.)"""
    stacked = "layers" in (_key_name(e) for e in path) and getattr(x, "ndim", 0) >= 1
    return ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES, shard_axes=(0,) if stacked else ())


def _state_handler(ocp):
    """Orbax's handler for the train state (the format of its StandardSave). In one process, Orbax's
    replica-parallel writing, where each replica of a replicated array writes a slice of it, is
    turned off: the one process writes every slice anyway, and each slice is an eager device program
    per array shape (a small model's parity test on 8 CPU devices: 72 of its 76 compiles). Across processes,
    where the slices spread the writing over hosts, Orbax's default stays."""
    th = ocp.type_handlers
    kwargs = {"save_concurrent_gb": 96, "restore_concurrent_gb": 96}
    if jax.process_count() == 1:
        default = th.get_type_handler(jax.Array)
        arrays = th.ArrayHandler(
            use_replica_parallel=False,
            # keep the per-array metadata the default handler writes
            array_metadata_store=getattr(default, "_array_metadata_store", None))
        kwargs["type_handler_registry"] = th.create_type_handler_registry(
            *[(ty, arrays if ty is jax.Array else th.get_type_handler(ty)) for ty in th.supported_types()])
    return ocp.PyTreeCheckpointHandler(**kwargs)


class Checkpointer:
    """Saves train states under `directory/<step>` (async), keeps the last `keep`, and records each
    committed step's files (megajax/checkpoint/integrity.py) once its save has finished: at the next
    save, `wait` or `close`."""

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
        import orbax.checkpoint as ocp
        self.directory = Path(directory).absolute()
        self._ocp = ocp
        self._manager = ocp.CheckpointManager(
            self.directory, item_names=(STATE, META), item_handlers={STATE: _state_handler(ocp)},
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                                 create=True))
        self._unrecorded: list[int] = []

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: Any, meta: dict, *, wait: bool = False) -> None:
        ocp = self._ocp
        save_args = jax.tree_util.tree_map_with_path(lambda path, x: _save_args(ocp, path, x), state)
        self.wait()  # Orbax's save waits for the previous one anyway: record it first
        self._manager.save(step, args=ocp.args.Composite(**{
            STATE: ocp.args.PyTreeSave(state, save_args=save_args), META: ocp.args.JsonSave(meta)}),
            force=True)
        self._unrecorded.append(step)
        if wait:
            self.wait()

    def wait(self) -> None:
        self._manager.wait_until_finished()
        self._record()

    def _record(self) -> None:
        """Process 0 records the finished saves' files (after Orbax's commit, so every process's)."""
        steps, self._unrecorded = self._unrecorded, []
        if jax.process_index() != 0:
            return
        for step in steps:
            step_dir = self.directory / str(step)
            if (step_dir / STATE).is_dir():  # committed (and not yet removed by checkpoint.keep)
                write_record(step_dir)

    def close(self) -> None:
        self.wait()
        self._manager.close()


# ----------------------------------------------------------------------------
# Finding checkpoints and reading their metadata
# ----------------------------------------------------------------------------

def _committed_steps(directory: Path) -> list[int]:
    steps = []
    for d in directory.iterdir() if directory.is_dir() else []:
        if d.name.isdigit() and (d / STATE).is_dir() and (d / META).is_dir():
            steps.append(int(d.name))
    return sorted(steps)


def step_dirs(directory: Path) -> list[Path]:
    """The committed step directories under a checkpoints/ directory, oldest first."""
    return [directory / str(s) for s in _committed_steps(directory)]


def _is_step_dir(path: Path) -> bool:
    return (path / STATE).is_dir() and (path / META).is_dir()


def find_step_dir(path: str | Path, step: int | None = None) -> Path | None:
    """A step directory from a run directory (latest step, or `step`), its checkpoints/ directory, or a
    step directory; relative paths stay relative (they are made absolute only for reading).

    CheckpointError when `step` is given and the directory has no such step (naming those it has)."""
    path = Path(path)
    if _is_step_dir(path):
        if step is not None and step_number(path) != step:
            raise CheckpointError(f"checkpoint.step={step}, but {path} is the directory of step {path.name}; "
                                  f"name the run directory instead, or drop checkpoint.step.")
        return path
    for directory in (path / "checkpoints", path):
        steps = _committed_steps(directory)
        if not steps:
            continue
        if step is None:
            return directory / str(steps[-1])
        if step not in steps:
            raise CheckpointError(f"checkpoint.step={step}: {directory} has no checkpoint of step {step}; it "
                                  f"has step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}.")
        return directory / str(step)
    return None


def verify_step(step_dir: Path) -> Path:
    """`step_dir` when its files match the record written at save (or it has none); else the
    CheckpointError naming the damaged file and the newest intact step (integrity.py)."""
    check(Path(step_dir), step_dirs(Path(step_dir).parent))
    return step_dir


def require_step_dir(path: str | Path, key: str, step: int | None = None) -> Path:
    """The (verified) step directory `path` names, or `step` of it; a CheckpointError if none."""
    step_dir = find_step_dir(path, step)
    if step_dir is None:
        raise CheckpointError(f"{key} = {str(path)!r}: no megajax checkpoint there (expected a run directory "
                              f"with checkpoints/<step>/, a checkpoints/ directory, or one step's directory "
                              f"holding state/ and meta/; relative paths are read from {Path.cwd()}).")
    return verify_step(step_dir)


def set_aside_newer(step_dir: Path) -> tuple[list[int], Path]:
    """Moves the steps newer than `step_dir` (a run resumed from an older step with checkpoint.step) to
    `<run_dir>/checkpoints.superseded/`, out of the way of the steps the run saves again (Orbax saves
    no step that exists), kept rather than deleted. Every process calls it; process 0 moves.
    Returns (the steps moved, where to)."""
    step_dir = Path(step_dir).absolute()
    aside = step_dir.parent.parent / "checkpoints.superseded"
    newer = [d for d in step_dirs(step_dir.parent) if step_number(d) > step_number(step_dir)]
    if jax.process_index() == 0 and newer:
        aside.mkdir(exist_ok=True)
        for d in newer:
            target = aside / d.name
            while target.exists():
                target = target.with_name(target.name + ".old")
            os.replace(d, target)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("megajax: newer checkpoints set aside")
    return [int(d.name) for d in newer], aside


def _read_failed(step_dir: Path, error: BaseException) -> CheckpointError:
    return read_failed(Path(step_dir), error, step_dirs(Path(step_dir).parent))


def _drop_closed_loop_errors() -> None:
    """When a read fails, Orbax closes its event loop while TensorStore still completes the read's
    other futures: their callbacks print 'RuntimeError: Event loop is closed' tracebacks (through
    sys.excepthook or threading.excepthook), their coroutines 'Exception ignored in' ones
    (sys.unraisablehook) and their tasks 'Task exception was never retrieved' (the asyncio logger),
    around the user's one-paragraph error and even before it is raised. Those alone are dropped;
    installed before any read."""
    def stray(error: BaseException | None) -> bool:  # Orbax's read error, TensorStore's ('OUT_OF_RANGE: ...')
        text = str(error)
        return (text == "Event loop is closed" or text.startswith("Encountered error while reading array")
                or re.match(r"[A-Z][A-Z_]+: ", text) is not None)

    if getattr(sys.excepthook, "drops_stray_read_errors", False):
        return
    previous_hook, previous_unraisable, previous_thread = sys.excepthook, sys.unraisablehook, threading.excepthook

    def hook(kind, value, tb):  # the exception ending the program comes here too: never dropped
        if not stray(value) or _from_main(tb):
            previous_hook(kind, value, tb)

    def unraisable(info):
        if not stray(info.exc_value):
            previous_unraisable(info)

    def thread_hook(args):
        if not stray(args.exc_value):
            previous_thread(args)
    def logged(record: logging.LogRecord) -> bool:
        return not (record.exc_info and stray(record.exc_info[1]))
    hook.drops_stray_read_errors = True
    sys.excepthook, sys.unraisablehook, threading.excepthook = hook, unraisable, thread_hook
    logging.getLogger("asyncio").addFilter(logged)


def _from_main(tb) -> bool:
    """Whether a traceback runs through the program's __main__ module: the exception ending the program (a
    stray callback's traceback starts in the callback)."""
    while tb is not None:
        if tb.tb_frame.f_globals.get("__name__") == "__main__":
            return True
        tb = tb.tb_next
    return False


def _storage_error(error: BaseException) -> bool:
    """Orbax and TensorStore report unreadable files as these exact types (not their subclasses, which
    are programming errors: KeyError, TypeError, ...)."""
    return type(error) in (Exception, ValueError, RuntimeError) or isinstance(error, OSError)


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
    cfg = _build(Config, read_meta(step_dir)["config"], "")
    finalize(cfg)
    return cfg.model


def _state_dir(step_dir: Path) -> Path:
    return (Path(step_dir) / STATE).absolute()


# The metadata's record of the arrays stored padded: {storage name: logical shape}. A train state's
# dims split over the data-parallel axes are stored padded with zeros where their split does not
# divide them (megajax/mesh.py PADDED_AXES); a reader crops them, a restore onto another split
# crops or zero-pads them to its own.
LOGICAL_SHAPES = "logical_shapes"

PARAMS = "params."  # the train state's parameters' storage names
# The optimizer state's fp32 master copy of 16-bit parameters (megajax/train/optimizer.py MasterParams,
# the optimizer state's last part): `opt_state.<i>.master.<parameter>`.
MASTER = re.compile(r"opt_state\.\d+\.master\.")


def master_prefix(names) -> str | None:
    """The storage-name prefix of the fp32 master parameters among a checkpoint's `names`, or None."""
    for name in names:
        found = MASTER.match(name)
        if found:
            return found.group(0)
    return None


def logical_shapes(step_dir: Path, stored: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """{storage name: the array's logical shape} (its stored shape unless the metadata records it padded)."""
    record = read_meta(step_dir).get(LOGICAL_SHAPES) or {}
    return {name: tuple(record.get(name, a.shape)) for name, a in stored.items()}


def stored_arrays(step_dir: Path) -> tuple[dict[str, Any], bool]:
    """({storage name: Orbax ArrayMetadata (shape, dtype, ...)}, whether zarr3) from Orbax's
    metadata API, without reading any array."""
    import orbax.checkpoint as ocp
    try:
        metadata = ocp.PyTreeCheckpointHandler().metadata(_state_dir(step_dir))
    except (OSError, ValueError, KeyError) as e:
        raise _read_failed(step_dir, e) from None
    tree = getattr(metadata, "tree", metadata)
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
    arrays = {_path_name(path): leaf for path, leaf in leaves if hasattr(leaf, "shape")}
    return arrays, bool(getattr(metadata, "use_zarr3", False))


# ----------------------------------------------------------------------------
# Restoring onto a mesh
# ----------------------------------------------------------------------------

def _check_shapes(step_dir: Path, stored: dict[str, tuple[int, ...]], names: list[str], targets: list,
                  resize: VocabResize | None) -> set[str]:
    """The names whose vocabulary dim is resized; raises on anything else that differs (`stored`: the
    logical shapes, logical_shapes)."""
    missing = [n for n in names if n not in stored]
    if missing:
        raise CheckpointError(f"checkpoint {step_dir}: lacks {len(missing)} arrays this run needs, e.g. "
                              f"{missing[:3]}; it was saved with a different model, optimizer or precision "
                              f"(train.precision decides whether a loss scale or FP8 scaling state is stored).")
    resized = set()
    for name, t in zip(names, targets):
        have, want = tuple(stored[name]), tuple(t.shape)
        if have == want:
            continue
        differing = [d for d, (a, b) in enumerate(zip(have, want)) if a != b] if len(have) == len(want) else None
        vocab_dim = VocabResize.vocab_dim(name)
        if differing == [vocab_dim]:
            if resize is None:
                raise CheckpointError(
                    f"checkpoint {step_dir}: {name} has {have[vocab_dim]:,} (padded) vocabulary rows but this "
                    f"run has {want[vocab_dim]:,}, for the same vocabulary: the vocabulary padding differs "
                    f"(model.make_vocab_size_divisible_by, or a checkpoint saved when the padding also "
                    f"depended on mesh.tensor). Set checkpoint.resize_vocab=true to crop or zero-pad the "
                    f"padding rows.")
            resized.add(name)
            continue
        raise CheckpointError(f"checkpoint {step_dir}: {name} has shape {have} but this run expects {want}; "
                              f"the model config differs from the checkpoint's.")
    return resized


def _restore(step_dir: Path, target: Any, cfg: Config, what: str) -> tuple[Any, str]:
    """`target` (a pytree of ShapeDtypeStructs at their logical shapes with shardings, named like the
    stored tree) read from the checkpoint through Orbax, as a train state stores it (padded_shape);
    returns (tree, note on a vocabulary resize or '')."""
    import orbax.checkpoint as ocp
    resize = check_vocabulary(step_dir, read_meta(step_dir).get("config", {}), cfg, what)
    stored, _ = stored_arrays(step_dir)
    names = leaf_names(target)
    leaves, treedef = jax.tree.flatten(target)
    resized = _check_shapes(step_dir, logical_shapes(step_dir, stored), names, leaves, resize)
    padded = [padded_struct(t) for t in leaves]
    # strict=False lets Orbax crop or zero-pad the stored array to the target shape: only the
    # vocabulary dim (checked above) or a stored padding (zeros, to this run's own) differ.
    args = [ocp.ArrayRestoreArgs(sharding=t.sharding, global_shape=tuple(t.shape), dtype=t.dtype,
                                 strict=name not in resized and tuple(stored[name].shape) == tuple(t.shape))
            for name, t in zip(names, padded)]
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    _drop_closed_loop_errors()
    try:
        restored = checkpointer.restore(_state_dir(step_dir), args=ocp.args.PyTreeRestore(
            item=jax.tree.unflatten(treedef, padded), restore_args=jax.tree.unflatten(treedef, args),
            partial_restore=True))
    except Exception as e:
        if not _storage_error(e):
            raise
        raise _read_failed(step_dir, e) from None
    finally:
        checkpointer.close()
    changed = set(resized)
    if resize is not None and resize.stored != resize.vocab:  # rows past the smaller vocabulary: zero
        changed |= {n for n in names if VocabResize.vocab_dim(n) is not None}
    if not changed:
        return restored, ""
    out = [zero_rows_from(x, VocabResize.vocab_dim(n), resize.keep_rows) if n in changed else x
           for n, x in zip(names, jax.tree.leaves(restored))]
    return jax.tree.unflatten(treedef, out), resize.describe(sorted(changed))


def restore_state(step_dir: Path, target: Any, cfg: Config) -> tuple[Any, str]:
    """The checkpoint's train state laid out like `target` (a TrainState of ShapeDtypeStructs with
    shardings), and a note ('' or one line) when checkpoint.resize_vocab resized the vocabulary.

    Raises CheckpointError when the checkpoint lacks an array, a shape differs, or the vocabulary
    differs from `cfg`'s (unless cfg.checkpoint.resize_vocab)."""
    return _restore(step_dir, target, cfg, "resume")


def restore_params(step_dir: Path, target_params: dict, cfg: Config) -> tuple[dict, str]:
    """Only the parameters (fine-tuning with a fresh optimizer, generation), laid out like
    `target_params` (in its dtypes): the fp32 master copy where the checkpoint holds one (16-bit
    parameters, master_prefix), else the parameters; the same checks and note as restore_state."""
    prefix = master_prefix(stored_arrays(step_dir)[0])
    if prefix is None:
        restored, note = _restore(step_dir, {"params": target_params}, cfg, "load")
        return restored["params"], note
    index = int(prefix.split(".")[1])  # the optimizer state's part holding it
    restored, note = _restore(step_dir, {"opt_state": [None] * index + [{"master": target_params}]}, cfg, "load")
    return restored["opt_state"][index]["master"], note


def restore_expert_bias(step_dir: Path, cfg: Config) -> np.ndarray | None:
    """The MoE routers' expert bias [router layers, E] a checkpoint stores (a trained or imported model
    with aux-loss-free balancing), for fine-tuning or generation; None when it stores none.
    CheckpointError when its shape is not the model's."""
    from megajax.models.layout import has_expert_bias
    stored, _ = stored_arrays(step_dir)
    m = cfg.model
    if not has_expert_bias(m) or EXPERT_BIAS_STORED not in stored:
        return None
    want = (m.num_router_layers(), m.num_experts)
    if tuple(stored[EXPERT_BIAS_STORED].shape) != want:
        raise CheckpointError(f"checkpoint {step_dir}: {EXPERT_BIAS_STORED} has shape "
                              f"{tuple(stored[EXPERT_BIAS_STORED].shape)} but this model expects {want}.")
    return np.asarray(CheckpointSource(step_dir).stored(EXPERT_BIAS_STORED), np.float32)


# ----------------------------------------------------------------------------
# Streaming one tensor (or one layer) at a time, for exporters
# ----------------------------------------------------------------------------

def _free_large_buffers_eagerly(threshold: int = 2**20) -> None:
    """Fixes glibc's mmap threshold at `threshold` bytes for this process.

    TensorStore decodes chunks (up to CHUNK_BYTES) on its own threads. With glibc's dynamic
    threshold, once such a buffer is freed the threshold rises above it and later ones come from
    per-thread arenas, which keep them after they are freed: an export's peak memory then grows
    with the model (Hugging Face export of a 125 MB-embedding Llama: +342 MB at 12 layers, +395 MB
    at 24; +197 MB at both with the threshold fixed; scripts/bench_export.py --from-checkpoint).
    A fixed threshold maps every buffer of at least `threshold` bytes on its own and unmaps it when
    freed. No-op where the C library has no mallopt."""
    global _THRESHOLD_FIXED
    if _THRESHOLD_FIXED:
        return
    _THRESHOLD_FIXED = True
    try:
        import ctypes
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    M_MMAP_THRESHOLD = -3
    mallopt(M_MMAP_THRESHOLD, threshold)


_THRESHOLD_FIXED = False


class CheckpointSource:
    """TensorSource over a checkpoint's parameters, reading one tensor (or one layer) at a time.

    Names, shapes and dtypes come from Orbax's metadata API. A whole-tensor restore through
    Orbax cannot serve a layer of a stacked `layers/...` tensor: Orbax restores whole arrays
    (or, with `strict=False`, a crop anchored at index 0), and a layer is an interior slice.
    So each array is opened with TensorStore from the read spec Orbax itself builds for it
    (`type_handlers.get_json_tspec_read`: the spec its array handler restores from, in Orbax's
    TensorStore context) and sliced there: only the chunks of the requested layer are read and
    decoded (stacked tensors are written in chunks of one layer, `_save_args`), so peak host
    memory stays near one tensor whatever the model size. Export runs in one process, so no
    sharding is involved."""

    def __init__(self, path: str | Path, key: str = "--checkpoint", step: int | None = None,
                 prefix: str = "params."):
        """`prefix`: the stored subtree served (`opt_state.0.mu.`: Adam's first moments, named like
        the parameters); the parameters (`params.`) are served from the fp32 master copy where the
        checkpoint holds one (16-bit parameters, master_prefix)."""
        import orbax.checkpoint as ocp
        from etils import epath
        self.step_dir = require_step_dir(path, key, step)
        self.model = model_config_of(self.step_dir)
        self._arrays, use_zarr3 = stored_arrays(self.step_dir)
        self._logical = logical_shapes(self.step_dir, self._arrays)  # a padded array's own (cropped)
        params = prefix == PARAMS
        if params:
            prefix = master_prefix(self._arrays) or prefix
        self._prefix = prefix
        self._names = sorted(n[len(prefix):].replace(".", "/") for n in self._arrays if n.startswith(prefix))
        # The routers' expert bias: one stored array, served as the layers' and the MTP block's.
        self._bias_rows = expert_bias_rows(self.model) if params and EXPERT_BIAS_STORED in self._arrays else {}
        self._names += list(self._bias_rows)
        self._context = ocp.type_handlers.get_ts_context(use_ocdbt=True)
        self._parent = epath.Path(_state_dir(self.step_dir))
        self._ocdbt = ocp.type_handlers.is_ocdbt_checkpoint(self._parent)
        self._zarr3 = use_zarr3
        self._ocp, self._open = ocp, {}
        _free_large_buffers_eagerly()
        _drop_closed_loop_errors()

    def names(self) -> list[str]:
        return list(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        shape = self._logical[self._storage(name)]
        rows = self._bias_rows.get(name)
        return shape if rows is None else (len(rows),) + shape[1:]

    def _storage(self, name: str) -> str:
        key = EXPERT_BIAS_STORED if name in self._bias_rows else self._prefix + name.replace("/", ".")
        if key not in self._arrays:
            what = ("parameter " + name if self._prefix == PARAMS or MASTER.match(self._prefix)
                    else self._prefix + name.replace("/", "."))
            raise CheckpointError(f"checkpoint {self.step_dir}: has no {what}.")
        return key

    def stored(self, key: str) -> np.ndarray | None:
        """The whole stored array `key` (an Orbax storage name, e.g. `opt_state.0.count`), or None."""
        if key not in self._arrays:
            return None
        try:
            return np.asarray(self._cropped(key).read().result())
        except Exception as e:
            if not _storage_error(e):
                raise
            raise _read_failed(self.step_dir, e) from None

    def _store(self, key: str):
        if key not in self._open:
            import tensorstore as ts
            info = self._ocp.type_handlers.ParamInfo(name=key, parent_dir=self._parent,
                                                     is_ocdbt_checkpoint=self._ocdbt, use_zarr3=self._zarr3,
                                                     ts_context=self._context)
            spec = self._ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=self._ocdbt)
            try:
                self._open[key] = ts.open(spec, read=True, context=self._context).result()
            except Exception as e:  # TensorStore reports storage problems as ValueError/RuntimeError
                raise _read_failed(self.step_dir, e) from None
        return self._open[key]

    def _cropped(self, key: str):
        """The stored array `key` at its logical shape (a padded one's leading part)."""
        store = self._store(key)
        shape = self._logical[key]
        return store if tuple(store.shape) == shape else store[tuple(slice(0, n) for n in shape)]

    def get(self, name: str, layer: int | None = None) -> np.ndarray:
        store = self._cropped(self._storage(name))
        rows = self._bias_rows.get(name)
        if rows is not None:  # TensorStore keeps a slice's coordinates: index the stored array itself
            view = store[rows.start + layer] if layer is not None else store[rows.start:rows.stop]
        else:
            view = store[layer] if layer is not None else store
        try:
            return np.asarray(view.read().result(), np.float32)
        except Exception as e:
            if not _storage_error(e):
                raise
            raise _read_failed(self.step_dir, e) from None


def write_params_checkpoint(params: dict, cfg: Config, out_dir: str | Path, *, step: int = 0,
                            meta: dict | None = None) -> Path:
    """An Orbax checkpoint holding only parameters (e.g. imported from Hugging Face or Megatron),
    for `checkpoint.load`; expert biases in `params` (layout.expert_bias_rows) are stored as the train state's
    `moe_expert_bias`. Written as `<out_dir>/checkpoints/<step>/`; returns that directory."""
    out_dir = Path(out_dir)
    if find_step_dir(out_dir) is not None:
        raise CheckpointError(f"--output {out_dir} already holds a megajax checkpoint; choose an empty "
                              f"directory.")
    device = jax.local_devices()[0]
    arrays = jax.tree.map(lambda x: jax.device_put(np.asarray(x, np.float32), device), params)
    ckpt = Checkpointer(out_dir / "checkpoints", keep=1, async_save=False)
    try:
        params, bias = split_expert_bias(arrays)
        tree = {"params": params} if bias is None else {"params": params, "moe_expert_bias": bias}
        ckpt.save(step, tree, {"step": step, "consumed_samples": 0, "config": cfg.to_dict(),
                               "imported": True, **(meta or {})}, wait=True)
    finally:
        ckpt.close()
    return out_dir / "checkpoints" / str(step)

