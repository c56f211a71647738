"""Pipeline parallelism: GPipe, 1F1B and interleaved 1F1B as one SPMD program over `pipeline`.

The stacked blocks' parameters `[layers, ...]` are split over the `pipeline` mesh
axis: stage s holds a consecutive run of layers/P of them, or, with V virtual
stages (interleaved), V chunks of layers/(P V), chunk v of stage s being model
chunk v P + s. The embedding, the final norm and the output layer enter every
stage whole (the embedding and output layer gathered by the caller: the stages
keep them split between steps, and `scatter` reduce-scatters their gradients
back); the first stage runs the embedding and the last stage the final norm,
output layer and loss. So do the stacks every stage holds whole (the `stack`
logical axis): a dense-first model's dense layers run with the embedding, the
multi-token prediction depths with the loss, a vision-language model's encoder
with the embedding (its weights enter whole, the caller's gather; the images
whole over `context`).

A schedule is a table, built here in Python: for every tick t and stage s,
which microbatch (and chunk) the stage runs forward and which it runs
backward, and which stash slot holds the forward's residuals until its backward.
Every device runs the same program: one `shard_map` manual over every mesh
axis, each device holding its own shards of the weights and of every
microbatch, with tensor, sequence, context and expert parallelism written as
explicit collectives (the functions megajax/parallel/ uses outside the stages
too). Per tick a forward half and a backward half, each a `lax.cond`. When
the chunks hold collectives (an all-reduce over `tensor`, a ring hop over
`context`, an all-to-all over `expert`), the branches are taken on whether any
stage runs that half at that tick, alike on every device, so every device
joins every collective; a stage with no work of its own in the half computes
on zeros and drops the result (on GPUs this costs no time: a tick lasts as
long as its busiest stage). Otherwise each stage branches on its own table
entry, and an idle half does no work. After each half one `ppermute` sends
the activation to the next stage (forward) or the input cotangent to the
previous stage (backward). Both transfers arrive exactly when the receiver's
table asks for them, so nothing else crosses stages.

The forward half takes its chunk's VJP as it runs it and stashes the residuals
(the activations the backward reads; megajax/parallel/stash.py leaves out those
the weights alone determine, a weight's cast or concatenation, and recomputes
them from the weights in the backward); the backward half puts the VJP back
together from its stash slot and runs it. So nothing is recomputed but what
`parallel.recompute` asks for (the model's own checkpoints: every layer's input
kept with `full`, the attention core recomputed with `selective`), as without a
pipeline. The last stage's last chunk also stashes its output; its backward half
runs the output layer and the loss on it and starts the cotangent there, so the
gradients of a whole step are computed by hand inside one scan, never by
differentiating the scan. The schedules differ only in their tables:

- gpipe: every forward, then every backward. Stash: all M microbatches.
- 1f1b: the last stage runs a microbatch's backward the tick its forward ends,
  and each earlier stage one tick after the next one; in the steady state each
  tick runs one forward and one backward (Megatron's one-forward-one-backward),
  and the residuals of at most 2 (P - 1 - s) + 1 microbatches are stashed on
  stage s, whatever M is.
- interleaved: V chunks per stage in Megatron's order (groups of P microbatches
  run chunk 0, 1, ..., V - 1 forward, and V - 1, ..., 0 backward); needs M a
  multiple of P; the last stage's output of chunk v goes round to the first
  stage's chunk v + 1. Bubble (P - 1) / (V M + P - 1).

Gradients of the layers stay on their stage; those of the embedding and head
(and of a tied embedding, used at both ends) are summed over `pipeline` once
per step (reduce-scattered onto the stages' shares where the caller keeps them
split).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from megajax.mesh import entry_axes, like, mesh_sizes, spec_axes, spec_entry, spec_without, varying_axes
from megajax.parallel.stash import split_vjp

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class Schedule:
    """The tick tables of a pipeline schedule: [ticks, stages] int32 each, -1 where idle.

    `fwd_chunk[t, s]`, `fwd_micro[t, s]`: the chunk (virtual stage, 0..V-1) and microbatch stage s
    runs forward at tick t; `fwd_slot` the stash slot its input goes to. `bwd_*` the same for the
    backward half, which reads `bwd_slot`."""
    name: str
    stages: int
    virtual: int
    microbatches: int
    fwd_chunk: np.ndarray
    fwd_micro: np.ndarray
    fwd_slot: np.ndarray
    bwd_chunk: np.ndarray
    bwd_micro: np.ndarray
    bwd_slot: np.ndarray
    stash: int  # stash slots per stage (the most any stage uses: each device's buffers have that many)

    @property
    def ticks(self) -> int:
        return self.fwd_chunk.shape[0]

    @property
    def bubble_fraction(self) -> float:
        """Idle share of a stage's time, with a forward half costing 1/3 and a backward half 2/3
        of a tick's work on a chunk, and a tick lasting as long as the busiest stage's work."""
        f, b = 1.0, 2.0
        busy_f = (self.fwd_chunk >= 0).any(axis=1)
        busy_b = (self.bwd_chunk >= 0).any(axis=1)
        wall = f * busy_f.sum() + b * busy_b.sum()
        work = self.virtual * self.microbatches * (f + b)
        return float(1.0 - work / wall)

    @property
    def head_stash(self) -> int:
        """Slots for the last stage's chunk outputs waiting for the output layer and loss (its
        backward half runs them): the slots the last stage uses (1 for 1F1B)."""
        return int(self.fwd_slot[:, -1].max()) + 1

    def max_in_flight(self) -> int:
        """The most microbatches any stage holds residuals of at once (what activation memory scales with)."""
        return self.stash


def _orders(name: str, p: int, v: int, m: int) -> tuple[list, list]:
    """(forward order, backward order) of (chunk, microbatch) items, the same on every stage."""
    if v == 1:
        items = [(0, i) for i in range(m)]
        return items, list(items)
    fwd, bwd = [], []
    for g in range(m // p):
        for r in range(v):
            fwd += [(r, g * p + j) for j in range(p)]
        for r in reversed(range(v)):
            bwd += [(r, g * p + j) for j in range(p)]
    return fwd, bwd


def build_schedule(name: str, stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The tables of schedule `name` for P stages, M microbatches and V virtual stages per stage.

    Stage s runs its n-th forward at tick n + s, so an activation sent by stage s at tick t is
    what stage s + 1 runs at t + 1 (and, interleaved, stage P - 1's output of chunk v is what
    stage 0 runs as chunk v + 1 one tick later). The n-th backward runs at tick n + D + P - 1 - s,
    D the smallest delay that keeps every backward at or after its forward on every stage (1F1B,
    interleaved), or the end of the forwards (GPipe)."""
    p, v, m = stages, virtual, microbatches
    # The plan refuses what does not fit, naming the keys (megajax/plan.py validate_pipeline).
    assert name in SCHEDULES and (v == 1 or name == "interleaved") and m >= p, (name, p, v, m)
    assert name != "interleaved" or m % p == 0, (name, p, m)
    fwd, bwd = _orders(name, p, v, m)
    f_index = {item: n for n, item in enumerate(fwd)}
    b_index = {item: n for n, item in enumerate(bwd)}
    # Smallest D with n_b + D + P - 1 - s >= n_f + s for every item and stage (worst: s = P - 1).
    delay = max(f_index[it] - b_index[it] for it in fwd) + p - 1
    if name == "gpipe":
        delay = max(delay, m + p - 2)
    ticks = len(bwd) - 1 + delay + p - 1 + 1
    tabs = {k: np.full((ticks, p), -1, np.int32) for k in ("fc", "fm", "fs", "bc", "bm", "bs")}
    stash = 0
    for s in range(p):
        free, slot_of = [], {}
        events = []  # (tick, half, item): forward half (0) before backward half (1) in a tick
        for n, it in enumerate(fwd):
            events.append((n + s, 0, it))
        for n, it in enumerate(bwd):
            events.append((n + delay + p - 1 - s, 1, it))
        used = 0
        for t, half, it in sorted(events):
            if half == 0:
                slot = free.pop(0) if free else used
                used = max(used, slot + 1)
                slot_of[it] = slot
                tabs["fc"][t, s], tabs["fm"][t, s], tabs["fs"][t, s] = it[0], it[1], slot
            else:
                slot = slot_of.pop(it)  # KeyError: a backward before its forward (a bug here)
                tabs["bc"][t, s], tabs["bm"][t, s], tabs["bs"][t, s] = it[0], it[1], slot
                free.append(slot)
                free.sort()
        stash = max(stash, used)
    sched = Schedule(name=name, stages=p, virtual=v, microbatches=m, fwd_chunk=tabs["fc"], fwd_micro=tabs["fm"],
                     fwd_slot=tabs["fs"], bwd_chunk=tabs["bc"], bwd_micro=tabs["bm"], bwd_slot=tabs["bs"],
                     stash=stash)
    check_schedule(sched)
    return sched


