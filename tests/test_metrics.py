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
