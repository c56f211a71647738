"""Time to the first step: the persistent compilation cache (ops.compile_cache) and what the log says
of it, the model's initialisation read back from the cache bit for bit, and the start-up's fast paths
(the embedded corpus's file list, tensorboardX without PyTorch)."""

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import SMALL, xla_flags
from megajax.compile_cache import cache_directory
from megajax.config import user_cache_dir
from megajax.data.corpus import SKIPPED, stdlib_files

ROOT = Path(__file__).resolve().parent.parent


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XLA_FLAGS=xla_flags(),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")  # this tiny model's programs compile fast
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env.update(extra)
    return env


def _train(run_dir: Path, *overrides: str, env: dict) -> subprocess.CompletedProcess:
    args = [*SMALL, "train.steps=1", "train.eval_every=1", "train.eval_steps=1", "data.split=90,10,0",
            f"train.run_dir={run_dir}", *overrides]
    p = subprocess.run([sys.executable, "-m", "megajax.cli", "train", *args], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr
    return p


def _line(out: str, start: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(start))


def test_a_second_run_reads_its_programs_from_the_cache_and_says_so(tmp_path):
    cache = tmp_path / "jit"
    env = _env()
    first = _train(tmp_path / "a", f"ops.compile_cache={cache}", env=env).stdout
    assert "not in the compilation cache yet" in _line(first, "megajax: compiled the train step in")
    assert any(cache.iterdir())
    second = _train(tmp_path / "b", f"ops.compile_cache={cache}", env=env).stdout  # a fresh process
    for start in ("megajax: train state ready in", "megajax: compiled the train step in",
                  "megajax: compiled and ran the first evaluation batch in"):
        assert _line(second, start).endswith("(from the compilation cache)"), start
    # The programs read back compute what the compiled ones did.
    timing = ("tokens_per_sec", "tflops_per_device", "mfu", "step_time", "data_wait", "memory_gib")
    a, b = ([{k: v for k, v in json.loads(line).items() if k not in timing}
             for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()] for run in "ab")
    assert a == b and any("val_loss" in r for r in a)


def test_the_cache_is_off_when_configured_so(tmp_path):
    cache = tmp_path / "jit"  # where JAX would put it: must stay empty
    p = _train(tmp_path / "run", "ops.compile_cache=false", "train.eval_every=0",
               env=_env(JAX_COMPILATION_CACHE_DIR=str(cache)))
    assert _line(p.stdout, "megajax: compiled the train step in").endswith("(compilation cache off)")
    assert not cache.exists() or not any(cache.iterdir())


_INIT = """
import hashlib, sys
import jax, numpy as np
from megajax import compile_cache
compile_cache.enable(sys.argv[1] if sys.argv[1] != "off" else False)
from megajax.config import load_config
from megajax.plan import make_plan
from megajax.train.setup import build_setup
cfg = load_config(overrides=sys.argv[2:])
setup = build_setup(make_plan(cfg, jax.device_count()))
with compile_cache.CompileWatch() as watch:
    state = jax.block_until_ready(setup.fresh_state())
digest = hashlib.sha256()
for leaf in jax.tree.leaves(jax.device_get(state)):
    digest.update(np.ascontiguousarray(leaf).tobytes())
print(watch.source(), "|", digest.hexdigest())
"""


def test_the_initialisation_read_from_the_cache_equals_the_compiled_one_bit_for_bit(tmp_path):
    """The fresh train state (parameters, optimizer state, RNG) is one program; read back from the
    cache in a new process it gives the same bits as compiled, and as with the cache off."""
    def init(cache: str) -> tuple[str, str]:
        p = subprocess.run([sys.executable, "-c", _INIT, cache, *SMALL], capture_output=True, text=True,
                           env=_env(), cwd=ROOT, timeout=600)
        assert p.returncode == 0, p.stderr
        source, digest = p.stdout.strip().splitlines()[-1].split(" | ")
        return source, digest

    cache = str(tmp_path / "jit")
    compiled, cached, off = init(cache), init(cache), init("off")
    assert compiled[0] == "compiled; not in the compilation cache yet"
    assert cached[0] == "from the compilation cache"
    assert off[0] == "compilation cache off"
    assert compiled[1] == cached[1] == off[1]


def test_cache_directory_follows_the_setting_and_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("MEGAJAX_CACHE", str(tmp_path / "m"))
    assert cache_directory(True) == tmp_path / "m" / "jax"
    monkeypatch.delenv("MEGAJAX_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache_dir() == tmp_path / "xdg" / "megajax"
    assert cache_directory(True) == tmp_path / "xdg" / "megajax" / "jax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_directory(True) == Path.home() / ".cache" / "megajax" / "jax"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "j"))
    assert cache_directory(True) == tmp_path / "j"
    assert cache_directory(str(tmp_path / "d")) == tmp_path / "d"
    assert cache_directory(False) is None and cache_directory("") is None


def test_the_config_key_takes_true_false_and_a_directory():
    from megajax.config import load_config
    assert load_config().ops.compile_cache is True
    assert load_config(overrides=["ops.compile_cache=false"]).ops.compile_cache is False
    assert load_config(overrides=["ops.compile_cache="]).ops.compile_cache == ""
    assert load_config(overrides=["ops.compile_cache=/tmp/x"]).ops.compile_cache == "/tmp/x"


def test_stdlib_files_are_the_full_listings_files():
    """The pruned walk finds the files a full recursive listing, filtered, finds, in the same order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    listed = [p for p in sorted(root.rglob("*.py")) if p.is_file()
              and not any(part in SKIPPED for part in p.relative_to(root).parts)]
    for cap in (0.3, 8.0):
        files = stdlib_files(int(cap * 2**20))
        assert files and files == listed[:len(files)]
        total = sum(f.stat().st_size for f in files)
        assert total <= cap * 2**20 and (len(files) == len(listed)
                                        or total + listed[len(files)].stat().st_size > cap * 2**20)


def test_tensorboard_events_are_written_without_loading_pytorch(tmp_path):
    pytest.importorskip("tensorboardX")
    script = ("import sys; from pathlib import Path; from megajax.train.metrics import MetricsLogger\n"
              "log = MetricsLogger(Path(sys.argv[1]), tensorboard=True, progress=False, total_steps=1)\n"
              "log.log({'step': 1, 'loss': 2.5}, console=False); log.close()\n"
              "print('torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                       env=_env(), cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "False"
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and b"train/loss" in events[0].read_bytes()
