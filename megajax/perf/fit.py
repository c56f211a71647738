"""Will it fit? Compiled per-device memory against the device's capacity, with advice.

Before the first step the train loop compares the compiled step's memory
(arguments + outputs + temporaries - donated aliases, from XLA's memory
analysis) with the device's capacity and stops with the figures and changes
that would make it fit.

Advice only names changes the same devices can run and that fit by the
analytic estimate (megajax/perf/analytic.py): each candidate (a stronger
recompute policy, a smaller micro batch, the distributed optimizer, FSDP or
more tensor parallelism taken from the data axes of a node) is applied to a
copy of the config and planned (`RunPlan.variant`: the plan's own checks and
batch arithmetic; a candidate the plan refuses is not offered), its memory
estimated, and the difference from the current estimate applied to the
measured figure. Single changes that fit are offered
first, cheapest first; when none fits alone, the smallest combination that
does; when nothing fits, the message says so, with the most any combination
saves.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass

from megajax.config import Config
from megajax.errors import MeshError, UserError
from megajax.perf import analytic
from megajax.perf.device_kinds import DEVICE_KINDS
from megajax.plan import RunPlan
from megajax.train.metrics import readable_bytes

GIB = 2**30
# Per-device HBM by device kind (the datasheets of megajax/perf/device_kinds.py), used when the runtime
# does not report a limit.
CAPACITY_GIB = {name: kind.memory_gib for name, kind in DEVICE_KINDS.items()}


def compiled_bytes(compiled) -> dict[str, int] | None:
    """XLA's memory analysis of a compiled executable (per device), or None if unavailable."""
    try:
        m = compiled.memory_analysis()
    except Exception:
        return None
    if m is None:
        return None
    out = {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
           "temporaries": m.temp_size_in_bytes, "aliased": m.alias_size_in_bytes}
    out["total"] = out["arguments"] + out["outputs"] + out["temporaries"] - out["aliased"]
    return out


def device_capacity_bytes(device, override_gib: float | None = None) -> tuple[int | None, str]:
    """(capacity in bytes, where it came from) of one device; None when unknown (CPU)."""
    if override_gib:
        return int(override_gib * GIB), "train.device_memory_gib"
    try:
        stats = device.memory_stats() or {}
    except Exception:
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), "device runtime"
    kind = getattr(device, "device_kind", "").upper().replace(" ", "")
    for name, gib in CAPACITY_GIB.items():
        if name in kind:
            return int(gib * GIB), f"{name} datasheet"
    return None, "unknown"


# ----------------------------------------------------------------------------------------------
# Candidate changes

@dataclass(frozen=True)
class Option:
    """One change: config overrides, the group it belongs to (one option per group in a
    combination), its kind (the advice offers one option per kind), and a rough throughput cost
    used to order the advice (lower first)."""
    group: str  # recompute | micro_batch | layout
    kind: str  # recompute | micro_batch | distributed_optimizer | fsdp | tensor
    overrides: tuple[str, ...]
    cost: float


@dataclass(frozen=True)
class Variant:
    options: tuple[Option, ...]
    delta: int  # analytic bytes per device after the change minus before (negative: saves)

    @property
    def cost(self) -> float:
        return sum(o.cost for o in self.options)

    def describe(self) -> str:
        return " + ".join(" ".join(o.overrides) for o in self.options)


def _signed(n: int) -> str:
    return ("-" if n < 0 else "+") + readable_bytes(abs(n))


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


