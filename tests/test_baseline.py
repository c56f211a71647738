"""`megajax bench --baseline`: checked before anything is built, and JAX leaves GPU memory to the
PyTorch baseline sharing the device."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megajax.errors import ConfigError
from megajax.perf import baseline

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(Path("/proc/driver/nvidia/gpus").is_dir(), reason="this machine has an NVIDIA GPU")
def test_megatron_baseline_without_a_gpu_fails_before_the_megajax_bench(tmp_path):
    cache = tmp_path / "cache"  # the bench would build its embedded corpus here first
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", MEGAJAX_CACHE=str(cache),
               XLA_FLAGS="--xla_force_host_platform_device_count=1")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "megajax.cli", "bench", "--baseline", "megatron"], env=env,
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - t0
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("megajax bench: error: --baseline megatron runs Megatron-Core on an NVIDIA GPU")
    assert "--baseline torch" in p.stderr and "Traceback" not in p.stderr
    assert p.stdout == "" and not cache.exists(), "the megajax bench ran first"
    assert elapsed < 60, elapsed


def test_baseline_on_a_gpu_keeps_jax_from_preallocating(monkeypatch):
    monkeypatch.setattr(baseline, "_nvidia_gpus", lambda environ: 1)
    env: dict[str, str] = {}
    baseline.check_baseline("torch", env)
    assert env == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    # A choice the user made stays (setting both fractions is an error in JAX 0.11).
    env = {"XLA_CLIENT_MEM_FRACTION": ".4"}
    baseline.check_baseline("torch", env)
    assert env == {"XLA_CLIENT_MEM_FRACTION": ".4"}
    # Without a GPU nothing changes.
    monkeypatch.setattr(baseline, "_nvidia_gpus", lambda environ: 0)
    env = {}
    baseline.check_baseline("torch", env)
    assert env == {}


def test_missing_packages_are_named(monkeypatch):
    monkeypatch.setattr(baseline, "_nvidia_gpus", lambda environ: 1)
    monkeypatch.setattr(baseline, "_installed", lambda module: module == "torch")
    with pytest.raises(ConfigError, match=r"--baseline megatron needs megatron.core \(pip install megatron-core"):
        baseline.check_baseline("megatron", {})
    with pytest.raises(ConfigError, match=r"--baseline torch needs transformers"):
        baseline.check_baseline("torch", {})
    with pytest.raises(ConfigError, match="accepted values are torch, megatron"):
        baseline.check_baseline("deepspeed", {})
