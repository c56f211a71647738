"""Host batches -> global jax.Arrays laid out for the train step.

A dataset maps a sample index to seq_len + 1 token ids. The loader turns
global batch `step` into arrays [accumulation, micro_batch x dp, seq] placed
with the batch sharding; each process only materialises the rows its own
devices hold (make_array_from_callback asks for exactly those).
"""

from __future__ import annotations

import numpy as np
import jax


class TokenWindows:
    """Non-overlapping windows of seq_len + 1 tokens over a token array, in a seeded order per epoch."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int):
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(f"corpus of {len(tokens)} tokens is shorter than one sample of {seq_len + 1}")
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)}
        return self._orders[epoch]

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> np.ndarray:
        epoch, pos = divmod(int(index), self.num_windows)
        start = int(self._order(epoch)[pos]) * self.seq_len
        return self.tokens[start:start + self.seq_len + 1]


class Loader:
    """Global batch `step` of a dataset as sharded arrays {tokens, labels, loss_mask}."""

    def __init__(self, dataset, *, global_batch: int, accumulation: int, seq_len: int, shardings: dict):
        self.dataset, self.global_batch, self.accumulation = dataset, global_batch, accumulation
        self.seq_len, self.shardings = seq_len, shardings
        self.shape = (accumulation, global_batch // accumulation, seq_len)

    def _rows(self, step: int, rows: slice, micro: slice) -> np.ndarray:
        """Samples [micro, rows, seq + 1] of global batch `step`."""
        b = self.shape[1]
        base = step * self.global_batch
        out = np.empty((len(range(*micro.indices(self.accumulation))),
                        len(range(*rows.indices(b))), self.seq_len + 1), np.int32)
        for i, a in enumerate(range(*micro.indices(self.accumulation))):
            for j, r in enumerate(range(*rows.indices(b))):
                out[i, j] = self.dataset[base + a * b + r]
        return out

    def batch(self, step: int) -> dict:
        cache: dict = {}

        def samples(index):
            key = (index[0].indices(self.shape[0]), index[1].indices(self.shape[1]))
            if key not in cache:
                cache[key] = self._rows(step, rows=index[1], micro=index[0])
            return cache[key]

        def make(name, fn):
            return jax.make_array_from_callback(self.shape, self.shardings[name], lambda idx: fn(samples(idx))[..., idx[2]])

        return {
            "tokens": make("tokens", lambda s: s[..., :-1]),
            "labels": make("labels", lambda s: s[..., 1:]),
            "loss_mask": make("loss_mask", lambda s: np.ones(s[..., 1:].shape, np.float32)),
        }
