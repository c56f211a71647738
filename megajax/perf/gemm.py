"""Matmul efficiency by shape: measured per device kind, read by `megajax plan`.

    megajax bench --gemm-table FILE.yaml         measure it on this machine's device, write it
    megajax plan --device-kinds FILE.yaml ...    estimate compute time from it

(H100, H200 and MI300X carry published tables until then: megajax/perf/matmul_tables.py.)

A table is a device kind's `gemm_efficiency`: rows [M, K, N, share of the peak] for a grid of
shapes (every combination of the M, K and N sizes measured), a product [M, K] x [K, N] in the
table's precision. `efficiency(table, m, k, n)` interpolates it linearly in log2 of each size
(clamped to the grid's edges). `step_gemms(plan, spec)` lists the products one device runs in a
step: per layer kernel (q, k, v, o, the MLP's, the routers, the routed experts'), the output layer,
each forward and its two backward products (the input's gradient [M, N] x [N, K], the kernel's
[K, M] x [M, N]), at the device's shard of the kernel (split over tensor and expert; FSDP gathers
it whole) and its tokens (the micro batch of its sequence chunk under context parallelism; with
sequence parallelism the gathered sequence). A routed expert gets its expected share of the
expert group's tokens: ep x tokens x top-k / experts rows. Each product carries its precision (under
FP8 the layers' linear products FP8, the rest 16-bit), which `gemm_seconds` times at its own peak.

On CPU a lone matmul has every core of the host: its share is of the host's peak (the simulated
devices of a step share those cores, each with host peak / devices).

`megajax bench --gemm-table` also measures the kind's other figures (`measure_probes`): its memory
bandwidth per device (an element-wise stream), the optimizer's (Adam's update over arrays larger than
the caches) and, with several devices, a collective's latency per call and bus bandwidth and a
pipeline tick's fixed cost.
"""

from __future__ import annotations

import functools
import math
import os
import re
import time
from typing import Any

from megajax.checkpoint.source import flatten
from megajax.errors import ConfigError
from megajax.mesh import logical_to_spec

# The sizes measured for each of M, K, N: the table is their grid (4^3 products).
SIZES = {"cpu": (16, 64, 256, 1024), "gpu": (128, 512, 2048, 8192)}
_STACKED = ("layers", "experts")  # leading dims of a stacked kernel that are not a product's K or N


def check_table(where: str, rows) -> list[tuple[int, int, int, float]]:
    """The rows of a gemm_efficiency table checked: [M, K, N, share] with whole sizes >= 1, a share
    in (0, 1], and every combination of the sizes present (ConfigError naming where and the row)."""
    accepted = "a list of [M, K, N, share of the peak] rows (sizes >= 1, share in (0, 1]) over a full grid of sizes"
    if not isinstance(rows, list) or not rows:
        raise ConfigError(f"{where}: gemm_efficiency = {str(rows)[:80]!r}: expected {accepted}.")
    out = []
    for row in rows:
        ok = (isinstance(row, (list, tuple)) and len(row) == 4
              and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in row[:3])
              and isinstance(row[3], (int, float)) and not isinstance(row[3], bool) and 0 < row[3] <= 1)
        if not ok:
            raise ConfigError(f"{where}: gemm_efficiency row {row!r}: expected {accepted}.")
        out.append((int(row[0]), int(row[1]), int(row[2]), float(row[3])))
    axes = [sorted({r[i] for r in out}) for i in range(3)]
    have = {r[:3] for r in out}
    missing = [(m, k, n) for m in axes[0] for k in axes[1] for n in axes[2] if (m, k, n) not in have]
    if missing:
        raise ConfigError(f"{where}: gemm_efficiency has no row for [M, K, N] = {list(missing[0])} "
                          f"({len(missing)} of the grid's {math.prod(map(len, axes))} missing): expected {accepted}.")
    return out


@functools.lru_cache(maxsize=64)
def _grid(rows: tuple) -> tuple[dict, list]:
    return {tuple(r[:3]): r[3] for r in rows}, [sorted({r[i] for r in rows}) for i in range(3)]


def efficiency(rows, m: float, k: float, n: float) -> float:
    """The table's share of the peak at [m, k] x [k, n]: linear in log2 of each size between the grid's
    sizes, the edge's value beyond them."""
    return _efficiency(rows if isinstance(rows, tuple) else tuple(map(tuple, rows)), m, k, n)


