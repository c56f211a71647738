"""What the user sees: log lines, metrics.jsonl, TensorBoard events, progress bar."""

from __future__ import annotations

import json
import os
import resource
import socket
import struct
import sys
import time
from pathlib import Path

import jax


def device_memory_gib() -> tuple[float | None, str]:
    """(GiB in use on the first local device, or host peak RSS on CPU; label)."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:
        stats = None
    if stats and "bytes_in_use" in stats:
        return stats["bytes_in_use"] / 2**30, "device"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "host peak RSS"


def format_line(r: dict, total_steps: int) -> str:
    parts = [f"step {r['step']:>{len(str(total_steps))}d}/{total_steps}",
             f"loss {r['loss']:.4f}", f"lr {r['lr']:.3e}", f"grad norm {r['grad_norm']:.3f}"]
    if r.get("loss_scale") is not None:
        parts.append(f"loss scale {r['loss_scale']:.0f}")
    if r.get("skipped_steps"):
        parts.append(f"skipped {r['skipped_steps']}")
    parts += [f"{r['tokens_per_sec']:,.0f} tok/s", f"{r['tflops_per_device']:.3f} TFLOP/s/dev",
              f"MFU {100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "MFU n/a", f"{1000 * r['step_time']:.1f} ms/step"]
    if r.get("memory_gib") is not None:
        parts.append(f"mem {r['memory_gib']:.2f} GiB")
    return " | ".join(parts)


# ----------------------------------------------------------------------------------------------
# TensorBoard scalars without tensorboardX: an event file is a TFRecord stream of `Event` protocol
# buffers (tensorflow/core/util/event.proto); scalars need only a few fields, encoded by hand.

def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # Castagnoli polynomial, reflected
        table.append(c)
    return table


_CRC32C = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC32C[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (strings and messages)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def scalar_event(tag: str, value: float, step: int, wall_time: float) -> bytes:
    """Event{wall_time=1, step=2, summary=5{value=1{tag=1, simple_value=2}}} serialized."""
    summary_value = _field(1, tag.encode()) + b"\x15" + struct.pack("<f", value)
    return (b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step & (2**64 - 1))
            + _field(5, _field(1, summary_value)))


class ScalarEventWriter:
    """Writes TensorBoard scalar events (`add_scalar`), used when tensorboardX is not installed."""

    def __init__(self, logdir: str | Path):
        Path(logdir).mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.megajax"
        self._file = open(Path(logdir) / name, "ab")
        version = b"\x09" + struct.pack("<d", time.time()) + _field(3, b"brain.Event:2")
        self._record(version)

    def _record(self, data: bytes) -> None:
        header = struct.pack("<Q", len(data))
        self._file.write(header + struct.pack("<I", masked_crc32c(header)) + data
                         + struct.pack("<I", masked_crc32c(data)))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._record(scalar_event(tag, float(value), int(step), time.time()))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def summary_writer(logdir: str | Path):
    """tensorboardX's SummaryWriter when installed, else the scalar writer above (same files)."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        return ScalarEventWriter(logdir)
    return SummaryWriter(str(logdir))


class MetricsLogger:
    """Writes each record to metrics.jsonl (and TensorBoard); prints on process 0."""

    def __init__(self, run_dir: Path, *, tensorboard: bool, progress: bool | None, total_steps: int,
                 start_step: int = 0):
        self.is_main = jax.process_index() == 0
        self.total_steps = total_steps
        self.jsonl = open(run_dir / "metrics.jsonl", "a") if self.is_main else None
        self.tb = None
        if tensorboard and self.is_main:
            self.tb = summary_writer(run_dir / "tensorboard")
        show_bar = sys.stderr.isatty() if progress is None else progress
        self.bar = None
        if show_bar and self.is_main:
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def print(self, text: str) -> None:
        if not self.is_main:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def log(self, record: dict, console: bool = True) -> None:
        if not self.is_main:
            return
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and v == v:
                    self.tb.add_scalar(f"train/{k}", v, record["step"])
            self.tb.flush()
        if console and "loss" in record:
            self.print(format_line(record, self.total_steps))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
