"""Declarative tables between megajax parameters and an external checkpoint format.

A format is a tuple of `Row`s, one per external tensor (`{i}` in a name is the
layer). A row lists the megajax parameter(s) it holds, each with the layout
change between the two (`Part`), and how several parts share one tensor:

    Row("model.layers.{i}.self_attn.q_proj.weight", linear("layers/attn/q/kernel"))
    Row("transformer.h.{i}.attn.c_attn.weight",            # GPT-2: [D, 3D], columns q | k | v
        conv1d("layers/attn/q/kernel"), conv1d("layers/attn/k/kernel"), conv1d("layers/attn/v/kernel"), axis=1)
    Row("decoder.layers.{i}.self_attention.linear_qkv.weight",  # Megatron: rows per query group
        linear("layers/attn/q/kernel"), linear("layers/attn/k/kernel"), linear("layers/attn/v/kernel"),
        groups="kv_heads", split="column")

The exporter and the importer of a format walk the same rows: `to_external`
builds one external tensor from one layer of each part, `to_ours` takes it
apart again. A row applies to a model when every parameter it names exists
in the model's layout (so biases, LayerNorm biases, learned positions or an
untied output layer need no conditions); of several rows with one external
name the first that applies wins (SwiGLU's [gate; up] fc1 or GELU's fc1).
Every parameter of the layout must be held by some row: a model with a
parameter the table lacks is refused by name rather than exported without it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterator

import numpy as np

from megajax.config import ModelConfig
from megajax.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class Part:
    """One megajax parameter inside an external tensor, and the layout change between them.

    kind: `same` (unchanged), `flat` (one dim), `linear` (a PyTorch Linear weight: kernel
    [in..., out...] -> [out, in]), `conv1d` (a GPT-2 Conv1D weight: -> [in, out]); `n_in` is
    how many leading dims of the kernel are inputs.
    """
    path: str
    kind: str = "same"
    n_in: int = 1

    @property
    def label(self) -> str:
        """Short name in messages: `gate` for layers/mlp/gate/kernel."""
        parts = self.path.split("/")
        return parts[-2] if parts[-1] in ("kernel", "bias", "scale") and len(parts) > 1 else parts[-1]

    def external_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The external shape of a megajax tensor of `shape` (one layer)."""
        inputs, outputs = math.prod(shape[:self.n_in]), math.prod(shape[self.n_in:])
        return {"same": tuple(shape), "flat": (math.prod(shape),), "linear": (outputs, inputs),
                "conv1d": (inputs, outputs)}[self.kind]

    def to_external(self, x: np.ndarray) -> np.ndarray:
        if self.kind == "same":
            return x
        if self.kind == "flat":
            return x.reshape(-1)
        inputs = math.prod(x.shape[:self.n_in])
        return x.reshape(inputs, -1).T if self.kind == "linear" else x.reshape(inputs, -1)

    def to_ours(self, y: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return (y.T if self.kind == "linear" else y).reshape(shape)


def same(path: str) -> Part:
    return Part(path, "same")


def flat(path: str) -> Part:
    return Part(path, "flat")


def linear(path: str, n_in: int = 1) -> Part:
    return Part(path, "linear", n_in)


def conv1d(path: str, n_in: int = 1) -> Part:
    return Part(path, "conv1d", n_in)


@dataclasses.dataclass(frozen=True)
class Row:
    """One external tensor: `name` (with `{i}` for the layer) holds `parts` joined along `axis`.

    groups: the parts are interleaved per group, [a_0 b_0 | a_1 b_1 | ...] with each part cut
        into that many blocks along `axis`: `kv_heads` (Megatron's per-query-group q|k|v) or
        `tensor` (Megatron's per-rank [gate; up]); None: plain concatenation.
    vocab: external dim 0 is the vocabulary: exported as vocab_size rows (formats may pad
        again), imported back to megajax's padding with zero rows.
    split: tensor-parallel layout for formats stored per rank: `column` (dim 0), `row` (dim 1)
        or `replicated`.
    aliases: other names accepted on import (e.g. Transformer Engine's fused norm names).
    copy: a duplicate of a tensor another row holds (Megatron's last-stage copy of tied word
        embeddings); written where the format wants it, ignored on import.
    """
    name: str
    parts: tuple[Part, ...]
    axis: int = 0
    groups: str | None = None
    vocab: bool = False
    split: str = "replicated"
    aliases: tuple[str, ...] = ()
    copy: bool = False

    def __init__(self, name: str, *parts: Part, **options):
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "parts", parts)
        known = {f.name for f in dataclasses.fields(self)}
        for key, value in options.items():
            if key not in known:
                raise TypeError(f"Row has no option {key!r}")
            object.__setattr__(self, key, value)

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.name

    def names(self, i: int | None = None) -> tuple[str, ...]:
        """The external name for layer `i`, then its aliases."""
        return tuple(n.replace("{i}", str(i)) for n in (self.name,) + self.aliases)


