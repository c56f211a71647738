"""Megatron's GPT sampling over an indexed dataset.

A split (a contiguous range of the dataset's documents) is read as one
stream of tokens per epoch, the documents in a seeded shuffled order. Sample
k is the window of seq_len + 1 tokens starting at token k x seq_len of that
stream (windows cross document boundaries; consecutive samples share one
token, inputs = window[:-1], labels = window[1:]). Three index arrays make
this O(1) per sample:

    document_index [E x D] int32    document ids, E epochs of the split's D documents,
                                    shuffled (a short last epoch shuffled on its own)
    sample_index   [N + 1, 2]       (position in document_index, token offset) where
                                    sample k starts; sample k ends where k + 1 starts
    shuffle_index  [N]              seeded permutation of the samples

The arrays, the RNG calls (numpy RandomState(seed), in the same order) and the
dtypes are those of megatron-core's GPTDataset, so a megajax split yields the
same samples in the same order as Megatron for the same data, split,
seq_len, sample count and seed. The sample index is computed with one
cumulative sum and one binary search (no loop over samples or tokens).

Index arrays are cached as .npy files in `cache_dir`, named by the md5 of a
description of every parameter that shapes them; a second build with the
same parameters memory-maps them instead of recomputing.

Megatron splits by sequences of the .idx; `megajax preprocess` writes one
sequence per document, so here "document" means one .idx sequence.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path
from typing import Sequence

import numpy as np

from megajax.config import parse_split  # noqa: F401  (data.split's syntax is the config's; re-exported)
from megajax.data.indexed import IndexedDataset
from megajax.errors import ConfigError, DataError

SPLIT_NAMES = ("train", "valid", "test")
SEPARATE_LAST_EPOCH_BELOW = 0.80  # a last epoch under 80 % of an epoch's samples is shuffled on its own


# --- splits -----------------------------------------------------------------------------------

def split_ranges(split: str, num_documents: int) -> list[tuple[int, int] | None]:
    """[begin, end) document range of each of train/valid/test (None where empty), Megatron's rounding."""
    fractions, bounds = parse_split(split), [0.0]
    for f in fractions:
        bounds.append(bounds[-1] + f)
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        begin, end = int(round(lo * num_documents)), int(round(hi * num_documents))
        out.append((begin, end) if hi > lo and end > begin else None)
    return out


# --- index construction -----------------------------------------------------------------------

