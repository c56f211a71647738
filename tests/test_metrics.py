"""TensorBoard event files without tensorboardX: the records TensorBoard reads, checked against the
protocol buffer definitions and the TFRecord checksums."""

import struct
import sys

import pytest

from megajax.train.metrics import MetricsLogger, ScalarEventWriter, crc32c, masked_crc32c


def _records(path):
    """(data) of each TFRecord, checking both masked CRC32C checksums."""
    raw, out, i = path.read_bytes(), [], 0
    while i < len(raw):
        header = raw[i:i + 8]
        (n,), (hcrc,) = struct.unpack("<Q", header), struct.unpack("<I", raw[i + 8:i + 12])
        data = raw[i + 12:i + 12 + n]
        (dcrc,) = struct.unpack("<I", raw[i + 12 + n:i + 16 + n])
        assert hcrc == masked_crc32c(header) and dcrc == masked_crc32c(data)
        out.append(data)
        i += 16 + n
    return out


def test_crc32c_check_value():
    assert crc32c(b"123456789") == 0xE3069283  # the Castagnoli CRC's standard check value
    assert crc32c(b"") == 0


def test_scalar_events_parse_as_tensorboard_events(tmp_path):
    event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2")
    w = ScalarEventWriter(tmp_path)
    w.add_scalar("train/loss", 2.5, 7)
    w.add_scalar("train/tokens_per_sec", 123456, 2**40)
    w.close()
    [path] = tmp_path.glob("events.out.tfevents.*")
    events = [event_pb2.Event.FromString(r) for r in _records(path)]
    assert events[0].file_version == "brain.Event:2" and events[0].wall_time > 0
    got = [(e.step, v.tag, v.simple_value) for e in events[1:] for v in e.summary.value]
    assert got == [(7, "train/loss", 2.5), (2**40, "train/tokens_per_sec", 123456.0)]


def test_logger_writes_events_when_tensorboardx_is_missing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import tensorboardX -> ImportError
    log = MetricsLogger(tmp_path, tensorboard=True, progress=False, total_steps=2)
    assert isinstance(log.tb, ScalarEventWriter)
    log.log({"step": 1, "loss": 3.0, "lr": 0.1, "grad_norm": 1.0, "tokens_per_sec": 10.0,
             "tflops_per_device": 0.0, "mfu": None, "step_time": 0.5}, console=False)
    [path] = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    assert len(_records(path)) == 1 + 6  # file version + one event per finite number (mfu is None)
    log.close()
