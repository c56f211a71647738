"""Will it fit? Compiled per-device memory against the device's capacity, with advice.

Before the first step the train loop compares the compiled step's memory
(arguments + outputs + temporaries - donated aliases, from XLA's memory
analysis) with the device's capacity and stops with the figures and the
changes most likely to help, each with an analytic estimate of what it saves.
"""

from __future__ import annotations

import copy

from megajax.config import Config
from megajax.errors import MeshError
from megajax.perf.analytic import activation_bytes

GIB = 2**30
# Per-device HBM by device kind, used when the runtime does not report a limit.
CAPACITY_GIB = {"H100": 80.0, "H200": 141.0, "A100": 80.0, "MI300X": 192.0, "MI250": 64.0}


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


def advice(cfg: Config, sizes: dict[str, int], micro_batch: int, state: dict[str, int]) -> list[str]:
    """Changes that reduce per-device memory, with estimated savings (GiB), largest first."""
    tips: list[tuple[float, str]] = []
    act_now = activation_bytes(cfg, sizes, micro_batch)
    for policy in ("selective", "full"):
        if cfg.parallel.recompute != policy and not (cfg.parallel.recompute == "full"):
            alt = copy.deepcopy(cfg)
            alt.parallel.recompute = policy
            saved = act_now - activation_bytes(alt, sizes, micro_batch)
            if saved > 0:
                tips.append((saved, f"parallel.recompute={policy}"))
    if micro_batch > 1:
        saved = act_now - activation_bytes(cfg, sizes, micro_batch // 2)
        tips.append((saved, f"train.micro_batch={micro_batch // 2} (more accumulation steps)"))
    if sizes["tensor"] == 1 and cfg.model.num_heads % 2 == 0 and cfg.model.num_kv_heads % 2 == 0:
        saved = (state["params"] + state["grads"] + state["optimizer"]) / 2 + act_now / 2
        tips.append((saved, "mesh.tensor=2 (with parallel.sequence_parallel=true)"))
    if sizes["data"] > 1 and sizes["fsdp"] == 1:
        saved = (state["params"] + state["grads"] + state["optimizer"]) * (1 - 1 / sizes["data"])
        tips.append((saved, f"mesh.fsdp={sizes['data']} mesh.data=1 (shard parameters and optimizer state)"))
    if not cfg.parallel.distributed_optimizer and sizes["data"] * sizes["fsdp"] > 1 and sizes["fsdp"] == 1:
        saved = state["optimizer"] * (1 - 1 / sizes["data"])
        tips.append((saved, "parallel.distributed_optimizer=true"))
    tips.sort(key=lambda x: -x[0])
    return [f"{what} (-{saved / GIB:.1f} GiB est.)" for saved, what in tips[:3]]


def check_fit(needed: int, capacity: int | None, source: str, tips: list[str]) -> None:
    """Raises MeshError when `needed` bytes per device exceed `capacity`."""
    if capacity is None or needed <= capacity:
        return
    tip = ("; try " + " or ".join(tips)) if tips else ""
    raise MeshError(f"the compiled train step needs {needed / GIB:.2f} GiB per device of {capacity / GIB:.2f} "
                    f"({source}){tip}.")
