"""Datasets for a run, and host batches -> global jax.Arrays laid out for the train step.

A dataset maps a sample index to a dict of [seq_len + 1] arrays (`tokens`,
and with document-aware batches `segment_ids`, `positions`, `loss_mask`).
The loader turns the global batch that starts at sample `start` into arrays
[accumulation, micro_batch x dp, seq] placed with the batch sharding. Each
process materialises only the rows its own devices hold
(make_array_from_callback asks for exactly those), and the next batches are
prepared in a background thread while the current step runs.
"""

from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np

from megajax.config import Config, parse_split
from megajax.data.blend import BlendedDataset, build_datasets, parse_data_path
from megajax.data.corpus import stdlib_corpus
from megajax.data.indexed import IndexedDataset
from megajax.errors import DataError


def batch_keys(cfg: Config, context: int = 1) -> tuple[str, ...]:
    keys = ("tokens", "labels", "loss_mask")
    if cfg.data.reset_position_ids or context > 1:  # reordered sequences carry their positions
        keys += ("positions",)
    if cfg.data.reset_attention_mask:
        keys += ("segment_ids",)
    return keys


def document_aware(cfg: Config) -> bool:
    d = cfg.data
    return d.reset_position_ids or d.reset_attention_mask or d.eod_mask_loss


def split_sample_counts(cfg: Config) -> list[int]:
    """Samples needed per split (train, valid, test), as Megatron sizes them."""
    t = cfg.train
    evals = t.steps // t.eval_every + 1 if t.eval_every else 0
    return [t.steps * t.global_batch, evals * t.eval_steps * t.global_batch or 1,
            t.eval_steps * t.global_batch]


def build_run_datasets(cfg: Config, tokenizer) -> tuple[object, object | None, list[str]]:
    """(train, valid or None, report lines) for data.path, or the embedded corpus when it is empty."""
    path = cfg.data.path or stdlib_corpus(cfg.data.tokenizer, cfg.data.corpus_max_mb)
    prefixes, _ = parse_data_path(path)
    for prefix in prefixes:
        check_vocabulary(IndexedDataset(prefix), cfg.model.vocab_size, cfg.data.tokenizer)
    cache = cfg.data.cache_dir or str(Path(prefixes[0]).parent / "cache" / "GPTDataset_indices")
    train, valid, _ = build_datasets(
        path, split=cfg.data.split, num_samples=split_sample_counts(cfg), seq_len=cfg.train.seq_len,
        seed=cfg.train.seed, cache_dir=cache, document_aware=document_aware(cfg),
        eod_id=getattr(tokenizer, "eod_id", None))
    if train is None:
        raise DataError(f"data.split = {cfg.data.split!r} leaves no documents for training in {path}; "
                        f"give the train split a positive share.")
    if valid is None and cfg.train.eval_every:
        shares = parse_split(cfg.data.split)
        larger = next((s for s in ("90,10,0", "80,20,0", "50,50,0") if parse_split(s)[1] > shares[1]), None)
        give = f"a larger share (e.g. data.split={larger})" if larger else "more documents (data.path)"
        raise DataError(f"data.split = {cfg.data.split!r} leaves no validation documents in {path} "
                        f"({len(train):,} train samples) but train.eval_every = {cfg.train.eval_every}; give "
                        f"the validation split {give} or set train.eval_every=0.")
    report = [f"data: {'embedded corpus ' if not cfg.data.path else ''}{path}, split {cfg.data.split}: "
              f"{len(train):,} train samples" + (f", {len(valid):,} validation" if valid else "")]
    if isinstance(train, BlendedDataset):
        report.append(train.report())
    return train, valid, report


def check_vocabulary(ds: IndexedDataset, vocab_size: int, tokenizer: str, scan_tokens: int = 1 << 24) -> None:
    """Token ids in the data (the first `scan_tokens` of the .bin, so it stays instant) fit the model."""
    n = min(ds.num_tokens, scan_tokens)
    if n == 0:
        return
    top = int(np.max(_head(ds, n)))
    if top >= vocab_size:
        raise DataError(
            f"indexed dataset {ds.prefix!r} ({ds.dtype.name}) holds token id {top} but model.vocab_size="
            f"{vocab_size} (data.tokenizer={tokenizer!r}); the data was tokenized with another tokenizer. "
            f"Set data.tokenizer to the tokenizer used by preprocess, or model.vocab_size > {top}.")


