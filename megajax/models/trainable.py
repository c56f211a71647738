"""Which parameters train: one predicate over parameter paths ('/'-joined dict keys, `layers/attn/qkv/kernel`)
for every way of freezing part of a model.

- model.lora: the base model is frozen; the adapters train (megajax/models/lora.py), and so does a
  vision-language model's projector (and its encoder unless model.vision.freeze).
- model.vision.freeze: the image encoder (`vision/...`) is frozen.
- model.freeze_language_model: the language model (everything but `vision/...` and `projector/...`).

A frozen parameter takes no gradient and no optimizer state. Where it lives: with model.lora the frozen
base is outside the train state (TrainState.frozen; checkpoints record where it comes from, `lora_base`),
and the state's parameters all train (`split_frozen`); otherwise the frozen parameters stay in the train
state, under a stop-gradient, and the optimizer is masked off them (make_optimizer's `frozen`).
"""

from __future__ import annotations

from typing import Callable

from megajax.config import ModelConfig
from megajax.models.lora import is_adapter

VISION, PROJECTOR = "vision/", "projector/"


def frozen_parameters(m: ModelConfig) -> Callable[[str], bool] | None:
    """path -> whether the parameter is frozen (no gradient, no optimizer state); None: every one trains."""
    v = m.vision
    freeze_vision = v is not None and v.freeze
    if not (freeze_vision or m.freeze_language_model or m.lora is not None):
        return None

    def frozen(path: str) -> bool:
        if v is not None and path.startswith(VISION):
            return freeze_vision
        if v is not None and path.startswith(PROJECTOR):
            return False
        if m.lora is not None:
            return not is_adapter(tuple(path.split("/")))
        return m.freeze_language_model

    return frozen


def frozen_in_state(m: ModelConfig) -> Callable[[str], bool] | None:
    """The frozen parameters among the train state's own (TrainState.params): none with model.lora (its
    frozen base is outside the state), else frozen_parameters'."""
    return None if m.lora is not None else frozen_parameters(m)


def split_frozen(tree: dict, frozen: Callable[[str], bool]) -> tuple[dict, dict]:
    """(the trainable part, the frozen part) of a nested dict keyed like the parameters (their values,
    shapes or axes)."""
    flat = _flat(tree)
    return (_nest({p: v for p, v in flat.items() if not frozen("/".join(p))}),
            _nest({p: v for p, v in flat.items() if frozen("/".join(p))}))


def join(frozen: dict | None, trainable: dict) -> dict:
    """split_frozen undone: one nested dict."""
    if not frozen:
        return trainable
    return _nest({**_flat(frozen), **_flat(trainable)})


def _flat(tree: dict, prefix: tuple = ()) -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def _nest(flat: dict) -> dict:
    out: dict = {}
    for path, v in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return out
