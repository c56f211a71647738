"""Megatron-Core `torch_dist` checkpoints (dist_checkpointing over PyTorch Distributed Checkpoint): reading.

    <save>/latest_checkpointed_iteration.txt         the iteration, or `release`
    <save>/iter_{iteration:07d}/.metadata            DCP metadata: every key's global shape and chunks
                               /__{rank}_{k}.distcp  the chunks, each a torch.save'd tensor (or raw bytes)
                               /metadata.json        {"sharded_backend": "torch_dist", ...}
                               /common.pt            args, iteration, ... (megatron-core <= 0.18)

From megatron-core 0.19 the common state is not in common.pt but a bytes entry `common_state` of the
shards. Tensors are global, whatever TP/PP/EP wrote them: per-layer tensors stacked on a leading
layer dim (`decoder.layers.mlp.linear_fc2.weight [L, h, f]`), SequentialMLP experts on a second one
(`decoder.layers.mlp.experts.experts.linear_fc1.weight [L, E, 2f, h]`), or one key per expert
(`...experts.experts.{j}.linear_fc1.weight`, SwiGLU's halves as `..._w` / `..._v` keys).

Reading needs no process group: this module reads `.metadata` itself with an unpickler that admits
only the DCP metadata classes, and each chunk with torch's weights-only loader. A stacked tensor is
read one layer at a time (only the chunks that hold that layer), so the import's peak adds about one
layer's largest tensor (in float32) to the parameters it builds.
"""

from __future__ import annotations

import io
import json
import pickle
import re
from pathlib import Path

import numpy as np

from megajax.errors import CheckpointError

