"""A small model with random weights and the real parameter tree, shared by the export tests
(tests/test_export.py) and the generation tests (tests/test_generate.py)."""

from __future__ import annotations

import functools

import numpy as np

from megajax.checkpoint.source import flatten, unflatten
from megajax.config import load_config
from megajax.train.state import build_model_spec

VOCAB = 257  # the byte tokenizer's


@functools.lru_cache(maxsize=None)
def random_model(family: str = "llama", *overrides: str, std: float = 0.05, seq_len: int = 32, seed: int = 0):
    """(config, spec, params): 2 layers, hidden 64, 8 query heads (4 kv heads for llama: GQA), ffn 128, the
    byte tokenizer's vocabulary, `overrides` on top; every parameter drawn from N(0, std) (norm scales near
    1, biases nonzero), the vocabulary padding zero as training keeps it. Cached: do not mutate."""
    heads = ["model.num_kv_heads=4"] if family == "llama" else []
    cfg = load_config(overrides=[f"model.family={family}", "model.num_layers=2", "model.hidden_size=64",
                                 "model.num_heads=8", *heads, "model.ffn_hidden_size=128",
                                 f"model.vocab_size={VOCAB}", f"train.seq_len={seq_len}", *overrides])
    spec, _ = build_model_spec(cfg, cfg.model.padded_vocab_size())
    return cfg, spec, unflatten(random_weights(spec, std, np.random.default_rng(seed)))


def random_weights(spec, std: float, rng: np.random.Generator) -> dict:
    """{name: array} of a ModelSpec's parameters drawn from N(0, std) with `rng` (norm scales near 1), the
    padding of a VOCAB-token vocabulary zero."""
    flat = {}
    for name, x in flatten(spec.abstract_params):
        w = rng.normal(0.0, std, x.shape).astype(np.float32) + (1.0 if name.endswith("/scale") else 0.0)
        if name == "embed/embedding":
            w[VOCAB:] = 0
        if name == "output":
            w[:, VOCAB:] = 0
        flat[name] = w
    return flat
