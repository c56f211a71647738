"""What the exporters and importers share: the parameter layout a ModelConfig implies,
the architecture as config overrides, output dtypes, and crash-safe output directories.

Layout of a megajax parameter tree (names are '/'-joined paths; stacked layer
tensors carry the layer as dim 0; kernels are [in..., out...]):

    embed/embedding          [Vp, D]      Vp >= vocab_size; rows >= vocab_size are zero
    pos_embed                [P, D]       learned positions only
    layers/attn_norm/scale   [L, D]       (+ bias for LayerNorm); mlp_norm the same
    layers/attn/q/kernel     [L, D, H, hd]    k, v: [L, D, KV, hd]    o: [L, H, hd, D]
    layers/attn/q/bias       [L, H, hd]       k, v: [L, KV, hd]       o: [L, D]
    layers/mlp/gate|up/kernel [L, D, F]  (swiglu)   fc1/kernel [L, D, F] (gelu)
    layers/mlp/fc2/kernel    [L, F, D]    biases: gate|up|fc1 [L, F], fc2 [L, D]
    final_norm/scale         [D]          (+ bias)
    output                   [D, Vp]      untied embeddings only
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from pathlib import Path
from typing import Iterator

import numpy as np

from megajax.config import ModelConfig
from megajax.errors import CheckpointError

DTYPES = ("bf16", "fp32")

# ModelConfig fields that describe the architecture (what an importer hands back).
ARCH_FIELDS = (
    "family", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "ffn_hidden_size",
    "vocab_size", "max_position_embeddings", "norm", "activation", "position_embedding", "use_bias",
    "tie_embeddings", "norm_eps", "rope_theta", "rope_scaling", "rope_scaling_factor",
    "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_position",
    "hidden_dropout", "attention_dropout", "init_std",
)


def numpy_dtype(dtype: str):
    """The numpy dtype of an export dtype name ('bf16' is ml_dtypes' bfloat16, which JAX ships)."""
    if dtype == "fp32":
        return np.dtype(np.float32)
    if dtype == "bf16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    raise CheckpointError(f"export dtype={dtype!r} is not supported; accepted: {', '.join(DTYPES)}.")


def param_shapes(m: ModelConfig, padded_vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of a model with resolved config `m`."""
    d, n, h, kv, hd, f = (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim,
                          m.ffn_hidden_size)
    shapes = {"embed/embedding": (padded_vocab_size, d)}
    if m.position_embedding == "learned":
        shapes["pos_embed"] = (m.max_position_embeddings, d)
    for norm in ("layers/attn_norm", "layers/mlp_norm", "final_norm"):
        lead = (n,) if norm.startswith("layers/") else ()
        shapes[f"{norm}/scale"] = lead + (d,)
        if m.norm == "layernorm":
            shapes[f"{norm}/bias"] = lead + (d,)
    a = "layers/attn"
    shapes.update({f"{a}/q/kernel": (n, d, h, hd), f"{a}/k/kernel": (n, d, kv, hd),
                   f"{a}/v/kernel": (n, d, kv, hd), f"{a}/o/kernel": (n, h, hd, d)})
    if m.use_bias:
        shapes.update({f"{a}/q/bias": (n, h, hd), f"{a}/k/bias": (n, kv, hd),
                       f"{a}/v/bias": (n, kv, hd), f"{a}/o/bias": (n, d)})
    columns = ("gate", "up") if m.activation == "swiglu" else ("fc1",)
    for c in columns:
        shapes[f"layers/mlp/{c}/kernel"] = (n, d, f)
        if m.use_bias:
            shapes[f"layers/mlp/{c}/bias"] = (n, f)
    shapes["layers/mlp/fc2/kernel"] = (n, f, d)
    if m.use_bias:
        shapes["layers/mlp/fc2/bias"] = (n, d)
    if not m.tie_embeddings:
        shapes["output"] = (d, padded_vocab_size)
    return shapes


def check_source(source) -> int:
    """Checks that `source` holds exactly the parameters its model config implies; returns its padded vocab.

    Raises CheckpointError naming missing or unknown tensors, or the first shape that differs.
    """
    m = source.model
    names = set(source.names())
    if "embed/embedding" not in names:
        raise CheckpointError("the checkpoint has no tensor 'embed/embedding' (the token embedding); "
                              f"it holds: {', '.join(sorted(names)) or 'nothing'}.")
    padded = source.shape("embed/embedding")[0]
    if padded < m.vocab_size:
        raise CheckpointError(f"embed/embedding has {padded} rows, fewer than model.vocab_size="
                              f"{m.vocab_size}.")
    want = param_shapes(m, padded)
    missing = sorted(set(want) - names)
    unknown = sorted(names - set(want))
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"missing tensors {', '.join(missing)}")
        if unknown:
            parts.append(f"tensors the exporter does not know {', '.join(unknown)}")
        raise CheckpointError(f"the checkpoint does not match its model config (family={m.family}, "
                              f"norm={m.norm}, activation={m.activation}, position_embedding="
                              f"{m.position_embedding}, use_bias={m.use_bias}, tie_embeddings="
                              f"{m.tie_embeddings}): {'; '.join(parts)}.")
    for name, shape in want.items():
        got = tuple(source.shape(name))
        if got != shape:
            raise CheckpointError(f"tensor {name} has shape {list(got)}, but the model config implies "
                                  f"{list(shape)} (num_layers={m.num_layers}, hidden_size={m.hidden_size}, "
                                  f"num_heads={m.num_heads}, num_kv_heads={m.num_kv_heads}, head_dim="
                                  f"{m.head_dim}, ffn_hidden_size={m.ffn_hidden_size}).")
    return padded


def model_overrides(m: ModelConfig) -> dict:
    """The architecture fields of a resolved ModelConfig, as `model.<field>` values."""
    out = {k: getattr(m, k) for k in ARCH_FIELDS}
    if m.rope_scaling == "none" or m.position_embedding != "rope":
        for k in ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                  "rope_original_max_position"):
            out.pop(k)
    return out


def resolved_model(overrides: dict) -> ModelConfig:
    """ModelConfig from importer overrides, resolved (without a train config)."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    m = ModelConfig(**{k: v for k, v in overrides.items() if k in fields})
    m.resolve(seq_len=m.max_position_embeddings or 1)
    return m


def padded_zeros(x: np.ndarray, size: int, axis: int) -> np.ndarray:
    """`x` padded with zeros along `axis` to `size` (or cut to it)."""
    if x.shape[axis] >= size:
        return x[(slice(None),) * axis + (slice(0, size),)]
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return np.pad(x, pad)


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | os.PathLike) -> Iterator[Path]:
    """Yields a temporary directory beside `out_dir` that becomes `out_dir` only on success.

    A crash never leaves a half-written export under the final name. `out_dir`
    may exist only if it is empty.
    """
    out = Path(out_dir).expanduser().absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"output directory {str(out)!r} already exists and is not empty; "
                              f"choose a new directory or remove it.")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
