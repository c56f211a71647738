"""Greedy decoding (fixed-size buffer, full forward per token: simple and compile-once)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def greedy_generate(apply_fn, params, prompt_ids: list[int], num_tokens: int, context: int,
                    eod_id: int | None = None) -> list[int]:
    """Appends up to `num_tokens` greedy tokens to `prompt_ids`; the model sees the last `context`."""

    @jax.jit
    def next_token(params, buf_1xC, pos):
        logits = apply_fn(params, buf_1xC)
        return jnp.argmax(logits[0, pos - 1]).astype(jnp.int32)

    ids = list(prompt_ids)
    for _ in range(num_tokens):
        window = ids[-context:]
        buf = np.zeros((1, context), np.int32)
        buf[0, :len(window)] = window
        tok = int(next_token(params, buf, len(window)))
        if eod_id is not None and tok == eod_id:
            break
        ids.append(tok)
    return ids
