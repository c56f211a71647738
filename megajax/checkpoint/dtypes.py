"""The dtypes an export may store its weights in: one table for the CLI's --dtype, the Hugging Face
writer (config.json's torch_dtype, safetensors' codes) and the Megatron-Core writer (torch dtypes).

Light on purpose (numpy, ml_dtypes and torch are imported where a dtype is asked for), so that the
CLI can list the choices without importing JAX.
"""

from __future__ import annotations

from dataclasses import dataclass

from megajax.errors import CheckpointError


@dataclass(frozen=True)
class ExportDtype:
    name: str  # the --dtype / export_*(dtype=) value
    full_name: str  # numpy's (ml_dtypes' for bfloat16), torch's and transformers' config.json name
    safetensors: str  # the safetensors header's code


EXPORT_DTYPES = {d.name: d for d in (ExportDtype("bf16", "bfloat16", "BF16"),
                                     ExportDtype("fp32", "float32", "F32"),
                                     ExportDtype("fp16", "float16", "F16"))}
# A run's train.precision -> the dtype its export stores by default (fp8 trains bf16 products and keeps
# no fp8 weights).
PRECISION_EXPORT_DTYPE = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "fp8": "bf16"}


def run_export_dtype(precision: str | None) -> str:
    """The export dtype that follows a run's train.precision (fp32 when it names none: megajax's default)."""
    return PRECISION_EXPORT_DTYPE.get(precision or "fp32", "fp32")


def export_dtype(name: str) -> ExportDtype:
    """The table's entry for an export dtype name; CheckpointError naming the accepted ones."""
    try:
        return EXPORT_DTYPES[name]
    except KeyError:
        raise CheckpointError(f"export dtype={name!r} is not supported; accepted: "
                              f"{', '.join(EXPORT_DTYPES)}.") from None


def numpy_dtype(name: str):
    """The numpy dtype of an export dtype name ('bf16' is ml_dtypes' bfloat16, which JAX ships)."""
    import ml_dtypes
    import numpy as np
    full = export_dtype(name).full_name
    return np.dtype(getattr(ml_dtypes, full, None) or full)


def torch_dtype(name: str):
    """The torch dtype of an export dtype name."""
    import torch
    return getattr(torch, export_dtype(name).full_name)


def safetensors_code(dtype) -> str:
    """The safetensors header code of a numpy dtype from `numpy_dtype`."""
    for d in EXPORT_DTYPES.values():
        if d.full_name == dtype.name:
            return d.safetensors
    raise CheckpointError(f"numpy dtype {dtype.name} is not an export dtype; accepted: "
                          f"{', '.join(d.full_name for d in EXPORT_DTYPES.values())}.")
