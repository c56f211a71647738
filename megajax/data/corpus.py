"""The embedded default corpus: this Python's own standard-library sources.

Present on every machine with Python, so `megajax train` needs no download.
Each .py file is one document; files are taken in sorted path order until
the size cap is reached, so the corpus is deterministic for a given Python.
It is preprocessed once, like any user corpus, into a Megatron indexed
dataset in the cache directory (`$MEGAJAX_CACHE`, default ~/.cache/megajax),
and trained on through the same dataset and loader code.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from pathlib import Path

from megajax.data.indexed import exists


def cache_dir() -> Path:
    return Path(os.environ.get("MEGAJAX_CACHE") or Path.home() / ".cache" / "megajax")


def stdlib_files(max_bytes: int) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if any(p in ("site-packages", "test", "tests", "idlelib", "lib2to3") for p in rel):
            continue
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
