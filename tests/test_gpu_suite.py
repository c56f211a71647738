"""scripts/gpu_suite.sh: every section's code path on CPU at toy sizes (CPU_SMOKE=1), with the
packages the GPU machine lacks made unimportable; and the runner's isolation of sections."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Not on the GPU machine (it has no package registry to install them from).
BLOCKED = ("tensorboardX", "megatron")
SITECUSTOMIZE = textwrap.dedent(f"""
    import sys

    class _NotOnTheGpuMachine:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {BLOCKED!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the GPU suite test)", name=name)
            return None

    sys.meta_path.insert(0, _NotOnTheGpuMachine())
""")


def _load_suite():
    spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "scripts" / "gpu_suite.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_cpu_smoke_runs_every_section_without_the_missing_packages(tmp_path):
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(SITECUSTOMIZE)
    out = tmp_path / "results"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    # The smoke checks code paths, not speed: a budget no loaded machine runs out of (the suite's
    # own budget is tested below with sections made to overrun it).
    env.update(CPU_SMOKE="1", OUT=str(out), PYTHON=sys.executable, PYTHONPATH=str(block), SUITE_BUDGET_S="1200")
    probe = subprocess.run([sys.executable, "-c", "import tensorboardX"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "blocked by the GPU suite test" in probe.stderr  # the block works
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_suite.sh")], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=1500)
    print(p.stdout[-3000:])
    assert p.returncode == 0, p.stdout[-5000:] + p.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    status = {r["section"]: r["status"] for r in summary["sections"]}
    assert status == {"env": "ok", "attention": "ok", "ssd": "ok", "fp8": "ok", "composed": "ok",
                      "bench_llama1b_cudnn": "ok",
                      "bench_llama1b_fp8": "ok",
                      "bench_llama1b_flash": "ok",
                      "bench_llama1b_megatron": "skipped", "tp_overlap": "ok", "serve": "ok", "block_fp8": "ok"}, summary
    megatron = next(r["headline"] for r in summary["sections"] if r["section"] == "bench_llama1b_megatron")
    assert "megatron.core" in megatron or "NVIDIA GPU" in megatron, megatron  # skipped for a stated reason
    for name in status:
        assert (out / f"{name}.txt").is_file() and json.loads((out / f"{name}.json").read_text())
    attention = json.loads((out / "attention.json").read_text())
    assert attention["ok"] and all(c["ok"] for c in attention["correctness"]) and attention["timing"]
    assert "3.5 x forward" in attention["flops_convention"]
    ssd = json.loads((out / "ssd.json").read_text())  # the SSD kernels: correct, and timed against ssd_chunked
    assert ssd["ok"] and all(c["ok"] for c in ssd["correctness"])
    assert {t["impl"] for t in ssd["timing"]} == {"pallas ssd", "xla chunked"}
    composed = json.loads((out / "composed.json").read_text())
    assert composed["ok"] and len(composed["checks"]) == 2  # stage loop (flash + FP8), FP8 under SP; no cuDNN
    for impl in ("cudnn", "flash", "fp8"):
        bench = json.loads((out / f"bench_llama1b_{impl}.json").read_text())
        precision = "fp8" if impl == "fp8" else "bf16"
        assert bench["tokens_per_sec"] > 0 and "mfu" in bench and bench["layout"]["precision"] == precision
        assert bench["model"]["kv_heads"] == 2 and bench["layout"]["accumulation"] == 2
    block_fp8 = json.loads((out / "block_fp8.json").read_text())  # the blockwise kernel and mxfp8, correct and timed
    assert block_fp8["ok"] and len(block_fp8["checks"]) == 7 and all(c["ok"] for c in block_fp8["checks"])
    assert {t["impl"] for t in block_fp8["timing"] if t["ms"]} == {
        "blockwise pallas", "blockwise xla", "mxfp8", "per-tensor fp8 pallas", "bf16"}
    serve = json.loads((out / "serve.json").read_text())  # megajax serve under 1 and 2 streaming clients
    assert [c["clients"] for c in serve["modes"]["continuous"]["concurrency"]] == [1, 2]
    assert all(c["tokens"] > 0 and c["tokens_per_s"] > 0 for c in serve["modes"]["continuous"]["concurrency"])
    assert "section" in p.stdout and "total" in p.stdout.splitlines()[-1]  # the closing table
    assert summary["budget_s"] == 1200


def test_one_failing_or_hanging_section_does_not_stop_the_others(tmp_path, monkeypatch, capsys):
    suite = _load_suite()
    monkeypatch.setattr(suite, "MIN_SECTION_S", 0)
    py = sys.executable
    ctx = suite.Context(out=tmp_path, smoke=True, python=py)
    write = "import json, sys; json.dump({'x': 1}, open(sys.argv[1], 'w')); print('done')"
    sections = [
        suite.Section("fails", 5, lambda c: [py, "-c", "import sys; print('boom'); sys.exit(3)"], smoke_limit_s=5),
        suite.Section("hangs", 5, lambda c: [py, "-c", "import time; print('waiting', flush=True); time.sleep(60)"],
                      smoke_limit_s=1),
        suite.Section("absent", 5, lambda c: [py, "-c", "raise SystemExit('never run')"],
                      skip=lambda c: "needs a thing this machine lacks"),
        suite.Section("silent", 5, lambda c: [py, "-c", "pass"], smoke_limit_s=5),
        suite.Section("works", 5, lambda c: [py, "-c", write, c.json("works")], smoke_limit_s=5,
                      headline=lambda r: f"x={r['x']}"),
    ]
    t0 = time.monotonic()
    rows = [suite.run_section(s, ctx, 100, dict(os.environ)) for s in sections]
    assert time.monotonic() - t0 < 30
    assert [r["status"] for r in rows] == ["failed", "timeout", "skipped", "failed", "ok"]
    assert rows[0]["headline"] == "boom" and rows[0]["exit_status"] == 3
    assert rows[2]["headline"] == "needs a thing this machine lacks"
    assert rows[3]["headline"] == "exit 0 but no silent.json"
    assert rows[4]["headline"] == "x=1"
    assert (tmp_path / "hangs.txt").read_text() == "waiting\n"  # output kept up to the timeout
    for r in rows:  # every section leaves its .txt and .json
        assert (tmp_path / f"{r['section']}.txt").is_file()
        assert json.loads((tmp_path / f"{r['section']}.json").read_text())
    assert json.loads((tmp_path / "fails.json").read_text())["status"] == "failed"
    table = suite.summary_table(rows, 12.0)
    assert "timeout" in table and "x=1" in table and table.splitlines()[-1].startswith("total")


def test_scripts_need_no_install_and_call_python3():
    text = (ROOT / "scripts" / "gpu_suite.sh").read_text()
    assert '"${PYTHON:-python3}"' in text and "PYTHONPATH" in text
    for name in ("gpu_suite.sh", "gpu_suite.py", "gpu_bench.sh", "gpu_env.py", "gpu_check_attention.py"):
        assert "pip install" not in (ROOT / "scripts" / name).read_text(), name


@pytest.mark.parametrize("script", ["gpu_check_attention.py", "gpu_env.py"])
def test_section_scripts_run_from_any_directory_without_pythonpath(tmp_path, script):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--help"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
