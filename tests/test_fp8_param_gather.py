"""precision.fp8_param_gather: under FSDP the FP8 products' weights are all-gathered as their float8
copies (bytes) instead of in a float type, read from the compiled train step of the small Llama
on FSDP 4 x data 2. No step runs."""

import re

import jax
import numpy as np
import pytest

from megajax.train.loop import build_trainer
from test_fp8_training import FP8

BYTES = {"f32": 4, "bf16": 2, "f16": 2, "u8": 1, "s32": 4}
GATHER = re.compile(r"= (\w+)\[([\d,]+)\]\S* all-gather(?:-start)?\(")


def _gathered(cfg) -> dict[str, int]:
    """Bytes the compiled step all-gathers per element type, of arrays of rank 2 or more."""
    tr = build_trainer(cfg, jax.devices())
    text = tr.step_fn.as_text()
    out: dict[str, int] = {}
    for m in GATHER.finditer(text):
        dims = [int(d) for d in m.group(2).split(",")]
        if len(dims) >= 2:
            out[m.group(1)] = out.get(m.group(1), 0) + int(np.prod(dims)) * BYTES[m.group(1)]
    return out


@pytest.mark.parametrize("recipe", ["current", "blockwise"])
def test_fp8_param_gather_gathers_the_float8_weights(small_config, recipe):
    layout = [*FP8, f"precision.fp8_recipe={recipe}", "mesh.fsdp=4", "mesh.data=2"]
    plain = _gathered(small_config(*layout))
    fp8 = _gathered(small_config(*layout, "precision.fp8_param_gather=true"))
    assert "u8" not in plain and fp8.get("u8", 0) > 0
    # The FP8 products' weights (qkv [64, 128], out projection [64, 64], fc1 [64, 256], fc2 [128, 64];
    # the layers' scan body gathers one layer's at a time) move as one byte a value; what stays in a
    # float type (the embedding, norms) is gathered as before.
    weights = 64 * (128 + 64 + 256) + 128 * 64
    assert fp8["u8"] == weights
    float_plain = sum(v for k, v in plain.items() if k != "u8")
    float_fp8 = sum(v for k, v in fp8.items() if k != "u8")
    assert float_plain - float_fp8 >= 2 * weights            # at least 2 bytes a value fewer
    assert sum(fp8.values()) <= sum(plain.values()) / 2