def linear_rows(name: str, ours: str, n_in: int = 1, split: str = "replicated",
                kind: Callable[..., Part] = linear) -> tuple[Row, Row]:
    """A linear module: `{name}.weight` from `{ours}/kernel`, `{name}.bias` from `{ours}/bias` (applies
    when the model has biases). A row-parallel module's bias is replicated."""
    return (Row(f"{name}.weight", kind(f"{ours}/kernel", n_in), split=split),
            Row(f"{name}.bias", flat(f"{ours}/bias"), split="column" if split == "column" else "replicated"))


def norm_rows(name: str, ours: str, aliases: tuple[str, str] | None = None) -> tuple[Row, Row]:
    """A norm: `{name}.weight` (scale) and `{name}.bias` (LayerNorm only); `aliases`: other names of both."""
    return (Row(f"{name}.weight", flat(f"{ours}/scale"), aliases=(aliases[0],) if aliases else ()),
            Row(f"{name}.bias", flat(f"{ours}/bias"), aliases=(aliases[1],) if aliases else ()))


def rows_for(table: tuple[Row, ...], shapes: dict[str, tuple[int, ...]], fmt: str) -> list[Row]:
    """The rows of `table` that apply to a model with layout `shapes`, in table order.

    Raises CheckpointError naming the parameters no row holds.
    """
    out, taken = [], set()
    for row in table:
        if row.name in taken or not all(p.path in shapes for p in row.parts):
            continue
        taken.add(row.name)
        out.append(row)
    unheld = sorted(set(shapes) - {p.path for row in out for p in row.parts})
    if unheld:
        raise CheckpointError(f"the {fmt} format has no place for the parameters {', '.join(unheld)}; "
                              f"this model cannot be written as {fmt}.")
    return out


def in_layer_order(rows: list[Row], num_layers: int) -> Iterator[tuple[Row, int | None]]:
    """(row, layer) pairs: rows in table order, each run of per-layer rows expanded layer by layer."""
    k = 0
    while k < len(rows):
        end = k
        while end < len(rows) and rows[end].per_layer:
            end += 1
        if end == k:
            yield rows[k], None
            k += 1
            continue
        for i in range(num_layers):
            for row in rows[k:end]:
                yield row, i
        k = end


def _layer_shape(shapes: dict, path: str) -> tuple[int, ...]:
    shape = shapes[path]
    return shape[1:] if path.startswith("layers/") else shape


def _groups(row: Row, m: ModelConfig, tensor: int) -> int:
    return {None: 1, "kv_heads": m.num_kv_heads, "tensor": tensor}[row.groups]


def external_shape(row: Row, shapes: dict, m: ModelConfig, *, vocab_rows: int | None = None) -> tuple[int, ...]:
    """Shape of the whole (unsplit) external tensor; a vocabulary has `vocab_rows` rows (default vocab_size)."""
    part_shapes = [p.external_shape(_layer_shape(shapes, p.path)) for p in row.parts]
    out = list(part_shapes[0])
    out[row.axis] = sum(s[row.axis] for s in part_shapes)
    if row.vocab:
        out[0] = vocab_rows or m.vocab_size
    return tuple(out)


def _join(xs: list[np.ndarray], axis: int, groups: int) -> np.ndarray:
    if len(xs) == 1:
        return xs[0]
    if groups == 1:
        return np.concatenate(xs, axis)
    blocks = [np.moveaxis(x, axis, 0) for x in xs]
    blocks = [b.reshape((groups, -1) + b.shape[1:]) for b in blocks]  # [groups, block, ...]
    joined = np.concatenate(blocks, 1)
    return np.moveaxis(joined.reshape((-1,) + joined.shape[2:]), 0, axis)


