"""Streaming safetensors files, written and read without holding more than one tensor.

A safetensors file is: an 8-byte little-endian header length N, N bytes of
JSON (`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`,
offsets relative to the end of the header), then the tensors' raw
little-endian bytes. The `safetensors` library writes a whole dict at once;
`ShardWriter` instead writes the header from the shapes known up front and
then appends one tensor at a time.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import numpy as np

from megajax.errors import CheckpointError

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


def read_header(path: Path) -> tuple[dict, int]:
    """(tensor entries, byte offset of the data) of a safetensors file."""
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            if n > 100 * 2 ** 20:
                raise ValueError(f"header length {n} is implausible")
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise CheckpointError(f"{str(path)!r} is not a readable safetensors file ({e}).") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def read_tensor(path: Path, entry: dict, data_start: int) -> np.ndarray:
    """One tensor of a safetensors file as float32 (memory-mapped read of just its bytes)."""
    table = _dtype_table()
    if entry["dtype"] not in table:
        raise CheckpointError(f"{str(path)!r}: tensor dtype {entry['dtype']} is not supported "
                              f"(accepted: {', '.join(table)}).")
    dtype = table[entry["dtype"]]
    begin, end = entry["data_offsets"]
    shape = tuple(entry["shape"])
    if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
        raise CheckpointError(f"{str(path)!r}: a tensor's data_offsets {begin}..{end} do not fit its "
                              f"shape {list(shape)} and dtype {entry['dtype']}.")
    if end == begin:
        return np.zeros(shape, np.float32)
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start + begin, shape=(end - begin,))
    return mm.view(dtype).reshape(shape).astype(np.float32)
