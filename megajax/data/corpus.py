"""The embedded default corpus: this Python's own standard-library sources.

Present on every machine with Python, so `megajax train` needs no download.
Each .py file is one document; files are taken in sorted path order until
the size cap is reached, so the corpus is deterministic for a given Python.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np


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


def stdlib_corpus_tokens(tokenizer, max_mb: float) -> np.ndarray:
    """All documents' tokens, each followed by the end-of-document id, as one uint16 array."""
    pieces = []
    for path in stdlib_files(int(max_mb * 2**20)):
        text = path.read_text(encoding="utf-8", errors="replace")
        pieces.append(np.asarray(tokenizer.encode(text) + [tokenizer.eod_id], np.uint16))
    return np.concatenate(pieces)