def _layout_options(cfg: Config, ici: dict[str, int], dcn: dict[str, int]) -> list[tuple[Option, dict]]:
    """(option, new per-node sizes) for layouts over the same devices: the distributed optimizer,
    and FSDP or tensor parallelism taken from the data axis (then fsdp) of a node."""
    out: list[tuple[Option, dict]] = []
    if not cfg.parallel.distributed_optimizer and ici["data"] * dcn["data"] > 1:
        out.append((Option("layout", "distributed_optimizer", ("parallel.distributed_optimizer=true",), 1.0),
                    dict(ici)))

    def keys(grown: str, donor: str, new: dict) -> tuple[str, ...]:
        # The axis that grows, then the one it takes from, unless that is the axis filling the rest.
        shown = [grown] + ([] if getattr(cfg.mesh, donor) == -1 else [donor])
        return tuple(f"mesh.{a}={new[a]}" for a in shown)

    for f in _divisors(ici["data"]):
        new = {**ici, "data": ici["data"] // f, "fsdp": ici["fsdp"] * f}
        out.append((Option("layout", "fsdp", keys("fsdp", "data", new), 1.5 + 0.1 * math.log2(f)), new))
    for donor in ("data", "fsdp"):
        for k in _divisors(ici[donor]):
            new = {**ici, donor: ici[donor] // k, "tensor": ici["tensor"] * k}
            sp = () if cfg.parallel.sequence_parallel else ("parallel.sequence_parallel=true",)
            out.append((Option("layout", "tensor", keys("tensor", donor, new) + sp, 3.0 + 0.5 * math.log2(k)),
                        new))
    return out


def _apply(cfg: Config, option: Option) -> None:
    """Applies an option's overrides to `cfg` in place (mesh sizes are applied separately)."""
    for item in option.overrides:
        key, value = item.split("=", 1)
        section, name = key.split(".", 1)
        if section == "mesh":
            continue
        current = getattr(getattr(cfg, section), name)
        setattr(getattr(cfg, section), name, value == "true" if isinstance(current, bool) else
                (int(value) if name == "micro_batch" else value))


class Advice:
    """Every change (alone and combined) the same devices could run, with its analytic effect;
    `phrases(needed, capacity)` picks what to tell the user."""

    def __init__(self, variants: list[Variant], devices: int):
        self.variants, self.devices = variants, devices

    def phrases(self, needed: int, capacity: int | None, limit: int = 3) -> list[str]:
        """What to try, each phrase complete after 'try ': the single changes that fit (cheapest
        first, the least drastic option of each kind), else the smallest combination that fits,
        else a statement that nothing does."""
        singles = [v for v in self.variants if len(v.options) == 1]
        if capacity is None:  # nothing to compare with: the largest savings
            best = sorted((v for v in singles if v.delta < 0), key=lambda v: v.delta)
            return [self._phrase(v, needed) for v in best[:limit]]
        fits = [v for v in self.variants if needed + v.delta <= capacity]
        fitting_singles = [v for v in fits if len(v.options) == 1]
        if fitting_singles:
            chosen, kinds = [], set()
            for v in sorted(fitting_singles, key=lambda v: (v.cost, needed + v.delta)):
                if v.options[0].kind not in kinds:
                    kinds.add(v.options[0].kind)
                    chosen.append(v)
            return [self._phrase(v, needed) for v in chosen[:limit]]
        if fits:
            smallest = min(len(v.options) for v in fits)
            best = min((v for v in fits if len(v.options) == smallest),
                       key=lambda v: (v.cost, needed + v.delta))
            return [self._phrase(best, needed)]
        most = min(self.variants, key=lambda v: v.delta, default=None)
        tried = "recompute or micro batch" + (" or layout" if self.devices > 1 else "")
        where = "this 1 device" if self.devices == 1 else f"these {self.devices} devices"
        text = (f"more devices or a smaller model, batch or sequence: no change of {tried} on {where} "
                f"fits by the analytic estimate")
        if most is not None and most.delta < 0:
            text += (f"; the most that helps, {most.describe()} ({_signed(most.delta)} est.), still "
                     f"needs {readable_bytes(needed + most.delta)}")
        return [text]

    @staticmethod
    def _phrase(v: Variant, needed: int) -> str:
        return f"{v.describe()} ({_signed(v.delta)} est., {readable_bytes(needed + v.delta)})"


def _variant(plan: RunPlan, options: list[tuple[Option, dict | None]]) -> RunPlan | None:
    """The plan with the options applied (None when the plan refuses the result)."""
    alt, per_node = copy.deepcopy(plan.cfg), dict(plan.ici)
    for option, new_sizes in options:
        _apply(alt, option)
        if new_sizes is not None:
            per_node = new_sizes
    try:
        return plan.variant(alt, per_node)
    except UserError:
        return None


def advice(plan: RunPlan, spec=None) -> Advice:
    """The changes that reduce per-device memory for the run `plan` describes, each planned as a
    variant of it (`spec`: the model spec, built from the config when not given)."""
    if spec is None:
        from megajax.train.state import build_model_spec
        spec, _ = build_model_spec(plan.cfg, plan.padded_vocab)
    cfg, micro_batch = plan.cfg, plan.batch.micro_batch
    now = analytic.memory_estimate(plan, spec)["total"]
    order = ("none", "selective", "full")
    groups: list[list[tuple[Option, dict | None]]] = [
        [(Option("recompute", "recompute", (f"parallel.recompute={p}",), {"selective": 2.0, "full": 4.0}[p]), None)
         for p in order[order.index(cfg.parallel.recompute) + 1:]],
        [(Option("micro_batch", "micro_batch", (f"train.micro_batch={d}",), 2.0 + 0.2 * math.log2(micro_batch / d)),
          None) for d in sorted((d for d in range(1, micro_batch) if micro_batch % d == 0), reverse=True)],
        _layout_options(cfg, plan.ici, plan.dcn),
    ]
    variants = []
    for picks in itertools.product(*[[None, *g] for g in groups]):
        chosen = [p for p in picks if p is not None]
        if not chosen:
            continue
        changed = _variant(plan, chosen)
        if changed is None:
            continue
        variants.append(Variant(tuple(o for o, _ in chosen), analytic.memory_estimate(changed, spec)["total"] - now))
    return Advice(variants, plan.num_devices)


def check_fit(needed: int, capacity: int | None, source: str, tips: Advice | list[str]) -> None:
    """Raises MeshError when `needed` bytes per device exceed `capacity`, with what to try."""
    if capacity is None or needed <= capacity:
        return
    if isinstance(tips, Advice):
        tips = tips.phrases(needed, capacity)
    tip = ("; try " + " or ".join(tips)) if tips else ""
    raise MeshError(f"the compiled train step needs {readable_bytes(needed)} per device of "
                    f"{readable_bytes(capacity)} ({source}){tip}.")


def fit_check(setup, compiled) -> None:
    """Stops before the first step when the compiled step cannot fit in device memory.

    `setup` is the run's megajax.train.setup.Setup (its plan, mesh and model spec); the CLI hands
    this function to the training loop (`train(..., check_compiled=fit_check)`), which calls it
    with the compiled train step."""
    plan = setup.plan
    memory = compiled_bytes(compiled)
    capacity, source = device_capacity_bytes(setup.mesh.devices.flat[0], plan.cfg.train.device_memory_gib)
    if memory is None or capacity is None or memory["total"] <= capacity:
        return
    check_fit(memory["total"], capacity, source, advice(plan, spec=setup.spec))
