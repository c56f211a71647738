"""The host memory allocator of the `megajax` command: glibc's malloc with transparent huge pages.

On CPU, XLA allocates a program's temporaries (the activations, the logits and their gradient:
0.6 GiB per step for the reference Llama of docs/performance.md) at every execution and frees
them after. glibc serves blocks that large with a fresh `mmap`, so every step first-touches all
of them again in 4 KiB pages: 156,000 page faults and 0.36 s of kernel time per step on a
2-core machine, a sixth of the step. With glibc's `glibc.malloc.hugetlb=1` tunable (glibc 2.35+)
malloc asks for transparent huge pages (`madvise(MADV_HUGEPAGE)`), so the same blocks fault in
2 MiB pages: a few hundred faults per step. Memory is returned to the system as before.

glibc reads its tunables when a process starts, so the `megajax` command, run as a program,
starts itself again once with `GLIBC_TUNABLES` extended (`reexec_with_huge_pages`, before it
imports anything heavy; the same process id, arguments and environment otherwise). It does not
when
- MEGAJAX_HOST_ALLOCATOR=system (the opt-out; `hugepages` is the default);
- the C library is not glibc 2.35 or later, or the kernel's transparent huge pages are `never`;
- GLIBC_TUNABLES already sets glibc.malloc.hugetlb (the user's choice, or the restart done), or
  LD_PRELOAD names another allocator (jemalloc, tcmalloc, mimalloc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from typing import Mapping

SWITCH = "MEGAJAX_HOST_ALLOCATOR"
TUNABLE = "glibc.malloc.hugetlb"
PRELOADED = ("jemalloc", "tcmalloc", "mimalloc")
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of this process's glibc, or None for another C library."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        get = libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return None
    get.restype = ctypes.c_char_p
    try:
        major, minor = get().decode().split(".")[:2]
        return int(major), int(minor)
    except (ValueError, AttributeError):
        return None


def transparent_huge_pages(path: str = THP_SETTING) -> str | None:
    """The kernel's transparent huge page mode (always, madvise, never), None when unknown."""
    try:
        text = open(path).read()
    except OSError:
        return None
    chosen = [w.strip("[]") for w in text.split() if w.startswith("[")]
    return chosen[0] if chosen else None


def reason_to_leave(environ: Mapping[str, str], glibc: tuple[int, int] | None, thp: str | None) -> str | None:
    """Why the command keeps the allocator as it is (None: it restarts with huge pages)."""
    choice = environ.get(SWITCH, "").strip().lower()
    if choice not in ("", "hugepages", "system"):
        return f"{SWITCH}={environ[SWITCH]!r} is not one of hugepages, system; left as it is"
    if choice == "system":
        return f"{SWITCH}=system"
    if TUNABLE in environ.get("GLIBC_TUNABLES", ""):
        return f"GLIBC_TUNABLES sets {TUNABLE}"
    named = [a for a in PRELOADED if a in environ.get("LD_PRELOAD", "")]
    if named:
        return f"{named[0]} preloaded (LD_PRELOAD)"
    return unsupported(glibc, thp)


def unsupported(glibc: tuple[int, int] | None, thp: str | None) -> str | None:
    """Why huge-page malloc cannot work here (None: it can)."""
    if glibc is None or glibc < (2, 35):
        return "needs glibc 2.35 or later" + ("" if glibc is None else f" (this is {glibc[0]}.{glibc[1]})")
    if thp not in ("always", "madvise"):
        return f"transparent huge pages are {thp or 'not available'} in this kernel"
    return None


def tunables_with_huge_pages(current: str) -> str:
    """GLIBC_TUNABLES with glibc.malloc.hugetlb=1 added (colon-separated)."""
    return f"{current}:{TUNABLE}=1" if current else f"{TUNABLE}=1"


def reexec_with_huge_pages(argv: list[str], program: list[str] | None = None) -> None:
    """Starts this `megajax` command (or `program`, a script's [python, path]) again with
    huge-page malloc when it should (see the module); returns when it should not or cannot."""
    if reason_to_leave(os.environ, glibc_version(), transparent_huge_pages()) is not None:
        return
    env = dict(os.environ, GLIBC_TUNABLES=tunables_with_huge_pages(os.environ.get("GLIBC_TUNABLES", "")))
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        program = program or [sys.executable, "-m", "megajax.cli"]
        os.execve(program[0], [*program, *argv], env)
    except OSError:
        return  # the command runs on, with the system's allocator


def described(environ: Mapping[str, str] | None = None) -> str:
    """What this process's allocator is, for the logs."""
    environ = os.environ if environ is None else environ
    glibc, thp = glibc_version(), transparent_huge_pages()
    if f"{TUNABLE}=1" in environ.get("GLIBC_TUNABLES", "") and unsupported(glibc, thp) is None:
        return f"glibc malloc with transparent huge pages ({TUNABLE}=1)"
    why = reason_to_leave(environ, glibc, thp)
    return f"system default ({why or 'not restarted with huge pages'})"