@functools.lru_cache(maxsize=65536)
def _efficiency(rows: tuple, m: float, k: float, n: float) -> float:
    table, axes = _grid(rows)

    def bracket(sizes, x):
        x = min(max(x, sizes[0]), sizes[-1])
        for lo, hi in zip(sizes, sizes[1:]):
            if x <= hi:
                w = (math.log2(x) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
                return ((lo, 1 - w), (hi, w))
        return ((sizes[0], 1.0),)

    total = 0.0
    for a, wa in bracket(axes[0], m):
        for b, wb in bracket(axes[1], k):
            for c, wc in bracket(axes[2], n):
                total += wa * wb * wc * table[a, b, c]
    return total


def _kernel_dims(name: str, names: tuple, shape: tuple, rules, sizes: dict[str, int]) -> tuple[float, int, int, int]:
    """(layer count a device runs, local experts, K, N) of a kernel's shard on a device: the sizes split
    over tensor, expert and (the layers) pipeline (not over the data axes: FSDP gathers the kernel for
    its products, nor the ends' over `pipeline`: the stages gather them for the step).
    A kernel whose first product dim is `embed` maps it to N = the rest (q, k, v, fc1, router, output);
    otherwise K is every dim but the last (o, fc2)."""
    split = {**sizes, "data": 1, "fsdp": 1}
    local = []
    for dim, size, entry in zip(names, shape, logical_to_spec(names, rules)):
        # Only the layers stay split over `pipeline` for the step (the ends are gathered whole for it).
        over = split if dim == "layers" else {**split, "pipeline": 1}
        pieces = math.prod(over[a] for a in (entry if isinstance(entry, tuple) else (entry,)) if a is not None)
        local.append((dim, size / pieces))
    layers = math.prod(s for d, s in local if d == "layers")
    experts = int(math.prod(s for d, s in local if d == "experts"))
    dims = [(d, s) for d, s in local if d not in _STACKED]
    if dims[0][0] == "embed":
        k, n = dims[0][1], math.prod(s for _, s in dims[1:])
    else:
        k, n = math.prod(s for _, s in dims[:-1]), dims[-1][1]
    return layers, experts, max(1, round(k)), max(1, round(n))


def step_gemms(plan, spec, expert_tile: int = 0) -> list[dict[str, Any]]:
    """The products one device runs in a step, forward and backward: [{name, m, k, n, count}] (count:
    how many times per step; FLOPs 2 m k n each). Full recompute adds the layers' forward products again.
    `expert_tile` > 0: a routed expert's rows padded to whole tiles of that many rows (the tiled loop
    XLA:CPU runs; dropless routing only: capacity mode's buffers are their own size)."""
    from megajax.train.flops import expert_kernel_pattern
    cfg, sizes, m = plan.cfg, plan.sizes, plan.cfg.model
    rules = plan.rules.params
    cp, stages = sizes["context"], sizes["pipeline"]
    rows = plan.batch.micro_batch * plan.batch.seq_len / cp  # a microbatch's tokens on a device
    micro = plan.batch.accumulation
    shapes = dict(flatten(spec.abstract_params))
    pattern = expert_kernel_pattern(m)
    tied = "output" not in shapes
    # Full recompute runs the forward again (a pipeline's backward half too, only then: it runs the
    # VJP its forward half took, megajax/parallel/pipeline.py).
    full = cfg.parallel.recompute == "full"
    # Each product's precision: under FP8 the layers' linear products (and the output layer's with
    # precision.fp8_output_layer) in FP8, the rest (routers, attention's own) in 16 bits.
    compute, fp8_output = product_precisions(cfg)
    fp8 = "fp8" if cfg.train.precision == "fp8" else compute
    out = []
    for name, names in flatten(spec.axes):
        if name.startswith(("vision/", "projector/")):
            continue
        is_expert = bool(m.num_experts) and re.fullmatch(pattern, name) is not None
        is_router = name.endswith(("/mlp/router", "/mixer/router"))
        is_output = name == "output" or (tied and name == "embed/embedding")
        if not (name.endswith("/kernel") or is_expert or is_router or is_output):
            continue
        shape = shapes[name].shape
        if is_output and name == "embed/embedding":  # tied: the table [vocab, embed] multiplied as [embed, vocab]
            names, shape = names[::-1], shape[::-1]
        layers, experts, k, n = _kernel_dims(name, names, shape, rules, sizes)
        count = micro * (layers if "layers" in names else (1 + m.mtp_num_layers) / stages)
        mrows = rows
        if is_expert:  # each local expert's expected rows of the expert group's tokens
            mrows = sizes["expert"] * rows * m.moe_router_topk / m.num_experts
            if expert_tile and m.moe_expert_capacity_factor is None and _tiled(m.moe_grouped_gemm_impl):
                mrows = math.ceil(mrows / expert_tile) * expert_tile
            count *= experts
        mrows = max(1, round(mrows))
        fwd = count * (2 if full and "layers" in names else 1)
        p = fp8 if (is_output and fp8_output) or ("layers" in names and not is_router) else compute
        out.append({"name": name, "m": mrows, "k": k, "n": n, "count": fwd, "precision": p})
        out.append({"name": name + " (input grad)", "m": mrows, "k": n, "n": k, "count": count, "precision": p})
        out.append({"name": name + " (kernel grad)", "m": k, "k": mrows, "n": n, "count": count, "precision": p})
    return out + [dict(g, precision=compute) for g in attention_gemms(plan, full)]


def attention_gemms(plan, full: bool) -> list[dict[str, Any]]:
    """Attention's products where they are plain matmuls (model.attention_impl xla): per layer, microbatch
    and (batch row, local head) the scores [sq, d] x [d, skv] and the output [sq, skv] x [skv, d]
    forward, backward their four products (dP, dV, dQ, dK), the forward again where it is recomputed
    (full or selective recompute). sq: the device's query rows (its
    sequence chunk under context parallelism); skv: the keys of one product (the whole sequence, also
    the all-gather implementation's; the ring's blocks of half chunks). The batch rows and heads of a
    batched product are folded into its rows M (one program runs them together)."""
    cfg, sizes, m = plan.cfg, plan.sizes, plan.cfg.model
    if m.attention_impl != "xla" or not m.num_heads:
        return []
    cp, t = sizes["context"], sizes["tensor"]
    seq = plan.batch.seq_len
    ring = cp > 1 and cfg.parallel.context_impl == "ring"
    # The ring (megajax/parallel/context.py) splits a device's chunk in halves of seq / (2 C) rows: 3
    # blocks of a half against a half on its own chunk, then 2 C - 2 more (a whole chunk against a
    # half, as two) over the C - 1 hops; its backward recomputes each block's forward.
    sq = skv = seq / (2 * cp) if ring else seq / cp
    if not ring:
        skv = seq
    hops = 2 * cp + 1 if ring else 1
    attention_layers = m.attention_layers()
    if m.multi_latent_attention:
        dq, dv = m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim
    else:
        dq = dv = m.head_dim
    fold = plan.batch.micro_batch * max(1.0, m.num_heads / t)
    count = plan.batch.accumulation * attention_layers / sizes["pipeline"] * hops
    if plan.pipeline is not None:
        count = plan.pipeline.microbatches * attention_layers / sizes["pipeline"] * hops
    again = 2 if full or ring or cfg.parallel.recompute == "selective" else 1
    r, kv = max(1, round(fold * sq)), max(1, round(skv))
    fw = [("scores", r, dq, kv), ("output", r, kv, dv)]
    bw = [("scores (dP)", r, dv, kv), ("output (dV)", max(1, round(fold * skv)), round(sq), dv),
          ("scores (dQ)", r, kv, dq), ("scores (dK)", max(1, round(fold * skv)), round(sq), dq)]
    return ([{"name": f"attention {n}", "m": a, "k": b, "n": c, "count": count * again} for n, a, b, c in fw]
            + [{"name": f"attention {n}", "m": a, "k": b, "n": c, "count": count} for n, a, b, c in bw])


def _tiled(impl: str) -> bool:
    """model.moe_grouped_gemm_impl runs tiles on a host that tiles (`auto` resolves to tiled on XLA:CPU)."""
    return impl in ("auto", "tiled")


def product_precisions(cfg) -> tuple[str, bool]:
    """(the precision of the products FP8 leaves in 16 bits (the run's own without FP8), whether the
    output layer runs in FP8)."""
    from megajax.precision.policy import precision_policy
    if cfg.train.precision != "fp8":
        return cfg.train.precision, False
    return "bf16", precision_policy(cfg).fp8.output_layer


def gemm_seconds(gemms, kind) -> tuple[float, float]:
    """(seconds, FLOPs) of the products on a device kind: each at its table's interpolated share
    (kind.gemm_efficiency, shares of the peak of kind.gemm_precision) of its precision's peak, scaled by
    the ratio of the two precisions' matmul ceilings (kind.matmul_peak_share) where the kind has them."""
    seconds = flops = 0.0
    for g in gemms:
        f = 2.0 * g["m"] * g["k"] * g["n"] * g["count"]
        flops += f
        p = g.get("precision", kind.gemm_precision)
        peak = kind.peak_tflops.get(p) or kind.peak_tflops["bf16"]
        seconds += f / (efficiency(kind.gemm_efficiency, g["m"], g["k"], g["n"]) * ceiling_ratio(kind, p)
                        * peak * 1e12)
    return seconds, flops


def ceiling_ratio(kind, precision: str) -> float:
    """How a product in `precision` fares against the table's own precision: the ratio of their
    largest reachable shares of their peaks (1 where the kind lacks either)."""
    ceilings = kind.matmul_peak_share or {}
    if precision in ceilings and kind.gemm_precision in ceilings:
        return ceilings[precision] / ceilings[kind.gemm_precision]
    return 1.0


def measure(dtype: str = "bfloat16", sizes=None, min_seconds: float = 0.05, runs: int = 7) -> dict[str, Any]:
    """Times [M, K] x [K, N] for every combination of `sizes` (the platform's SIZES by default) on the
    first device: {platform, device_kind, dtype, rows: [[M, K, N, TFLOP/s]]}, the fastest of `runs`
    runs of at least `min_seconds` in all (after one compiling run): other work on a shared host only
    adds time, so the fastest run is the least disturbed. On CPU a run's time is the process's CPU
    seconds (every thread's) over the host's cores: what the product costs the host whether it keeps
    one core or all of them busy (the simulated devices of `--cluster NxCPU` share those cores), and
    hardly stretched by other processes, unlike its wall time."""
    import jax
    import jax.numpy as jnp
    device = jax.devices()[0]
    sizes = sizes or SIZES["cpu" if device.platform == "cpu" else "gpu"]
    if device.platform == "cpu":
        cores = os.cpu_count() or 1
        clock = lambda: time.process_time() / cores  # noqa: E731
        # the other threads' CPU time is accounted in scheduler ticks: runs of tens of milliseconds
        min_seconds = max(min_seconds, 0.03 * runs)
    else:
        clock = time.perf_counter
    key = jax.random.PRNGKey(0)
    out = []
    for mm in sizes:
        for kk in sizes:
            for nn in sizes:
                a = jax.device_put(jax.random.normal(key, (mm, kk), jnp.float32).astype(dtype), device)
                b = jax.device_put(jax.random.normal(key, (kk, nn), jnp.float32).astype(dtype), device)
                f = jax.jit(jnp.matmul)
                jax.block_until_ready(f(a, b))
                t0 = time.perf_counter()
                jax.block_until_ready(f(a, b))
                once = max(time.perf_counter() - t0, 1e-7)
                reps = max(1, min(1000, int(min_seconds / once / runs)))
                times = []
                for _ in range(runs):
                    t0 = clock()
                    for _ in range(reps):
                        r = f(a, b)
                    jax.block_until_ready(r)
                    times.append(max(clock() - t0, 1e-9) / reps)
                out.append([mm, kk, nn, 2.0 * mm * kk * nn / min(times) / 1e12])
    return {"platform": device.platform, "device_kind": getattr(device, "device_kind", ""), "dtype": dtype,
            "rows": out}


def kind_name(platform: str, device_kind: str) -> str:
    """The `--cluster` kind a measured table belongs to: a known kind named in the device's kind, CPU
    for the host's devices, else the device kind's letters and digits."""
    from megajax.train.flops import PEAK_TFLOPS
    for name in PEAK_TFLOPS:
        if name in device_kind.upper().replace(" ", ""):
            return name
    if platform == "cpu":
        return "CPU"
    return re.sub(r"[^A-Za-z0-9]", "", device_kind).upper() or platform.upper()


def table_yaml(measured: dict[str, Any], peak_tflops: float, peak_source: str, command: str,
               probes: dict[str, float] | None = None, precision: str = "bf16") -> tuple[str, str]:
    """(kind, the --device-kinds YAML of the measured table): each row's TFLOP/s as a share of
    `peak_tflops` (capped at 1: a peak estimate below what the device reaches), the peak's precision
    (gemm_precision: products in another precision scale by the kind's matmul ceilings), and the figures
    `measure_probes` measured (memory_gbps, with memory_efficiency 1: the probe's bandwidth is what a
    stream reaches; optimizer_gbps, collective_latency_us, collective_gbps, tick_overhead_us)."""
    import yaml
    kind = kind_name(measured["platform"], measured["device_kind"])
    rows = [[m, k, n, round(min(1.0, t / peak_tflops), 4)] for m, k, n, t in measured["rows"]]
    header = (f"{command}\n{measured['device_kind'] or measured['platform']}: [M, K] x [K, N] {measured['dtype']}, "
              f"share of {peak_tflops:.4g} TFLOP/s ({peak_source}); megajax plan --device-kinds THIS_FILE "
              f"--cluster Nx{kind}\n")
    entry: dict[str, Any] = {"gemm_efficiency": rows, "gemm_precision": precision}
    if probes:
        entry.update({k: round(v, 4) for k, v in probes.items()})
        if "memory_gbps" in probes:
            entry["memory_efficiency"] = 1.0
    body = yaml.safe_dump({kind: entry}, default_flow_style=None, sort_keys=False)
    return kind, "".join(f"# {line}\n" for line in header.splitlines()) + body


# The memory-bound and fixed-cost probes `megajax bench --gemm-table` adds to the table (the device
# kind's memory_gbps, collective_latency_us, tick_overhead_us; and the bandwidths below): per device
# 2^18 fp32 elements (1 MiB, the size of a small model's activations), and tiny arrays for the fixed
# costs, each probe a loop inside one program so that no dispatch from Python is timed.
PROBE_ELEMENTS = 2**18
PROBE_ITERATIONS = 64
# The optimizer's update streams the parameters, their gradients and the Adam moments through main
# memory once per step: its probe is that update over more elements per device than the caches hold
# (on CPU 4 MiB per array and device, 8 devices' 28 MiB each beyond a host's last-level cache; on a
# GPU 256 MiB per array, beyond its L2), and the collective's bandwidth probe an all-reduce of 4 MiB
# per device (the gradients of a small model's shard).
OPTIMIZER_PROBE_ELEMENTS = {"cpu": 2**20, "gpu": 2**26}
OPTIMIZER_PROBE_ITERATIONS = 4
COLLECTIVE_PROBE_ELEMENTS = 2**20
COLLECTIVE_PROBE_ITERATIONS = 8


def measure_probes(shared_devices: int = 1, runs: int = 7, min_seconds: float = 0.2) -> dict[str, float]:
    """The kind's memory bandwidth per device and fixed costs, measured on every local device at once:
    `memory_gbps`, from y = a x + y over PROBE_ELEMENTS per device (3 arrays' bytes moved per
    iteration), as bytes per device over the time (divided by `shared_devices` when measured on fewer
    devices than share the host: a lone device has every core); `optimizer_gbps`, from Adam's update
    over OPTIMIZER_PROBE_ELEMENTS per device (7 arrays' bytes: read p, g, m, v, write p, m, v); with
    more than one device, `collective_latency_us`, an all-reduce of 4 elements over all of them per
    iteration, `collective_gbps`, an all-reduce of COLLECTIVE_PROBE_ELEMENTS per device (its bus
    bandwidth: 2 (n - 1) / n of the buffer over the time it adds to the loop), and
    `tick_overhead_us`, a scan whose every tick takes two `lax.cond` branches on 4 elements (a
    pipeline's tick without its work or transfers). Timed as `measure` times (the fastest of
    `runs`; on CPU the process's CPU seconds over the host's cores, the host's time for what all the
    devices do)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    devices = jax.devices()
    n = len(devices)
    cpu = devices[0].platform == "cpu"
    if cpu:
        cores = os.cpu_count() or 1
        clock = lambda: time.process_time() / cores  # noqa: E731
        min_seconds = max(min_seconds, 0.03 * runs)
    else:
        clock = time.perf_counter
    mesh = Mesh(np.array(devices), ("d",))
    spec = NamedSharding(mesh, P("d"))
    iters = PROBE_ITERATIONS

    def timed(f, *args, iters: int = iters) -> float:
        jax.block_until_ready(f(*args))
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        once = max(time.perf_counter() - t0, 1e-7)
        reps = max(1, min(1000, int(min_seconds / once / runs)))
        best = math.inf
        for _ in range(runs):
            t0 = clock()
            for _ in range(reps):
                r = f(*args)
            jax.block_until_ready(r)
            best = min(best, max(clock() - t0, 1e-9) / reps)
        return best / iters

    def per_device(body, size, loops: int = iters):
        x = jax.device_put(jnp.ones((n * size,), jnp.float32), spec)
        f = jax.jit(jax.shard_map(lambda x: jax.lax.fori_loop(0, loops, body, x), mesh=mesh, in_specs=P("d"),
                                  out_specs=P("d")))
        return timed(f, x, iters=loops)

    y = jax.device_put(jnp.ones((n * PROBE_ELEMENTS,), jnp.float32), spec)
    x = jax.device_put(jnp.ones((n * PROBE_ELEMENTS,), jnp.float32), spec)
    stream = jax.jit(jax.shard_map(lambda x, y: jax.lax.fori_loop(0, iters, lambda i, c: x * 1.0001 + c, y),
                                   mesh=mesh, in_specs=(P("d"), P("d")), out_specs=P("d")))
    seconds = timed(stream, x, y)
    share = shared_devices if n < shared_devices else 1  # a lone device of a shared host has every core
    out = {"memory_gbps": 3 * 4 * PROBE_ELEMENTS / seconds / 1e9 / share}
    # The optimizer's update (optax's Adam moments, then the parameter): read p, g, m, v, write p, m, v.
    size = OPTIMIZER_PROBE_ELEMENTS["cpu" if cpu else "gpu"]

    def adam(g):
        def step(i, c):
            p, m, v = c
            m = 0.9 * m + 0.1 * g
            v = 0.999 * v + 0.001 * g * g
            return p - 1e-3 * m / (jnp.sqrt(v) + 1e-8), m, v
        return step

    update = jax.jit(jax.shard_map(
        lambda p, g, m, v: jax.lax.fori_loop(0, OPTIMIZER_PROBE_ITERATIONS, adam(g), (p, m, v)),
        mesh=mesh, in_specs=(P("d"),) * 4, out_specs=(P("d"),) * 3))
    state = [jax.device_put(jnp.full((n * size,), v, jnp.float32), spec) for v in (1.0, 0.01, 0.0, 0.0)]
    seconds = timed(update, *state, iters=OPTIMIZER_PROBE_ITERATIONS)
    out["optimizer_gbps"] = 7 * 4 * size / seconds / 1e9 / share
    del state
    if n > 1:
        reduce = per_device(lambda i, c: c * 0.5 + jax.lax.psum(c, "d") * 0.1, 4)
        plain = per_device(lambda i, c: c * 0.5 + 0.1, 4)
        out["collective_latency_us"] = max(reduce - plain, 0.0) * 1e6
        # an all-reduce's bus bandwidth: 2 (n - 1) / n of the buffer per device (the planner's count), over
        # the time the all-reduce adds to the same loop without it
        def large(body):
            return per_device(body, COLLECTIVE_PROBE_ELEMENTS, COLLECTIVE_PROBE_ITERATIONS)
        added = large(lambda i, c: c * 0.5 + jax.lax.psum(c, "d") * 0.1) - large(lambda i, c: c * 0.5 + 0.1)
        if added > 0:
            out["collective_gbps"] = 4 * COLLECTIVE_PROBE_ELEMENTS * 2 * (n - 1) / n / added / 1e9

        def tick(c, i):
            c = jax.lax.cond(i % 2 == 0, lambda c: c * 0.5 + 1.0, lambda c: c, c)
            return jax.lax.cond(i % 3 == 0, lambda c: c * 0.25 + 1.0, lambda c: c, c), None
        ticks = jax.jit(jax.shard_map(lambda x: jax.lax.scan(tick, x, jnp.arange(iters))[0], mesh=mesh,
                                      in_specs=P("d"), out_specs=P("d")))
        out["tick_overhead_us"] = timed(ticks, jax.device_put(jnp.ones((n * 4,), jnp.float32), spec)) * 1e6
    return out