METADATA = ".metadata"
COMMON_FILE = "common.pt"
COMMON_KEY = "common_state"
MEGATRON_VERSIONS = ("0.16", "0.17", "0.18", "0.19")  # the megatron-core forms megajax writes (common state)
NEWEST_MEGATRON = MEGATRON_VERSIONS[-1]
NOT_MODEL = ("optimizer.", "rng_state", "rerun_state_machine", COMMON_KEY)
_DCP = "torch.distributed.checkpoint."
_ALLOWED = {
    (_DCP + "metadata", n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                     "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                     "_MEM_FORMAT_ENCODING")} | {
    (_DCP + "filesystem", "_StorageInfo"),
    (_DCP + "planner", "SavePlan"), (_DCP + "planner", "TensorWriteData"), (_DCP + "planner", "WriteItem"),
    (_DCP + "planner", "WriteItemType"), ("torch.serialization", "_get_layout"), ("torch", "Size"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice")}


def is_torch_dist(step: Path) -> bool:
    return (step / METADATA).is_file() or (step / "metadata.json").is_file() or any(step.glob("*.distcp"))


def _torch():
    try:
        import torch
    except ImportError:
        raise CheckpointError("Megatron checkpoints need PyTorch: pip install 'megajax[torch]'.") from None
    return torch


class _MetadataUnpickler(pickle.Unpickler):
    """Admits the classes of PyTorch DCP's metadata and torch's dtypes, nothing else."""

    def find_class(self, module, name):
        torch = _torch()
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


class DistCheckpoint:
    """One torch_dist step directory: its keys, their global shapes, and reads of whole tensors or of
    one index along dim 0 (a layer), chunk by chunk."""

    def __init__(self, step: Path):
        self.step = Path(step)
        path = self.step / METADATA
        if not path.is_file():
            raise CheckpointError(f"{str(path)!r} is missing: {str(self.step)!r} looks like a Megatron torch_dist "
                                  f"checkpoint (metadata.json or .distcp files) but has no DCP metadata file.")
        backend = self.step / "metadata.json"
        if backend.is_file():
            try:
                said = json.loads(backend.read_text())
            except ValueError as e:
                raise CheckpointError(f"{str(backend)!r} is not valid JSON ({e}).") from None
            if said.get("sharded_backend", "torch_dist") != "torch_dist":
                raise CheckpointError(f"{str(backend)!r} names sharded_backend={said.get('sharded_backend')!r}; "
                                      f"megajax reads torch_dist (and the legacy torch format).")
        try:
            with open(path, "rb") as f:
                md = _MetadataUnpickler(f).load()
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"{str(path)!r} holds a Python object outside PyTorch DCP's metadata classes "
                                  f"({e}); megajax does not unpickle it.") from None
        except Exception as e:  # noqa: BLE001 - a truncated or foreign file fails in many ways
            raise CheckpointError(f"{str(path)!r} is not a readable PyTorch DCP metadata file "
                                  f"({type(e).__name__}: {e}).") from None
        self.meta = md.state_dict_metadata
        self._where: dict[tuple, object] = {}
        for index, info in md.storage_data.items():
            offsets = None if index.offset is None else tuple(int(x) for x in index.offset)
            self._where[(index.fqn, offsets)] = info

    def keys(self) -> list[str]:
        return [k for k, v in self.meta.items() if hasattr(v, "chunks")]

    def byte_keys(self) -> list[str]:
        return [k for k, v in self.meta.items() if not hasattr(v, "chunks")]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(int(x) for x in self.meta[key].size)

    def _read(self, key: str, offsets) -> bytes:
        info = self._where.get((key, offsets))
        if info is None:
            raise CheckpointError(f"{str(self.step / METADATA)!r} lists {key} but says nowhere where a chunk of it "
                                  f"is stored.")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{str(self.step / info.relative_path)!r} stores {key} with the transforms "
                                  f"{list(info.transform_descriptors)}, which megajax does not read.")
        path = self.step / info.relative_path
        try:
            with open(path, "rb") as f:
                f.seek(info.offset)
                data = f.read(info.length)
        except FileNotFoundError:
            raise CheckpointError(f"shard file {str(path)!r} is missing (its {METADATA} places {key} there).") \
                from None
        if len(data) != info.length:
            raise CheckpointError(f"shard file {str(path)!r} is truncated: {key} needs bytes {info.offset}.."
                                  f"{info.offset + info.length}, the file ends at {info.offset + len(data)}.")
        return data

    def read_bytes(self, key: str) -> bytes:
        return self._read(key, None)

    def read(self, key: str, index: int | None = None) -> np.ndarray:
        """The global tensor `key` as float32 (with `index`: only [index] of its dim 0)."""
        torch = _torch()
        md = self.meta[key]
        shape = self.shape(key)
        out_shape = shape if index is None else shape[1:]
        out = np.zeros(out_shape, np.float32)
        covered = 0
        for chunk in md.chunks:
            offsets, sizes = tuple(int(x) for x in chunk.offsets), tuple(int(x) for x in chunk.sizes)
            if index is not None and not offsets[0] <= index < offsets[0] + sizes[0]:
                continue
            data = self._read(key, offsets)
            try:
                x = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001
                info = self._where[(key, offsets)]
                raise CheckpointError(f"shard file {str(self.step / info.relative_path)!r}: the chunk of {key} at "
                                      f"byte {info.offset} is not a readable tensor ({type(e).__name__}).") from None
            if tuple(x.shape) != sizes:
                raise CheckpointError(f"{str(self.step)!r}: a chunk of {key} has shape {list(x.shape)}, its "
                                      f"metadata says {list(sizes)}.")
            x = x.float().numpy()
            if index is not None:
                x, offsets, sizes = x[index - offsets[0]], offsets[1:], sizes[1:]
            out[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = x
            covered += int(np.prod(sizes))
        if covered != int(np.prod(out_shape)):
            raise CheckpointError(f"{str(self.step)!r}: the chunks of {key} cover {covered} of its "
                                  f"{int(np.prod(out_shape))} elements{'' if index is None else f' at [{index}]'}.")
        return out


def read_common(step: Path, ckpt: DistCheckpoint, load) -> dict:
    """The common state (args, iteration, ...): common.pt (megatron-core <= 0.18) or the shards'
    `common_state` entry (0.19); `load(path_or_file)` is the weights-only loader with Megatron's classes."""
    if (step / COMMON_FILE).is_file():
        return load(step / COMMON_FILE)
    key = next((k for k in ckpt.byte_keys() if k == COMMON_KEY or k.startswith(COMMON_KEY + "/")), None)
    if key is None:
        raise CheckpointError(f"{str(step)!r} has neither {COMMON_FILE} (megatron-core <= 0.18) nor a "
                              f"{COMMON_KEY} entry in its shards (0.19): no args to read the model from.")
    common = load(io.BytesIO(ckpt.read_bytes(key)), name=f"{step / METADATA} entry {key}")
    if isinstance(common, (list, tuple)) and len(common) == 1:  # the objects of a ShardedObject, one here
        common = common[0]
    if not isinstance(common, dict):
        raise CheckpointError(f"{str(step)!r}: the {key} entry holds a {type(common).__name__}, not the common "
                              f"state dict.")
    return common


def layer_keys(ckpt: DistCheckpoint, num_layers: int) -> dict[str, tuple[str, int | None, int | None]]:
    """{legacy per-rank name (TP 1): (torch_dist key, layer index or None, expert index or None)}.

    `decoder.layers.X [L, ...]` becomes `decoder.layers.{i}.X` (a layer's own `decoder.layers.{i}.X`
    stays, its experts' `mlp.experts.experts.Y [E, ...]` split per expert); SequentialMLP's
    `decoder.layers.mlp.experts.experts.Y [L, E, ...]` and the per-expert `experts.experts.{j}.Y`
    become `decoder.layers.{i}.mlp.experts.local_experts.{j}.Y` (a mixture-of-experts multi-token
    prediction depth's `mtp.layers.{k}.transformer_layer.mlp.experts.experts.Y [E, ...]` alike). SwiGLU's `_w` / `_v` halves are
    named with their suffix; `merged_fc1` joins them."""
    out: dict = {}
    for key in ckpt.keys():
        shape = ckpt.shape(key)
        if key.startswith(NOT_MODEL):
            continue
        mtp = re.match(r"(mtp\.layers\.\d+\.transformer_layer\.mlp\.experts\.)experts\.(.*)$", key)
        if mtp:  # a multi-token prediction depth's experts [E, ...], kept per depth as a layer's own
            for j in range(shape[0]):
                out[f"{mtp.group(1)}local_experts.{j}.{mtp.group(2)}"] = (key, None, j)
            continue
        if not key.startswith("decoder.layers."):
            out[key] = (key, None, None)
            continue
        rest = key[len("decoder.layers."):]
        head, _, tail = rest.partition(".")
        if head.isdigit():  # one layer's own key (megatron-core's form when its layers differ)
            if tail.startswith("mlp.experts.experts."):
                name = tail[len("mlp.experts.experts."):]
                for j in range(shape[0]):
                    out[f"decoder.layers.{head}.mlp.experts.local_experts.{j}.{name}"] = (key, None, j)
            else:
                out[key] = (key, None, None)
            continue
        if shape[0] != num_layers:
            raise CheckpointError(f"{str(ckpt.step)!r}: {key} has shape {list(shape)}, but args num_layers="
                                  f"{num_layers} (the first dim of a layer-stacked tensor).")
        held = {i for c in ckpt.meta[key].chunks for i in range(int(c.offsets[0]), int(c.offsets[0] + c.sizes[0]))}
        for i in sorted(held):  # with dense layers between MoE ones, a key holds only some layers
            if rest.startswith("mlp.experts.experts."):
                tail = rest[len("mlp.experts.experts."):]
                head, _, name = tail.partition(".")
                if head.isdigit():  # one key per expert
                    out[f"decoder.layers.{i}.mlp.experts.local_experts.{head}.{name}"] = (key, i, None)
                else:
                    for j in range(shape[1]):
                        out[f"decoder.layers.{i}.mlp.experts.local_experts.{j}.{tail}"] = (key, i, j)
            else:
                out[f"decoder.layers.{i}.{rest}"] = (key, i, None)
    return out
