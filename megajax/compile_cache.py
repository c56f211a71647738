"""JAX's persistent compilation cache for megajax's commands, and which compiles it served.

`ops.compile_cache` (default true) keeps every compiled program (the model's
initialisation, the train step, the evaluation step, ...) on disk, so a
repeated or resumed run loads its programs instead of compiling them again.
Where:

    ops.compile_cache = true    $JAX_COMPILATION_CACHE_DIR if set, else <megajax cache>/jax, the
                                megajax cache being $MEGAJAX_CACHE, else $XDG_CACHE_HOME/megajax,
                                else ~/.cache/megajax
    ops.compile_cache = DIR     that directory
    ops.compile_cache = false   (or "") off

A program is cached when it took at least MIN_COMPILE_SECONDS to compile, unless
$JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says otherwise. With several
processes every process reads the cache and only process 0 writes to it
(JAX's own rule), so a shared file system sees no concurrent writers.

`CompileWatch` counts JAX's cache events while a block runs, to say in the log
whether a compile came from the cache.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import jax

from megajax.config import user_cache_dir

# Below this a program is cheaper to compile than to read back (a slice, a dtype conversion); the
# programs of a run (initialisation, train step, evaluation) take longer even for tiny models.
MIN_COMPILE_SECONDS = 0.1

_HIT = "/jax/compilation_cache/cache_hits"
_REQUEST = "/jax/compilation_cache/compile_requests_use_cache"


def cache_directory(setting: bool | str) -> Path | None:
    """The directory `ops.compile_cache` names (None: off)."""
    if setting is False or setting == "":
        return None
    if setting is True:
        env = os.environ.get("JAX_COMPILATION_CACHE_DIR")
        return Path(env) if env else user_cache_dir() / "jax"
    return Path(setting).expanduser()


def enable(setting: bool | str) -> Path | None:
    """Points JAX's persistent compilation cache at `setting`'s directory (or turns it off); call
    before the process's first compile. Returns the directory (None: off)."""
    directory = cache_directory(setting)
    if directory is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return directory


class CompileWatch:
    """Counts the compiles that consulted the persistent cache, and its hits, while the block runs on
    this thread.

        with CompileWatch() as watch:
            compiled = jitted.lower(...).compile()
        say(f"compiled in {watch.seconds:.1f} s ({watch.source()})")
    """

    _active: list["CompileWatch"] = []
    _lock = threading.Lock()
    _listening = False

    def __init__(self):
        self.requests = 0  # compiles that looked in the cache
        self.hits = 0  # ... and found their program there
        self.seconds = 0.0
        self._thread = threading.get_ident()

    @classmethod
    def _listen(cls, event: str, **_) -> None:
        if event not in (_HIT, _REQUEST):
            return
        thread = threading.get_ident()  # JAX reports a compile on the thread that asked for it
        with cls._lock:
            for watch in cls._active:
                if watch._thread != thread:
                    continue
                if event == _HIT:
                    watch.hits += 1
                else:
                    watch.requests += 1

    def __enter__(self) -> "CompileWatch":
        with CompileWatch._lock:
            if not CompileWatch._listening:
                jax.monitoring.register_event_listener(CompileWatch._listen)
                CompileWatch._listening = True
            CompileWatch._active.append(self)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._t0
        with CompileWatch._lock:
            CompileWatch._active.remove(self)

    def source(self) -> str:
        """Where the block's programs came from, for a log line."""
        if self.requests == 0:
            return "already compiled in this process" if _cache_on() else "compilation cache off"
        if self.hits == self.requests:
            return "from the compilation cache"
        if self.hits == 0:
            return "compiled; not in the compilation cache yet"
        return f"{self.hits} of {self.requests} programs from the compilation cache"


def _cache_on() -> bool:
    return bool(jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir)
