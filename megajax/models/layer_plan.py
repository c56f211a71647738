"""Which layer of which kind runs where: one description read by training, the pipeline and generation.

A model's layers are held in stacks of one kind each (`kinds`): a transformer's `layers` (and a
MoE model's dense layers, `dense_layers`), a hybrid's per-slot stacks `layers/layer{j}`. Layer n
is row `row(n)` of its kind's stack, and a router layer (a mixture of experts) is also row
`router_row(n)` of the routers' expert bias and statistics.

A run of consecutive layers (the whole model, or a pipeline chunk) is walked as `segments`: each a
unit of kinds repeated, scanned over its repeats (so compile time does not grow with depth) with
the unit's layers unrolled in the body. The segments are chosen to unroll as few layers as possible:
a plain model is one segment of one layer; a dense-first model two; dense layers between MoE layers
one segment of groups; a hybrid pattern its repeats (an irregular pattern its own runs).

`StagePlan` lays the stacks out for a pipeline (megajax/pipeline_layout.py gives each chunk's
layers): stage s holds rows [s S, (s + 1) S) of every kind's stage form, its chunks' layers of
that kind one after the other (padding rows, zeros, after them); chunk (s, v) reads a window of
`window` rows from `offset[s, v]`. A chunk's program is one of a few `branches` (its segments,
rows counted from its window), chosen per (stage, chunk) by `branch[s, v]`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from megajax.config import ModelConfig


@dataclass(frozen=True)
class Kind:
    """One stack of layers: its path in the parameter tree and whether its layers route (MoE)."""
    path: tuple[str, ...]
    router: bool

    @property
    def name(self) -> str:
        return "/".join(self.path)


@dataclass(frozen=True)
class Segment:
    """`repeats` repeats of `unit` (kind indices in model order) from model layer `first_layer`;
    `rows[k]`: the row of kind k's first layer here, `router_row` that of the first router layer
    (both counted from wherever the walk's stacks start)."""
    unit: tuple[int, ...]
    repeats: int
    first_layer: int
    rows: tuple[int, ...]
    router_row: int

    def counts(self, kinds: int) -> tuple[int, ...]:
        return tuple(self.unit.count(k) for k in range(kinds))

    @property
    def layers(self) -> int:
        return self.repeats * len(self.unit)


@dataclass(frozen=True)
class LayerPlan:
    kinds: tuple[Kind, ...]
    kind_of: tuple[int, ...]  # per model layer

    @property
    def num_layers(self) -> int:
        return len(self.kind_of)

    def row(self, n: int) -> int:
        """Layer n's row in its kind's stack."""
        return self.kind_of[:n].count(self.kind_of[n])

    def router_row(self, n: int) -> int | None:
        if not self.kinds[self.kind_of[n]].router:
            return None
        return sum(self.kinds[k].router for k in self.kind_of[:n])

    def is_router(self, n: int) -> bool:
        return self.kinds[self.kind_of[n]].router

    def count(self, kind: int, layers: range) -> int:
        return sum(self.kind_of[n] == kind for n in layers)

    def routers(self, layers: range) -> int:
        return sum(self.is_router(n) for n in layers)

    def segments(self, layers: range | None = None) -> tuple[Segment, ...]:
        """The walk of `layers` (default all) as segments; rows counted from the range's first layer of
        each kind (and router)."""
        layers = range(self.num_layers) if layers is None else layers
        return self.segments_of(tuple(self.kind_of[n] for n in layers))

    def segments_of(self, seq: tuple[int, ...]) -> tuple[Segment, ...]:
        """The walk of a sequence of kinds as segments (first_layer: positions in `seq`)."""
        routers = tuple(self.kinds[k].router for k in range(len(self.kinds)))
        out, i = [], 0
        for unit, repeats in _decompose(seq):
            done = seq[:i]
            rows = tuple(done.count(k) for k in range(len(self.kinds)))
            out.append(Segment(unit, repeats, i, rows, sum(routers[k] for k in done)))
            i += len(unit) * repeats
        return tuple(out)


@functools.lru_cache(maxsize=256)
def _decompose(seq: tuple[int, ...]) -> tuple[tuple[tuple[int, ...], int], ...]:
    """`seq` as runs (unit, repeats) with unit * repeats covering it in order, unrolling the fewest
    layers (the units' lengths, and half a layer per run: fewer runs where it is a tie)."""
    n = len(seq)
    best = [0.0] * (n + 1)
    choice: list[tuple[int, int]] = [(0, 0)] * (n + 1)
    for i in range(n - 1, -1, -1):
        best[i], choice[i] = float("inf"), (0, 0)
        for u in range(1, n - i + 1):
            j = i + u  # extend the period-u run as far as it goes
            while j < n and seq[j] == seq[j - u]:
                j += 1
            for r in range(1, (j - i) // u + 1):
                cost = u + 0.5 + best[i + r * u]
                if cost < best[i]:
                    best[i], choice[i] = cost, (u, r)
    out, i = [], 0
    while i < n:
        u, r = choice[i]
        out.append((seq[i:i + u], r))
        i += u * r
    return tuple(out)


def layer_plan(m: ModelConfig) -> LayerPlan:
    """The stacks of a model and where each of its layers is."""
    n, e = m.num_layers, bool(m.num_experts)
    if m.hybrid_layer_pattern:
        group = m.hybrid_group()
        kinds = tuple(Kind(("layers", f"layer{j}"), c == "E") for j, c in enumerate(group))
        return LayerPlan(kinds, tuple(i % len(group) for i in range(n)))
    k = m.dense_first_layers()
    if k:
        return LayerPlan((Kind(("dense_layers",), False), Kind(("layers",), True)),
                         tuple(0 if i < k else 1 for i in range(n)))
    if m.interleaves_dense_layers():
        f = m.moe_layer_freq
        return LayerPlan((Kind(("layers",), True), Kind(("dense_layers",), False)),
                         tuple(0 if i % f == 0 else 1 for i in range(n)))
    return LayerPlan((Kind(("layers",), e),), (0,) * n)


# ----------------------------------------------------------------------------
# Walking a run of layers
# ----------------------------------------------------------------------------

def walk(plan: LayerPlan, segments: tuple[Segment, ...], stacks: list, x, layer: Callable, *,
         first_layer=0, bias=None, caches: list | None = None, unroll=1, checkpoint: Callable | None = None):
    """Runs the segments' layers on x: `stacks[k]` kind k's parameters (a tree of arrays [rows, ...]),
    `bias` the router rows [rows, E] or None, `caches[k]` kind k's per-layer state (a tree [rows, ...])
    or None; `layer(k, params, x, index, bias_row, cache) -> (x, stats, cache)` runs one layer (index:
    its model layer, `first_layer` + the segment's). Returns (x, the router layers' stats stacked in
    model order or None, the caches). `checkpoint`: applied to each repeat's body (full recompute)."""
    kinds = len(plan.kinds)
    all_stats = []
    new_caches = [None if caches is None else caches[k] for k in range(kinds)]
    cache_parts: list[list] = [[] for _ in range(kinds)]
    for seg in segments:
        counts, r = seg.counts(kinds), seg.repeats
        nb = sum(plan.kinds[k].router for k in seg.unit)

        def rows(tree, start, c):
            return jax.tree.map(lambda a: a[start:start + r * c].reshape((r, c) + a.shape[1:]), tree)

        xs_params = {k: rows(stacks[k], seg.rows[k], c) for k, c in enumerate(counts) if c}
        xs_caches = {k: rows(caches[k], seg.rows[k], c) for k, c in enumerate(counts)
                     if c and caches is not None and caches[k] is not None}
        xs_bias = None if bias is None or not nb else bias[seg.router_row:seg.router_row + r * nb].reshape(
            (r, nb) + bias.shape[1:])

        def body(x, xs, seg=seg):
            params, cache, b, i = xs
            seen, stats, nr = [0] * kinds, [], 0
            out_cache = {k: [] for k in cache}
            for pos, k in enumerate(seg.unit):
                one = jax.tree.map(lambda a, j=seen[k]: a[j], params[k])
                c = None if k not in cache else jax.tree.map(lambda a, j=seen[k]: a[j], cache[k])
                brow = None
                if plan.kinds[k].router:
                    brow = None if b is None else b[nr]
                    nr += 1
                index = first_layer + seg.first_layer + i * len(seg.unit) + pos
                x, s, c = layer(k, one, x, index, brow, c)
                if plan.kinds[k].router:
                    stats.append(s)
                if k in cache:
                    out_cache[k].append(c)
                seen[k] += 1
            stacked = None if not stats or stats[0] is None else jax.tree.map(lambda *a: jnp.stack(a), *stats)
            return x, (stacked, {k: jax.tree.map(lambda *a: jnp.stack(a), *v) for k, v in out_cache.items()})

        run = checkpoint(body) if checkpoint is not None else body
        x, (stats, cache_out) = jax.lax.scan(run, x, (xs_params, xs_caches, xs_bias, jnp.arange(r)), unroll=unroll)
        if stats is not None:
            all_stats.append(jax.tree.map(lambda a: a.reshape((r * nb,) + a.shape[2:]), stats))
        for k, c in cache_out.items():
            cache_parts[k].append(jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), c))
    stats = None
    if all_stats:
        stats = all_stats[0] if len(all_stats) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *all_stats)
    for k, parts in enumerate(cache_parts):
        if parts:
            new_caches[k] = parts[0] if len(parts) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *parts)
    return x, stats, new_caches


