"""Collectives of a compiled XLA program, counted per execution.

Reads the optimized HLO text (`compiled.as_text()`): every all-reduce,
all-gather, reduce-scatter, all-to-all and collective-permute (the
synchronous form or the `-start` of an async pair), weighted by how often
its computation runs: the body of a while loop with a known trip count (a
scan over layers or microbatches) counts that many times, nested loops
multiply. Bytes are per device, of the buffer the collective works on:

- all-reduce, all-to-all, collective-permute: the operand (= result) size;
- all-gather: the gathered result;
- reduce-scatter: the operand, i.e. result x group size.

A collective whose groups hold one device each moves nothing and is left out.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(.*?)\s([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"\b([a-z]+\d*[a-z\d]*)\[([\d,]*)\]")
_CALLEE = re.compile(r"\b(body|condition|calls|to_apply|branch_computations|called_computations)="
                     r"(\{[^}]*\}|%[\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]+)\}")
_SINGLETONS = re.compile(r"replica_groups=\{\{\d+\}(,\{\d+\})*\}")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


@dataclass
class Collective:
    kind: str
    bytes: int  # per device per execution
    count: int  # executions per program run (loop trip counts applied)
    group_size: int
    name: str = ""


@dataclass
class CommReport:
    ops: list[Collective] = field(default_factory=list)

    def total(self, kind: str) -> tuple[int, int]:
        """(executions, bytes) of one kind per program run."""
        ops = [o for o in self.ops if o.kind == kind]
        return sum(o.count for o in ops), sum(o.count * o.bytes for o in ops)


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        if dtype not in DTYPE_BYTES:
            continue
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        total += n * DTYPE_BYTES[dtype]
    return total


def _group_size(line: str) -> int:
    m = _GROUPS_IOTA.search(line)
    if m:
        return int(m.group(2))
    m = _GROUPS_LIST.search(line)
    if m:
        return len(m.group(1).split(","))
    m = _GROUPS_MESH.search(line)
    if m:
        sizes = dict((k.strip("' "), int(v)) for k, v in
                     (p.split("=") for p in m.group(1).split(",") if "=" in p))
        n = 1
        for axis in m.group(2).split(","):
            axis = axis.strip().strip("'")
            if axis:
                n *= sizes.get(axis, 1)
        return n
    return 1


def parse(hlo: str) -> CommReport:
    """All collectives of an optimized HLO module, with per-run execution counts."""
    computations: dict[str, list[str]] = defaultdict(list)
    entry, current = None, None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(1)
            if line.startswith("ENTRY"):
                entry = current
            continue
        if current is not None:
            computations[current].append(line)
    # Edges: computation -> (callee, multiplier)
    edges: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for comp, lines in computations.items():
        for line in lines:
            trip = _TRIP.search(line)
            for key, names in _CALLEE.findall(line):
                for name in names.strip("{}").replace("%", "").split(","):
                    name = name.strip()
                    if name in computations:
                        edges[comp].append((name, int(trip.group(1)) if (trip and key == "body") else 1))
    runs: dict[str, int] = defaultdict(int)

    def visit(comp: str, times: int, depth: int = 0) -> None:
        if depth > 64:
            return
        runs[comp] += times
        for callee, mult in edges.get(comp, []):
            visit(callee, times * mult, depth + 1)

    visit(entry or next(iter(computations)), 1)
    report = CommReport()
    for comp, lines in computations.items():
        for line in lines:
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            result, op = m.group(1), m.group(2)
            kind = op[:-len("-start")] if op.endswith("-start") else op
            if kind not in KINDS or runs.get(comp, 0) == 0:
                continue
            group = _group_size(line)
            if _SINGLETONS.search(line):  # one device per group (a size-1 mesh axis): nothing moves
                continue
            size = _shape_bytes(result)
            if op.endswith("-start") and result.startswith("("):
                # async start returns (operand(s), result(s), ...): count the result half
                size = size // 2
            if kind == "reduce-scatter":
                size *= group
            name = line.split("=", 1)[0].strip().replace("ROOT", "").strip()
            report.ops.append(Collective(kind, size, runs[comp], group, name))
    return report
