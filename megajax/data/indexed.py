"""Megatron indexed datasets (`P.bin` + `P.idx`): memory-mapped reader, crash-safe writer, merge.

A dataset is a path prefix P and two files, byte-compatible with Megatron's
MMIDIDX version 1 format:

    P.bin   every sequence's token ids, concatenated, one dtype, no header
    P.idx   magic b"MMIDIDX\\0\\0" | u64 version = 1 | u8 dtype code | u64 S | u64 D
            int32[S] sequence lengths (tokens)
            int64[S] byte offset of each sequence in P.bin
            int64[D] document boundaries: the sequence index where each document
                     ends, with a leading 0 (D = documents + 1)
            (multimodal datasets append int8[S] sequence modes; read, never written)

All integers are little-endian. Without sentence splitting a document is one
sequence; an empty document has no sequence (two equal boundaries).

The reader maps both files (no copy of the corpus into memory; opening is
O(1) however large the files). The writer streams tokens to temporary files
and renames them into place in `finalize()`, so an interrupted write never
leaves a half-written dataset under the final name.
"""

from __future__ import annotations

import os
import shutil
import struct
from array import array
from pathlib import Path

import numpy as np

from megajax.errors import DataError
from megajax.paths import refuse_existing

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8  # = 34

DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
    5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32), 8: np.dtype(np.uint16),
}
CODE_OF_DTYPE = {dt: code for code, dt in DTYPE_CODES.items()}
_ACCEPTED_CODES = ", ".join(f"{c} {dt.name}" for c, dt in DTYPE_CODES.items())

_SPILL_ENTRIES = 1 << 20  # index entries buffered in memory before they go to a side file


def idx_path(prefix) -> str:
    return f"{prefix}.idx"


def bin_path(prefix) -> str:
    return f"{prefix}.bin"


def exists(prefix) -> bool:
    """Whether both P.idx and P.bin exist."""
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