# ----------------------------------------------------------------------------
# The pipeline's stage form
# ----------------------------------------------------------------------------

@dataclass(frozen=True)
class StageRows:
    """One row space (a kind's stack, or the routers') laid out over the stages: stage s holds rows
    [s stage_rows, (s + 1) stage_rows) of the stage form; chunk (s, v) reads `window` of them from
    `offset[s][v]` (its layers first, `count[s][v]` of them); `rows[i]` is the logical row at stage
    form row i, -1 for padding."""
    stage_rows: int
    window: int
    offset: tuple[tuple[int, ...], ...]
    count: tuple[tuple[int, ...], ...]
    rows: tuple[int, ...]

    @property
    def logical(self) -> int:
        return sum(r >= 0 for r in self.rows)

    def to_stage_index(self) -> np.ndarray:
        """[stage form rows]: the logical row each stage row takes, `logical` (one past the end: a zero
        row the caller appends) for padding."""
        rows = np.asarray(self.rows, np.int32)
        return np.where(rows < 0, self.logical, rows).astype(np.int32)

    def to_logical_index(self) -> np.ndarray:
        """[logical rows]: the stage form row each logical row is at."""
        out = np.zeros(self.logical, np.int32)
        for i, r in enumerate(self.rows):
            if r >= 0:
                out[r] = i
        return out

    def padding(self) -> int:
        return len(self.rows) - self.logical


