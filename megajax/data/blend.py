"""Weighted blends of datasets, as Megatron's `--data-path w1 p1 w2 p2 ...`.

Weights are normalised to sum to 1. For a blend of `size` samples, dataset j
is asked for ceil(ceil(w_j x size) x 1.005) samples (megatron-core's sizing
with its 0.5 % surplus) and the blend has sum_j ceil(w_j x size) samples. Sample
i comes from the dataset whose deficit w_j x max(i, 1) - count_j is largest
(first on ties), its count_j-th sample: deterministic, no RNG, the same
choice as Megatron's helper, so blends line up sample for sample.
"""

from __future__ import annotations

import hashlib
import json
import math
from array import array
from typing import Sequence

import numpy as np

from megajax.data.gpt_dataset import SPLIT_NAMES, build_gpt_datasets, load_cached, save_cached
from megajax.data.indexed import IndexedDataset
from megajax.errors import ConfigError, DataError

SURPLUS = 0.005


def _number(value) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def parse_data_path(path, key: str = "data.path", chat: bool = False) -> tuple[list[str], list[float]]:
    """A prefix, or [w1, p1, w2, p2, ...] (a list or one whitespace-separated string starting with a weight; a
    string starting otherwise is one path, spaces included) -> (prefixes, weights);
    `chat`: the entries are chat jsonl files or directories (data.format=chat), as the messages say.

    Weights come back normalised to sum to 1; a single prefix has weight 1.
    """
    what = "a chat jsonl file or directory" if chat else "a dataset prefix"
    example = ("[0.3, data/math.jsonl, 0.7, data/chats]" if chat else
               "[0.3, data/a_text_document, 0.7, data/b_text_document]")
    if isinstance(path, str) and path.split() and _number(path.split()[0]) is None:
        return [path.strip()], [1.0]  # one path, spaces and all: a blend string starts with a weight
    items = path.split() if isinstance(path, str) else path
    if not isinstance(items, (list, tuple)) or not items:
        raise ConfigError(f"{key} = {path!r}: expected {what} or a list [weight, {'path' if chat else 'prefix'}, "
                          f"weight, {'path' if chat else 'prefix'}, ...].")
    if len(items) == 1 and isinstance(items[0], str) and _number(items[0]) is None:
        return [items[0]], [1.0]
    if len(items) % 2:
        raise ConfigError(f"{key} = {path!r}: {len(items)} entries; a blend alternates weight and "
                          f"{'path' if chat else 'prefix'}, e.g. {example}.")
    weights, prefixes = [_number(w) for w in items[0::2]], list(items[1::2])
    for w, raw in zip(weights, items[0::2]):
        if w is None or not math.isfinite(w) or w <= 0:
            raise ConfigError(f"{key} = {path!r}: weight {raw!r} is not a positive number; a blend "
                              f"alternates weight and {'path' if chat else 'prefix'}, e.g. {example}.")
    for p in prefixes:
        if not isinstance(p, str) or not p or _number(p) is not None:
            raise ConfigError(f"{key} = {path!r}: {p!r} is not {what}; a blend alternates "
                              f"weight and {'path' if chat else 'prefix'}, e.g. {example}.")
    total = float(np.sum(np.array(weights, np.float64)))
    return prefixes, [w / total for w in weights]


