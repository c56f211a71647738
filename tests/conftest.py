"""Tests run on 8 simulated CPU devices unless the caller already chose a device count."""

import os

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_FLAG}=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The tests compile many small programs and run each briefly: on CPU, XLA's backend without its LLVM
# optimisations compiles them several times faster (a model's initialisation: 5.6 s -> 1.0 s), and
# its older elemental emitters instead of the MLIR fusion emitters compile them ~2.5x faster again
# (the small Llama's train step on tensor 4 x data 2: 1.6 -> 0.65 s; tests/test_parity.py on two
# workers: 127 -> 73 s). Both are compile-time choices: every run in a test, the one-device
# reference included, is compiled with the same ones.
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
if os.environ["JAX_PLATFORMS"] == "cpu":
    for _flag in FAST_COMPILE:
        if _flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
            os.environ["XLA_FLAGS"] += f" {_flag}"

# Keep the embedded corpus cache of test runs out of the user's ~/.cache: a directory for the
# session, which the process that made it removes at the end (pytest-xdist's workers inherit it).
_MADE_HERE = []
if "MEGAJAX_CACHE" not in os.environ:
    import tempfile
    os.environ["MEGAJAX_CACHE"] = tempfile.mkdtemp(prefix="megajax-test-cache-")
    _MADE_HERE.append(os.environ["MEGAJAX_CACHE"])
# Many tests compile the same small programs, in this process and in the `megajax` commands they
# run: one persistent compilation cache for the session, given through the environment so the
# subprocesses inherit it (it is where `megajax train`'s own cache, ops.compile_cache, goes then).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(os.environ["MEGAJAX_CACHE"], "jax")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402  (after XLA_FLAGS and the cache's variables)
import pytest  # noqa: E402

from megajax.config import load_config  # noqa: E402

# A small model that still exercises GQA (8 query heads, 4 kv heads) and divides tensor=4.
SMALL = [
    "model.num_layers=2", "model.hidden_size=64", "model.num_heads=8", "model.num_kv_heads=4",
    "model.ffn_hidden_size=128", "train.seq_len=32", "train.global_batch=8",
    "train.log_every=1", "train.sample_tokens=0", "logging.tensorboard=false",
    "logging.progress=false", "data.corpus_max_mb=0.5", "optim.warmup_steps=1", "optim.lr=3e-3",
    "train.eval_every=0",
]


@pytest.fixture
def small_config(tmp_path):
    """Builds a small config with a fresh run directory per call; extra overrides win."""
    calls = iter(range(10**6))

    def make(*overrides, steps=3):
        return load_config(overrides=SMALL + [f"train.steps={steps}", f"train.run_dir={tmp_path / f'run{next(calls)}'}",
                                              *overrides])
    return make


def xla_flags(devices: int | None = 1) -> str:
    """XLA_FLAGS for a `megajax` subprocess on CPU: `devices` simulated devices (None: left to the
    command's mesh.cpu_devices), compiled as this session's programs are (FAST_COMPILE)."""
    count = [f"{_FLAG}={devices}"] if devices else []
    return " ".join(count + list(FAST_COMPILE))


def pytest_sessionfinish(session, exitstatus):
    import shutil
    for directory in _MADE_HERE:
        shutil.rmtree(directory, ignore_errors=True)


def pytest_report_header(config):
    return f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices"
