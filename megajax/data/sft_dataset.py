"""Tokenized conversations as training samples: fitted to the sequence, packed into rows, epochs.

A row holds seq_len + 1 tokens (the loader's inputs are row[:-1], its labels row[1:]). Each
conversation (a "document" of the row) is first fitted to one row:

  - one of at most seq_len + 1 tokens is kept whole;
  - a longer one is cut just after the last assistant answer that ends within seq_len + 1 tokens
    (whole turns only: never inside an answer), and counted as cut;
  - a longer one whose first answer already ends beyond seq_len + 1 tokens is dropped and counted;
  - with loss_on="assistant", one without any answer token trains nothing and is dropped and
    counted too.

With packing, epoch e's conversations (a seeded permutation per epoch) are packed best-fit: each
goes into the open row with the least room that still holds it, else into a new row; the rows of
the epoch are then shuffled. Without packing each conversation is a row of its own. Rows are
padded at the end. Sample i is row i of the epochs laid end to end: a pure function of (data,
seq_len, seed, i), so a resumed run reads the same samples and every host can build any of them.

`dataset[i]` is a dict of [seq_len + 1] arrays, as GPTDataset's document-aware samples:

    tokens       int32, the conversations' ids, then padding (pad_id)
    segment_ids  int32, k for the k-th conversation of the row; the padding is one more segment
    positions    int32, position within its conversation (0 at each start; the padding counts from 0)
    loss_mask    float32, aligned with the *input* token: loss_mask[t] = 1 when label t (the token at
                 t + 1) is trained, i.e. t + 1 is in the same conversation and marked by the mask
                 (an assistant answer token, or any token with loss_on="all"); 0 on padding and at
                 each conversation's last token (its label would be the next conversation's first)
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from megajax.data.chat import Conversation
from megajax.errors import DataError


@dataclass
class FitCounts:
    """What fitting conversations to rows of `limit` tokens did."""
    limit: int
    conversations: int = 0
    kept: int = 0
    cut: int = 0
    cut_tokens: int = 0  # tokens removed from the cut conversations
    dropped_long: int = 0
    dropped_no_answer: int = 0

    def text(self) -> str:
        return (f"{self.conversations:,} conversations: {self.kept:,} kept, {self.cut:,} cut at a turn boundary "
                f"({self.cut_tokens:,} tokens removed), {self.dropped_long:,} dropped (no answer ends within "
                f"seq_len + 1 = {self.limit} tokens), {self.dropped_no_answer:,} dropped (no assistant answer)")


def fit_conversations(conversations: list[Conversation], limit: int, loss_on: str
                      ) -> tuple[list[tuple[np.ndarray, np.ndarray]], FitCounts]:
    """(ids [L] int32, input-aligned loss mask [L] float32) of each kept conversation, L <= limit."""
    counts = FitCounts(limit, conversations=len(conversations))
    out = []
    for conv in conversations:
        if loss_on == "assistant" and not conv.answer.any():
            counts.dropped_no_answer += 1
            continue
        n = len(conv.ids)
        if n > limit:
            fits = [e for e in conv.answer_ends if e <= limit]
            if not fits:
                counts.dropped_long += 1
                continue
            counts.cut, counts.cut_tokens, n = counts.cut + 1, counts.cut_tokens + n - max(fits), max(fits)
        else:
            counts.kept += 1
        trained = conv.answer[:n] if loss_on == "assistant" else np.ones(n, bool)
        mask = np.zeros(n, np.float32)
        mask[:-1] = trained[1:]  # the prediction from token t is of token t + 1
        out.append((np.ascontiguousarray(conv.ids[:n], np.int32), mask))
    return out, counts


def pack_best_fit(lengths: np.ndarray, order: np.ndarray, limit: int) -> list[list[int]]:
    """Rows (lists of document ids, in placement order) of the documents taken in `order`, each
    placed into the open row with the least room left that holds it, else a new row."""
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, row id), sorted
    smallest = int(lengths.min(initial=limit))
    for d in order:
        n = int(lengths[d])
        k = bisect.bisect_left(room, (n, -1))
        if k < len(room):
            left, r = room.pop(k)
        else:
            left, r = limit, len(rows)
            rows.append([])
        rows[r].append(int(d))
        if left - n >= smallest:
            bisect.insort(room, (left - n, r))
    return rows


class ChatDataset:
    """Packed (or one-per-row) samples of tokenized conversations; see the module docstring.

    len(dataset) counts every row of the epochs built: at least num_samples (one epoch when None)."""

    def __init__(self, conversations: list[Conversation], *, seq_len: int, seed: int, loss_on: str = "assistant",
                 packing: bool = True, num_samples: int | None = None, pad_id: int = 0,
                 split_name: str = "train", name: str = "chat data"):
        self.seq_len, self.limit, self.pad_id, self.split_name = seq_len, seq_len + 1, pad_id, split_name
        self.docs, self.counts = fit_conversations(conversations, self.limit, loss_on)
        if not self.docs:
            c = self.counts
            answered = sum(conv.answered for conv in conversations)
            if c.dropped_no_answer == c.conversations and answered:  # the answers are there: the template drops them
                raise DataError(f"{name}: {answered:,} of the {split_name} split's {c.conversations:,} conversations "
                                f"hold an assistant answer, but the chat template writes none of them into the text "
                                f"it renders (or writes them where no token of the text is), so "
                                f"data.loss_on=assistant finds nothing to train on; fix the template to write each "
                                f"assistant message (or mark the answers with {{% generation %}} ... "
                                f"{{% endgeneration %}}), or set data.loss_on=all.")
            if c.dropped_no_answer == c.conversations:
                raise DataError(f"{name}: none of the {split_name} split's {c.conversations:,} conversations holds an "
                                f"assistant answer to train on (a non-empty message with role \"assistant\"), and "
                                f"data.loss_on=assistant trains on the answers only; add the answers, or set "
                                f"data.loss_on=all to train on every token.")
            also = (f" ({c.dropped_no_answer:,} more hold no assistant answer to train on)" if c.dropped_no_answer
                    else "")
            raise DataError(f"{name}: none of the {split_name} split's {c.conversations:,} conversations fits a row "
                            f"of seq_len + 1 = {self.limit} tokens{also}: {c.dropped_long:,} have no answer ending "
                            f"within it ({c.text()}); raise train.seq_len or give shorter conversations.")
        self.lengths = np.fromiter((len(t) for t, _ in self.docs), np.int64, len(self.docs))
        rng = np.random.RandomState(seed)
        rows: list[list[int]] = []
        epoch_rows: list[int] = []
        while not epoch_rows or (num_samples is not None and len(rows) < num_samples):
            order = rng.permutation(len(self.docs))
            epoch = pack_best_fit(self.lengths, order, self.limit) if packing else [[int(d)] for d in order]
            rows += [epoch[k] for k in rng.permutation(len(epoch))]
            epoch_rows.append(len(epoch))
        self.epochs = len(epoch_rows)
        self.row_offsets = np.cumsum([0] + [len(r) for r in rows], dtype=np.int64)
        self.row_docs = np.fromiter((d for r in rows for d in r), np.int64, int(self.row_offsets[-1]))
        first = self.row_docs[: self.row_offsets[epoch_rows[0]]]
        self.rows_per_epoch = epoch_rows[0]
        self.efficiency = float(self.lengths[first].sum()) / (epoch_rows[0] * self.limit)

    def __len__(self) -> int:
        return len(self.row_offsets) - 1

    def report(self) -> str:
        trained = sum(float(m.sum()) for _, m in self.docs)
        return (f"{self.split_name}: {self.counts.text()}; {len(self.docs):,} conversations "
                f"({int(self.lengths.sum()):,} tokens, {int(trained):,} trained) "
                f"in {self.rows_per_epoch:,} rows of {self.limit} tokens per epoch, {self.epochs} epoch"
                f"{'s' if self.epochs > 1 else ''}; packing efficiency {self.efficiency:.1%} "
                f"(real tokens / row tokens)")

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        i = int(i)
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} of a {self.split_name} split of {len(self)} rows")
        i %= len(self)
        out = {"tokens": np.full(self.limit, self.pad_id, np.int32),
               "segment_ids": np.empty(self.limit, np.int32),
               "positions": np.empty(self.limit, np.int32),
               "loss_mask": np.zeros(self.limit, np.float32)}
        at = 0
        for k, d in enumerate(self.row_docs[self.row_offsets[i]:self.row_offsets[i + 1]]):
            ids, mask = self.docs[int(d)]
            end = at + len(ids)
            out["tokens"][at:end], out["loss_mask"][at:end] = ids, mask
            out["segment_ids"][at:end], out["positions"][at:end] = k, np.arange(len(ids), dtype=np.int32)
            at, last = end, k
        out["segment_ids"][at:] = last + 1
        out["positions"][at:] = np.arange(self.limit - at, dtype=np.int32)
        return out
