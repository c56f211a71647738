"""Declarative tables between megajax parameters and an external checkpoint format.

A format is a tuple of `Row`s, one per external tensor (`{i}` in a name is the
layer), each naming the megajax parameter(s) it holds with the layout change
between them (`Part`) and how several share one tensor:

    Row("model.layers.{i}.self_attn.q_proj.weight", linear("layers/attn/q/kernel"))
    Row("decoder.layers.{i}.self_attention.linear_qkv.weight",  # rows grouped per query group
        *(linear(f"layers/attn/{x}/kernel") for x in "qkv"), groups="kv_heads", split="column")
    Row("model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight", linear("layers/mlp/gate", experts=True))

`{j}` is an expert: the row stands for one tensor per expert, its parts reading that expert's
slice of a `[layers, experts, ...]` parameter (`rows_for` expands it, `Row.expert`).

A format's exporter and importer walk the same rows (`to_external`, `to_ours`).
A row applies when every parameter it names is in the model's layout (so
biases or an untied output layer need no conditions); of rows with one name
the first that applies wins; a parameter no row holds is refused by name.

A model with dense layers between its MoE layers (model.moe_layer_freq > 1) keeps
the dense ones in a second stack, `dense_layers/`: a per-layer row naming
`layers/...` also stands for the same parameters under `dense_layers/`, and
each row holds the layers of its stack (`layer_rows`, `slot`).

Multi-token prediction's parameters (`mtp/...`) are stacked over the depths: a row naming them
has `{i}` for the depth (its stack is `mtp/`, which `layer_rows` never yields): Megatron's format
walks them itself (`mtp.layers.{k}`), `in_layer_order` as the layers after the last (Hugging Face's
DeepSeek-V3, `model.layers.{num_layers + k}`).

A hybrid model (model.hybrid_layer_pattern) stacks the groups of its pattern: layer n's parameters are
`layers/layer{j}/...` (j = n mod the group's length) at index n // that length. A row naming them has
that slot for its stack (`layers/layer{j}/`), so each slot's rows hold only the layers of its kind;
a row of `layers/` itself holds one row per MoE layer (E), in model order: the expert bias.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Callable, Iterator

import numpy as np

from megajax.config import ModelConfig
from megajax.errors import CheckpointError
from megajax.models.layout import STACKS, layer_slots, stacked

MTP_STACK = "mtp/"  # multi-token prediction's depths, stacked on dim 0
_HYBRID_SLOT = re.compile(r"layers/layer\d+/")  # a hybrid group's slot inside the `layers/` stack


@dataclasses.dataclass(frozen=True)
class Part:
    """A megajax parameter (one layer of it) inside an external tensor: `same` (unchanged), `flat`
    (one dim), `linear` (PyTorch Linear: kernel [in..., out...] -> [out, in]), `conv1d` (GPT-2's
    Conv1D: -> [in, out]), `depthwise` (a depthwise Conv1d's weight: [channels..., K] -> [C, 1, K]),
    `patch` (a ViT's patch kernel [p, p, 3, D] -> Conv2d's [D, 3, p, p]) or `token` ([D] -> [1, 1, D]);
    the kernel's first `n_in` dims are its inputs."""
    path: str
    kind: str
    n_in: int = 1
    experts: bool = False  # the parameter's first (per layer) dim is the expert: one tensor per expert
    expert: int | None = None  # set by rows_for on a row expanded per expert

    def external_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.kind == "depthwise":
            return (math.prod(shape[:-1]), 1, shape[-1])
        if self.kind == "patch":
            return (shape[3], shape[2], shape[0], shape[1])
        if self.kind == "token":
            return (1, 1, math.prod(shape))
        n_in, n_out = math.prod(shape[:self.n_in]), math.prod(shape[self.n_in:])
        return {"same": tuple(shape), "flat": (n_in * n_out,), "linear": (n_out, n_in),
                "conv1d": (n_in, n_out)}[self.kind]

    def to_external(self, x: np.ndarray) -> np.ndarray:
        if self.expert is not None:
            x = x[self.expert]
        if self.kind in ("same", "flat"):
            return x if self.kind == "same" else x.reshape(-1)
        if self.kind == "depthwise":
            return x.reshape(-1, 1, x.shape[-1])
        if self.kind in ("patch", "token"):
            return np.transpose(x, (3, 2, 0, 1)) if self.kind == "patch" else x.reshape(1, 1, -1)
        x = x.reshape(math.prod(x.shape[:self.n_in]), -1)
        return x.T if self.kind == "linear" else x

    def to_ours(self, y: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        if self.kind == "patch":
            return np.transpose(y, (2, 3, 1, 0)).reshape(shape)
        return (y.T if self.kind == "linear" else y).reshape(shape)


same, flat = functools.partial(Part, kind="same"), functools.partial(Part, kind="flat")
linear, conv1d = functools.partial(Part, kind="linear"), functools.partial(Part, kind="conv1d")
depthwise, patch = functools.partial(Part, kind="depthwise"), functools.partial(Part, kind="patch")
token = functools.partial(Part, kind="token")


@dataclasses.dataclass(frozen=True)
class Row:
    """External tensor `name` holding `parts` joined along `axis`.

    groups: parts interleaved per group ([a_0 b_0 | a_1 b_1 | ...]): `kv_heads` (Megatron's
        per-query-group q|k|v), `vision_heads` (the same for a vision encoder's heads) or `tensor`
        (Megatron's per-rank [gate; up]); None: concatenated.
    vocab: dim 0 is the vocabulary: vocab_size rows outside, megajax's zero padding inside.
    split: tensor-parallel layout of formats stored per rank: `column` (dim 0), `row` (dim 1),
        `replicated`.
    aliases: other names accepted on import (Transformer Engine's fused norms).
    copy: a duplicate another row holds (Megatron's last-stage copy of tied embeddings): written
        where the format keeps it, skipped on import.
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
        assert set(options) <= {f.name for f in dataclasses.fields(Row)}, options
        for key, value in dict(options, name=name, parts=parts).items():
            object.__setattr__(self, key, value)

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.name

    @property
    def stack(self) -> str | None:
        """The stack (`layers/` or `dense_layers/`; a hybrid's slot `layers/layer{j}/`) of a per-layer
        row's parameters."""
        if not self.per_layer:
            return None
        slot = _HYBRID_SLOT.match(self.parts[0].path)
        return slot.group(0) if slot else self.parts[0].path.split("/")[0] + "/"

    def in_stack(self, stack: str) -> "Row":
        """This per-layer row with its `layers/` parameters read from `stack` instead."""
        options = {f.name: getattr(self, f.name) for f in dataclasses.fields(Row) if f.name not in ("name", "parts")}
        return Row(self.name, *(dataclasses.replace(p, path=stack + p.path.split("/", 1)[1]) for p in self.parts),
                   **options)

    def as_copy(self) -> "Row":
        """This row as a duplicate another row holds (written, skipped on import)."""
        options = {f.name: getattr(self, f.name) for f in dataclasses.fields(Row) if f.name not in ("name", "parts")}
        return Row(self.name, *self.parts, **dict(options, copy=True))

    @property
    def expert(self) -> int | None:
        """The expert a row expanded per expert holds (its parts' slice of the expert dim)."""
        return self.parts[0].expert

    def for_expert(self, j: int) -> "Row":
        options = {f.name: getattr(self, f.name) for f in dataclasses.fields(Row) if f.name not in ("name", "parts")}
        return Row(self.name.replace("{j}", str(j)),
                   *(dataclasses.replace(p, expert=j) for p in self.parts), **options)

    def names(self, i: int | None = None) -> tuple[str, ...]:
        """The name for layer `i`, then its aliases."""
        return tuple(n.replace("{i}", str(i)) for n in (self.name,) + self.aliases)


def linear_rows(name: str, ours: str, n_in: int = 1, split: str = "replicated", kind=linear) -> tuple[Row, Row]:
    """`{name}.weight` from `{ours}/kernel` and `{name}.bias` from `{ours}/bias` (replicated when row-parallel)."""
    return (Row(f"{name}.weight", kind(f"{ours}/kernel", n_in=n_in), split=split),
            Row(f"{name}.bias", flat(f"{ours}/bias"), split="column" if split == "column" else "replicated"))


def norm_rows(name: str, ours: str, aliases: tuple[str, str] = ()) -> tuple[Row, Row]:
    """`{name}.weight` from `{ours}/scale` and `{name}.bias` from `{ours}/bias` (LayerNorm)."""
    return tuple(Row(f"{name}.{w}", flat(f"{ours}/{p}"), aliases=aliases[k:k + 1])
                 for k, (w, p) in enumerate((("weight", "scale"), ("bias", "bias"))))


def rows_for(table: tuple[Row, ...], shapes: dict[str, tuple[int, ...]], fmt: str) -> list[Row]:
    """The rows of `table` that apply to a model with layout `shapes`; CheckpointError for a parameter
    no row holds."""
    out = []
    for row in table:
        variants = [row] + ([row.in_stack("dense_layers/")] if row.per_layer and row.stack == "layers/" else [])
        for r in variants:  # a copy (of a tensor another row holds) is one per name whatever its stack
            held = {(x.name, None if x.copy else x.stack) for x in out}
            if (r.name, None if r.copy else r.stack) not in held and all(p.path in shapes for p in r.parts):
                out.append(r)
    # A `{j}` row becomes one row per expert (the count: the parameter's dim after the layer's).
    out = [e for r in out for e in ([r.for_expert(j) for j in range(_num_experts(r, shapes))]
                                    if "{j}" in r.name else [r])]
    unheld = sorted(set(shapes) - {p.path for row in out for p in row.parts})
    if unheld:
        raise CheckpointError(f"the {fmt} format has no place for the parameters {', '.join(unheld)}; "
                              f"this model cannot be written as {fmt}.")
    return out


def layer_rows(rows: list[Row], m: ModelConfig, layer: int) -> Iterator[tuple[Row, int]]:
    """(row, slot) for the per-layer rows holding model layer `layer`: those of its stack, `slot`
    its index in that stack (a hybrid's: its group's)."""
    if m.hybrid_layer_pattern:
        g, pattern = len(m.hybrid_group()), m.hybrid_pattern()
        stack, slot = f"layers/layer{layer % g}/", layer // g
        if pattern[layer] == "E":  # a hybrid's rows of `layers/` itself: per MoE layer (the expert bias)
            yield from ((r, pattern[:layer].count("E")) for r in rows if r.per_layer and r.stack == "layers/")
    else:
        stack, slot = layer_slots(m)[layer]
    yield from ((r, slot) for r in rows if r.per_layer and r.stack == stack)


def in_layer_order(rows: list[Row], m: ModelConfig) -> Iterator[tuple[Row, int | None, int | None]]:
    """(row, layer, slot): the rows before the per-layer ones, those layer by layer (`slot`: the
    layer's index in the row's stack), the multi-token prediction depths' as the layers after the
    last (layer num_layers + k, slot k; a copy of an unstacked tensor named per depth: slot None),
    then the rest."""
    per_layer = [r for r in rows if r.per_layer]
    start = rows.index(per_layer[0]) if per_layer else len(rows)
    yield from ((r, None, None) for r in rows[:start] if not r.per_layer)
    yield from ((r, i, slot) for i in range(m.num_layers) for r, slot in layer_rows(rows, m, i))
    depth_rows = [r for r in per_layer if not r.stack.startswith(STACKS)]
    yield from ((r, m.num_layers + k, k if r.stack == MTP_STACK else None)
                for k in range(m.mtp_num_layers) for r in depth_rows)
    yield from ((r, None, None) for r in rows[start:] if not r.per_layer)


def _num_experts(row: Row, shapes: dict) -> int:
    return shapes[row.parts[0].path][1]


def _layer_shape(shapes: dict, path: str, part: Part | None = None) -> tuple[int, ...]:
    """One layer's shape of a parameter (one expert's, for a part of a row expanded per expert)."""
    shape = shapes[path][1:] if stacked(path) or path.startswith(MTP_STACK) else shapes[path]
    return shape[1:] if part is not None and part.expert is not None else shape


def index(slot: int | None, row: Row) -> tuple | type(Ellipsis):
    """Where a `to_ours` tensor of `row` at stack index `slot` goes in the whole (stacked) parameter."""
    idx = tuple(k for k in (slot, row.expert) if k is not None)
    return idx if idx else ...


def _groups(row: Row, m: ModelConfig, tensor: int) -> int:
    if row.groups == "vision_heads":
        return m.vision.num_heads
    return {None: 1, "kv_heads": m.num_kv_heads, "tensor": tensor}[row.groups]


def external_shape(row: Row, shapes: dict, m: ModelConfig, *, vocab_rows: int | None = None) -> tuple[int, ...]:
    """Shape of the whole external tensor; a vocabulary has `vocab_rows` rows (default vocab_size)."""
    part_shapes = [p.external_shape(_layer_shape(shapes, p.path, p)) for p in row.parts]
    out = list(part_shapes[0])
    out[row.axis] = sum(s[row.axis] for s in part_shapes)
    if row.vocab:
        out[0] = vocab_rows or m.vocab_size
    return tuple(out)


def _join(xs: list[np.ndarray], axis: int, groups: int) -> np.ndarray:
    if len(xs) == 1:
        return xs[0]
    blocks = [np.moveaxis(x, axis, 0) for x in xs]
    joined = np.concatenate([b.reshape((groups, -1) + b.shape[1:]) for b in blocks], 1)  # [groups, ...]
    return np.moveaxis(joined.reshape((-1,) + joined.shape[2:]), 0, axis)


def _unjoin(y: np.ndarray, sizes: list[int], axis: int, groups: int) -> list[np.ndarray]:
    y = np.moveaxis(y, axis, 0)
    y = y.reshape((groups, -1) + y.shape[1:])
    pieces = np.split(y, np.cumsum([s // groups for s in sizes])[:-1], axis=1)
    return [np.moveaxis(p.reshape((-1,) + p.shape[2:]), 0, axis) for p in pieces]


def _shard(x: np.ndarray, split: str, rank: int, size: int, rows: int | None = None) -> np.ndarray:
    """Rank `rank`'s piece of x (of `size` ranks) for a `split` layout, a view where it can be; with
    `rows`, dim 0 counts as zero-padded to that size (a vocabulary) without padding the whole."""
    if split == "replicated":
        return x
    axis = 0 if split == "column" else 1
    n = (rows or x.shape[axis]) // size
    piece = x[(slice(None),) * axis + (slice(rank * n, (rank + 1) * n),)]
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n - piece.shape[axis])
    return np.pad(piece, pad) if pad[axis][1] else piece


def to_external(row: Row, read: Callable[[str], np.ndarray], m: ModelConfig, *, tensor: int = 1,
                rank: int | None = None, vocab_rows: int | None = None) -> np.ndarray:
    """The external tensor of `row` (a vocabulary cut to vocab_size rows), `read(path)` giving one
    megajax tensor (one layer of a stacked one). With `rank`: only that tensor rank's piece, a
    vocabulary padded to `vocab_rows`; joined parts are split before they are joined (less memory)."""
    parts = [p.to_external(read(p.path)) for p in row.parts]
    if row.vocab:
        parts = [parts[0][:m.vocab_size]]
    groups = _groups(row, m, tensor)
    if rank is None or row.split == "replicated":
        return _join(parts, row.axis, groups)
    if len(parts) == 1:
        return _shard(parts[0], row.split, rank, tensor, vocab_rows if row.vocab else None)
    assert row.axis == (row.split == "row") and groups % tensor == 0, (row, groups, tensor)
    return _join([_shard(x, row.split, rank, tensor) for x in parts], row.axis, groups // tensor)


def to_ours(row: Row, name: str, y: np.ndarray, shapes: dict, m: ModelConfig, *, tensor: int = 1,
            vocab_rows: int | None = None, mismatch: Callable[[str, tuple, tuple], Exception]) -> dict:
    """{path: megajax tensor (one layer)} from `y`, the external tensor `name` of `row`.

    `tensor`: the rank count a `groups="tensor"` row was written for; `vocab_rows`: the stored
    vocabulary rows. A shape other than the model implies raises `mismatch(what, got, want)`,
    `what` naming the first part when a joined tensor is off along its join axis alone.
    """
    targets = [_layer_shape(shapes, p.path, p) for p in row.parts]
    sizes = [p.external_shape(t)[row.axis] for p, t in zip(row.parts, targets)]
    want, got, a = external_shape(row, shapes, m, vocab_rows=vocab_rows), tuple(y.shape), row.axis
    if got != want:
        total, first = sum(sizes), row.parts[0]
        if len(sizes) == 1 or len(got) != len(want) or got[:a] + got[a + 1:] != want[:a] + want[a + 1:] \
                or got[a] * sizes[0] % total:
            raise mismatch(name, got, want)
        part_want = first.external_shape(targets[0])
        raise mismatch(f"{name} ({first.path.split('/')[-2]})",
                       part_want[:a] + (got[a] * sizes[0] // total,) + part_want[a + 1:], part_want)
    if row.vocab:  # vocab_size rows, then megajax's zero padding
        y = y[:m.vocab_size]
        y = np.pad(y, [(0, row.parts[0].external_shape(targets[0])[0] - y.shape[0])] + [(0, 0)] * (y.ndim - 1))
    pieces = _unjoin(y, sizes, row.axis, _groups(row, m, tensor)) if len(sizes) > 1 else [y]
    return {p.path: p.to_ours(piece, t) for p, piece, t in zip(row.parts, pieces, targets)}
