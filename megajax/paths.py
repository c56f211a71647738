"""Where a command will write, checked before it starts the work: a file where a directory belongs,
a directory where a file belongs, a read-only place.

    output_problem(path, directory=False) -> None, or why `path` cannot be written (a phrase)
    check_outputs((option, path), ..., directory=False)   UserError naming the first option that cannot be

The check reads the filesystem only (nothing is created).
"""

from __future__ import annotations

import os
from pathlib import Path

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
