"""The committed FP8 convergence record (docs/fp8/convergence.json, written by
scripts/fp8_vs_bf16.py over 300 steps): it is the script's format, each recipe's verdict is the
script's, each recipe meets the bar against bf16 on every model recorded (final loss within 1.5 %,
finite, no skipped step) except the misses listed in MISSES, which are strict expected failures
(a record that meets the bar there fails the test until the entry goes), and
docs/fp8-and-kernels.md's table is the script's table of this record. No training here."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "docs" / "fp8" / "convergence.json"
# (model, recipe) -> the measured miss (docs/fp8-and-kernels.md#convergence-against-bf16)
MISSES = {
    ("quickstart", "blockwise"): "final loss +1.60 % of bf16's (over steps 200-300: +1.2 % a step)",
}
PAIRS = [(model, recipe) for model, runs in json.loads(RECORD.read_text())["models"].items()
         for recipe in runs if recipe != "bf16"]


def _script():
    spec = importlib.util.spec_from_file_location("fp8_vs_bf16", ROOT / "scripts" / "fp8_vs_bf16.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_record_is_the_scripts_format():
    script = _script()
    record = json.loads(RECORD.read_text())
    assert record["steps"] == 300 and record["bar"] == script.BAR == 0.015
    assert record["final_window"] == script.FINAL_WINDOW
    assert "quickstart" in record["models"] and set(record["models"]) <= set(script.MODELS)
    for model, runs in record["models"].items():
        assert set(runs) == {"bf16", *script.RECIPES}, model          # bf16 and all four recipes
        for name, curve in runs.items():
            assert len(curve["losses"]) == len(curve["grad_norms"]) == 300, (model, name)
            assert all(math.isfinite(x) for x in curve["losses"] + curve["grad_norms"]), (model, name)
            assert curve["skipped_steps"] == 0, (model, name)
        # It learned: the final loss well under the first.
        assert script.final_loss(runs["bf16"]) < 0.8 * runs["bf16"]["losses"][0], model
        for recipe in script.RECIPES:
            v = script.verdict(runs[recipe], runs["bf16"])
            assert v == runs[recipe]["verdict"], (model, recipe)     # the verdict stored is the script's
            assert v["finite"] and v["skipped_steps"] == 0, (model, recipe)
            assert runs[recipe]["losses"] != runs["bf16"]["losses"], (model, recipe)  # an FP8 run, not bf16's


@pytest.mark.parametrize("model, recipe", [
    pytest.param(m, r, marks=[pytest.mark.xfail(strict=True, reason=MISSES[m, r])] if (m, r) in MISSES else [])
    for m, r in PAIRS], ids=[f"{m}-{r}" for m, r in PAIRS])
def test_final_loss_within_the_bar_of_bf16(model, recipe):
    script = _script()
    runs = json.loads(RECORD.read_text())["models"][model]
    v = script.verdict(runs[recipe], runs["bf16"])
    assert v["ok"] and abs(v["final_rel"]) <= 0.015, v


def test_docs_table_is_the_records():
    table = _script().markdown(json.loads(RECORD.read_text()))
    docs = (ROOT / "docs" / "fp8-and-kernels.md").read_text()
    assert table in docs
    assert (ROOT / "docs" / "fp8" / "convergence.png").is_file()
