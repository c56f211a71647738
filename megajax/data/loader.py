"""Datasets for a run, and host batches -> global jax.Arrays laid out for the train step.

A dataset maps a sample index to a dict of [seq_len + 1] arrays (`tokens`,
and with document-aware batches `segment_ids`, `positions`, `loss_mask`; chat data's packed rows
always carry all four, megajax/data/sft_dataset.py; image-text samples add `images` [N, H, W, 3],
megajax/data/webdataset.py, read by a pool of decoding threads).
The loader turns the global batch that starts at sample `start` into arrays
[accumulation, micro_batch x dp, seq] placed with the batch sharding. Each
process materialises only the rows its own devices hold
(make_array_from_callback asks for exactly those), and the next batches are
prepared in a background thread while the current step runs.
"""

from __future__ import annotations

import collections
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np

from megajax.config import Config, parse_split
from megajax.data.blend import BlendedDataset, blend_sizes, build_datasets, parse_data_path
from megajax.data.chat import chat_files, chat_template_of, checked_chat_template, tokenize_files
from megajax.data.gpt_dataset import SPLIT_NAMES, split_ranges
from megajax.data.sft_dataset import ChatDataset
from megajax.data.corpus import stdlib_corpus
from megajax.data.indexed import IndexedDataset
from megajax.data.instruct_tasks import instruct_train_file
from megajax.errors import ConfigError, DataError


def batch_keys(cfg: Config, context: int = 1) -> tuple[str, ...]:
    keys = ("tokens", "labels", "loss_mask")
    chat = cfg.data.format == "chat"  # packed conversations: positions restart, attention stays inside each
    if cfg.data.reset_position_ids or context > 1 or chat:  # reordered sequences carry their positions
        keys += ("positions",)
    if cfg.data.reset_attention_mask or chat:
        keys += ("segment_ids",)
    return keys


def document_aware(cfg: Config) -> bool:
    d = cfg.data
    return d.reset_position_ids or d.reset_attention_mask or d.eod_mask_loss


def sample_loss_mask(cfg: Config) -> bool:
    """Whether the batch's loss_mask is the samples' own (eod_mask_loss, chat data's answer masks)."""
    return cfg.data.eod_mask_loss or cfg.data.format in ("chat", "webdataset")


def split_sample_counts(cfg: Config) -> list[int]:
    """Samples needed per split (train, valid, test), as Megatron sizes them."""
    t = cfg.train
    evals = t.steps // t.eval_every + 1 if t.eval_every else 0
    return [t.steps * t.global_batch, evals * t.eval_steps * t.global_batch or 1,
            t.eval_steps * t.global_batch]


# Host bytes per sample of a run's sample indices, built whole before the first step (gpt: Megatron's
# document, sample and shuffle indices; chat: the packed rows, Python lists of conversation ids; image-text
# shards: the sample order), a round upper figure (packed chat rows measured 129 bytes each at the peak).
INDEX_BYTES_PER_SAMPLE = {"gpt": 32, "chat": 128, "webdataset": 32}


def host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_sample_count(cfg: Config) -> None:
    """ConfigError when the samples the run reads (train.steps x train.global_batch, with validation's) need
    sample indices larger than this host's memory: an index that cannot be built would fail after minutes
    (chat data's rows are packed epoch by epoch) or at once with an allocation error."""
    counts = split_sample_counts(cfg)
    need, host = sum(counts) * INDEX_BYTES_PER_SAMPLE[cfg.data.format], host_memory_bytes()
    if host is not None and need > host:
        t = cfg.train
        raise ConfigError(f"train.steps x train.global_batch = {t.steps:,} x {t.global_batch:,} = {counts[0]:,} "
                          f"samples{f' (and {counts[1]:,} for validation)' if t.eval_every else ''}: their sample "
                          f"index, built before the first step, would need about {need / 2**30:,.0f} GiB of host "
                          f"memory, more than this machine's {host / 2**30:,.0f} GiB; lower train.steps (a run can "
                          f"be resumed with more steps later).")


