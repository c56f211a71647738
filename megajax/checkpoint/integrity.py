"""What a checkpoint step holds, recorded at save and checked before any read.

Once Orbax has committed a step (its temporary directory renamed to `<step>/`), process 0
writes `<step>/files.json`: the relative path and size of every file under the step
(with several processes on a shared filesystem, the other processes' files too: the
commit comes after they have all finished). The record is written to a temporary file
and renamed, so it is either whole or absent. A step without one (a crash between the
commit and the record, or a checkpoint from before records existed) is "unverified":
it is read as it is.

Before a step is read (resume, `checkpoint.load`, generate, serve, export), every
recorded file must exist with its recorded size; otherwise the step is "damaged" and
the error names the file and the newest intact step, with the override that selects
it (`checkpoint.step=N`). Sizes catch truncated, missing and replaced files, not a
flipped byte; what TensorStore then fails to decode is reported the same way
(`read_failed`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from megajax.errors import CheckpointError

RECORD = "files.json"


def _files(step_dir: Path) -> dict[str, int]:
    out = {}
    for root, _, names in os.walk(step_dir):
        for name in names:
            path = Path(root) / name
            rel = path.relative_to(step_dir).as_posix()
            if rel != RECORD and not name.startswith(f".{RECORD}."):
                out[rel] = path.stat().st_size
    return out


def write_record(step_dir: str | Path) -> None:
    """Records every file under a committed step directory with its size (atomically)."""
    step_dir = Path(step_dir)
    tmp = step_dir / f".{RECORD}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"files": _files(step_dir)}, indent=0, sort_keys=True))
    os.replace(tmp, step_dir / RECORD)


def damage(step_dir: str | Path) -> str | None:
    """What is wrong with a step directory's files against its record ('state/d/ab12: 500,000 bytes,
    recorded 1,124,202'), or None when they match or the step has no record (unverified)."""
    step_dir = Path(step_dir)
    try:
        recorded = json.loads((step_dir / RECORD).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    for rel, size in sorted(recorded.items()):
        path = step_dir / rel
        try:
            found = path.stat().st_size
        except OSError:
            return f"{path} is missing (recorded with {size:,} bytes)"
        if found != size:
            return f"{path} has {found:,} bytes, recorded with {size:,}"
    return None


def step_number(step_dir: Path) -> int | None:
    return int(step_dir.name) if re.fullmatch(r"\d+", step_dir.name) else None


def newest_intact(step_dirs: list[Path], below: int | None = None) -> Path | None:
    """The newest of `step_dirs` (sorted by step) below step `below` whose files match its record."""
    for d in reversed(step_dirs):
        n = step_number(d)
        if (below is None or (n is not None and n < below)) and damage(d) is None:
            return d
    return None


def damaged_error(step_dir: Path, problem: str, siblings: list[Path]) -> CheckpointError:
    """One paragraph: the step, what is wrong, and the newest intact step with its override."""
    step = step_number(step_dir)
    intact = newest_intact(siblings, below=step)
    if intact is not None:
        fix = (f"The newest intact checkpoint is step {intact.name} ({intact}): add the override "
               f"checkpoint.step={intact.name} to use it.")
    else:
        fix = (f"No older checkpoint in {step_dir.parent} is intact; start afresh in another train.run_dir "
               f"(or restore the file from a copy).")
    return CheckpointError(f"checkpoint step {step if step is not None else '?'} ({step_dir}) is damaged: "
                           f"{problem}. {fix}")


def read_failed(step_dir: Path, error: BaseException, siblings: list[Path]) -> CheckpointError:
    """A storage error while reading a step (TensorStore, Orbax) as one paragraph, like damaged_error."""
    first = re.sub(r"\s+", " ", str(error).split("See full TensorStore details")[0]).strip()[:300]
    return damaged_error(step_dir, f"reading it failed ({type(error).__name__}: {first})", siblings)


def check(step_dir: Path, siblings: list[Path]) -> None:
    """Raises damaged_error when the step's files do not match its record."""
    problem = damage(step_dir)
    if problem is not None:
        raise damaged_error(step_dir, problem, siblings)