def check_schedule(sc: Schedule) -> None:
    """Asserts that every transfer arrives when its receiver runs it: a forward on stage s > 0 (or
    of chunk v > 0 on stage 0) runs one tick after the previous stage's forward of the same item,
    and a backward one tick after the next stage's; every item runs forward and backward once."""
    p, v = sc.stages, sc.virtual
    for t in range(sc.ticks):
        for s in range(p):
            c, i = sc.fwd_chunk[t, s], sc.fwd_micro[t, s]
            if c >= 0 and (s > 0 or c > 0):
                ps, pc = (s - 1, c) if s > 0 else (p - 1, c - 1)
                assert t > 0 and (sc.fwd_chunk[t - 1, ps], sc.fwd_micro[t - 1, ps]) == (pc, i), (t, s, c, i)
            c, i = sc.bwd_chunk[t, s], sc.bwd_micro[t, s]
            if c >= 0 and (s < p - 1 or c < v - 1):
                ns, nc = (s + 1, c) if s < p - 1 else (0, c + 1)
                assert t > 0 and (sc.bwd_chunk[t - 1, ns], sc.bwd_micro[t - 1, ns]) == (nc, i), (t, s, c, i)
    for tab in (sc.fwd_chunk, sc.bwd_chunk):
        assert ((tab >= 0).sum(axis=0) == v * sc.microbatches).all()