def build_run_datasets(cfg: Config, tokenizer) -> tuple[object, object | None, list[str]]:
    """(train, valid or None, report lines) for data.path, or the embedded corpus when it is empty."""
    check_sample_count(cfg)
    if cfg.data.format == "chat":
        return build_chat_datasets(cfg, tokenizer)
    if cfg.data.format == "webdataset":
        return build_image_text_datasets(cfg, tokenizer)
    path = cfg.data.path or stdlib_corpus(cfg.data.tokenizer, cfg.data.corpus_max_mb)
    prefixes, _ = parse_data_path(path)
    for prefix in prefixes:
        _not_other_format(prefix)
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
        _no_validation(cfg, path, f"{len(train):,} train samples", "documents")
    report = [f"data: {'embedded corpus ' if not cfg.data.path else ''}{path}, split {cfg.data.split}: "
              f"{len(train):,} train samples" + (f", {len(valid):,} validation" if valid else "")]
    if isinstance(train, BlendedDataset):
        report.append(train.report())
    return train, valid, report


def _not_other_format(prefix: str) -> None:
    """A DataError naming the data.format that reads `prefix` when it is a chat jsonl or image-text shards
    rather than an indexed dataset's prefix (data.format=gpt, the default)."""
    p = Path(prefix).expanduser()
    if Path(f"{prefix}.bin").is_file() or not p.exists():
        return
    files = [p] if p.is_file() else sorted(p.iterdir()) if p.is_dir() else []
    suffixes = {f.suffix for f in files}
    for suffix, what in ((".jsonl", "jsonl: data.format=chat reads conversations from jsonl files, and `megajax "
                                    "preprocess` turns jsonl text into an indexed dataset"),
                         (".tar", "tar shards: data.format=webdataset reads image-text shards")):
        if suffix in suffixes:
            raise DataError(f"data.path = {prefix!r} is {what}; data.format=gpt (the default) reads the prefix P of a "
                            f"Megatron indexed dataset P.bin/P.idx.")


def _no_validation(cfg: Config, path, have: str, what: str) -> None:
    shares = parse_split(cfg.data.split)
    larger = next((s for s in ("90,10,0", "80,20,0", "50,50,0") if parse_split(s)[1] > shares[1]), None)
    give = f"a larger share (e.g. data.split={larger})" if larger else f"more {what} (data.path)"
    raise DataError(f"data.split = {cfg.data.split!r} leaves no validation {what} in {path} "
                    f"({have}) but train.eval_every = {cfg.train.eval_every}; give "
                    f"the validation split {give} or set train.eval_every=0.")


def build_chat_datasets(cfg: Config, tokenizer) -> tuple[object, object | None, list[str]]:
    """(train, valid or None, report lines) of data.format=chat (with data.path empty: the generated
    instruction tasks' training split, megajax/data/instruct_tasks.py): the conversations of each jsonl path
    split by data.split (in file order, as Megatron splits documents), packed per split; a weighted
    list of paths is blended as Megatron blends."""
    d = cfg.data
    template, source = checked_chat_template(tokenizer)
    paths, weights = parse_data_path(d.path or str(instruct_train_file()), chat=True)
    counts = split_sample_counts(cfg)
    sizes = [blend_sizes(weights, n) for n in counts] if len(paths) > 1 else None
    pad = getattr(tokenizer, "eod_id", None) or 0
    per_path, report = [], []
    for j, path in enumerate(paths):
        conversations = tokenize_files(tokenizer, template, chat_files(path), source)
        if not conversations:
            raise DataError(f"data.path {path!r} holds no conversations (every line is blank); data.format=chat "
                            f"reads one conversation object per line.")
        top = max(int(c.ids.max(initial=0)) for c in conversations)
        if top >= cfg.model.vocab_size:
            raise DataError(f"data.tokenizer = {d.tokenizer!r} gives token id {top} in {path} but model.vocab_size = "
                            f"{cfg.model.vocab_size}; set model.vocab_size > {top} (or the model's own tokenizer).")
        datasets = []
        for i, (name, rng) in enumerate(zip(SPLIT_NAMES[:2], split_ranges(d.split, len(conversations))[:2])):
            n = counts[i] if sizes is None else sizes[i][1][j]
            ds = None if rng is None else ChatDataset(
                conversations[rng[0]:rng[1]], seq_len=cfg.train.seq_len, seed=cfg.train.seed, loss_on=d.loss_on,
                packing=d.packing, num_samples=n, pad_id=pad, split_name=name, name=path)
            datasets.append(ds)
            if ds is not None:
                report.append(f"chat data {path} {ds.report()}")
        if datasets[0] is None:
            raise DataError(f"data.split = {d.split!r} leaves no conversations for training in {path} "
                            f"({len(conversations)} conversations); give the train split a positive share.")
        if datasets[1] is None and cfg.train.eval_every:
            _no_validation(cfg, path, f"{len(conversations)} conversations", "conversations")
        per_path.append(datasets)
    if sizes is None:
        train, valid = per_path[0]
    else:
        train, valid = (None if any(p[i] is None for p in per_path) else
                        BlendedDataset([p[i] for p in per_path], weights, sum(sizes[i][0]), names=paths)
                        for i in range(2))
        report += [b.report() for b in (train, valid) if b is not None]
    return train, valid, report


