"""Text -> Megatron indexed datasets (`megajax preprocess`).

Each JSON key of the input becomes one dataset `{output_prefix}_{key}_document`
.{bin,idx}, one sequence per document, documents in input order (Megatron's
naming and format). Inputs:

    jsonl   one JSON object per line; each key's string value is a document
    lines   plain text, one document per line
    files   plain text, one document per file

`auto` picks jsonl for *.jsonl / *.json (optionally .gz), lines otherwise.
Input is UTF-8: bytes that are not stop with the file and line, unless
errors="replace" substitutes U+FFFD for them. An input with no documents, or
only empty ones, is an error (a dataset without tokens cannot be trained on).

Memory stays flat however large the input: lines are read in ~1 MiB chunks,
at most 2 x workers chunks are in flight, tokens stream to the writer, and
the writer spills its index entries to disk. With workers > 1 the chunks are
tokenized in worker processes and written back in input order.
"""

from __future__ import annotations

import codecs
import contextlib
import gzip
import itertools
import multiprocessing
import os
import signal
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple

import numpy as np

from megajax.data.indexed import IndexedDatasetWriter, optimal_dtype
from megajax.data.text_files import lone_surrogate, parse_json, without_surrogates
from megajax.data.tokenizer import EOD_CANDIDATES, load_tokenizer
from megajax.errors import ConfigError, DataError
from megajax.paths import refuse_existing

INPUT_FORMATS = ("auto", "jsonl", "lines", "files")
DECODE_ERRORS = ("strict", "replace")
CHUNK_BYTES = 1 << 20
CHUNK_DOCS = 8192


class Chunk(NamedTuple):
    """Raw documents of one input file: `items` start at line `first_line` (1-based; files: 0)."""
    path: str
    fmt: str
    first_line: int
    items: list[bytes]


@dataclass
class Summary:
    prefixes: dict[str, str]                      # json key -> dataset prefix
    documents: int = 0
    tokens: dict[str, int] = field(default_factory=dict)
    input_bytes: int = 0
    seconds: float = 0.0
    dtype: str = ""


def output_prefix(prefix, key: str) -> str:
    return f"{prefix}_{key}_document"