def optimal_dtype(vocab_size: int) -> np.dtype:
    """Token dtype for a vocabulary, as Megatron chooses it: uint16 under 65,500 ids, else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def _token_dtype(dtype) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt not in CODE_OF_DTYPE:
        raise DataError(f"indexed dataset dtype {dtype!r} is not storable; the .idx format knows "
                        f"{', '.join(d.name for d in DTYPE_CODES.values())}.")
    return dt


class IndexedDataset:
    """Read-only, memory-mapped view of a Megatron dataset `prefix`.{bin,idx}.

    `sequence_lengths` [S] int32, `sequence_pointers` [S] int64 (byte offsets)
    and `document_indices` [D] int64 are views of the mapped index; `get`
    returns views of the mapped data. Header, sizes and the data file's length
    are checked on open (O(1)); `verify()` checks every entry (O(S)).
    """

    def __init__(self, prefix):
        self.prefix = str(prefix)
        self._open()

    # --- opening and checking ---------------------------------------------------------------

    def _open(self) -> None:
        idx, bin_ = idx_path(self.prefix), bin_path(self.prefix)
        for path in (idx, bin_):
            if not os.path.isfile(path):
                raise DataError(f"indexed dataset {self.prefix!r}: {path} does not exist; a dataset "
                                f"prefix P needs both P.idx and P.bin (as written by `megajax "
                                f"preprocess` or Megatron's preprocess_data.py).")
        size = os.path.getsize(idx)
        if size < HEADER_BYTES:
            raise DataError(f"{idx}: truncated index of {size} bytes, shorter than the "
                            f"{HEADER_BYTES}-byte header of a Megatron MMIDIDX index.")
        with open(idx, "rb") as f:
            head = f.read(HEADER_BYTES)
        if head[:len(MAGIC)] != MAGIC:
            raise DataError(f"{idx}: not a Megatron indexed-dataset index: it starts with "
                            f"{head[:len(MAGIC)]!r}, expected {MAGIC!r}.")
        version, code, S, D = struct.unpack("<QBQQ", head[len(MAGIC):])
        if version != VERSION:
            raise DataError(f"{idx}: index version {version}; only version {VERSION} (MMIDIDX) is "
                            f"supported.")
        if code not in DTYPE_CODES:
            raise DataError(f"{idx}: unknown dtype code {code}; accepted codes are {_ACCEPTED_CODES}.")
        self.dtype = DTYPE_CODES[code]
        expected = HEADER_BYTES + 12 * S + 8 * D
        if size not in (expected, expected + S):
            raise DataError(f"{idx}: index is {size} bytes, but its header ({S} sequences, {D} "
                            f"document entries) needs {expected} bytes ({expected + S} if multimodal); "
                            f"the file is truncated or corrupt.")
        if D < 1:
            raise DataError(f"{idx}: document index is empty; it must hold at least the leading 0.")
        self._idx_map = np.memmap(idx, dtype=np.uint8, mode="r")
        buf, at = self._idx_map, HEADER_BYTES
        self.sequence_lengths = np.frombuffer(buf, np.int32, S, at)
        self.sequence_pointers = np.frombuffer(buf, np.int64, S, at + 4 * S)
        self.document_indices = np.frombuffer(buf, np.int64, D, at + 12 * S)
        self.sequence_modes = np.frombuffer(buf, np.int8, S, expected) if size > expected else None
        first, last = int(self.document_indices[0]), int(self.document_indices[-1])
        if first != 0 or last != S:
            raise DataError(f"{idx}: document boundaries run from {first} to {last}; they must run from "
                            f"0 to the sequence count {S}. The index is corrupt.")
        item = self.dtype.itemsize
        bin_size = os.path.getsize(bin_)
        want = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * item if S else 0
        if bin_size != want:
            raise DataError(f"{bin_}: data file is {bin_size} bytes, but {idx} describes {want} bytes "
                            f"({self.dtype.name} tokens); the two files do not belong together or one "
                            f"of them is truncated.")
        # np.memmap cannot map an empty file; an empty dataset reads from an empty buffer.
        self._bin_map = np.memmap(bin_, dtype=np.uint8, mode="r") if bin_size else np.empty(0, np.uint8)

    def verify(self) -> "IndexedDataset":
        """Checks every index entry (O(S), vectorised): lengths >= 0, pointers contiguous, boundaries sorted."""
        idx = idx_path(self.prefix)
        lengths = self.sequence_lengths
        if len(lengths) and int(lengths.min()) < 0:
            raise DataError(f"{idx}: negative sequence length {int(lengths.min())}; the index is corrupt.")
        item = self.dtype.itemsize
        expect = np.zeros(len(lengths), np.int64)
        np.cumsum(lengths[:-1], out=expect[1:])
        bad = np.flatnonzero(self.sequence_pointers != expect * item)
        if len(bad):
            i = int(bad[0])
            raise DataError(f"{idx}: sequence {i} starts at byte {int(self.sequence_pointers[i])}, "
                            f"expected {int(expect[i]) * item} (sequences are stored back to back); "
                            f"the index is corrupt.")
        if np.any(np.diff(self.document_indices) < 0):
            raise DataError(f"{idx}: document boundaries are not sorted; the index is corrupt.")
        return self

    # --- access -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_sequences(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [length] of sequence i from token `offset` on (default: to its end); a read-only view."""
        n = int(self.sequence_lengths[i])
        if length is None:
            length = n - offset
        if offset < 0 or length < 0 or offset + length > n:
            raise IndexError(f"tokens [{offset}, {offset + length}) are outside sequence {i} of "
                             f"{n} tokens in {self.prefix}")
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin_map, self.dtype, length, start)

    def __getitem__(self, i):
        """Sequence i's tokens, or a list of them for a slice."""
        if isinstance(i, slice):
            return [self.get(j) for j in range(*i.indices(len(self)))]
        return self.get(int(i))

    def document_sequences(self, d: int) -> range:
        """Indices of the sequences that make up document d."""
        return range(int(self.document_indices[d]), int(self.document_indices[d + 1]))

    def __getstate__(self):
        return {"prefix": self.prefix}

    def __setstate__(self, state):
        self.prefix = state["prefix"]
        self._open()

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}: {self.num_documents} documents, {self.num_sequences} "
                f"sequences, {self.dtype.name})")