def num_epochs(tokens_per_epoch: int, num_samples: int | None, seq_len: int) -> int:
    """Fewest epochs whose tokens cover num_samples windows of seq_len + 1 (1 when num_samples is None)."""
    if num_samples is None:
        return 1
    need = num_samples * seq_len + 1
    return max(1, -(-need // tokens_per_epoch))


def build_document_index(documents: np.ndarray, epochs: int, rng: np.random.RandomState,
                         separate_last: bool) -> np.ndarray:
    """Document ids [epochs x D] int32, shuffled; with separate_last the last epoch is shuffled alone."""
    if separate_last and epochs > 1:
        return np.concatenate([build_document_index(documents, epochs - 1, rng, False),
                               build_document_index(documents, 1, rng, False)])
    index = np.tile(np.asarray(documents, np.int32), epochs)
    rng.shuffle(index)
    return index


def build_sample_index(lengths: np.ndarray, document_index: np.ndarray, seq_len: int,
                       num_samples: int) -> np.ndarray:
    """[num_samples + 1, 2]: (position in document_index, token offset) where each sample starts.

    Sample k starts at token k x seq_len of the stream document_index defines;
    that token lies in the first document whose cumulative end exceeds it.
    int32 when every value fits, else int64 (as Megatron).
    """
    ends = np.cumsum(lengths[document_index], dtype=np.int64)            # [E x D] stream end of each
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_len        # [N + 1] first token of each
    position = np.searchsorted(ends, starts, side="right")               # [N + 1]
    offset = starts - (ends[position] - lengths[document_index[position]])
    big = max(len(document_index), int(lengths.max(initial=0))) > np.iinfo(np.int32).max
    out = np.empty((num_samples + 1, 2), np.int64 if big else np.int32)
    out[:, 0], out[:, 1] = position, offset
    out[0] = 0  # Megatron starts at (0, 0) even when the first document is empty
    return out


def build_shuffle_index(first: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """Permutation [total] of the samples: [0, first) and [first, total) shuffled separately."""
    dtype = np.int64 if total >= np.iinfo(np.uint32).max - 1 else np.uint32
    head = np.arange(first, dtype=dtype)
    rng.shuffle(head)
    if first == total:
        return head
    tail = np.arange(first, total, dtype=dtype)
    rng.shuffle(tail)
    return np.concatenate([head, tail])


def build_indices(lengths: np.ndarray, documents: np.ndarray, seq_len: int, num_samples: int | None,
                  seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document_index, sample_index, shuffle_index) for `documents` (ids into `lengths`, tokens each)."""
    tokens_per_epoch = int(np.sum(lengths[documents], dtype=np.int64))
    epochs = num_epochs(tokens_per_epoch, num_samples, seq_len)
    separate_last, head = False, None
    if epochs > 1:
        head = ((epochs - 1) * tokens_per_epoch - 1) // seq_len       # samples before the last epoch
        per_epoch = (tokens_per_epoch - 1) // seq_len
        separate_last = num_samples - head < int(SEPARATE_LAST_EPOCH_BELOW * per_epoch)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, epochs, rng, separate_last)
    total = (epochs * tokens_per_epoch - 1) // seq_len
    sample_index = build_sample_index(lengths, document_index, seq_len, total)
    shuffle_index = build_shuffle_index(head if separate_last else total, total, rng)
    return document_index, sample_index, shuffle_index


# --- the dataset ------------------------------------------------------------------------------

def _cache_paths(cache_dir, stem: str, names: Sequence[str]) -> tuple[list[Path], Path]:
    base = Path(cache_dir)
    return [base / f"{stem}-{n}.npy" for n in names], base / f"{stem}-description.txt"


def load_cached(cache_dir, stem: str, names: Sequence[str]) -> tuple[np.ndarray, ...] | None:
    """The arrays `{stem}-{name}.npy`, memory-mapped, if a complete cache entry exists."""
    paths, described = _cache_paths(cache_dir, stem, names)
    if described.is_file() and all(p.is_file() for p in paths):
        return tuple(np.load(p, mmap_mode="r") for p in paths)
    return None


def save_cached(cache_dir, stem: str, arrays: dict[str, np.ndarray], description: str) -> None:
    """Writes `{stem}-{name}.npy` per array, then `{stem}-description.txt` (the entry is complete once
    it exists); every file goes to a temporary name first, so concurrent builders never see half a file."""
    paths, described = _cache_paths(cache_dir, stem, list(arrays))
    tag = f".tmp-{socket.gethostname()}-{os.getpid()}"
    try:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        for path, array in zip(paths, arrays.values()):
            with open(path.with_name(path.name + tag), "wb") as f:
                np.save(f, array)
            os.replace(path.with_name(path.name + tag), path)
        described.with_name(described.name + tag).write_text(description)
        os.replace(described.with_name(described.name + tag), described)
    except OSError as e:
        where = f" ({e.filename})" if e.filename else ""
        raise DataError(f"data.cache_dir: cannot write the sample-index cache in {str(cache_dir)!r}: "
                        f"{e.strerror or e}{where}; set data.cache_dir to a directory this user can write (the "
                        f"default is beside the dataset).") from None


class GPTDataset:
    """Samples of seq_len + 1 tokens from documents [begin, end) of an IndexedDataset.

    `dataset[i]` returns a dict of numpy arrays, all [seq_len + 1] and aligned
    with `tokens` (the loader takes [:-1] of each for inputs, tokens[1:] as labels):

        tokens       int32 (int64 for int64 datasets)
    and with document_aware=True (Megatron's --reset-position-ids
    --reset-attention-mask --eod-mask-loss), where a document ends at each `eod_id`:
        segment_ids  int32, number of end-of-document tokens before each token
                     (attend only within equal segment ids)
        positions    int32, position within its segment (restarts after each eod)
        loss_mask    float32, 0 where the *input* token is eod (the prediction made
                     from an eod token is not trained), else 1

    len(dataset) counts every sample of the epochs built, at least num_samples.
    """

    def __init__(self, indexed: IndexedDataset, *, seq_len: int, seed: int,
                 documents: tuple[int, int] | None = None, num_samples: int | None = None,
                 split_name: str = "train", cache_dir=None, document_aware: bool = False,
                 eod_id: int | None = None):
        if seq_len < 1:
            raise ConfigError(f"seq_len = {seq_len}: must be at least 1.")
        if num_samples is not None and num_samples < 0:
            raise ConfigError(f"num_samples = {num_samples}: must be non-negative.")
        if document_aware and eod_id is None:
            raise ConfigError("document_aware GPT samples need the tokenizer's eod_id (none was given).")
        self.indexed, self.seq_len, self.seed = indexed, seq_len, seed
        self.split_name, self.num_samples = split_name, num_samples
        self.document_aware, self.eod_id = document_aware, eod_id
        begin, end = documents if documents is not None else (0, indexed.num_sequences)
        if not 0 <= begin < end <= indexed.num_sequences:
            raise DataError(f"{indexed.prefix}: the {split_name} split covers documents [{begin}, {end}) "
                            f"but the dataset holds {indexed.num_sequences}; the split is empty or out "
                            f"of range.")
        self.documents = (begin, end)
        lengths = indexed.sequence_lengths
        tokens = int(np.sum(lengths[begin:end], dtype=np.int64))
        if tokens < 2 or (num_samples is None and tokens - 1 < seq_len):
            raise DataError(f"{indexed.prefix}: the {split_name} split holds {tokens} tokens, fewer than "
                            f"one sample of seq_len + 1 = {seq_len + 1}; use a shorter sequence or give "
                            f"this split a larger share.")
        self.description = json.dumps({
            "class": "GPTDataset", "path": os.path.abspath(indexed.prefix),
            "num_sequences": indexed.num_sequences, "documents": [begin, end], "tokens": tokens,
            "split": split_name,
            "num_samples": num_samples, "seq_len": seq_len, "seed": seed,
        }, indent=1)
        self.description_hash = hashlib.md5(self.description.encode()).hexdigest()
        self.from_cache = False
        self.document_index, self.sample_index, self.shuffle_index = self._indices(cache_dir)
        self._out_dtype = np.int64 if indexed.dtype.itemsize > 4 else np.int32

    def _indices(self, cache_dir):
        names = ("document_index", "sample_index", "shuffle_index")
        stem = f"{self.description_hash}-GPTDataset-{self.split_name}"
        if cache_dir is not None and (cached := load_cached(cache_dir, stem, names)) is not None:
            self.from_cache = True
            return cached
        arrays = build_indices(self.indexed.sequence_lengths, np.arange(*self.documents, dtype=np.int32),
                               self.seq_len, self.num_samples, self.seed)
        if cache_dir is not None:
            save_cached(cache_dir, stem, dict(zip(names, arrays)), self.description)
        return arrays

    def __len__(self) -> int:
        return len(self.sample_index) - 1

    def tokens(self, i: int) -> np.ndarray:
        """Tokens [seq_len + 1] of sample i."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} of a {self.split_name} split of {len(self)} samples")
        j = int(self.shuffle_index[i])
        (d0, o0), (d1, o1) = self.sample_index[j], self.sample_index[j + 1]
        d0, o0, d1, o1 = int(d0), int(o0), int(d1), int(o1)
        get, doc = self.indexed.get, self.document_index
        if d0 == d1:
            parts = [get(int(doc[d0]), o0, o1 - o0 + 1)]
        else:
            parts = [get(int(doc[d0]), o0)] + [get(int(doc[k])) for k in range(d0 + 1, d1)]
            parts.append(get(int(doc[d1]), 0, o1 + 1))
        return np.concatenate(parts).astype(self._out_dtype, copy=False)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        tokens = self.tokens(int(i))
        if not self.document_aware:
            return {"tokens": tokens}
        return {"tokens": tokens, **document_masks(tokens, self.eod_id)}


def document_masks(tokens: np.ndarray, eod_id: int) -> dict[str, np.ndarray]:
    """segment_ids, positions [L] int32 and loss_mask [L] float32 of tokens [L] (see GPTDataset)."""
    is_eod = tokens == eod_id
    t = np.arange(len(tokens), dtype=np.int32)
    after_eod = np.where(is_eod, t + 1, 0)                   # a new segment starts after each eod
    segment_start = np.maximum.accumulate(np.concatenate([[0], after_eod[:-1]])).astype(np.int32)
    return {
        "segment_ids": (np.cumsum(is_eod, dtype=np.int32) - is_eod).astype(np.int32),
        "positions": t - segment_start,
        "loss_mask": (~is_eod).astype(np.float32),
    }


def build_gpt_datasets(indexed: IndexedDataset | str, *, split: str, num_samples: Sequence[int | None],
                       seq_len: int, seed: int, cache_dir=None, document_aware: bool = False,
                       eod_id: int | None = None) -> list[GPTDataset | None]:
    """train/valid/test GPTDatasets of one indexed dataset (None for a split given no documents)."""
    if not isinstance(indexed, IndexedDataset):
        indexed = IndexedDataset(indexed)
    if len(num_samples) != 3:
        raise ConfigError(f"num_samples = {list(num_samples)}: give one count (or None) per split "
                          f"{SPLIT_NAMES}.")
    out = []
    for name, rng, n in zip(SPLIT_NAMES, split_ranges(split, indexed.num_sequences), num_samples):
        out.append(None if rng is None else GPTDataset(
            indexed, seq_len=seq_len, seed=seed, documents=rng, num_samples=n, split_name=name,
            cache_dir=cache_dir, document_aware=document_aware, eod_id=eod_id))
    return out