def _stage_rows(counts: np.ndarray) -> StageRows:
    """From [P, V] layer counts of one row space (chunks in model order c = v P + s)."""
    p, v = counts.shape
    window = int(counts.max()) if counts.size else 0
    offset = np.zeros((p, v), np.int64)
    for s in range(p):
        offset[s] = np.concatenate([[0], np.cumsum(counts[s])[:-1]])
    # Every chunk's window inside its stage's rows (a chunk with layers reads `window` from its offset).
    need = [int(offset[s, c] + window) for s in range(p) for c in range(v) if counts[s, c]] or [0]
    stage = max(need + [int(counts[s].sum()) for s in range(p)])
    first = np.zeros((p, v), np.int64)  # the logical row of chunk (s, v)'s first layer
    running = 0
    for c in range(v):
        for s in range(p):
            first[s, c] = running
            running += counts[s, c]
    rows = np.full(p * stage, -1, np.int64)
    for s in range(p):
        for c in range(v):
            for j in range(counts[s, c]):
                rows[s * stage + offset[s, c] + j] = first[s, c] + j
    return StageRows(stage, window, tuple(map(tuple, offset.tolist())), tuple(map(tuple, counts.tolist())),
                     tuple(rows.tolist()))


@dataclass(frozen=True)
class StagePlan:
    """A layer plan laid out on a pipeline: per kind (and the routers) its stage form; per chunk its
    first model layer and its branch, the branches' segments.

    `uniform`: every chunk runs one program, the shortest common run of kinds of all chunks
    (`branches[0]`, positions 0..n-1), each position a layer of the chunk (`real[s][v][j]`, model
    layer `layer_of[s][v][j]`) or a padding row computed on and dropped. For chunks that hold
    collectives every device must join in step (a ring's permutes: the CPU runtime meets each with
    all devices of the permute, every stage's): a chunk with fewer layers would leave the others
    waiting."""
    plan: LayerPlan
    stages: int
    virtual: int
    kinds: tuple[StageRows, ...]
    router: StageRows
    first_layer: tuple[tuple[int, ...], ...]  # [P][V]
    branch: tuple[tuple[int, ...], ...]  # [P][V]
    branches: tuple[tuple[Segment, ...], ...]
    uniform: bool = False
    real: tuple = ()  # uniform: [P][V][positions] bools
    layer_of: tuple = ()  # uniform: [P][V][positions] model layers (0 at padding)

    def kind_at(self, path: tuple[str, ...]) -> int | None:
        """The kind whose stack holds the parameter at `path` (None: not a stacked parameter)."""
        for k, kind in enumerate(self.plan.kinds):
            if tuple(path[:len(kind.path)]) == kind.path:
                return k
        return None

    def padding_layers(self) -> int:
        return sum(k.padding() for k in self.kinds)