def _unjoin(y: np.ndarray, sizes: list[int], axis: int, groups: int) -> list[np.ndarray]:
    if len(sizes) == 1:
        return [y]
    y = np.moveaxis(y, axis, 0)
    y = y.reshape((groups, -1) + y.shape[1:])
    cuts = np.cumsum([s // groups for s in sizes])[:-1]
    return [np.moveaxis(p.reshape((-1,) + p.shape[2:]), 0, axis) for p in np.split(y, cuts, axis=1)]


def shard(x: np.ndarray, split: str, rank: int, size: int, rows: int | None = None) -> np.ndarray:
    """Tensor rank `rank`'s piece of x (of `size` ranks) for a `split` layout, as a view where it can be;
    `rows`: dim 0 counts as padded with zero rows to this size (a vocabulary), never materialised."""
    if split == "replicated":
        return x
    axis = 0 if split == "column" else 1
    n = (rows or x.shape[axis]) // size
    lo, hi = rank * n, min((rank + 1) * n, x.shape[axis])
    piece = x[(slice(None),) * axis + (slice(lo, max(lo, hi)),)]
    if piece.shape[axis] < n:
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, n - piece.shape[axis])
        piece = np.pad(piece, pad)
    return piece


def to_external(row: Row, read: Callable[[str], np.ndarray], m: ModelConfig, *, tensor: int = 1,
                rank: int | None = None, vocab_rows: int | None = None) -> np.ndarray:
    """The external tensor of `row` from `read(path)`, which returns one megajax tensor (one layer of a
    stacked one); a vocabulary is cut to vocab_size rows.

    With `rank`, only that tensor rank's piece (of `tensor` ranks) for the row's split, a vocabulary
    counting as padded to `vocab_rows`: the parts of a joined row are split before they are joined,
    so the whole joined tensor never exists.
    """
    parts = [p.to_external(read(p.path)) for p in row.parts]
    groups = _groups(row, m, tensor)
    if rank is None or row.split == "replicated":
        x = _join(parts, row.axis, groups)
        return x[:m.vocab_size] if row.vocab else x
    if len(parts) == 1:
        x = parts[0][:m.vocab_size] if row.vocab else parts[0]
        return shard(x, row.split, rank, tensor, vocab_rows if row.vocab else None)
    if row.axis != (0 if row.split == "column" else 1) or groups % tensor:
        raise ValueError(f"row {row.name}: parts joined along the split dim need groups divisible by the "
                         f"tensor size ({groups=}, {tensor=})")
    return _join([shard(x, row.split, rank, tensor) for x in parts], row.axis, groups // tensor)


def to_ours(row: Row, name: str, y: np.ndarray, shapes: dict, m: ModelConfig, *, tensor: int = 1,
            vocab_rows: int | None = None,
            mismatch: Callable[[str, tuple, tuple], Exception]) -> dict[str, np.ndarray]:
    """megajax tensors (one layer each) from `y`, the external tensor `name` of `row`.

    `tensor` is the rank count a `groups="tensor"` row was written for, `vocab_rows` the stored
    vocabulary rows (default vocab_size). A shape other than the model implies raises
    `mismatch(what, got, want)`; for a joined tensor `what` names the part, e.g. `... (gate)`.
    """
    targets = [_layer_shape(shapes, p.path) for p in row.parts]
    sizes = [p.external_shape(t)[row.axis] for p, t in zip(row.parts, targets)]
    want = external_shape(row, shapes, m, vocab_rows=vocab_rows)
    if tuple(y.shape) != want:
        raise _mismatch(row, name, tuple(y.shape), want, sizes, targets, mismatch)
    if row.vocab:  # vocab_size rows, then megajax's zero padding
        y = y[:m.vocab_size]
        y = np.pad(y, [(0, row.parts[0].external_shape(targets[0])[0] - y.shape[0])] + [(0, 0)] * (y.ndim - 1))
    pieces = _unjoin(y, sizes, row.axis, _groups(row, m, tensor))
    return {p.path: p.to_ours(piece, t) for p, piece, t in zip(row.parts, pieces, targets)}


def _mismatch(row, name, got, want, sizes, targets, mismatch) -> Exception:
    """The error for a wrong shape; a joined tensor that is off along the join axis alone is
    described by its first part (what the file holds of it, what the model implies)."""
    total, a = sum(sizes), row.axis
    if len(row.parts) == 1 or len(got) != len(want) or got[:a] + got[a + 1:] != want[:a] + want[a + 1:] \
            or got[a] * sizes[0] % total:
        return mismatch(name, got, want)
    part = row.parts[0]
    part_want = part.external_shape(targets[0])
    part_got = part_want[:a] + (got[a] * sizes[0] // total,) + part_want[a + 1:]
    return mismatch(f"{name} ({part.label})", part_got, part_want)