class _Spill:
    """An append-only integer array that spills to a side file, so memory stays bounded."""

    def __init__(self, path: str, typecode: str, dtype):
        self.path, self.dtype = path, np.dtype(dtype)
        self.buf, self.typecode, self.count = array(typecode), typecode, 0
        self.file = open(path, "wb")

    def extend(self, values) -> None:
        values = np.asarray(values, self.dtype)
        self.buf.frombytes(values.tobytes())
        self.count += len(values)
        if len(self.buf) >= _SPILL_ENTRIES:
            self.flush()

    def flush(self) -> None:
        self.file.write(self.buf.tobytes())
        self.buf = array(self.typecode)

    def chunks(self):
        """The whole array, in chunks of at most _SPILL_ENTRIES entries."""
        if not self.file.closed:
            self.flush()
            self.file.close()
        with open(self.path, "rb") as f:
            while block := f.read(_SPILL_ENTRIES * self.dtype.itemsize):
                yield np.frombuffer(block, self.dtype)

    def remove(self) -> None:
        self.file.close()
        if os.path.exists(self.path):
            os.remove(self.path)


class IndexedDatasetWriter:
    """Writes a Megatron dataset `prefix`.{bin,idx} in `dtype`, streaming.

        with IndexedDatasetWriter("out/corpus_text_document", np.uint16) as w:
            w.add_document(tokens)          # one document = one sequence
            w.add_item(part); w.end_document()   # or sentence by sentence

    Everything goes to `<name>.tmp-<pid>` files; `finalize()` writes the index
    and renames both files into place, the .idx last (a dataset is complete
    once its .idx exists). `abort()` (or an exception inside `with`) removes
    the temporary files and leaves any existing dataset untouched. Memory use
    is bounded: index entries spill to side files.
    """

    def __init__(self, prefix, dtype):
        self.prefix = str(prefix)
        self.dtype = _token_dtype(dtype)
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        tag = f".tmp-{os.getpid()}"
        self._tmp_bin, self._tmp_idx = bin_path(self.prefix) + tag, idx_path(self.prefix) + tag
        self._bin = open(self._tmp_bin, "wb")
        self._lengths = _Spill(self._tmp_idx + ".lengths", "i", np.int32)   # [S]
        self._docs = _Spill(self._tmp_idx + ".docs", "q", np.int64)         # [D - 1], leading 0 implied
        self.num_tokens, self._done = 0, False

    def _check(self, tokens) -> np.ndarray:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise DataError(f"{self.prefix}: tokens must be a 1-D array, got shape {arr.shape}.")
        if arr.dtype != self.dtype and len(arr) and arr.dtype.kind in "iu" and self.dtype.kind in "iu":
            lo, hi, info = int(arr.min()), int(arr.max()), np.iinfo(self.dtype)
            if lo < info.min or hi > info.max:
                bad = lo if lo < info.min else hi
                raise DataError(f"{self.prefix}: token id {bad} does not fit the dataset dtype "
                                f"{self.dtype.name} ({info.min}..{info.max}); write with a wider dtype "
                                f"(int32 for vocabularies of 65,500 ids or more).")
        return arr.astype(self.dtype, copy=False)

    def _write(self, arr: np.ndarray) -> None:
        self._bin.write(arr.tobytes())
        self.num_tokens += len(arr)

    def add_item(self, tokens) -> None:
        """Appends one sequence to the current document."""
        arr = self._check(tokens)
        if len(arr) > np.iinfo(np.int32).max:
            raise DataError(f"{self.prefix}: a sequence of {len(arr)} tokens exceeds the format's "
                            f"int32 length field.")
        self._write(arr)
        self._lengths.extend([len(arr)])

    def end_document(self) -> None:
        """Closes the current document (its sequences are those added since the last boundary)."""
        self._docs.extend([self._lengths.count])

    def add_document(self, tokens, lengths=None) -> None:
        """Appends one document: its tokens, split into sequences of `lengths` (default: one sequence).

        An empty document is recorded as a document with no sequence, as Megatron does.
        """
        arr = self._check(tokens)
        if lengths is None:
            lengths = [len(arr)] if len(arr) else []
        if sum(int(n) for n in lengths) != len(arr):
            raise DataError(f"{self.prefix}: sequence lengths {list(lengths)} do not add up to the "
                            f"document's {len(arr)} tokens.")
        self._write(arr)
        self._lengths.extend(lengths)
        self.end_document()

    def add_documents(self, tokens_T, lengths_N) -> None:
        """Appends N documents given as their concatenated tokens [T] and lengths [N] (one sequence each)."""
        arr, lengths = self._check(tokens_T), np.asarray(lengths_N, np.int64)
        if int(lengths.sum()) != len(arr):
            raise DataError(f"{self.prefix}: document lengths add up to {int(lengths.sum())}, but "
                            f"{len(arr)} tokens were given.")
        self._write(arr)
        nonempty = lengths > 0
        ends = self._lengths.count + np.cumsum(nonempty)     # [N] sequence count after each document
        self._lengths.extend(lengths[nonempty])
        self._docs.extend(ends)

    def add_index(self, prefix) -> None:
        """Appends a whole existing dataset (same dtype), streaming its data file."""
        src = IndexedDataset(prefix)
        if src.dtype != self.dtype:
            raise DataError(f"cannot merge {src.prefix} ({src.dtype.name} tokens) into {self.prefix} "
                            f"({self.dtype.name}); all merged datasets must share one dtype.")
        base = self._lengths.count
        for start in range(0, src.num_sequences, _SPILL_ENTRIES):
            self._lengths.extend(src.sequence_lengths[start:start + _SPILL_ENTRIES])
        for start in range(1, len(src.document_indices), _SPILL_ENTRIES):
            self._docs.extend(base + src.document_indices[start:start + _SPILL_ENTRIES])
        with open(bin_path(src.prefix), "rb") as f:
            shutil.copyfileobj(f, self._bin, 16 << 20)
        self.num_tokens += src.num_tokens

    def finalize(self) -> None:
        """Writes the index and moves both files into place (replacing an existing dataset)."""
        if self._done:
            return
        try:
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
            item = self.dtype.itemsize
            with open(self._tmp_idx, "wb") as f:
                f.write(MAGIC + struct.pack("<QBQQ", VERSION, CODE_OF_DTYPE[self.dtype],
                                            self._lengths.count, self._docs.count + 1))
                for chunk in self._lengths.chunks():
                    f.write(chunk.tobytes())
                carry = 0
                for chunk in self._lengths.chunks():
                    ends = np.cumsum(chunk, dtype=np.int64)
                    f.write(((carry + ends - chunk) * item).astype(np.int64).tobytes())
                    carry += int(ends[-1])
                f.write(np.zeros(1, np.int64).tobytes())
                for chunk in self._docs.chunks():
                    f.write(chunk.tobytes())
                f.flush()
                os.fsync(f.fileno())
            # The .idx goes last: a dataset whose .idx exists is complete.
            if os.path.exists(idx_path(self.prefix)):
                os.remove(idx_path(self.prefix))
            os.replace(self._tmp_bin, bin_path(self.prefix))
            os.replace(self._tmp_idx, idx_path(self.prefix))
            self._done = True
        finally:
            self.abort()

    def abort(self) -> None:
        """Removes the temporary files; an existing dataset under the final name is untouched."""
        self._bin.close()
        for spill in (self._lengths, self._docs):
            spill.remove()
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def merge(prefixes, output_prefix) -> IndexedDataset:
    """Concatenates datasets (same dtype) into `output_prefix`, documents in the given order."""
    prefixes = [str(p) for p in prefixes]
    if not prefixes:
        raise DataError("merge needs at least one input dataset prefix.")
    same = [p for p in prefixes if Path(p).absolute() == Path(output_prefix).absolute()]
    if same:
        raise DataError(f"--output-prefix {output_prefix} is also one of the --merge inputs ({same[0]}); write the "
                        f"merged dataset under a new prefix.")
    refuse_existing("--output-prefix", str(output_prefix), [bin_path(output_prefix), idx_path(output_prefix)],
                    "a dataset written before")
    first = IndexedDataset(prefixes[0])
    with IndexedDatasetWriter(output_prefix, first.dtype) as writer:
        for prefix in prefixes:
            writer.add_index(prefix)
    return IndexedDataset(output_prefix)