def _common_run(seqs: list[tuple[int, ...]]) -> tuple[int, ...]:
    """A short sequence every one of `seqs` is a subsequence of (pairwise shortest common supersequences)."""
    out: tuple[int, ...] = ()
    for b in seqs:
        a, n, m = out, len(out), len(b)
        lcs = np.zeros((n + 1, m + 1), np.int64)
        for i in range(n - 1, -1, -1):
            for j in range(m - 1, -1, -1):
                lcs[i, j] = lcs[i + 1, j + 1] + 1 if a[i] == b[j] else max(lcs[i + 1, j], lcs[i, j + 1])
        i = j = 0
        merged = []
        while i < n or j < m:
            if i < n and j < m and a[i] == b[j]:
                merged.append(a[i])
                i, j = i + 1, j + 1
            elif j == m or (i < n and lcs[i + 1, j] >= lcs[i, j + 1]):
                merged.append(a[i])
                i += 1
            else:
                merged.append(b[j])
                j += 1
        out = tuple(merged)
    return out


def _uniform_plan(plan: LayerPlan, span, p: int, v: int) -> StagePlan:
    """stage_plan's `uniform` form: every chunk one program (the chunks' common run of kinds), each
    chunk's layers at the positions of that run they embed in, every kind's window the run's."""
    seqs = {(s, c): tuple(plan.kind_of[n] for n in span(s, c)) for s in range(p) for c in range(v)}
    run = _common_run(list(seqs.values()))
    kinds = len(plan.kinds)
    routers = [plan.kinds[k].router for k in run]
    real = np.zeros((p, v, len(run)), bool)
    layer_of = np.zeros((p, v, len(run)), np.int64)
    for (s, c), seq in seqs.items():
        j = 0
        for pos, k in enumerate(run):  # leftmost embedding
            if j < len(seq) and seq[j] == k:
                real[s, c, pos], layer_of[s, c, pos] = True, span(s, c)[j]
                j += 1
        assert j == len(seq), (seq, run)

    def rows_of(positions, logical_row) -> StageRows:
        w = len(positions)
        rows = np.full(p * v * w, -1, np.int64)
        count = np.zeros((p, v), np.int64)
        for s in range(p):
            for c in range(v):
                for i, pos in enumerate(positions):
                    if real[s, c, pos]:
                        rows[s * v * w + c * w + i] = logical_row(int(layer_of[s, c, pos]))
                        count[s, c] += 1
        offset = tuple(tuple(c * w for c in range(v)) for _ in range(p))
        return StageRows(v * w, w, offset, tuple(map(tuple, count.tolist())), tuple(rows.tolist()))

    stage_kinds = tuple(rows_of([i for i, k in enumerate(run) if k == kind], plan.row) for kind in range(kinds))
    router = rows_of([i for i, r in enumerate(routers) if r], plan.router_row)
    first_layer = tuple(tuple(span(s, c).start for c in range(v)) for s in range(p))
    return StagePlan(plan, p, v, stage_kinds, router, first_layer, tuple((0,) * v for _ in range(p)),
                     (plan.segments_of(run),), True, tuple(map(lambda a: tuple(map(tuple, a)), real.tolist())),
                     tuple(map(lambda a: tuple(map(tuple, a)), layer_of.tolist())))


def stage_plan(plan: LayerPlan, chunks: tuple[int, ...], stages: int, virtual: int,
               uniform: bool = False) -> StagePlan:
    """The stage form of `plan` for a pipeline whose chunk c = v P + s holds chunks[c] layers (`uniform`:
    every chunk one program, StagePlan's docstring)."""
    p, v = stages, virtual
    first = np.concatenate([[0], np.cumsum(chunks)]).astype(int)
    span = lambda s, c: range(first[c * p + s], first[c * p + s + 1])
    if uniform:
        return _uniform_plan(plan, span, p, v)
    kinds = tuple(_stage_rows(np.array([[plan.count(k, span(s, c)) for c in range(v)] for s in range(p)]))
                  for k in range(len(plan.kinds)))
    router = _stage_rows(np.array([[plan.routers(span(s, c)) for c in range(v)] for s in range(p)]))
    branches, branch = [], np.zeros((p, v), np.int64)
    for s in range(p):
        for c in range(v):
            segs = plan.segments(span(s, c))
            if segs not in branches:
                branches.append(segs)
            branch[s, c] = branches.index(segs)
    first_layer = tuple(tuple(int(first[c * p + s]) for c in range(v)) for s in range(p))
    return StagePlan(plan, p, v, kinds, router, first_layer, tuple(map(tuple, branch.tolist())), tuple(branches))
