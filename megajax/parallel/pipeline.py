"""Pipeline parallelism: GPipe, 1F1B and interleaved 1F1B as one SPMD program over `pipeline`.

The stacked blocks' parameters `[layers, ...]` are split over the `pipeline` mesh
axis: stage s holds a consecutive run of layers/P of them, or, with V virtual
stages (interleaved), V chunks of layers/(P V), chunk v of stage s being model
chunk v P + s. The embedding, the final norm and the output layer are held by
every stage (replicated over `pipeline`); the first stage runs the embedding and
the last stage the final norm, output layer and loss.

A schedule is a table, built here in Python: for every tick t and stage s,
which microbatch (and chunk) the stage runs forward and which it runs
backward, and which stash slot holds the forward's input until its backward.
Every stage runs the same program (`shard_map` over `pipeline`, the other
mesh axes left to the compiler): per tick a forward half and a backward half,
each a `lax.cond` on the table entry, so an idle half does no work; after each
half one `ppermute` sends the activation to the next stage (forward) or the
input cotangent to the previous stage (backward). Both transfers arrive exactly
when the receiver's table asks for them, so nothing else crosses stages.

The backward half recomputes its chunk's forward from the stashed input and
takes its VJP (the stage iteration is rematerialised); the last stage's
backward of a microbatch's last chunk also runs the output layer and the loss
and starts the cotangent there, so the gradients of a whole step are computed
by hand inside one scan, never by differentiating the scan. The schedules
differ only in their tables:

- gpipe: every forward, then every backward. Stash: all M microbatches.
- 1f1b: the last stage runs a microbatch's backward the tick its forward ends,
  and each earlier stage one tick after the next one; in the steady state each
  tick runs one forward and one backward (Megatron's one-forward-one-backward),
  and at most 2 (P - 1 - s) + 1 stage inputs are stashed on stage s, whatever M is.
- interleaved: V chunks per stage in Megatron's order (groups of P microbatches
  run chunk 0, 1, ..., V - 1 forward, and V - 1, ..., 0 backward); needs M a
  multiple of P; the last stage's output of chunk v goes round to the first
  stage's chunk v + 1. Bubble (P - 1) / (V M + P - 1).

Gradients of the layers stay on their stage; those of the embedding and head
(and of a tied embedding, used at both ends) are summed over `pipeline` once
per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from megajax.mesh import mesh_sizes, spec_axes, spec_entry, spec_without
from megajax.parallel.manual import inside_manual, varying_axes

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
    stash: int  # stash slots per stage

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

    def max_in_flight(self) -> int:
        """The most stage inputs any stage holds stashed at once (what activation memory scales with)."""
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
                       maxed: dict | None = None, seq_axes: tuple[str, ...] = ()) -> tuple[dict, jax.Array, dict | None]:
    """(gradients of `seed` x the loss sum [+ `router_seed` x the router losses] w.r.t. `params`,
    the loss sum, the router sums or None) of one step's M microbatches through the pipeline.
    `batch` arrays are [M, micro x dp, seq]; `params` the model's tree with its stacked `layers`
    [layers, ...] (split over `axis`, the stage axis of the rules table); `rng` the step's dropout
    key (microbatch i uses fold_in(rng, i), as without a pipeline) or None. `param_specs`: where the
    parameters (and their gradient sums) live on the other mesh axes during the step.

    `data_axes`: the data-parallel mesh axes the batch is split over, taken into the stage loop's
    shard_map too: each device then runs its own shard of every microbatch and keeps its own
    gradient sums, and the one data-parallel reduction of the step happens after the loop (an
    all-reduce, or a reduce-scatter onto the optimizer's shards). Empty: the compiler splits the
    batch inside the loop and reduces every microbatch's gradient there (the masks of dropout,
    drawn for the whole microbatch, need this). `seq_axes`: those of them that split the sequence.

    A layer weight split over a data axis (a MoE model's experts over `expert`) enters the loop
    split: each device holds, and differentiates, its own part.

    A mixture-of-experts model (`model_fns.experts` > 0): each chunk also returns its layers'
    router losses (balancing + z, this shard's share of the whole microbatch's: the chunk sums its
    token counts over `data_axes` with the `data_sum` it is given), added to the objective with
    weight `router_seed`, and the router sums the metrics need: `aux`, `z`, `dropped` (summed over
    layers and microbatches) and `tokens` [layers, experts] (summed over microbatches).

    `maxed`: a tree like `params` of bools; where True the "gradient" is combined with max instead
    of summed (over microbatches, stages and data shards): the FP8 scales, whose cotangents are
    the amaxes the products saw (megajax/precision/fp8.py)."""
    p, v = sched.stages, sched.virtual
    layers, other = params["layers"], {k: x for k, x in params.items() if k != "layers"}
    maxed = jax.tree.map(lambda _: False, params) if maxed is None else maxed
    max_layers, max_other = maxed["layers"], {k: x for k, x in maxed.items() if k != "layers"}
    num_layers = jax.tree.leaves(layers)[0].shape[0]
    order = stage_order(num_layers, p, v)
    if order is not None:
        layers = jax.tree.map(lambda w: jnp.take(w, order, axis=0), layers)
    manual = (axis, *data_axes)
    loop = _StageLoop(model_fns, sched, axis, tuple(data_axes), manual, num_layers // (p * v), param_specs,
                      max_layers, max_other, grad_dtype, rng is not None)

    # The stored layers as the loop takes them: split over the stage axis and any data axis a
    # weight's own spec uses (experts over `expert`); the gradient sums get a leading dim over the
    # other data axes.
    layer_in = jax.tree.map(lambda sp: P(*spec_without(sp, set(spec_axes(sp)) - set(manual))),
                            param_specs["layers"], is_leaf=lambda x: isinstance(x, P))
    layer_out = jax.tree.map(lambda sp: P(spec_entry([a for a in data_axes if a not in spec_axes(sp)]), *sp)
                             if data_axes else sp, layer_in, is_leaf=lambda x: isinstance(x, P))
    other_out = jax.tree.map(lambda _: P(spec_entry(data_axes)) if data_axes else P(), other)
    batch_axes = tuple(a for a in data_axes if a not in seq_axes)
    seq = lambda x: (spec_entry(seq_axes),) if x.ndim > 2 else ()
    batch_spec = jax.tree.map(lambda x: P(None, spec_entry(batch_axes), *seq(x)), batch)
    router_out = {"aux": P(), "z": P(), "dropped": P(), "tokens": P(axis)}
    fn = jax.shard_map(loop.body, mesh=mesh, in_specs=(layer_in, P(), batch_spec, P(), P(), P()),
                       out_specs=(layer_out, other_out, P(), router_out), axis_names=set(manual))
    rng = rng if rng is not None else jnp.zeros((2,), jnp.uint32)
    router_seed = jnp.zeros((), jnp.float32) if router_seed is None else router_seed.astype(jnp.float32)
    g_layers, g_other, loss_sum, router_sums = fn(layers, other, batch, rng, seed, router_seed)
    if data_axes:  # the step's one data-parallel reduction (the caller places the result)
        g_layers, g_other = jax.tree.map(lambda m, g: jnp.max(g, axis=0) if m else jnp.sum(g, axis=0),
                                         (max_layers, max_other), (g_layers, g_other))
    if order is not None:
        inverse = np.argsort(order)
        g_layers = jax.tree.map(lambda g: jnp.take(g, inverse, axis=0), g_layers)
        router_sums["tokens"] = jnp.take(router_sums["tokens"], inverse, axis=0)
    return {**g_other, "layers": g_layers}, loss_sum, router_sums if model_fns.experts > 0 else None


def _combine(tree_max, a, b):
    """a + b, or max(a, b) where `tree_max` says so."""
    return jax.tree.map(lambda m, x, y: jnp.maximum(x, y.astype(x.dtype)) if m else x + y.astype(x.dtype),
                        tree_max, a, b)


def _index(tree, i):
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


@dataclass(frozen=True)
class _StageLoop:
    """The per-device program of the stage loop (`body`, run under shard_map over the manual axes):
    one scan over the schedule's ticks, each a forward half and a backward half (see the module
    docstring), carrying the received activation and cotangent, the stash, the gradient sums, the
    loss sum and the router sums."""
    fns: "StageFunctions"
    sched: Schedule
    axis: str
    data_axes: tuple[str, ...]
    manual: tuple[str, ...]  # the stage axis and the data axes
    per: int  # layers per chunk
    param_specs: dict
    max_layers: dict
    max_other: dict
    grad_dtype: object
    use_rng: bool

    @property
    def other_specs(self) -> dict:
        return {k: x for k, x in self.param_specs.items() if k != "layers"}

    def data_sum(self, x):
        return jax.lax.psum(x, self.data_axes) if self.data_axes else x

    def vary(self, tree):
        """`tree` typed as varying over every manual axis: parameters used by every stage (and,
        with data axes, every data shard) are differentiated as this device's own copy (no
        implicit sum over stages or shards inside a branch); the copies' gradients are summed once
        at the end."""
        def one(x):
            missing = tuple(a for a in self.manual if a not in varying_axes(x))
            return jax.lax.pcast(x, missing, to="varying") if missing else x
        return jax.tree.map(one, tree)

    def pin(self, tree, specs, lead=0):
        """Keeps `tree` (and, through the scan's carry, its gradient sums) laid out as `specs` on
        the auto axes: left free, the compiler would carry the optimizer's layout (e.g. the
        distributed optimizer's) into the stage loop."""
        here = jax.sharding.get_abstract_mesh()
        return jax.tree.map(lambda x, sp: jax.lax.with_sharding_constraint(
            x, jax.sharding.NamedSharding(here, P(*((None,) * lead), *spec_without(sp, self.manual)))), tree, specs)

    def body(self, layers, other, batch, rng, seed, router_seed):
        sc, v, per, other_specs = self.sched, self.sched.virtual, self.per, self.other_specs
        other, batch, seed, layers, router_seed = (self.vary(t) for t in (other, batch, seed, layers, router_seed))
        other = self.pin(other, other_specs)
        chunks = self.pin(jax.tree.map(lambda w: w.reshape(v, per, *w.shape[1:]), layers),
                          self.param_specs["layers"], lead=1)
        dev = _Device(self, jax.lax.axis_index(self.axis), chunks, other, batch, rng, seed, router_seed)
        dtype = lambda m: jnp.float32 if m else self.grad_dtype  # amaxes (maxed) stay fp32
        g_layers0 = self.pin(self.vary(jax.tree.map(lambda m, w: jnp.zeros(w.shape, dtype(m)), self.max_layers,
                                                    chunks)), self.param_specs["layers"], lead=1)
        g_other0 = self.pin(jax.tree.map(lambda m, o: jnp.zeros(o.shape, dtype(m)), self.max_other, other),
                            other_specs)
        zero = self.vary(jnp.zeros((), jnp.float32))
        router0 = self.vary({"aux": zero, "z": zero, "dropped": zero,
                             "tokens": jnp.zeros((v, per, max(self.fns.experts, 1)), jnp.float32)})
        carry = (dev.zeros_x, dev.zeros_x, dev.stash0, g_layers0, self.vary(g_other0), zero, router0)
        (_, _, _, g_layers, g_other, loss_sum, router_sums), _ = jax.lax.scan(dev.tick, carry, jnp.arange(sc.ticks))
        g_layers = jax.tree.map(lambda g: g.reshape(v * per, *g.shape[2:]), g_layers)
        g_other = jax.tree.map(lambda m, g: jax.lax.pmax(g, self.axis) if m else jax.lax.psum(g, self.axis),
                               self.max_other, g_other)
        if self.data_axes:  # each shard's sums, on a leading dim over the data axes
            g_layers, g_other = jax.tree.map(lambda g: g[None], (g_layers, g_other))
        # (Zeros for a dense model.) Each stage's layers' token counts, summed over the data shards.
        router_sums = {k: jax.lax.psum(router_sums[k], self.manual) for k in ("aux", "z", "dropped")} | {
            "tokens": self.data_sum(router_sums["tokens"].reshape(v * per, -1))}
        return g_layers, g_other, jax.lax.psum(loss_sum, self.manual), router_sums


class _Device:
    """One device's view inside the stage loop: its stage index, its chunks' weights, the shared
    parameters, its batch, and the two halves of a tick."""

    def __init__(self, loop: _StageLoop, stage, chunks, other, batch, rng, seed, router_seed):
        self.loop, self.stage, self.chunks, self.other, self.batch = loop, stage, chunks, other, batch
        self.rng, self.seed, self.router_seed = rng, seed, router_seed
        p, v = loop.sched.stages, loop.sched.virtual
        self.tables = jnp.asarray(np.stack([loop.sched.fwd_chunk, loop.sched.fwd_micro, loop.sched.fwd_slot,
                                            loop.sched.bwd_chunk, loop.sched.bwd_micro, loop.sched.bwd_slot], -1))
        self.fwd_perm = [(s, s + 1) for s in range(p - 1)] + ([(p - 1, 0)] if v > 1 else [])
        self.bwd_perm = [(s + 1, s) for s in range(p - 1)] + ([(0, p - 1)] if v > 1 else [])
        # The embedding and head see a tree with some `layers` (the model needs a whole tree), unused.
        self.some_layers = jax.tree.map(lambda a: a[0], chunks)
        x_shape = jax.eval_shape(lambda: self.embed(other, 0))
        self.zeros_x = loop.vary(jnp.zeros(x_shape.shape, x_shape.dtype))
        self.stash0 = loop.vary(jnp.zeros((loop.sched.stash,) + x_shape.shape, x_shape.dtype))
        self.zero_loss = loop.vary(jnp.zeros((), jnp.float32))

    def keys(self, i):
        if not self.loop.use_rng:
            return None, None
        k = jax.random.split(jax.random.fold_in(jax.random.wrap_key_data(self.rng), i), 2)
        return k[0], k[1]

    def embed(self, o, i):
        return self.loop.fns.embed({**o, "layers": self.some_layers}, _index(self.batch, i), self.keys(i)[0])

    def head(self, o, y, i):
        return self.loop.fns.head({**o, "layers": self.some_layers}, y, _index(self.batch, i))

    def run_chunk(self, w, x, c, i):
        """(y, router) of chunk c on microbatch i (router None for a dense model)."""
        first_layer = (c * self.loop.sched.stages + self.stage) * self.loop.per
        return self.loop.fns.layers({**self.other, "layers": w}, x, _index(self.batch, i), self.keys(i)[1],
                                    first_layer, self.loop.data_sum)

    def forward(self, fc, fm, fs, recv_x, stash):
        """The forward half: this stage's input (the embedding on the first stage's first chunk,
        else what the previous stage sent), stashed; the chunk's output for the next stage. The
        last chunk of the last stage only stashes: its backward recomputes it with the loss."""
        p, v = self.loop.sched.stages, self.loop.sched.virtual
        x = jax.lax.cond((self.stage == 0) & (fc == 0), lambda: self.embed(self.other, fm), lambda: recv_x)
        stash = jax.lax.dynamic_update_index_in_dim(stash, x, fs, 0)
        last = (self.stage == p - 1) & (fc == v - 1)
        y = jax.lax.cond(last, lambda: self.zeros_x, lambda: self.run_chunk(_index(self.chunks, fc), x, fc, fm)[0])
        return y, stash

    def chunk_vjp(self, x, bc, bm, router_sums):
        """(y, vjp of the chunk's objective from the output's cotangent, router sums + the chunk's)."""
        w = _index(self.chunks, bc)
        if self.loop.fns.experts == 0:
            y, vjp = jax.vjp(lambda w, x: self.run_chunk(w, x, bc, bm)[0], w, x)
            return y, vjp, router_sums

        def objective(w, x):  # the chunk's router losses are part of the objective
            y, router = self.run_chunk(w, x, bc, bm)
            return (y, router["loss"]), {k: router[k] for k in ("aux", "z", "dropped", "tokens")}

        (y, _), vjp, sums = jax.vjp(objective, w, x, has_aux=True)
        tokens = router_sums["tokens"]
        router_sums = {k: router_sums[k] + sums[k] for k in ("aux", "z", "dropped")} | {
            "tokens": jax.lax.dynamic_update_index_in_dim(tokens, _index(tokens, bc) + sums["tokens"], bc, 0)}
        return y, lambda g_y: vjp((g_y, self.router_seed)), router_sums

    def backward(self, bc, bm, bs, recv_g, stash, acc):
        """The backward half: recompute the chunk from its stashed input, take the cotangent of its
        output (from the loss on the last chunk of the last stage, else from the next stage), and
        pass the input's cotangent on (through the embedding on the first chunk of stage 0)."""
        loop, (p, v) = self.loop, (self.loop.sched.stages, self.loop.sched.virtual)
        g_layers, g_other, loss_sum, router_sums = acc
        y, vjp, router_sums = self.chunk_vjp(_index(stash, bs), bc, bm, router_sums)

        def from_loss(g_other):
            loss, head_vjp = jax.vjp(lambda o, y: self.head(o, y, bm), self.other, y)
            g_o, g_y = head_vjp(self.seed.astype(loss.dtype))
            return loss, _combine(loop.max_other, g_other, g_o), g_y.astype(y.dtype)

        loss, g_other, g_y = jax.lax.cond((self.stage == p - 1) & (bc == v - 1), from_loss,
                                          lambda g_other: (self.zero_loss, g_other, recv_g), g_other)
        g_w, g_x = vjp(g_y)

        def into_embedding(g_other):
            _, embed_vjp = jax.vjp(lambda o: self.embed(o, bm), self.other)
            return _combine(loop.max_other, g_other, embed_vjp(g_x)[0])

        g_other = jax.lax.cond((self.stage == 0) & (bc == 0), into_embedding, lambda g: g, g_other)
        g_layers = jax.tree.map(
            lambda m, acc, g: jax.lax.dynamic_update_index_in_dim(acc, _combine(m, _index(acc, bc), g), bc, 0),
            loop.max_layers, g_layers, g_w)
        return g_x, (g_layers, g_other, loss_sum + loss, router_sums)

    def tick(self, carry, t):
        loop = self.loop
        recv_x, recv_g, stash, g_layers, g_other, loss_sum, router_sums = carry
        fc, fm, fs, bc, bm, bs = (self.tables[t, self.stage][k] for k in range(6))
        send_x, stash = jax.lax.cond(fc >= 0, lambda st: self.forward(fc, fm, fs, recv_x, st),
                                     lambda st: (self.zeros_x, st), stash)
        send_g, (g_layers, g_other, loss_sum, router_sums) = jax.lax.cond(
            bc >= 0, lambda acc: self.backward(bc, bm, bs, recv_g, stash, acc), lambda acc: (self.zeros_x, acc),
            (g_layers, g_other, loss_sum, router_sums))
        recv_x = jax.lax.ppermute(send_x, loop.axis, self.fwd_perm)
        recv_g = jax.lax.ppermute(send_g, loop.axis, self.bwd_perm)
        g_layers, g_other = loop.pin(g_layers, loop.param_specs["layers"], lead=1), loop.pin(g_other, loop.other_specs)
        return (recv_x, recv_g, stash, g_layers, g_other, loss_sum, router_sums), None


def stage_embedding(rules, table_axis: str = "vocab") -> Callable:
    """The token embedding lookup, traced inside a pipeline stage: rows of the (vocab-split)
    table, whose gradient is summed by hand inside shard_map over the mesh axes other than
    `pipeline` (each device adds its tokens' cotangents into its own vocabulary rows, then one sum
    over the batch axes). Left to the compiler, the scatter-add of the lookup's gradient inside
    the stage loop, with the table split over `tensor` and the tokens over a data axis, fails to
    compile (an XLA check in the SPMD partitioner) or, on CPU, deadlocks. `table_axis`: the logical
    axis of the table's rows (`vocab`, or `position` for learned positions)."""
    vocab_axes = tuple(rules.params[table_axis])
    batch_axes = tuple(rules.activations["batch"])

    def lookup(table_VxD, ids):
        if not inside_manual():  # outside a stage: the plain lookup, differentiated by JAX
            return jnp.take(table_VxD, ids, axis=0)
        shape, dtype = table_VxD.shape, table_VxD.dtype

        @jax.custom_vjp
        def embed(table, ids):
            return jnp.take(table, ids, axis=0)

        def fwd(table, ids):
            return embed(table, ids), ids

        def bwd(ids, g):
            mesh = jax.sharding.get_abstract_mesh()
            sizes = mesh_sizes(mesh)
            vocab = tuple(a for a in vocab_axes if a in sizes and a not in mesh.manual_axes)
            batch = tuple(a for a in batch_axes if a in sizes and a not in mesh.manual_axes)
            rows = shape[0] // int(np.prod([sizes[a] for a in vocab]))

            def local(ids, g):
                first = 0
                for a in vocab:  # this device's first vocabulary row (axes major to minor)
                    first = first * sizes[a] + jax.lax.axis_index(a)
                index = ids - first * rows
                mine = (index >= 0) & (index < rows)
                gt = jnp.zeros((rows, shape[1]), dtype).at[jnp.where(mine, index, rows)].add(
                    jnp.where(mine[..., None], g.astype(dtype), 0), mode="drop")
                return jax.lax.psum(gt, batch) if batch else gt

            g_table = jax.shard_map(local, mesh=mesh, in_specs=(P(spec_entry(batch)), P(spec_entry(batch))),
                                    out_specs=P(spec_entry(vocab)), axis_names=set(vocab) | set(batch))(ids, g)
            return g_table, None

        embed.defvjp(fwd, bwd)
        return embed(table_VxD, ids)

    return lookup


@dataclass(frozen=True)
class StageFunctions:
    """The model in the three pieces a pipeline runs, each on a whole parameter tree whose `layers`
    are one chunk's: embed(params, micro, key) -> x; layers(params, x, micro, key, first layer,
    data_sum) -> (x, router) where router is None for a dense model, else a dict of the chunk's
    router loss to differentiate (`loss`, [], this shard's share: token counts summed over the
    microbatch's shards with `data_sum`) and this shard's sums `aux`, `z`, `dropped` ([]) and
    `tokens` ([chunk layers, experts]); head(params, x, micro) -> loss sum. `micro` is one microbatch's dict of arrays.
    `experts`: the MoE layers' expert count (0: dense)."""
    embed: Callable
    layers: Callable
    head: Callable
    experts: int = 0