def _head(ds: IndexedDataset, n: int) -> np.ndarray:
    """The first n tokens of the dataset (a view of the memory map)."""
    return np.frombuffer(ds._bin_map, ds.dtype, n)


class Loader:
    """Global batches of a dataset as sharded arrays; `batch(start)` covers samples [start, start + G)."""

    def __init__(self, dataset, *, layout, shardings: dict, eod_mask_loss: bool = False, prefetch: int = 2,
                 order=None):
        """`layout` is the run's megajax.plan.BatchLayout: arrays are its `shape`,
        [accumulation, micro_batch x data-parallel size, seq_len]."""
        self.dataset, self.global_batch, self.accumulation = dataset, layout.global_batch, layout.accumulation
        self.eod_mask_loss = eod_mask_loss
        # Token order along the sequence (context parallelism's load-balanced chunks), or None.
        self.order = None if order is None else np.asarray(order)
        self.seq_len, self.shardings = layout.seq_len, shardings
        self.shape = layout.shape
        self.prefetch = prefetch
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="megajax-loader") if prefetch else None
        self._ahead: collections.OrderedDict = collections.OrderedDict()

    def abstract_batch(self) -> dict:
        """A batch's shapes, dtypes and shardings (what compiling a step needs), as ShapeDtypeStructs."""
        return {k: jax.ShapeDtypeStruct(self.shape, np.float32 if k == "loss_mask" else np.int32, sharding=sh)
                for k, sh in self.shardings.items()}

    def _rows(self, start: int, micro: slice, rows: slice) -> dict[str, np.ndarray]:
        """Samples [micro, rows, seq + 1] of the batch at `start`, one array per field."""
        b = self.shape[1]
        micros, rows_ = range(*micro.indices(self.accumulation)), range(*rows.indices(b))
        out: dict[str, np.ndarray] = {}
        for i, a in enumerate(micros):
            for j, r in enumerate(rows_):
                sample = self.dataset[start + a * b + r]
                if not isinstance(sample, dict):
                    sample = {"tokens": sample}
                for k, v in sample.items():
                    if k not in out:
                        out[k] = np.empty((len(micros), len(rows_), self.seq_len + 1), np.int32
                                          if k != "loss_mask" else np.float32)
                    out[k][i, j] = v
        return out

    def _make(self, start: int) -> dict:
        cache: dict = {}

        def samples(index):
            key = (index[0].indices(self.shape[0]), index[1].indices(self.shape[1]))
            if key not in cache:
                cache[key] = self._rows(start, index[0], index[1])
            return cache[key]

        fields = {
            "tokens": lambda s: s["tokens"][..., :-1],
            "labels": lambda s: s["tokens"][..., 1:],
            "loss_mask": lambda s: (s["loss_mask"][..., :-1] if self.eod_mask_loss
                                    else np.ones(s["tokens"][..., 1:].shape, np.float32)),
            "positions": lambda s: (s["positions"][..., :-1] if "positions" in s else
                                    np.broadcast_to(np.arange(self.seq_len, dtype=np.int32),
                                                    s["tokens"][..., 1:].shape)),
            "segment_ids": lambda s: s["segment_ids"][..., :-1],
        }
        order = self.order if self.order is not None else slice(None)

        def piece(idx, field):
            return field(samples(idx))[..., order][..., idx[2]]

        return {k: jax.make_array_from_callback(self.shape, sh, lambda idx, f=fields[k]: piece(idx, f))
                for k, sh in self.shardings.items()}

    def batch(self, start: int) -> dict:
        """The batch at sample `start`; queues the following ones in the background."""
        if self._pool is None:
            return self._make(start)
        for s in list(self._ahead):
            if s < start:
                self._ahead.pop(s).cancel()
        for k in range(self.prefetch + 1):
            s = start + k * self.global_batch
            if s not in self._ahead:
                self._ahead[s] = self._pool.submit(self._make, s)
        return self._ahead.pop(start).result()

    def close(self) -> None:
        if self._pool is not None:
            for f in self._ahead.values():
                f.cancel()
            self._pool.shutdown(wait=True)
            self._pool = None
