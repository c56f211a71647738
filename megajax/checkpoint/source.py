"""Read access to a model's parameters one tensor (or one layer of a stacked tensor) at a time.

Exporters read through a `TensorSource`, so a checkpoint can be streamed to
another format with peak host memory near one tensor: `DictSource` wraps
parameters already in memory; the Orbax checkpoint source reads each tensor
from disk on demand.

Parameter names are the '/'-joined paths of the parameter tree, e.g.
`embed/embedding`, `layers/attn/q/kernel`, `final_norm/scale`, `output`.
Tensors under `layers/` are stacked: dim 0 is the layer.
"""

from __future__ import annotations

from typing import Iterator, Protocol

import numpy as np

from megajax.config import ModelConfig


def flatten(tree: dict, prefix: str = "") -> Iterator[tuple[str, object]]:
    for k, v in tree.items():
        name = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, dict):
            yield from flatten(v, name)
        else:
            yield name, v


def unflatten(items: dict[str, object]) -> dict:
    out: dict = {}
    for name, v in items.items():
        node = out
        *parents, leaf = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return out


class TensorSource(Protocol):
    model: ModelConfig  # resolved model config (vocab_size is the real, unpadded vocabulary)

    def names(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def get(self, name: str, layer: int | None = None) -> np.ndarray:
        """The tensor as float32 numpy; `layer` selects [layer] of a stacked `layers/...` tensor."""
        ...


class DictSource:
    """A TensorSource over an in-memory parameter tree (numpy or jax arrays)."""

    def __init__(self, params: dict, model: ModelConfig):
        self.model = model
        self._flat = dict(flatten(params))

    def names(self) -> list[str]:
        return list(self._flat)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._flat[name].shape)

    def get(self, name: str, layer: int | None = None) -> np.ndarray:
        x = self._flat[name]
        if layer is not None:
            x = x[layer]
        return np.asarray(x, dtype=np.float32)