def build_image_text_datasets(cfg: Config, tokenizer) -> tuple[object, object | None, list[str]]:
    """(train, valid or None, report lines) of data.format=webdataset: the samples of data.path's tar
    shards (empty: the embedded drawn shapes, megajax/data/shapes.py) in shard order, split by
    data.split; unpaired members are reported (or fatal with data.strict)."""
    from megajax.data.chat_template import ChatTemplateError, find_chat_template
    from megajax.data.shapes import shapes_shards
    from megajax.data.webdataset import ImageTextDataset, index_shards, shard_files
    d, v = cfg.data, cfg.model.vision
    path = d.path or shapes_shards()
    index = index_shards(shard_files(path), strict=d.strict)
    report = [f"data: {'embedded drawn shapes ' if not d.path else ''}{path}: {len(index.samples):,} image-text "
              f"samples in {len(index.shards)} shard{'s' if len(index.shards) > 1 else ''}"
              + (f", {len(index.problems)} left out (unpaired or repeated members)" if index.problems else "")]
    for line in index.problems[:5]:
        report.append(f"data: {line}")
    if len(index.problems) > 5:
        report.append(f"data: ... and {len(index.problems) - 5} more")
    if not index.samples:
        raise DataError(f"data.path = {path!r}: the shards hold no image-text samples (an image and a json of the "
                        f"same key).")
    try:
        template = find_chat_template(tokenizer)
    except ChatTemplateError as e:
        raise DataError(f"data.tokenizer = {d.tokenizer!r}: {e}.") from None
    if template is None and getattr(tokenizer, "name", "byte") == "byte":
        template = chat_template_of(tokenizer)
    if template is not None:  # conversations among the samples: the template is checked before any is read
        template, _ = checked_chat_template(tokenizer)
    counts = split_sample_counts(cfg)
    datasets = []
    for i, (name, rng) in enumerate(zip(SPLIT_NAMES[:2], split_ranges(d.split, len(index.samples))[:2])):
        ds = None if rng is None else ImageTextDataset(
            index, index.samples[rng[0]:rng[1]], tokenizer=tokenizer, template=template, vision=v,
            seq_len=cfg.train.seq_len, seed=cfg.train.seed, num_samples=counts[i], loss_on=d.loss_on,
            strict=d.strict, split_name=name)
        if ds is not None:
            report.append(f"image-text data {ds.report()}")
        datasets.append(ds)
    if datasets[0] is None:
        raise DataError(f"data.split = {d.split!r} leaves no image-text samples for training in {path} "
                        f"({len(index.samples)} samples); give the train split a positive share.")
    if datasets[1] is None and cfg.train.eval_every:
        _no_validation(cfg, path, f"{len(index.samples)} samples", "samples")
    for ds in datasets:  # a split none of whose samples can be read (or trained) stops the start-up, not step 1
        if ds is not None:
            ds[0]
    return datasets[0], datasets[1], report


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
                 order=None, num_workers: int = 1):
        """`layout` is the run's megajax.plan.BatchLayout: arrays are its `shape`,
        [accumulation, micro_batch x data-parallel size, seq_len]. A dataset of images (its
        `images_shape`, [N, H, W, 3] per sample, e.g. megajax/data/webdataset.py) adds `images`
        [accumulation, micro_batch x data-parallel size, N, H, W, 3] when `shardings` has that key;
        its samples are then read (decoded) by `num_workers` threads."""
        self.dataset, self.global_batch, self.accumulation = dataset, layout.global_batch, layout.accumulation
        self.eod_mask_loss = eod_mask_loss
        # Token order along the sequence (context parallelism's load-balanced chunks), or None.
        self.order = None if order is None else np.asarray(order)
        self.seq_len, self.shardings = layout.seq_len, shardings
        self.shape = layout.shape
        self.prefetch = prefetch
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="megajax-loader") if prefetch else None
        self._ahead: collections.OrderedDict = collections.OrderedDict()
        self.wait_seconds = 0.0  # time `batch` spent blocked on a batch not ready yet (all calls)
        self.images_shape = getattr(dataset, "images_shape", None)
        if "images" in shardings and self.images_shape is None:
            raise DataError("a batch with images needs an image-text dataset (data.format=webdataset); this "
                            "dataset holds text only.")
        self._workers = (ThreadPoolExecutor(num_workers, thread_name_prefix="megajax-decode")
                         if self.images_shape is not None and num_workers > 1 else None)

    def abstract_batch(self) -> dict:
        """A batch's shapes, dtypes and shardings (what compiling a step needs), as ShapeDtypeStructs."""
        return {k: jax.ShapeDtypeStruct(self.shape[:2] + tuple(self.images_shape), np.float32, sharding=sh)
                if k == "images" else
                jax.ShapeDtypeStruct(self.shape, np.float32 if k == "loss_mask" else np.int32, sharding=sh)
                for k, sh in self.shardings.items()}

    def _rows(self, start: int, micro: slice, rows: slice) -> dict[str, np.ndarray]:
        """Samples [micro, rows, seq + 1] of the batch at `start`, one array per field."""
        b = self.shape[1]
        micros, rows_ = range(*micro.indices(self.accumulation)), range(*rows.indices(b))
        out: dict[str, np.ndarray] = {}
        where = [(i, j, start + a * b + r) for i, a in enumerate(micros) for j, r in enumerate(rows_)]
        got = (self._workers.map(self.dataset.__getitem__, [w[2] for w in where]) if self._workers is not None
               else (self.dataset[w[2]] for w in where))
        for (i, j, _), sample in zip(where, got):
            if not isinstance(sample, dict):
                sample = {"tokens": sample}
            for k, v in sample.items():
                if k not in out:
                    out[k] = np.empty((len(micros), len(rows_)) + np.shape(v), np.int32
                                      if k not in ("loss_mask", "images") else np.float32)
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
            "images": None,
        }
        order = self.order if self.order is not None else slice(None)

        def piece(idx, field):
            if len(idx) > 3:  # images [accumulation, batch, N, H, W, 3]: no sequence axis
                return samples(idx)["images"][(slice(None), slice(None)) + tuple(idx[2:])]
            return field(samples(idx))[..., order][..., idx[2]]

        return {k: jax.make_array_from_callback(self.shape[:2] + tuple(self.images_shape) if k == "images"
                                                else self.shape, sh, lambda idx, f=fields[k]: piece(idx, f))
                for k, sh in self.shardings.items()}

    def batch(self, start: int) -> dict:
        """The batch at sample `start`; queues the following ones in the background."""
        t0 = time.perf_counter()
        if self._pool is None:
            try:
                return self._make(start)
            finally:
                self.wait_seconds += time.perf_counter() - t0
        for s in list(self._ahead):
            if s < start:
                self._ahead.pop(s).cancel()
        for k in range(self.prefetch + 1):
            s = start + k * self.global_batch
            if s not in self._ahead:
                self._ahead[s] = self._pool.submit(self._make, s)
        try:
            return self._ahead.pop(start).result()
        finally:
            self.wait_seconds += time.perf_counter() - t0

    def close(self) -> None:
        if self._pool is not None:
            for f in self._ahead.values():
                f.cancel()
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._workers is not None:
            self._workers.shutdown(wait=True)
            self._workers = None
