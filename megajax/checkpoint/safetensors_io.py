"""A safetensors file written one tensor at a time (reading is the `safetensors` library's job).

A safetensors file is: an 8-byte little-endian header length N, N bytes of
JSON (`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`,
offsets relative to the end of the header), then the tensors' raw
little-endian bytes. The library's writers (`save_file`, `serialize_file`)
take every tensor's buffer in one call, so the whole shard would be in memory
at once; `ShardWriter` writes the header from the shapes known up front and
then appends one tensor at a time, keeping an export's peak near one tensor.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import numpy as np


_ALIGN = 8  # header padded with spaces so that the data starts 8-byte aligned


def _dtype_table() -> dict[str, np.dtype]:
    import ml_dtypes
    return {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "F64": np.dtype("<f8"),
            "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
            "U8": np.dtype("u1"), "BOOL": np.dtype("?")}


def dtype_name(dtype: np.dtype) -> str:
    for name, dt in _dtype_table().items():
        if dt == dtype:
            return name
    raise ValueError(f"no safetensors dtype for {dtype}")


class ShardWriter:
    """Writes one safetensors file whose tensors (names, shapes, dtype) are declared up front.

        w = ShardWriter(path, [(name, shape), ...], dtype)
        for name, _ in entries: w.write(name, array)   # in the declared order
        w.close()
    """

    def __init__(self, path: Path, entries: list[tuple[str, tuple[int, ...]]], dtype: np.dtype,
                 metadata: dict[str, str] | None = None):
        assert sys.byteorder == "little"
        self.dtype = np.dtype(dtype)
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        self._pending = []
        for name, shape in entries:
            size = int(np.prod(shape, dtype=np.int64)) * self.dtype.itemsize
            header[name] = {"dtype": dtype_name(self.dtype), "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            self._pending.append((name, tuple(shape)))
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(len(raw) + 8) % _ALIGN)
        self.path = path
        self.nbytes = offset
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)

    def write(self, name: str, x: np.ndarray) -> None:
        want_name, want_shape = self._pending.pop(0)
        assert name == want_name and tuple(x.shape) == want_shape, (name, x.shape, want_name, want_shape)
        x = np.ascontiguousarray(x, dtype=self.dtype)
        self._file.write(x.reshape(-1).view(np.uint8).data)

    def close(self) -> None:
        assert not self._pending, f"tensors declared but not written: {[n for n, _ in self._pending]}"
        self._file.close()
