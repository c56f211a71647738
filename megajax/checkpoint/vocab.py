"""Vocabulary changes between a checkpoint and the run that reads it.

Token ids mean different tokens under another tokenizer, so a checkpoint
saved with another vocabulary is refused (both vocabularies named) unless the
user sets `checkpoint.resize_vocab=true`. Then the vocabulary rows of the
embedding table [vocab, embed] and of the output layer [embed, vocab] (and of
their optimizer moments, on resume) are cropped or zero-padded to the new
padded vocabulary, and every row from the smaller of the two vocabularies on
is zero, as the model's own padding rows are.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp

from megajax.config import Config
from megajax.errors import CheckpointError

# Storage-name suffix -> vocabulary dim, for parameters and the optimizer moments named after them.
VOCAB_DIMS = {"embed.embedding": 0, "output": 1}


@dataclass(frozen=True)
class VocabResize:
    """An explicit (checkpoint.resize_vocab) change of vocabulary from `stored` ids to `vocab` ids."""
    stored: int
    stored_tokenizer: str
    vocab: int
    tokenizer: str
    padded: int  # this run's padded vocabulary (the new number of rows)

    @property
    def keep_rows(self) -> int:
        """Rows kept from the checkpoint; the rest are zero."""
        return min(self.stored, self.vocab)

    @staticmethod
    def vocab_dim(name: str) -> int | None:
        for suffix, dim in VOCAB_DIMS.items():
            if name == suffix or name.endswith("." + suffix):
                return dim
        return None

    def describe(self, names: list[str]) -> str:
        params = [n for n in names if n.startswith("params.") or ".master." in n]  # (or their fp32 copy)
        moments = " and their optimizer state" if len(names) > len(params) else ""
        return (f"checkpoint.resize_vocab: vocabulary changed from {self.stored:,} ids (data.tokenizer="
                f"{self.stored_tokenizer!r}) to {self.vocab:,} (data.tokenizer={self.tokenizer!r}); "
                f"{', '.join(params)}{moments} cropped/zero-padded to {self.padded:,} rows, rows from "
                f"{self.keep_rows:,} on zero")


def check_vocabulary(step_dir: Path, stored: dict, cfg: Config, what: str) -> VocabResize | None:
    """None when `cfg` reads the checkpoint as it is; a VocabResize when checkpoint.resize_vocab is
    set; raises CheckpointError when the vocabularies differ without it. `stored` is the config
    saved in the checkpoint's meta (a dict: only these two keys are read, so a checkpoint of an
    older config still resumes); `what` is 'resume' or 'load' (checkpoint.load), for the message."""
    old = stored.get("model", {}).get("vocab_size")
    old_tokenizer = stored.get("data", {}).get("tokenizer", "byte")
    new = cfg.model.vocab_size
    if cfg.checkpoint.resize_vocab:
        return VocabResize(old or new, old_tokenizer, new, cfg.data.tokenizer, cfg.model.padded_vocab_size())
    if old is None or new is None or old == new:
        return None
    reading = (f"resuming from {step_dir}" if what == "resume" else f"checkpoint.load reads {step_dir}")
    raise CheckpointError(
        f"{reading}, whose vocabulary has {old:,} ids (data.tokenizer={old_tokenizer!r}, "
        f"model.vocab_size={old}), but this run's has {new:,} ids (data.tokenizer={cfg.data.tokenizer!r}, "
        f"model.vocab_size={new}); token ids would mean other tokens. Use the checkpoint's tokenizer and "
        f"vocabulary size, or set checkpoint.resize_vocab=true to crop or zero-pad the embedding and "
        f"output rows{' and their optimizer state' if what == 'resume' else ''} to the new vocabulary.")


def zero_rows_from(x: jax.Array, dim: int, keep: int) -> jax.Array:
    """x with every index >= keep along `dim` set to zero, in x's sharding."""
    def mask(a):
        return jnp.where(jax.lax.broadcasted_iota(jnp.int32, a.shape, dim) < keep, a, jnp.zeros((), a.dtype))
    return jax.jit(mask, out_shardings=x.sharding)(x)
