"""Where a command will write, checked before it starts the work: a file where a directory belongs,
a directory where a file belongs, a read-only place.

    output_problem(path, directory=False) -> None, or why `path` cannot be written (a phrase)
    check_outputs((option, path), ..., directory=False)   UserError naming the first option that cannot be
    refuse_existing(option, value, paths)   UserError when an output is already there (nothing is replaced)
    fresh_output_dir(option, path)          a directory written under a temporary name, renamed when complete
    removed_on_failure(path, ...)           the directories a failed block created are removed

The checks read the filesystem only (nothing is created).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

from megajax.errors import UserError


def check_outputs(*options: tuple[str, str | None], directory: bool = False) -> None:
    """UserError, before any work, for an output (option, path) that cannot be written there; None paths
    (options not given) are skipped."""
    for option, path in options:
        why = output_problem(path, directory) if path else None
        if why:
            raise UserError(f"{option} {path}: cannot write {'a directory' if directory else 'a file'} there: {why}.")


def output_problem(path: str | Path, directory: bool = False) -> str | None:
    """None when `path` can be written as a file (or, `directory`, made or used as a directory); else
    why not, e.g. "it is a directory", "'a/b' is a file, where a directory of the path belongs"."""
    p = Path(path).expanduser().absolute()
    if p.exists():
        if directory and not p.is_dir():
            return "it is a file, not a directory"
        if not directory and p.is_dir():
            return "it is a directory; give a file name"
        where = p if directory else p.parent
    else:
        where = p.parent
        while not where.exists():
            where = where.parent
        if not where.is_dir():
            return f"{str(where)!r} is a file, where a directory of the path belongs"
    if not os.access(where, os.W_OK | os.X_OK):
        read_only = os.access(where, os.R_OK) and _read_only_filesystem(where)
        return (f"{str(where)!r} is on a read-only filesystem" if read_only else
                f"{str(where)!r} is not writable by this user")
    return None


def _read_only_filesystem(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def refuse_existing(option: str, value: str, paths, what: str = "an earlier output") -> None:
    """UserError when any of `paths` exists: a command does not replace what an earlier run wrote."""
    found = [str(p) for p in paths if Path(p).exists()]
    if found:
        listed = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise UserError(f"{option} {value}: {listed} already exist{'s' if len(found) == 1 else ''} ({what}); this "
                        f"command does not replace an earlier output: choose another {option} or remove what is "
                        f"there.")


@contextlib.contextmanager
def fresh_output_dir(option: str, path: str | Path) -> Iterator[Path]:
    """Yields a temporary directory beside `path` that becomes `path` only when the block ends without an
    exception (an error, Ctrl-C, a SIGTERM the command turns into one): a directory under the final name is
    always complete. `path` may exist only as an empty directory (UserError naming `option` otherwise)."""
    out = Path(path).expanduser().absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{option} {path}: {'the directory is not empty' if out.is_dir() else 'a file is there'}; "
                        f"this command does not write into or replace an earlier output: choose a new directory "
                        f"or remove it.")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def removed_on_failure(*paths: str | Path) -> Iterator[None]:
    """Each of `paths` (directories) that does not exist yet and that the block creates is removed when the
    block ends by an exception (an error, Ctrl-C, SIGTERM): a failed command leaves nothing half-written."""
    new = [Path(p).expanduser().absolute() for p in paths if not Path(p).expanduser().exists()]
    try:
        yield
    except BaseException:
        for p in new:
            shutil.rmtree(p, ignore_errors=True)
        raise
