"""A Hugging Face directory's weights read straight onto a mesh (`checkpoint.load=<HF dir>`).

    stream_hf(hf, like) -> {megajax path: jax.Array with like's sharding, stored as the train state is}
    hf_expert_bias(hf) -> the train state's MoE expert bias [router layers, E] (host), or None

`like` holds one jax.ShapeDtypeStruct with its sharding per megajax tensor (the run's target
state). Each parameter is built shard by shard: for every distinct block of it that this process's
devices hold, the Hugging Face tensors overlapping that block are read one at a time
(safetensors' safe_open), converted (checkpoint/mapping.py's rows) and their piece copied into a
host buffer the size of the block, which goes to its devices before the next block is built. Peak
host memory is one block of one parameter plus one Hugging Face tensor; the whole model is never
on the host. A tensor is read once per distinct block of the parameter it belongs to (a parameter
sharded over 8 devices reads its tensors 8 times, each time keeping 1/8 of it).
"""

from __future__ import annotations

from collections import defaultdict

import jax
import numpy as np

from megajax.checkpoint.hf import HfTensors
from megajax.checkpoint.mapping import index as stack_index
from megajax.errors import CheckpointError
from megajax.mesh import pad_to, padded_shape
from megajax.models.layout import EXPERT_BIAS, MTP_EXPERT_BIAS


def _key(idx: tuple[slice, ...]) -> tuple:
    return tuple((s.start, s.stop, s.step) for s in idx)


def _block(hf: HfTensors, path: str, sources: list, shape: tuple[int, ...], idx: tuple[slice, ...],
           dtype) -> np.ndarray:
    """The block `idx` (one slice per dim) of megajax tensor `path` (global `shape`), from `sources`:
    (row, slot, name) of every Hugging Face tensor holding a piece of it."""
    ranges = [range(*s.indices(n)) for s, n in zip(idx, shape)]
    out = np.zeros(tuple(len(r) for r in ranges), dtype)
    for row, slot, name in sources:
        at = stack_index(slot, row)
        lead = () if at is Ellipsis else at  # the stack (layer) and expert positions of this piece
        if any(k not in r for k, r in zip(lead, ranges)):
            continue
        x = hf.read(row, name)[path]  # one layer (one expert) of the tensor
        inner = tuple(slice(r.start, r.stop, r.step) for r in ranges[len(lead):])
        out[tuple(r.index(k) for k, r in zip(lead, ranges))] = x[inner]
    return out


def _sources(hf: HfTensors) -> dict[str, list]:
    """megajax path -> (row, slot, Hugging Face name) of every tensor holding a piece of it."""
    sources: dict[str, list] = defaultdict(list)
    for row, _, slot, name in hf.plan:
        for part in row.parts:
            sources[part.path].append((row, slot, name))
    return sources


def hf_expert_bias(hf: HfTensors) -> np.ndarray | None:
    """The train state's MoE expert bias [router layers, E] float32 (the MoE layers' rows, then the
    multi-token prediction depths'), or None for a model without one. Small: read on the host."""
    sources = _sources(hf)
    parts = [_block(hf, p, sources[p], hf.shapes[p], (slice(None),) * 2, np.float32)
             for p in (EXPERT_BIAS, MTP_EXPERT_BIAS) if p in hf.shapes]
    return np.concatenate(parts) if parts else None


def stream_hf(hf: HfTensors, like: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
    """{path: the tensor of Hugging Face directory `hf` placed as like[path] says}; CheckpointError when
    the run's tensors are not the directory's model's (names or shapes)."""
    sources = _sources(hf)
    differ = sorted(set(like) ^ (set(hf.shapes) - {EXPERT_BIAS, MTP_EXPERT_BIAS}))
    wrong = [(p, tuple(like[p].shape), tuple(hf.shapes[p])) for p in sorted(like)
             if p in hf.shapes and tuple(like[p].shape) != tuple(hf.shapes[p])]
    if differ or wrong:
        listed = "; ".join([f"{p}: the run's {w}, the directory's {g}" for p, w, g in wrong[:4]]
                           + [f"{p} only in {'the run' if p in like else 'the directory'}" for p in differ[:4]])
        raise CheckpointError(f"checkpoint.load = {str(hf.dir)!r}: the Hugging Face model's tensors do not fit "
                              f"this run's model ({listed}).")
    out = {}
    for path in sorted(like):
        target = like[path]
        shape, sharding = tuple(target.shape), target.sharding
        stored = padded_shape(shape, sharding)  # as the train state stores it (zeros past `shape`)
        by_block: dict[tuple, list] = defaultdict(list)
        slices = {}
        for device, idx in sharding.addressable_devices_indices_map(stored).items():
            idx = tuple(idx) + (slice(None),) * (len(shape) - len(idx))
            by_block[_key(idx)].append(device)
            slices[_key(idx)] = idx
        arrays = []
        for key, devices in by_block.items():
            block = _block(hf, path, sources[path], shape, slices[key], target.dtype)
            block = pad_to(block, tuple(len(range(*i.indices(n))) for i, n in zip(slices[key], stored)))
            arrays += [jax.device_put(block, d) for d in devices]
            del block
        out[path] = jax.make_array_from_single_device_arrays(stored, sharding, arrays)
    return out