def stage_order(num_layers: int, stages: int, virtual: int) -> np.ndarray | None:
    """Model layer held at each row of the pipeline's layer array (stage-major: stage s's rows are
    its chunks 0..V-1 in order), or None when that is the model's own order (V = 1)."""
    if virtual == 1:
        return None
    per = num_layers // (stages * virtual)
    return np.asarray([(v * stages + s) * per + j for s in range(stages) for v in range(virtual)
                       for j in range(per)], np.int32)


def schedule_gradients(model_fns: "StageFunctions", sched: Schedule, mesh, params: dict, batch: dict,
                       rng: jax.Array | None, seed: jax.Array, grad_dtype, param_specs: dict, *, axis: str,
                       data_axes: tuple[str, ...] = (), router_seed: jax.Array | None = None,
                       maxed: dict | None = None, seq_axes: tuple[str, ...] = (),
                       token_axes: tuple[str, ...] = (), lockstep: bool = True,
                       scatter: dict | None = None) -> tuple[dict, dict, dict | None]:
    """(gradients of `seed` x the head's objective [+ `router_seed` x the router losses] w.r.t.
    `params`, the head's sums (its `loss` sum and whatever else it returns, summed over
    microbatches), the router sums or None) of one step's M microbatches through the pipeline.
    `batch` arrays are [M, micro x dp, seq]; `params` the model's tree with its stacked `layers`
    [layers, ...] (split over `axis`, the stage axis of the rules table); `rng` the step's dropout
    key (microbatch i uses fold_in(rng, i), as without a pipeline) or None. `param_specs`: where the
    parameters live during the step (split over `axis`, `tensor`, `expert`; not over the
    data-parallel axes, whose copies are gathered before).

    The stage loop is one shard_map, manual over every mesh axis: each device runs its own shard
    of every microbatch with its own shards of the weights, and every collective inside a stage is
    explicit (tensor and sequence parallelism: megajax/parallel/tensor.py; context parallelism,
    fused attention kernels: context.py; expert dispatch: experts.py). `data_axes`: the axes that
    split the batch (and `seq_axes`, those of them that split the sequence: context); each device
    keeps its own gradient sums over them, and the one data-parallel reduction of the step happens
    after the loop (an all-reduce, or a reduce-scatter onto the optimizer's shards). `token_axes`:
    the axes that split a stage's tokens between the layers besides those (`tensor` under sequence
    parallelism), over which the router statistics are summed. `lockstep`: the chunks hold
    collectives (tensor, context or expert parallelism): every device runs every branch some stage
    runs at a tick, so each joins them; without, a stage runs only its own work.

    A mixture-of-experts model (`model_fns.experts` > 0): each chunk also returns its layers'
    router losses (balancing + z, this shard's share of the whole microbatch's: the chunk sums its
    token counts over `data_axes` with the `data_sum` it is given), added to the objective with
    weight `router_seed`, and the router sums the metrics need: `aux`, `z`, `dropped` (summed over
    layers and microbatches) and `tokens` [layers, experts] (summed over microbatches).

    `maxed`: a tree like `params` of bools; where True the "gradient" is combined with max instead
    of summed (over microbatches, stages and data shards): the FP8 scales, whose cotangents are
    the amaxes the products saw (megajax/precision/fp8.py).

    `scatter`: a tree like `params` of ints; a parameter outside the stacked layers with a dim d >= 0
    there (the embedding's and output layer's vocabulary dim: kept split over `axis` between steps,
    megajax.mesh.vocab_storage_axes) has its gradient reduce-scattered over the stages onto dim d
    (returned split over `axis` there) instead of summed whole on every stage."""
    p, v = sched.stages, sched.virtual
    layers, other = params["layers"], {k: x for k, x in params.items() if k != "layers"}
    maxed = jax.tree.map(lambda _: False, params) if maxed is None else maxed
    max_layers, max_other = maxed["layers"], {k: x for k, x in maxed.items() if k != "layers"}
    scatter = jax.tree.map(lambda _: -1, params) if scatter is None else scatter
    scatter_other = {k: x for k, x in scatter.items() if k != "layers"}
    num_layers = jax.tree.leaves(layers)[0].shape[0]
    order = stage_order(num_layers, p, v)
    if order is not None:
        layers = jax.tree.map(lambda w: jnp.take(w, order, axis=0), layers)
    data_axes = tuple(data_axes)
    reduced = ((axis,) if p > 1 else ()) + data_axes
    loop = _StageLoop(model_fns, sched, axis, data_axes, reduced, tuple(token_axes), lockstep,
                      num_layers // (p * v), max_layers, max_other, scatter_other, grad_dtype, rng is not None)

    # Gradient sums get a leading dim over the data axes a weight's own spec does not split it over.
    is_spec = lambda x: isinstance(x, P)
    out_spec = lambda sp: P(spec_entry([a for a in data_axes if a not in spec_axes(sp)]), *sp) if data_axes else sp
    # Axes of size 1 left out: a value "split" over one is whole on every device (typed invariant).
    ones = {a for a, n in mesh_sizes(mesh).items() if n == 1}
    param_specs = jax.tree.map(lambda sp: P(*spec_without(sp, ones)), param_specs, is_leaf=is_spec)
    layer_in = param_specs["layers"]
    other_in = {k: x for k, x in param_specs.items() if k != "layers"}
    # A reduce-scattered gradient leaves split over `axis` on its dim (after the axes splitting it inside).
    def scattered(sp, d):
        entries = tuple(sp) + (None,) * (d + 1 - len(sp))
        return sp if d < 0 else P(*(spec_entry((*entry_axes(e), axis)) if n == d else e for n, e in enumerate(entries)))
    other_split = jax.tree.map(scattered, other_in, scatter_other, is_leaf=is_spec)
    layer_out, other_out = (jax.tree.map(out_spec, t, is_leaf=is_spec) for t in (layer_in, other_split))
    batch_axes = tuple(a for a in data_axes if a not in seq_axes)
    # [M, B, L] split over the sequence axes too; a vision-language model's images [M, B, N, H, W, 3]
    # whole over them (every context shard of a row runs the encoder on the row's images).
    seq = lambda k, x: (spec_entry(seq_axes),) if x.ndim > 2 and k != "images" else ()
    batch_spec = {k: P(None, spec_entry(batch_axes), *seq(k, x)) for k, x in batch.items()}
    router_out = {"aux": P(), "z": P(), "dropped": P(), "tokens": P(axis)}
    fn = jax.shard_map(loop.body, mesh=mesh, in_specs=(layer_in, other_in, batch_spec, P(), P(), P()),
                       out_specs=(layer_out, other_out, P(), router_out))
    rng = rng if rng is not None else jnp.zeros((2,), jnp.uint32)
    router_seed = jnp.zeros((), jnp.float32) if router_seed is None else router_seed.astype(jnp.float32)
    g_layers, g_other, head_sums, router_sums = fn(layers, other, batch, rng, seed, router_seed)
    if data_axes:  # the step's one data-parallel reduction (the caller places the result)
        g_layers, g_other = jax.tree.map(lambda m, g: jnp.max(g, axis=0) if m else jnp.sum(g, axis=0),
                                         (max_layers, max_other), (g_layers, g_other))
    if order is not None:
        inverse = np.argsort(order)
        g_layers = jax.tree.map(lambda g: jnp.take(g, inverse, axis=0), g_layers)
        router_sums["tokens"] = jnp.take(router_sums["tokens"], inverse, axis=0)
    return {**g_other, "layers": g_layers}, head_sums, router_sums if model_fns.experts > 0 else None


def _combine(tree_max, a, b):
    """a + b, or max(a, b) where `tree_max` says so."""
    return jax.tree.map(lambda m, x, y: jnp.maximum(x, y.astype(x.dtype)) if m else x + y.astype(x.dtype),
                        tree_max, a, b)


def _index(tree, i):
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _aval_axes(aval) -> tuple:
    """The manual mesh axes a traced value's abstract value varies over."""
    mat = getattr(aval, "manual_axis_type", None)
    return tuple(getattr(mat, "varying", ()) if mat is not None else getattr(aval, "vma", ()))


def _zeros(struct, axes=()):
    """Zeros of a ShapeDtypeStruct's shape and dtype, typed as varying over its manual axes and `axes`."""
    x = jnp.zeros(struct.shape, struct.dtype)
    mat = getattr(struct, "manual_axis_type", None)
    want = set(getattr(mat, "varying", ()) if mat is not None else getattr(struct, "vma", ())) | set(axes)
    return jax.lax.pcast(x, tuple(sorted(want)), to="varying") if want else x


@dataclass(frozen=True)
class _StageLoop:
    """The per-device program of the stage loop (`body`, run under shard_map over every mesh axis):
    one scan over the schedule's ticks, each a forward half and a backward half (see the module
    docstring), carrying the received activation and cotangent, the stash, the gradient sums, the
    head's sums and the router sums."""
    fns: "StageFunctions"
    sched: Schedule
    axis: str
    data_axes: tuple[str, ...]
    reduced: tuple[str, ...]  # the stage axis and the data axes: per-device sums, reduced after the loop
    token_axes: tuple[str, ...]  # axes splitting a stage's tokens within the layers (sequence parallelism)
    lockstep: bool  # every device runs every branch some stage runs (collectives inside the chunks)
    per: int  # layers per chunk
    max_layers: dict
    max_other: dict
    scatter_other: dict  # per parameter outside the layers: the dim its gradient is reduce-scattered onto, or -1
    grad_dtype: object
    use_rng: bool

    def stage_sum(self, x):
        """`x`, this device's share of its stage's tokens, summed over the other axes that split
        them besides the data axes (`token_axes`: `tensor` under sequence parallelism)."""
        return jax.lax.psum(x, self.token_axes) if self.token_axes else x

    def data_sum(self, x):
        """`x` summed over every device holding a part of the microbatch."""
        x = self.stage_sum(x)
        return jax.lax.psum(x, self.data_axes) if self.data_axes else x

    def vary(self, tree):
        """`tree` typed as varying over the stage and data axes: parameters used by every stage
        (and every data shard) are differentiated as this device's own copy (no implicit sum over
        stages or shards inside a branch); the copies' gradients are summed once at the end. The
        tensor axes keep their types, so a weight replicated over them that meets a split one gets
        its cotangent summed over them inside the chunk, as Megatron's tensor parallelism does."""
        def one(x):
            missing = tuple(a for a in self.reduced if a not in varying_axes(x))
            return jax.lax.pcast(x, missing, to="varying") if missing else x
        return jax.tree.map(one, tree)

    def body(self, layers, other, batch, rng, seed, router_seed):
        sc, v, per = self.sched, self.sched.virtual, self.per
        other, batch, seed, layers, router_seed = (self.vary(t) for t in (other, batch, seed, layers, router_seed))
        chunks = jax.tree.map(lambda w: w.reshape(v, per, *w.shape[1:]), layers)
        stage = jax.lax.axis_index(self.axis) if sc.stages > 1 else 0
        dev = _Device(self, stage, chunks, other, batch, rng, seed, router_seed)
        dtype = lambda m: jnp.float32 if m else self.grad_dtype  # amaxes (maxed) stay fp32
        g_layers0 = jax.tree.map(lambda m, w: like(jnp.zeros(w.shape, dtype(m)), w), self.max_layers, chunks)
        g_other0 = jax.tree.map(lambda m, o: like(jnp.zeros(o.shape, dtype(m)), o), self.max_other, other)
        zero = self.vary(jnp.zeros((), jnp.float32))
        router0 = self.vary({"aux": zero, "z": zero, "dropped": zero,
                             "tokens": jnp.zeros((v, per, max(self.fns.experts, 1)), jnp.float32)})
        carry = (dev.zeros_x, dev.zeros_x, dev.stash0, dev.head_stash0, g_layers0, g_other0, dev.zero_sums, router0)
        (*_, g_layers, g_other, head_sums, router_sums), _ = jax.lax.scan(dev.tick, carry, jnp.arange(sc.ticks))
        g_layers = jax.tree.map(lambda g: g.reshape(v * per, *g.shape[2:]), g_layers)
        def over_stages(m, d, g):
            if m:
                return jax.lax.pmax(g, self.axis)
            return jax.lax.psum(g, self.axis) if d < 0 else jax.lax.psum_scatter(g, self.axis, scatter_dimension=d,
                                                                                   tiled=True)
        g_other = jax.tree.map(over_stages, self.max_other, self.scatter_other, g_other)
        if self.data_axes:  # each shard's sums, on a leading dim over the data axes
            g_layers, g_other = jax.tree.map(lambda g: g[None], (g_layers, g_other))
        # (Zeros for a dense model.) Each stage's layers' token counts, summed over the data shards.
        router_sums = {k: jax.lax.psum(router_sums[k], self.reduced) for k in ("aux", "z", "dropped")} | {
            "tokens": self.data_sum(router_sums["tokens"].reshape(v * per, -1))}
        return g_layers, g_other, jax.lax.psum(head_sums, self.reduced), router_sums


class _Device:
    """One device's view inside the stage loop: its stage index, its chunks' weights, the shared
    parameters, its batch, the split of a chunk's VJP residuals (megajax/parallel/stash.py), and the
    two halves of a tick."""

    def __init__(self, loop: _StageLoop, stage, chunks, other, batch, rng, seed, router_seed):
        self.loop, self.stage, self.chunks, self.other, self.batch = loop, stage, chunks, other, batch
        self.rng, self.seed, self.router_seed = rng, seed, router_seed
        p, v = loop.sched.stages, loop.sched.virtual
        self.tables = jnp.asarray(np.stack([loop.sched.fwd_chunk, loop.sched.fwd_micro, loop.sched.fwd_slot,
                                            loop.sched.bwd_chunk, loop.sched.bwd_micro, loop.sched.bwd_slot], -1))
        self.flags = jnp.asarray(branch_flags(loop.sched, loop.lockstep))
        self.fwd_perm = [(s, s + 1) for s in range(p - 1)] + ([(p - 1, 0)] if v > 1 else [])
        self.bwd_perm = [(s + 1, s) for s in range(p - 1)] + ([(0, p - 1)] if v > 1 else [])
        # The embedding and head see a tree with some `layers` (the model needs a whole tree), unused.
        self.some_layers = jax.tree.map(lambda a: a[0], chunks)
        x = jax.eval_shape(lambda: self.embed(other, 0))  # typed as the embedding's output is
        self.zeros_x = _zeros(x, axes=loop.reduced)
        self.split = split_vjp(self.chunk, *self.chunk_inputs(self.zeros_x, 0, 0))
        n = self.split.out_tree.num_leaves
        _, router = jax.tree.unflatten(self.split.out_tree, self.split.forward_jaxpr.out_avals[:n])
        self.zero_router = jax.tree.map(lambda a: _zeros(a, _aval_axes(a)), router)
        self.stash0 = [_zeros(jax.ShapeDtypeStruct((loop.sched.stash,) + a.shape, a.dtype), _aval_axes(a))
                       for a in self.split.kept_avals]
        # The last stage's last chunk's outputs wait for the output layer and loss (its backward half).
        self.head_stash0 = jnp.broadcast_to(self.zeros_x, (loop.sched.head_stash,) + x.shape)
        sums = jax.eval_shape(lambda: self.head(other, self.zeros_x, 0)[1])
        self.zero_sums = jax.tree.map(lambda s: _zeros(s, loop.reduced).astype(jnp.float32), sums)

    def keys(self, i):
        if not self.loop.use_rng:
            return None, None
        k = jax.random.split(jax.random.fold_in(jax.random.wrap_key_data(self.rng), i), 2)
        return k[0], k[1]

    def embed(self, o, i):
        return self.loop.fns.embed({**o, "layers": self.some_layers}, _index(self.batch, i), *self.keys(i))

    def head(self, o, y, i):
        objective, sums = self.loop.fns.head({**o, "layers": self.some_layers}, y, _index(self.batch, i),
                                             self.loop.data_sum)
        if "router" in sums:  # a MoE block in the head: its sums over the stage's tokens, as chunk's
            sums = {**sums, "router": self.loop.vary(jax.tree.map(self.loop.stage_sum, sums["router"]))}
        return objective, sums

    def chunk_inputs(self, x, c, i):
        """((the chunk's weights, the shared parameters), (its input, microbatch i, i's layer dropout
        key data, the chunk's first model layer)): the inputs of `chunk`, the first known to its
        backward (the same for every microbatch), the others per microbatch."""
        key = self.keys(i)[1]
        key = None if key is None else jax.random.key_data(key)
        first_layer = (c * self.loop.sched.stages + self.stage) * self.loop.per
        # Typed alike whether c and i are the tables' entries or constants (the example inputs).
        key, first_layer = self.loop.vary((key, jnp.asarray(first_layer, jnp.int32)))
        return (_index(self.chunks, c), self.other), (x, _index(self.batch, i), key, first_layer)

    def chunk(self, known, unknown):
        """(outputs, VJP, router sums or {}) of a chunk of layers: the outputs are its activation y, or
        for a mixture-of-experts model (y, its layers' router losses: part of the objective)."""
        (w, other), (x, micro, key, first_layer) = known, unknown
        key = None if key is None else jax.random.wrap_key_data(key)

        def run(w, x):
            y, router = self.loop.fns.layers({**other, "layers": w}, x, micro, key, first_layer, self.loop.data_sum)
            if router is None:
                return y, {}
            router = jax.tree.map(self.loop.stage_sum, router)
            return (y, router["loss"]), {k: router[k] for k in ("aux", "z", "dropped", "tokens")}

        outs, vjp, sums = jax.vjp(run, w, x, has_aux=True)
        return outs, vjp, sums

    def forward(self, t, fc, fm, recv_x):
        """The forward half: this stage's input (the embedding on the first stage's first chunk, else
        what the previous stage sent) through its chunk: (the output, for the next stage or, from the
        last stage's last chunk, for the loss; the chunk's router sums; the residuals its backward
        keeps). In lockstep every device runs the parts some stage needs at tick t (the branches are
        taken alike on every device, so that every collective inside a chunk is joined by every
        device); a stage with no work of its own then computes on zeros, and its results are
        dropped."""
        c, i = jnp.maximum(fc, 0), jnp.maximum(fm, 0)
        embedded = jax.lax.cond(self.flags[t, self.stage, 1], scoped("embed", lambda: self.embed(self.other, i)),
                                lambda: self.zeros_x)
        x = jnp.where((self.stage == 0) & (fc == 0), embedded, recv_x)
        with jax.named_scope(BRANCH_SCOPES["forward"]):
            outs, sums, kept = self.split.forward(*self.chunk_inputs(x, c, i))
        return (outs if self.loop.fns.experts == 0 else outs[0]), sums, kept

    def idle_forward(self):
        return self.zeros_x, self.zero_router, [_zeros(a, _aval_axes(a)) for a in self.split.kept_avals]

    def backward(self, t, bc, bm, bs, recv_g, stash, head_stash, acc):
        """The backward half: the cotangent of the chunk's output (from the loss on the last chunk of
        the last stage, else from the next stage) through the chunk's VJP from its stashed residuals,
        and the input's cotangent passed on (through the embedding on the first chunk of stage 0).
        Run by every device as `forward` is, the results of a stage without a backward of its own
        dropped."""
        loop, (p, v) = self.loop, (self.loop.sched.stages, self.loop.sched.virtual)
        g_layers, g_other = acc
        c, i, slot = jnp.maximum(bc, 0), jnp.maximum(bm, 0), jnp.maximum(bs, 0)
        zero_other = jax.tree.map(jnp.zeros_like, g_other)
        y = _index(head_stash, jnp.minimum(slot, loop.sched.head_stash - 1))

        def from_loss():
            objective, head_vjp, sums = jax.vjp(lambda o, y: self.head(o, y, i), self.other, y, has_aux=True)
            if isinstance(objective, tuple):  # (the loss, the head's router losses): weighed as the chunks'
                g_o, g_y = head_vjp((self.seed.astype(objective[0].dtype), self.router_seed.astype(objective[1].dtype)))
            else:
                g_o, g_y = head_vjp(self.seed.astype(objective.dtype))
            g_o = jax.tree.map(lambda g, z: g.astype(z.dtype), g_o, zero_other)  # (of 16-bit weights)
            return jax.tree.map(lambda s: s.astype(jnp.float32), sums), g_o, g_y.astype(y.dtype)

        sums_i, g_head, g_y = jax.lax.cond(self.flags[t, self.stage, 3], scoped("head", from_loss),
                                           lambda: (self.zero_sums, zero_other, self.zeros_x))
        at_head = (self.stage == p - 1) & (bc == v - 1)
        g_out = jnp.where(at_head, g_y, recv_g)
        with jax.named_scope(BRANCH_SCOPES["backward"]):
            vjp = self.split.backward((_index(self.chunks, c), self.other), [_index(s, slot) for s in stash])
            g_w, g_x = vjp(g_out if loop.fns.experts == 0 else (g_out, self.router_seed))

        def into_embedding():
            _, embed_vjp = jax.vjp(lambda o: self.embed(o, i), self.other)
            return jax.tree.map(lambda g, z: g.astype(z.dtype), embed_vjp(g_x)[0], zero_other)

        g_embed = jax.lax.cond(self.flags[t, self.stage, 4], scoped("embed_backward", into_embedding), lambda: zero_other)
        busy = bc >= 0
        keep = lambda on, g: jax.tree.map(lambda x: jnp.where(on, x, jnp.zeros_like(x)), g)
        g_other = _combine(loop.max_other, g_other, keep(at_head, g_head))
        g_other = _combine(loop.max_other, g_other, keep((self.stage == 0) & (bc == 0), g_embed))
        g_layers = jax.tree.map(
            lambda m, acc, g: jax.lax.dynamic_update_index_in_dim(acc, _combine(m, _index(acc, c), g), c, 0),
            loop.max_layers, g_layers, keep(busy, g_w))
        head_sums = jax.tree.map(lambda s: jnp.where(at_head, s, 0.0), sums_i)
        return jnp.where(busy, g_x, self.zeros_x), (g_layers, g_other), head_sums

    def tick(self, carry, t):
        loop, (p, v) = self.loop, (self.loop.sched.stages, self.loop.sched.virtual)
        recv_x, recv_g, stash, head_stash, g_layers, g_other, head_sums, router_sums = carry
        fc, fm, fs, bc, bm, bs = (self.tables[t, self.stage][k] for k in range(6))
        y, sums, kept = jax.lax.cond(self.flags[t, self.stage, 0], lambda: self.forward(t, fc, fm, recv_x),
                                     self.idle_forward)
        # Stash what the forward kept (in slot fs of every residual's buffer), and the last stage's
        # last chunk's output for its loss; a stage without a forward of its own writes nothing.
        busy, slot = fc >= 0, jnp.maximum(fs, 0)
        write = lambda buf, x, on: jax.lax.dynamic_update_index_in_dim(buf, jnp.where(on, x, _index(buf, slot)), slot, 0)
        stash = [write(buf, x, busy) for buf, x in zip(stash, kept)]
        last = (self.stage == p - 1) & (fc == v - 1)
        head_stash = write(head_stash, y, busy & last)
        send_x = jnp.where(busy & ~last, y, self.zeros_x)
        if sums:
            tokens = router_sums["tokens"]
            sums = jax.tree.map(lambda s: jnp.where(busy, s, jnp.zeros_like(s)), sums)
            router_sums = {k: router_sums[k] + sums[k] for k in ("aux", "z", "dropped")} | {
                "tokens": jax.lax.dynamic_update_index_in_dim(tokens, _index(tokens, jnp.maximum(fc, 0)) + sums["tokens"],
                                                              jnp.maximum(fc, 0), 0)}
        send_g, (g_layers, g_other), sums_i = jax.lax.cond(
            self.flags[t, self.stage, 2], lambda acc: self.backward(t, bc, bm, bs, recv_g, stash, head_stash, acc),
            lambda acc: (self.zeros_x, acc, self.zero_sums), (g_layers, g_other))
        head_sums = jax.tree.map(lambda a, s: a + s, head_sums, sums_i)
        if loop.sched.stages > 1:
            recv_x = jax.lax.ppermute(send_x, loop.axis, self.fwd_perm)
            recv_g = jax.lax.ppermute(send_g, loop.axis, self.bwd_perm)
        return (recv_x, recv_g, stash, head_stash, g_layers, g_other, head_sums, router_sums), None


# The named scope of each branch's work (branch_flags' order): what the compiled program's
# operations are tagged with, so that a product can be told by the branch it runs in (megajax bench
# counts each branch's matrix FLOPs as often as the tables run it).
BRANCH_SCOPES = {"forward": "stage_forward", "embed": "stage_embed", "backward": "stage_backward",
                 "head": "stage_head", "embed_backward": "stage_embed_backward"}


def scoped(branch: str, fn: Callable) -> Callable:
    """`fn` traced in its branch's named scope."""
    def run(*args):
        with jax.named_scope(BRANCH_SCOPES[branch]):
            return fn(*args)
    return run


def branch_runs(sc: Schedule, lockstep: bool) -> dict[str, np.ndarray]:
    """How many ticks each stage runs each branch in a step: {branch: [stages] ints}. With `lockstep`,
    what the devices execute (every branch some stage runs, on zeros where the stage has no work of
    its own); without, each stage's own work."""
    flags = branch_flags(sc, lockstep)
    return {name: flags[:, :, k].sum(axis=0) for k, name in enumerate(BRANCH_SCOPES)}


def branch_flags(sc: Schedule, lockstep: bool) -> np.ndarray:
    """[ticks, stages, 5] bools: at tick t, does stage s run a forward half (a chunk's forward), the
    embedding, a backward half (a chunk's backward from its stash), the output layer and loss, the
    embedding's backward. `lockstep`: every stage runs what some stage runs (the flags of each tick
    the same on every device)."""
    p, v = sc.stages, sc.virtual
    stage = np.arange(p)[None, :]
    fwd, bwd = sc.fwd_chunk >= 0, sc.bwd_chunk >= 0
    flags = np.stack([fwd, (stage == 0) & (sc.fwd_chunk == 0), bwd,
                      (stage == p - 1) & (sc.bwd_chunk == v - 1), (stage == 0) & (sc.bwd_chunk == 0)], axis=-1)
    if lockstep:
        flags = np.broadcast_to(flags.any(axis=1, keepdims=True), flags.shape)
    return flags


@dataclass(frozen=True)
class StageFunctions:
    """The model in the three pieces a pipeline runs, each on a whole parameter tree whose `layers`
    are one chunk's: embed(params, micro, key, layer key) -> x (the embedding's dropout key, and the
    layers' for what the first stage runs besides: a dense-first model's dense layers);
    layers(params, x, micro, key, first layer, data_sum) -> (x, router) where router is None for a
    dense model, else a dict of the chunk's router loss to differentiate (`loss`, [], this shard's
    share: token counts summed over the microbatch's shards with `data_sum`) and this shard's sums
    `aux`, `z`, `dropped` ([]) and `tokens` ([chunk layers, experts]); head(params, x, micro, data_sum)
    -> (objective to differentiate, {"loss": the cross entropy sum, ...: other sums to log}); a head
    with routers of its own (a mixture-of-experts MTP block) returns the pair (objective, its router
    loss, weighed as the chunks' are) and its sums under `router` as a chunk's.
    `micro` is one microbatch's dict of arrays. `experts`: the MoE layers' expert count (0: dense)."""
    embed: Callable
    layers: Callable
    head: Callable
    experts: int = 0
