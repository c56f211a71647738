"""The embedded default corpus: this Python's own standard-library sources.

Present on every machine with Python, so `megajax train` needs no download.
Each .py file is one document; files are taken in sorted path order until
the size cap is reached, so the corpus is deterministic for a given Python.
It is preprocessed once, like any user corpus, into a Megatron indexed
dataset in the cache directory (megajax.config.user_cache_dir: `$MEGAJAX_CACHE`,
else `$XDG_CACHE_HOME/megajax`, else ~/.cache/megajax), and trained on through
the same dataset and loader code. Every run lists the files again (sizes
included) to find its dataset, so a changed standard library gets a new one.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from pathlib import Path

from megajax.config import user_cache_dir
from megajax.data.indexed import exists
from megajax.errors import ConfigError


SKIPPED = ("site-packages", "test", "tests", "idlelib", "lib2to3")  # directories left out


def cache_dir() -> Path:
    return user_cache_dir()


def stdlib_files(max_bytes: int) -> list[Path]:
    """The standard library's .py files outside SKIPPED, in sorted path order, up to `max_bytes`.

    The walk prunes the skipped directories instead of listing them (site-packages can hold far
    more files than the library itself: 0.9-2.5 s with a full listing, 0.02 s pruned)."""
    root = sysconfig.get_paths()["stdlib"]
    found: list[tuple[str, ...]] = []  # paths relative to root, as parts (Path's sort order)
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in SKIPPED]
        rel = os.path.relpath(directory, root)
        parts = () if rel == "." else tuple(rel.split(os.sep))
        found += [parts + (f,) for f in files if f.endswith(".py")]
    out, total = [], 0
    for parts in sorted(found):
        path = Path(root, *parts)
        try:
            size = path.stat().st_size
        except OSError:
            continue
        if total + size > max_bytes:
            break
        out.append(path)
        total += size
    return out


def stdlib_corpus(tokenizer: str, max_mb: float) -> str:
    """Prefix of the embedded corpus as an indexed dataset, built on first use."""
    files = stdlib_files(int(max_mb * 2**20))
    if not files:
        raise ConfigError(f"data.corpus_max_mb = {max_mb:g}: the embedded corpus's first file does not fit in it; "
                          f"raise it (the default is 8), or set data.path to a dataset.")
    if tokenizer == "byte":
        tok_id = tokenizer
    else:  # a tokenizer.json, or a directory holding one (as data.tokenizer accepts)
        tok_file = Path(tokenizer) / "tokenizer.json" if Path(tokenizer).is_dir() else Path(tokenizer)
        tok_id = hashlib.md5(tok_file.read_bytes()).hexdigest()
    identity = (sys.version, [str(f) for f in files], [f.stat().st_size for f in files], tok_id)
    key = hashlib.md5(repr(identity).encode()).hexdigest()[:16]
    base = cache_dir() / "corpus" / f"stdlib-{key}"
    prefix = f"{base}_text_document"
    if not exists(prefix):
        from megajax.data.preprocess import preprocess
        base.parent.mkdir(parents=True, exist_ok=True)
        preprocess(files, ["text"], tokenizer, str(base), append_eod=True, workers=1,
                   input_format="files", progress=False)
    return prefix
