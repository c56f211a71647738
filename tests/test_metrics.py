"""metrics.jsonl and TensorBoard: strict JSON, resumed runs, and a run without tensorboardX."""

import json
import sys

from megajax.train.metrics import MetricsLogger

RECORD = {"step": 1, "loss": 3.0, "lr": 0.1, "grad_norm": float("nan"), "tokens_per_sec": 10.0,
          "tflops_per_device": 0.0, "mfu": None, "step_time": 0.5}


def test_without_tensorboardx_the_run_logs_jsonl_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import tensorboardX -> ImportError
    log = MetricsLogger(tmp_path, tensorboard=True, progress=False, total_steps=2)
    log.log(RECORD, console=False)
    log.close()
    assert "need tensorboardX" in capsys.readouterr().out
    assert not (tmp_path / "tensorboard").exists()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["grad_norm"] is None


def test_resumed_logger_drops_records_after_its_step(tmp_path):
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3)] + ['{"step": 4, "lo']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    MetricsLogger(tmp_path, tensorboard=False, progress=False, total_steps=9, start_step=2, resumed=True).close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_figures_are_readable_at_every_size():
    from megajax.train.metrics import format_line, readable_bytes, readable_percent, readable_rate
    assert readable_rate(2.75e10) == "27.5 GFLOP/s" and readable_rate(4.1e14) == "410 TFLOP/s"
    assert readable_rate(1.96e10) == "19.6 GFLOP/s" and readable_rate(3e6) == "3 MFLOP/s"
    assert readable_bytes(716 * 2**20) == "716 MiB" and readable_bytes(1.05 * 2**30) == "1.05 GiB"
    assert readable_bytes(512) == "512 B"
    assert readable_percent(0.076) == "7.6%" and readable_percent(0.00012) == "0.012%"
    assert readable_percent(0.0) == "0.0%"
    line = format_line(dict(RECORD, grad_norm=1.0, tflops_per_device=0.0275, mfu=0.00012, memory_gib=0.7,
                            consumed_samples=1234, skipped_steps=0), total_steps=2)
    for part in ("consumed samples 1,234", "skipped 0", "27.5 GFLOP/s/dev", "MFU 0.012%", "717 MiB"):
        assert part in line, line