def blend_sizes(weights: Sequence[float], size: int, surplus: float = SURPLUS) -> tuple[list[int], list[int]]:
    """(samples the blend takes from each dataset, samples to build in each) for a blend of `size`."""
    target = [int(math.ceil(size * w)) for w in weights]
    return target, [int(math.ceil(t * (1 + surplus))) for t in target]


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index [size] int16, dataset_sample_index [size] int64) of the greedy blend.

    A tight loop over samples (the choice depends on every earlier one), about
    0.3 us per sample for a few datasets; the result is cached by BlendedDataset.
    """
    w, k = [float(x) for x in weights], len(weights)
    if not 0 < k < 2**15:
        raise ConfigError(f"a blend needs 1 to 32767 datasets, got {k}.")
    counts = [0.0] * k
    chosen = array("h", bytes(2 * size))
    if k == 1:
        pass
    elif k == 2:
        w0, w1 = w
        c0 = c1 = 0.0
        for i in range(size):
            t = float(i) if i else 1.0
            if w1 * t - c1 > w0 * t - c0:
                chosen[i] = 1
                c1 += 1.0
            else:
                c0 += 1.0
    else:
        others = range(1, k)
        for i in range(size):
            t = float(i) if i else 1.0
            best, top = 0, w[0] * t - counts[0]
            for j in others:
                e = w[j] * t - counts[j]
                if e > top:
                    best, top = j, e
            chosen[i] = best
            counts[best] += 1.0
    dataset_index = np.frombuffer(chosen, np.int16).copy()
    sample_index = np.empty(size, np.int64)
    for j in range(k):
        where = np.flatnonzero(dataset_index == j)
        sample_index[where] = np.arange(len(where))
    return dataset_index, sample_index


class BlendedDataset:
    """`size` samples drawn from `datasets` in proportion to `weights` (normalised).

    `dataset[i]` is `datasets[d][s]` for (d, s) = (dataset_index[i],
    dataset_sample_index[i]); `counts` [k] says how many samples each dataset
    gives, `report()` formats that for a start-up log. With `cache_dir` and
    datasets that carry a `description` (GPTDataset does), the indices are
    cached like GPTDataset's.
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int, *, cache_dir=None,
                 names: Sequence[str] | None = None):
        if len(datasets) != len(weights) or not datasets:
            raise ConfigError(f"a blend needs one weight per dataset: {len(datasets)} datasets, "
                              f"{len(weights)} weights.")
        if any(not w > 0 for w in weights):
            raise ConfigError(f"blend weights {list(weights)}: every weight must be positive.")
        total = float(np.sum(np.array(weights, np.float64)))
        self.datasets, self.weights, self.size = list(datasets), [w / total for w in weights], size
        self.names = list(names) if names else [getattr(getattr(d, "indexed", None), "prefix", f"dataset {j}")
                                                 for j, d in enumerate(datasets)]
        descriptions = [getattr(d, "description", None) for d in datasets]
        self.description = None if None in descriptions else json.dumps(
            {"class": "BlendedDataset", "datasets": descriptions, "weights": self.weights, "size": size},
            indent=1)
        self.from_cache = False
        self.dataset_index, self.dataset_sample_index = self._indices(cache_dir)
        self.counts = np.bincount(self.dataset_index, minlength=len(datasets))
        for j, (n, d) in enumerate(zip(self.counts, self.datasets)):
            if n > len(d):
                raise DataError(f"blend: {self.names[j]} is asked for {n} samples but holds {len(d)}; "
                                f"build it with at least ceil(weight x size x 1.005) samples "
                                f"(blend_sizes).")

    def _indices(self, cache_dir):
        if cache_dir is None or self.description is None:
            return blending_indices(self.weights, self.size)
        names = ("dataset_index", "dataset_sample_index")
        stem = f"{hashlib.md5(self.description.encode()).hexdigest()}-BlendedDataset"
        if (cached := load_cached(cache_dir, stem, names)) is not None:
            self.from_cache = True
            return cached
        arrays = blending_indices(self.weights, self.size)
        save_cached(cache_dir, stem, dict(zip(names, arrays)), self.description)
        return arrays

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]

    def report(self) -> str:
        """One line per dataset: weight, samples taken, share achieved, name."""
        lines = [f"blend of {len(self.datasets)} datasets, {self.size} samples:"]
        for w, n, name in zip(self.weights, self.counts, self.names):
            lines.append(f"  weight {w:.4f}  {int(n):>12,} samples ({n / max(self.size, 1):.4f})  {name}")
        return "\n".join(lines)


def build_datasets(path, *, split: str, num_samples: Sequence[int | None], seq_len: int, seed: int,
                   cache_dir=None, document_aware: bool = False, eod_id: int | None = None,
                   key: str = "data.path") -> list:
    """train/valid/test datasets (None where a split is empty) for `data.path`: one prefix or a blend.

    Each sample is a dict as GPTDataset returns it.
    """
    prefixes, weights = parse_data_path(path, key)
    common = dict(split=split, seq_len=seq_len, seed=seed, cache_dir=cache_dir,
                  document_aware=document_aware, eod_id=eod_id)
    if len(prefixes) == 1:
        return build_gpt_datasets(IndexedDataset(prefixes[0]), num_samples=num_samples, **common)
    if any(n is None for n in num_samples):
        raise ConfigError(f"{key}: a weighted blend needs a sample count for every split, got "
                          f"{dict(zip(SPLIT_NAMES, num_samples))}.")
    sizes = [blend_sizes(weights, n) for n in num_samples]            # per split: (target, build)
    per_prefix = [build_gpt_datasets(IndexedDataset(p), num_samples=[s[1][j] for s in sizes], **common)
                  for j, p in enumerate(prefixes)]
    out = []
    for i, name in enumerate(SPLIT_NAMES):
        parts = [datasets[i] for datasets in per_prefix]
        if all(d is None for d in parts):
            out.append(None)
            continue
        empty = [p for p, d in zip(prefixes, parts) if d is None]
        if empty:
            raise DataError(f"{key}: {empty[0]} has no documents in the {name} split ({split!r}) while "
                            f"other datasets of the blend do; give it more documents or change the split.")
        out.append(BlendedDataset(parts, weights, sum(sizes[i][0]), cache_dir=cache_dir, names=prefixes))
    return out
