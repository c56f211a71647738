"""The host memory allocator of a megajax process: `MEGAJAX_HOST_ALLOCATOR=tuned` keeps glibc's
malloc from handing each step's buffers back to the kernel (CPU runs; off by default).

On CPU, XLA allocates a program's temporaries (the activations, the logits and their gradient:
0.6 GiB per step for the reference Llama of docs/performance.md) at every execution and frees
them after. glibc serves blocks that large with a fresh `mmap` (or from a per-thread arena that
it trims), so every step first-touches all of them again: 156,000 page faults and 0.36 s of
kernel time per step on a 2-core machine, a fifth of the step. With one arena, no `mmap` for
large blocks and trimming only past 2 GiB, a freed block stays in the process's heap and the
next step reuses it.

Why it is not the default: a large block that no longer fits the hole it left (a small
allocation took the hole's start) makes the heap grow. The peak resident size is higher (the
reference Llama 1.2-2.5 GB instead of 1.3 GB; tiny-moe with 64 experts 4.8-6.5 GB instead of
3.4 GB) and a small program run many times can creep upwards (128 MiB of temporaries: 0.5 GB
to 1.2 GB resident over ten runs, in some processes). XLA's multi-threaded compiles also share
the one arena (the reference step compiles in 3.7 s instead of 2.9 s).

`tune()` applies the setting with `mallopt` (M_ARENA_MAX 1, M_MMAP_MAX 0, M_TRIM_THRESHOLD
2 GiB - 1). It must run before the process starts threads (before `import jax`): threads that
already have an arena keep it. The `megajax` command calls it first thing. It does nothing
unless MEGAJAX_HOST_ALLOCATOR=tuned, and not then either when
- the C library is not glibc (musl, macOS, Windows);
- the user chose already: any of MALLOC_ARENA_MAX, MALLOC_MMAP_MAX_, MALLOC_MMAP_THRESHOLD_,
  MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_ set, or an allocator preloaded (LD_PRELOAD naming
  jemalloc, tcmalloc or mimalloc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Mapping

# mallopt's parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8

USER_SETTINGS = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                 "MALLOC_TOP_PAD_")
PRELOADED = ("jemalloc", "tcmalloc", "mimalloc")
SWITCH = "MEGAJAX_HOST_ALLOCATOR"
SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1))

_state: str | None = None  # what tune() did in this process


def _glibc():
    """glibc's libc, or None when this process's C library is another."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # absent outside glibc
        libc.mallopt
    except (OSError, AttributeError):
        return None
    return libc


def reason_to_leave(environ: Mapping[str, str]) -> str | None:
    """Why the allocator is left as it is (None: tune() sets it)."""
    choice = environ.get(SWITCH, "").strip().lower()
    if choice not in ("", "tuned", "system"):
        return f"{SWITCH}={environ[SWITCH]!r} is not one of tuned, system; left as it is"
    if choice != "tuned":
        return f"{SWITCH}=tuned not set"
    chosen = [k for k in USER_SETTINGS if k in environ]
    if chosen:
        return f"{', '.join(chosen)} set by the user"
    preload = environ.get("LD_PRELOAD", "")
    named = [a for a in PRELOADED if a in preload]
    if named:
        return f"{named[0]} preloaded (LD_PRELOAD)"
    return None


def tune(environ: Mapping[str, str] | None = None) -> str:
    """Sets glibc's malloc as the module says when asked to, once per process; returns what it did."""
    global _state
    if _state is not None:
        return _state
    environ = os.environ if environ is None else environ
    why = reason_to_leave(environ)
    libc = None if why else _glibc()
    if why is None and libc is None:
        why = "not glibc"
    if why is None:
        failed = [param for param, value in SETTINGS if libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) != 1]
        why = f"mallopt refused parameters {failed}" if failed else None
    _state = "glibc malloc tuned: one arena, no mmap, trim past 2 GiB" if why is None else f"system default ({why})"
    return _state


def described() -> str:
    """What tune() did in this process."""
    return _state or "system default (not tuned in this process)"
