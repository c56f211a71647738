"""The device kinds `megajax plan` estimates for: figures per kind, `--device-kinds FILE.yaml`, `--cluster NxKIND`.

    load_device_kinds(path) -> {KIND: DeviceKind}   the built-in table, extended or overridden by the file
    parse_cluster(text, kinds) -> (count, KIND, DeviceKind)

The file is a mapping of kind name to the fields of `DeviceKind`; each field is checked for its
type and range here (a ConfigError naming the file, the kind, the field, the value and what is
accepted), so that the estimate never meets a figure it cannot use.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path

import yaml

from megajax.errors import ConfigError
from megajax.perf.matmul_tables import MATMUL_PEAK_SHARE, gpu_table
from megajax.train.flops import PEAK_TFLOPS


@dataclass(frozen=True)
class DeviceKind:
    """A device kind's figures: memory, dense peak TFLOP/s by precision, devices per node, and the
    per-device bandwidth (GB/s, one direction) inside a node and across nodes."""
    memory_gib: float
    peak_tflops: dict[str, float]
    node_size: int = 8
    intra_node_gbps: float = 450.0
    inter_node_gbps: float = 50.0
    efficiency: float = 0.5  # share of the peak the model's matmuls reach in a step
    link_efficiency: float = 0.7  # share of the links' bandwidth collectives reach
    # [M, K, N, share of the peak] rows measured by `megajax bench --gemm-table` (megajax/perf/gemm.py):
    # with them the compute time is each product's at its shape's share; `efficiency` is then attention's
    # and what the table's products leave out
    gemm_efficiency: tuple | None = None
    # the devices share one host's cores (simulated CPU devices): a device idle in a pipeline bubble
    # leaves its cores to the others, so the bubble costs no time
    shared_host: bool = False
    # rows per tile of the routed experts' products: each expert's rows are padded to whole tiles
    # (XLA:CPU runs them as a loop over tiles, megajax.models.moe.expert_ffn_tiled); 0: exact rows
    # (a grouped GEMM)
    grouped_gemm_tile: int = 0
    # memory bandwidth per device (GB/s) for the memory-bound work: element-wise ops on the activations
    # (norms, activations, residual adds, softmax, the loss) and the optimizer's update; the share of it
    # such streams reach
    memory_gbps: float = 2000.0
    memory_efficiency: float = 0.8
    # fixed costs: a collective's latency per call (microseconds; what a tiny all-reduce takes), and
    # one pipeline tick's own (the stage loop's iteration and its branches, without their work)
    collective_latency_us: float = 15.0
    tick_overhead_us: float = 10.0
    # measured bandwidths per device (GB/s; 0: not measured, the figures above apply): the optimizer's
    # update, which streams the parameters, their gradients and the Adam moments through main memory
    # once per step (memory_gbps is the element-wise work's on activations, which may sit in a cache);
    # and a collective's bus bandwidth among a node's devices, in place of intra_node_gbps x link_efficiency
    optimizer_gbps: float = 0.0
    collective_gbps: float = 0.0
    # the precision a gemm_efficiency table's shares were measured in, and each precision's largest
    # share of its own peak a matmul reaches (maximum achievable matmul FLOPS, megajax/perf/
    # matmul_tables.py): a product in another precision gets the table's share x their ratio
    gemm_precision: str = "bf16"
    matmul_peak_share: dict | None = None
    # with parallel.tp_comm_overlap, the share of a tensor-parallel collective's time that runs beside
    # the products (collective matmuls: each step's transfer beside the previous step's partial
    # product), at most the products' own time; 0: none. An assumption on the GPU kinds until `bash
    # scripts/gpu_suite.sh` (section tp_overlap) measures it: the ring's first step and the transfers'
    # share of the GPU's memory bandwidth and SMs are taken to cost a tenth.
    tp_overlap: float = 0.0


# Vendor datasheets: SXM parts, NVLink 4 (900 GB/s both ways) / NVLink 3 (600), one 400 Gb/s
# (NDR) or 200 Gb/s (HDR) InfiniBand port per GPU; MI300X's Infinity Fabric (896 GB/s both ways);
# memory bandwidth: HBM3 3.35 TB/s (H100), HBM3e 4.8 TB/s (H200), HBM2e 2.04 TB/s (A100 80GB),
# HBM3 5.3 TB/s (MI300X). MI250X / MI250: per graphics compute die (two per module, each a device of
# 64 GiB and half the module's 3.2 TB/s), Infinity Fabric among a node's 8 dies, a 200 Gb/s port per
# die pair. The one list of kinds: `megajax plan --cluster`, `megajax bench --topology` and the fit
# check's datasheet capacities (megajax/perf/fit.py) all read it.
# H100, H200 and MI300X carry the published matmul tables (megajax/perf/matmul_tables.py: XLA's
# measured sm_90 table, the MAMF ceilings); with a table `efficiency` is attention's (a fused kernel's
# forward and backward: about half the 16-bit peak on H100, between FlashAttention-2's and -3's).
_TP_OVERLAP = 0.45


def _gpu(name: str, memory_gib: float, intra: float, inter: float, memory_gbps: float, **kw) -> DeviceKind:
    table = {}
    if name in MATMUL_PEAK_SHARE:
        table = dict(gemm_efficiency=gpu_table(name), matmul_peak_share=MATMUL_PEAK_SHARE[name])
    return DeviceKind(memory_gib, PEAK_TFLOPS[name], 8, intra, inter, memory_gbps=memory_gbps,
                      tp_overlap=_TP_OVERLAP, **table, **kw)


DEVICE_KINDS: dict[str, DeviceKind] = {
    "H100": _gpu("H100", 80.0, 450.0, 50.0, 3350.0),
    "H200": _gpu("H200", 141.0, 450.0, 50.0, 4800.0),
    "A100": _gpu("A100", 80.0, 300.0, 25.0, 2039.0),
    "MI300X": _gpu("MI300X", 192.0, 448.0, 50.0, 5300.0, efficiency=0.4),
    "MI250X": _gpu("MI250X", 64.0, 100.0, 12.5, 1638.0, efficiency=0.4),
    "MI250": _gpu("MI250", 64.0, 100.0, 12.5, 1638.0, efficiency=0.4),
}



def cpu_device_kind(devices: int = 8) -> DeviceKind:
    """This host's simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N): `devices`
    of them in one node sharing the host's cores and memory, each with host peak / devices (fp32: XLA
    runs 16-bit arithmetic in fp32 on CPU). Their collectives are copies in the host's memory: 10 GB/s
    per device (a share of one socket's copy bandwidth), none across nodes. The fixed costs and the
    memory bandwidth are in the same host-shared units as the peak: the host's time for what all the
    devices do at once (a collective's latency: the host's CPU time for one call on every device)."""
    from megajax.train.flops import cpu_peak_tflops
    peak = cpu_peak_tflops("fp32")
    peak = peak / devices if math.isfinite(peak) else 0.1
    try:
        mem = int(re.search(r"MemTotal:\s*(\d+) kB", open("/proc/meminfo").read()).group(1)) / 2**20
    except (OSError, AttributeError):
        mem = 16.0
    from megajax.models.moe import GROUPED_GEMM_TILE
    # Unmeasured, rough figures of a small host (`megajax bench --gemm-table` measures this one's):
    # 20 GB/s of the host's memory bandwidth shared by the devices, a collective's rendezvous of the
    # devices' threads 50 us, a stage loop's tick 10 us.
    return DeviceKind(mem / devices, {p: peak for p in ("fp32", "bf16", "fp16", "fp8")}, devices, 10.0, 10.0,
                      shared_host=True, grouped_gemm_tile=GROUPED_GEMM_TILE, memory_gbps=20.0 / devices,
                      memory_efficiency=1.0, collective_latency_us=50.0, tick_overhead_us=10.0)


PRECISIONS = ("fp32", "bf16", "fp16", "fp8")  # the keys of a peak_tflops mapping
MAX_DEVICES = 2**20  # a --cluster count beyond any machine room (the plan enumerates the count's divisors)
_NAME = re.compile(r"^[A-Za-z0-9]+$")
_CLUSTER = re.compile(r"^(\d+)x([A-Za-z0-9]+)$")
# Each number field: (test, what is accepted).
_RANGES = {
    "memory_gib": (lambda v: v > 0, "a number of GiB > 0"),
    "node_size": (lambda v: isinstance(v, int) and v >= 1, "a whole number of devices >= 1"),
    "intra_node_gbps": (lambda v: v > 0, "a bandwidth in GB/s > 0"),
    "inter_node_gbps": (lambda v: v > 0, "a bandwidth in GB/s > 0"),
    "efficiency": (lambda v: 0 < v <= 1, "a share of the peak in (0, 1], e.g. 0.5"),
    "link_efficiency": (lambda v: 0 < v <= 1, "a share of the links' bandwidth in (0, 1], e.g. 0.7"),
    "grouped_gemm_tile": (lambda v: isinstance(v, int) and v >= 0, "a whole number of rows >= 0 (0: exact rows)"),
    "memory_gbps": (lambda v: v > 0, "a bandwidth in GB/s > 0"),
    "memory_efficiency": (lambda v: 0 < v <= 1, "a share of the memory bandwidth in (0, 1], e.g. 0.8"),
    "collective_latency_us": (lambda v: v >= 0, "a time in microseconds >= 0"),
    "tick_overhead_us": (lambda v: v >= 0, "a time in microseconds >= 0"),
    "optimizer_gbps": (lambda v: v >= 0, "a bandwidth in GB/s >= 0 (0: not measured, memory_gbps x memory_efficiency)"),
    "collective_gbps": (lambda v: v >= 0, "a bandwidth in GB/s >= 0 (0: not measured, intra_node_gbps x link_efficiency)"),
    "tp_overlap": (lambda v: 0 <= v <= 1, "a share of the tensor-parallel transfers' time in [0, 1] (0: none hidden)"),
}
_PEAK = ("a number of TFLOP/s > 0 (the one peak for every precision), or a mapping of precision "
         f"({', '.join(PRECISIONS)}) to TFLOP/s > 0 that holds bf16 (the peak of the precisions it leaves out)")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _peak(where: str, value) -> dict[str, float]:
    """peak_tflops as the per-precision mapping (a plain number: the same peak for every precision)."""
    if _number(value) and value > 0:
        return {p: float(value) for p in PRECISIONS}
    ok = (isinstance(value, dict) and "bf16" in value and set(value) <= set(PRECISIONS)
          and all(_number(v) and v > 0 for v in value.values()))
    if not ok:
        raise ConfigError(f"{where}: peak_tflops = {value!r}: expected {_PEAK}.")
    return {p: float(v) for p, v in value.items()}


def _checked(where: str, entry: dict) -> dict:
    """The entry's fields checked for type and range (ConfigError naming the field, the value and what is accepted)."""
    out = {}
    for key, value in entry.items():
        if key == "peak_tflops":
            out[key] = _peak(where, value)
            continue
        if key == "shared_host":
            if not isinstance(value, bool):
                raise ConfigError(f"{where}: shared_host = {value!r}: expected true or false.")
            out[key] = value
            continue
        if key == "gemm_efficiency":
            from megajax.perf.gemm import check_table
            out[key] = tuple(check_table(where, value))
            continue
        if key == "gemm_precision":
            if value not in PRECISIONS:
                raise ConfigError(f"{where}: gemm_precision = {value!r}: expected one of {', '.join(PRECISIONS)}.")
            out[key] = value
            continue
        if key == "matmul_peak_share":
            ok = (isinstance(value, dict) and value and set(value) <= set(PRECISIONS)
                  and all(_number(v) and 0 < v <= 1 for v in value.values()))
            if not ok:
                raise ConfigError(f"{where}: matmul_peak_share = {value!r}: expected a mapping of precision "
                                  f"({', '.join(PRECISIONS)}) to the largest share of its peak a matmul reaches, "
                                  f"in (0, 1], e.g. {{bf16: 0.8, fp8: 0.7}}.")
            out[key] = {p: float(v) for p, v in value.items()}
            continue
        test, accepted = _RANGES[key]
        if not _number(value) or not test(value):
            raise ConfigError(f"{where}: {key} = {value!r}: expected {accepted}.")
        out[key] = value
    return out


def load_device_kinds(path: str | None) -> dict[str, DeviceKind]:
    """The built-in table, extended by a YAML file of {KIND: {memory_gib, peak_tflops: {bf16: ...}, ...}}."""
    kinds = {**DEVICE_KINDS, "CPU": cpu_device_kind()}
    if not path:
        return kinds
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"--device-kinds {path}: cannot read it as YAML ({e}).") from None
    names = {f.name for f in fields(DeviceKind)}
    example = "GB200: {memory_gib: 186, peak_tflops: {bf16: 2500}, node_size: 4}"
    if not isinstance(data, dict) or not data:
        got = "the file is empty" if not data else f"got {type(data).__name__} {str(data)[:80]!r}"
        raise ConfigError(f"--device-kinds {path}: expected a mapping of kind name to its figures, e.g. {example}; "
                          f"{got}.")
    for name, entry in data.items():
        if not isinstance(entry, dict) or set(entry) - names:
            raise ConfigError(f"--device-kinds {path}: kind {name!r} must be a mapping of "
                              f"{', '.join(sorted(names))}; got {entry!r}.")
        if not _NAME.match(str(name)):
            raise ConfigError(f"--device-kinds {path}: kind name {name!r}: letters and digits only (it is "
                              f"written in --cluster COUNTxKIND), e.g. GB200.")
        where = f"--device-kinds {path}, kind {name!r}"
        entry = _checked(where, entry)
        base = kinds.get(str(name).upper())
        if base is None and not {"memory_gib", "peak_tflops"} <= set(entry):
            missing = sorted({"memory_gib", "peak_tflops"} - set(entry))
            raise ConfigError(f"{where}: a new kind needs memory_gib and peak_tflops; {' and '.join(missing)} "
                              f"missing (known kinds, whose figures an entry changes: {', '.join(kinds)}).")
        kinds[str(name).upper()] = replace(base, **entry) if base else DeviceKind(**entry)
    return kinds


def parse_cluster(text: str, kinds: dict[str, DeviceKind], option: str = "--cluster") -> tuple[int, str, DeviceKind]:
    """(count, KIND, its figures) of `plan --cluster` / `bench --topology` COUNTxKIND (`option` names the
    flag in errors); a count above one node must be whole nodes."""
    m = _CLUSTER.match(text.strip())
    names = ", ".join(kinds)
    if not m or not 1 <= int(m.group(1)) <= MAX_DEVICES:
        raise ConfigError(f"{option} {text!r}: expected COUNTxKIND such as 32xH100, COUNT in 1..{MAX_DEVICES} "
                          f"(kinds: {names}).")
    count, name = int(m.group(1)), m.group(2).upper()
    if name not in kinds:
        more = " (add one with --device-kinds FILE.yaml)" if option == "--cluster" else ""
        raise ConfigError(f"{option} {text!r}: unknown device kind {m.group(2)!r}; known kinds: {names}{more}.")
    kind = kinds[name]
    if count > kind.node_size and count % kind.node_size:
        raise ConfigError(f"{option} {text!r}: {count} devices are not whole nodes of {kind.node_size} {name}.")
    return count, name, kind