def detect_format(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    name = path[:-3] if path.endswith(".gz") else path
    return "jsonl" if name.endswith((".jsonl", ".json")) else "lines"


def _open(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def read_chunks(paths: list[str], fmt: str) -> Iterator[Chunk]:
    """Chunks of raw documents (lines, or whole files), ~CHUNK_BYTES each, in input order."""
    files: list[bytes] = []
    files_bytes = 0
    for path in paths:
        kind = detect_format(path, fmt)
        if kind == "files":
            with _open(path) as f:
                files.append(f.read())
            files_bytes += len(files[-1])
            if files_bytes >= CHUNK_BYTES or len(files) >= CHUNK_DOCS:
                yield Chunk(path, kind, 0, files)
                files, files_bytes = [], 0
            continue
        items, size, first = [], 0, 1
        with _open(path) as f:
            for line_no, line in enumerate(f, 1):
                items.append(line)
                size += len(line)
                if size >= CHUNK_BYTES or len(items) >= CHUNK_DOCS:
                    yield Chunk(path, kind, first, items)
                    items, size, first = [], 0, line_no + 1
        if items:
            yield Chunk(path, kind, first, items)
    if files:
        yield Chunk(paths[-1], "files", 0, files)


# --- worker side: module globals set once per process by _init_worker ------------------------

_WORKER: dict = {}


def _init_worker(tokenizer: str, keys: list[str], append_eod: bool, parallel_tokenizer: bool,
                 errors: str = "strict", worker: bool = False) -> None:
    if worker:  # Ctrl-C reaches the whole process group: the main process stops the pool (_workers_ignore_ctrl_c)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not parallel_tokenizer:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = load_tokenizer(tokenizer, key="--tokenizer")
    _WORKER.update(tokenizer=tok, keys=keys, eod=tok.eod_id if append_eod else None, errors=errors)


def _decode(raw: bytes, chunk: Chunk, index: int, errors: str) -> str:
    """UTF-8 text of one item (a line, or a whole file; a byte-order mark opening a file dropped); strict: a
    DataError naming file and line."""
    if chunk.fmt == "files" or (index == 0 and chunk.first_line == 1):
        raw = raw.removeprefix(codecs.BOM_UTF8)
    try:
        return raw.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        if chunk.fmt == "files":
            line, start = raw.count(b"\n", 0, e.start) + 1, raw.rfind(b"\n", 0, e.start) + 1
        else:
            line, start = chunk.first_line + index, 0
        raise DataError(f"{chunk.path}, line {line}: byte 0x{raw[e.start]:02x} at column {e.start - start + 1} "
                        f"is not UTF-8 ({e.reason}); preprocess reads UTF-8 text. Convert the file (e.g. "
                        f"iconv -f latin1 -t utf-8), or pass --errors replace to substitute U+FFFD for "
                        f"bytes that are not UTF-8.") from None


def _texts(chunk: Chunk, keys: list[str], errors: str = "strict") -> dict[str, list[str]]:
    """Each key's documents in one chunk (jsonl: blank lines skipped)."""
    if chunk.fmt == "files":
        return {keys[0]: [_decode(b, chunk, i, errors) for i, b in enumerate(chunk.items)]}
    if chunk.fmt == "lines":
        return {keys[0]: [_decode(b.rstrip(b"\r\n"), chunk, i, errors) for i, b in enumerate(chunk.items)]}
    texts: dict[str, list[str]] = {k: [] for k in keys}
    for i, raw in enumerate(chunk.items):
        if not raw.strip():
            continue
        n = chunk.first_line + i
        where = f"{chunk.path}, line {n}"
        line = _decode(raw, chunk, i, errors)
        try:
            obj = parse_json(line)
        except ValueError as e:
            raise DataError(f"{where}: not valid JSON ({e}); jsonl input needs one JSON object per "
                            f"line (use --input-format lines for plain text).") from None
        if "\\u" in line and lone_surrogate(obj):  # "\ud800": valid JSON, not a character
            if errors == "strict":
                raise DataError(f"{where}: the JSON escape {lone_surrogate(obj)} is half of a UTF-16 surrogate pair "
                                f"without its other half (not a character; no UTF-8 form); give the whole pair or "
                                f"the character, or pass --errors replace to substitute U+FFFD.")
            obj = without_surrogates(obj)
        for key in keys:
            if not isinstance(obj, dict) or key not in obj:
                found = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
                raise DataError(f"{where}: no key {key!r} in this record (found {found}); choose the "
                                f"text fields with --json-keys.")
            if not isinstance(obj[key], str):
                raise DataError(f"{where}: key {key!r} holds a {type(obj[key]).__name__}, expected a "
                                f"string.")
            texts[key].append(obj[key])
    return texts


def encode_chunk(chunk: Chunk) -> tuple[int, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """(input bytes, {key: (ids [T] int32, document lengths [N])}) for one chunk."""
    tok, eod = _WORKER["tokenizer"], _WORKER["eod"]
    out = {}
    for key, texts in _texts(chunk, _WORKER["keys"], _WORKER["errors"]).items():
        ids_T, lengths_N = tok.encode_packed(texts)
        if eod is not None:  # an end-of-document id after every non-empty document
            nonempty = lengths_N > 0
            ids_T = np.insert(ids_T, np.cumsum(lengths_N)[nonempty], eod)
            lengths_N = lengths_N + nonempty
        out[key] = (ids_T, lengths_N)
    return sum(map(len, chunk.items)), out


@contextlib.contextmanager
def _workers_ignore_ctrl_c():
    """Ctrl-C reaches every process of the terminal's group: worker processes started inside this block inherit
    SIGINT ignored (from their first instruction, before _init_worker), and the main process stops the pool."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: nothing to inherit
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _ordered_map(chunks: Iterator[Chunk], workers: int, initargs: tuple):
    """encode_chunk over the chunks, results in input order, at most 2 x workers chunks in flight.

    Workers are spawned (never forked from a process that may hold threads); as
    with any spawning pool, a calling script needs an `if __name__ == "__main__":`
    guard. A worker that dies raises BrokenProcessPool instead of hanging.
    """
    if workers <= 1:
        _init_worker(*initargs)
        yield from map(encode_chunk, chunks)
        return
    pool = ProcessPoolExecutor(workers, multiprocessing.get_context("spawn"), _init_worker, (*initargs, True))
    try:
        pending: deque = deque()
        with _workers_ignore_ctrl_c():
            for chunk in itertools.islice(chunks, 2 * workers):  # the submissions that start the workers
                pending.append(pool.submit(encode_chunk, chunk))
        for chunk in chunks:
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
            pending.append(pool.submit(encode_chunk, chunk))
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _check_not_empty(inputs: list[str], input_format: str, documents: int, tokens: dict[str, int]) -> None:
    """An input without documents, or whose documents are all empty, makes a dataset nothing can be
    trained on: say so here rather than at training time."""
    names = ", ".join(inputs)
    if documents == 0:
        kinds = sorted({detect_format(p, input_format) for p in inputs})
        what = {"jsonl": "JSON lines", "lines": "lines", "files": "files"}
        raise DataError(f"--input {names}: no documents found (read as {' and '.join(what[k] for k in kinds)}; "
                        f"the input is empty{' or holds only blank lines' if 'jsonl' in kinds else ''}). "
                        f"Check the path and --input-format.")
    empty = [k for k, n in tokens.items() if n == 0]
    if empty:
        raise DataError(f"--input {names}: all {documents} documents are empty for --json-keys "
                        f"{' '.join(empty)} (0 tokens); a dataset needs text to train on.")


def preprocess(inputs, json_keys, tokenizer: str, output: str, *, append_eod: bool = False,
               workers: int = 1, input_format: str = "auto", progress: bool = True,
               errors: str = "strict") -> Summary:
    """Tokenizes `inputs` into one dataset per JSON key; returns what was written.

    `errors`: what to do with bytes that are not UTF-8: 'strict' (a DataError naming the file
    and line) or 'replace' (U+FFFD)."""
    inputs = [str(p) for p in inputs]
    json_keys = list(json_keys)
    missing = [p for p in inputs if not os.path.isfile(p)]
    if not inputs or missing:
        raise DataError(f"--input: {'no input files given' if not inputs else f'no such file(s) {missing}'}; "
                        f"give one or more jsonl or text files.")
    if input_format not in INPUT_FORMATS:
        raise ConfigError(f"--input-format = {input_format!r}: accepted values are {', '.join(INPUT_FORMATS)}.")
    if not json_keys or len(set(json_keys)) != len(json_keys):
        raise ConfigError(f"--json-keys = {json_keys}: give one or more distinct keys.")
    plain = [p for p in inputs if detect_format(p, input_format) != "jsonl"]
    if plain and len(json_keys) > 1:
        raise ConfigError(f"--json-keys = {json_keys}: plain-text inputs ({plain[0]}) hold one field; "
                          f"give a single key (it names the output, e.g. text).")
    if workers < 1:
        raise ConfigError(f"--workers = {workers}: must be at least 1.")
    if errors not in DECODE_ERRORS:
        raise ConfigError(f"--errors = {errors!r}: accepted values are {', '.join(DECODE_ERRORS)}.")
    tok = load_tokenizer(tokenizer, key="--tokenizer")
    if append_eod and tok.eod_id is None:
        raise ConfigError(f"--append-eod: tokenizer {tokenizer!r} has no end-of-document token (looked "
                          f"for its eos_token and {', '.join(EOD_CANDIDATES)}); drop --append-eod or use a "
                          f"tokenizer that has one.")
    dtype = optimal_dtype(tok.vocab_size)
    summary = Summary({k: output_prefix(output, k) for k in json_keys}, dtype=dtype.name)
    outputs = [f"{p}.{ext}" for p in summary.prefixes.values() for ext in ("bin", "idx")]
    refuse_existing("--output-prefix", output, outputs, "a dataset written before")
    total = None if any(p.endswith(".gz") for p in inputs) else sum(os.path.getsize(p) for p in inputs)
    from tqdm import tqdm
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="preprocess", file=sys.stderr,
               disable=None if progress else True, dynamic_ncols=True)  # None: only on a terminal
    start = time.perf_counter()
    writers: dict[str, IndexedDatasetWriter] = {}
    try:  # an error, Ctrl-C or SIGTERM from here on removes the writers' temporary files
        for k, p in summary.prefixes.items():
            writers[k] = IndexedDatasetWriter(p, dtype)
        initargs = (tokenizer, json_keys, append_eod, workers <= 1, errors)
        for nbytes, out in _ordered_map(read_chunks(inputs, input_format), workers, initargs):
            for key, (ids_T, lengths_N) in out.items():
                writers[key].add_documents(ids_T, lengths_N)
            summary.documents += len(next(iter(out.values()))[1])
            summary.input_bytes += nbytes
            bar.update(nbytes)
            rate = summary.documents / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"{summary.documents} docs, {rate:,.0f} docs/s", refresh=False)
        _check_not_empty(inputs, input_format, summary.documents, {k: w.num_tokens for k, w in writers.items()})
        for writer in writers.values():
            writer.finalize()
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    finally:
        bar.close()
    summary.tokens = {k: w.num_tokens for k, w in writers.items()}
    summary.seconds = time.perf_counter() - start
    return summary
