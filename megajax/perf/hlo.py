"""Collectives and matrix products of a compiled XLA program, counted per execution.

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

`matmuls` lists the products (`dot`) the same way, each with its FLOPs (2 x the result's elements
x the contracted size), its execution count and its op name (the JAX named scopes it was traced
in): what a step's matrix arithmetic is, recomputation included.
"""

from __future__ import annotations

import math
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
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_INSTRUCTION_NAME = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=")
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


def _computations(hlo: str) -> tuple[dict[str, list[str]], dict[str, int], dict[str, str], dict[str, list[str]]]:
    """(the lines of every computation, how often each runs per program run: a while loop's body
    its known trip count times its caller, every branch of a conditional as often as its caller;
    the op name of the instruction that calls each computation, inherited from its own caller
    where it has none; the instructions that call each computation)."""
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
    # Edges: computation -> (callee, multiplier, the calling instruction's op name)
    callers: dict[str, list[str]] = defaultdict(list)  # computation -> the instructions calling it
    edges: dict[str, list[tuple[str, int, str]]] = defaultdict(list)
    for comp, lines in computations.items():
        for line in lines:
            trip = _TRIP.search(line)
            op_name = _OP_NAME.search(line)
            instruction = _INSTRUCTION_NAME.match(line)
            for key, names in _CALLEE.findall(line):
                for name in names.strip("{}").replace("%", "").split(","):
                    name = name.strip()
                    if name in computations:
                        edges[comp].append((name, int(trip.group(1)) if (trip and key == "body") else 1,
                                            op_name.group(1) if op_name else ""))
                        if instruction:
                            callers[name].append(instruction.group(1))
    runs: dict[str, int] = defaultdict(int)
    called_as: dict[str, str] = {}

    def visit(comp: str, times: int, name: str, depth: int = 0) -> None:
        if depth > 64:
            return
        runs[comp] += times
        called_as.setdefault(comp, name)
        for callee, mult, op_name in edges.get(comp, []):
            visit(callee, times * mult, op_name or name, depth + 1)

    if computations:
        visit(entry or next(iter(computations)), 1, "")
    return computations, runs, called_as, callers


def parse(hlo: str) -> CommReport:
    """All collectives of an optimized HLO module, with per-run execution counts."""
    computations, runs, _, _ = _computations(hlo)
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


@dataclass
class Matmul:
    flops: int  # per execution
    count: int  # executions per program run (loop trip counts applied)
    op_name: str  # the op's metadata: the JAX function, transformations and named scopes it came from


_ARRAY = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*[a-z]+\d*[a-z\d]*\[([\d,]*)\]")
_OPERANDS = re.compile(r"%([\w.\-]+)")
_DOT = re.compile(r"\sdot\(%([\w.\-]+),\s*%([\w.\-]+)\)")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def matmuls(hlo: str) -> list[Matmul]:
    """Every `dot` of an optimized HLO module with its FLOPs per execution and per-run count. A dot
    without an op name of its own (one an XLA pass made) takes that of the nearest named instruction
    its operands come from (through a fused computation's parameters to the fusion's operands), else
    that of the instruction calling its computation."""
    computations, runs, called_as, callers = _computations(hlo)
    shapes: dict[str, list[int]] = {}
    named: dict[str, str] = {}  # instruction -> its op name
    inputs: dict[str, list[str]] = {}  # instruction -> where its operands come from
    for comp, lines in computations.items():
        for line in lines:
            m = _INSTRUCTION_NAME.match(line)
            if not m:
                continue
            array, op_name, body = _ARRAY.match(line), _OP_NAME.search(line), line.split("=", 1)[1]
            if array:
                shapes[m.group(1)] = _dims(array.group(2))
            if op_name:
                named[m.group(1)] = op_name.group(1)
            # A computation's parameter comes from whatever calls the computation.
            inputs[m.group(1)] = (callers.get(comp, []) if " parameter(" in body
                                  else _OPERANDS.findall(body.split("metadata=")[0]))

    def traced_name(instruction: str) -> str:
        seen, todo = set(), [instruction]
        while todo and len(seen) < 256:
            name = todo.pop(0)
            if name in named:
                return named[name]
            seen.add(name)
            todo += [o for o in inputs.get(name, []) if o not in seen]
        return ""

    out = []
    for comp, lines in computations.items():
        for line in lines:
            dot, array = _DOT.search(line), _ARRAY.match(line)
            if not dot or not array or runs.get(comp, 0) == 0:
                continue
            lhs = shapes[dot.group(1)]
            contracted = math.prod(lhs[d] for d in _dims(_CONTRACTING.search(line).group(1)))
            flops = 2 * math.prod(_dims(array.group(2))) * contracted
            name = traced_name(array.group(1)) or called_as.get(comp, "")
            out.append(Matmul(flops, runs[comp], name))
    return out
