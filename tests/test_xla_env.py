"""The XLA flags megajax's commands set before JAX starts (megajax.xla_env)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megajax import xla_env

ROOT = Path(__file__).resolve().parent.parent
CPU_OPTIONS = f"{xla_env.BACKEND_OPTIONS_FLAG}={xla_env.CPU_CODEGEN_OPTIONS}"


def test_a_cpu_run_gets_the_device_count_and_the_code_generation_options():
    env = {"JAX_PLATFORMS": "cpu"}
    flags = xla_env.prepare(8, env)
    assert flags == f"--xla_force_host_platform_device_count=8 {CPU_OPTIONS}"
    assert xla_env.prepare(8, env) == flags  # a second call adds nothing


def test_the_callers_own_flags_are_kept():
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2 "
                                                "--xla_backend_extra_options=-unroll-threshold=150"}
    assert xla_env.prepare(8, env) == env["XLA_FLAGS"] == ("--xla_force_host_platform_device_count=2 "
                                                          "--xla_backend_extra_options=-unroll-threshold=150")
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    assert xla_env.prepare(0, env) == f"--xla_dump_to=/tmp/x {CPU_OPTIONS}"


@pytest.mark.parametrize("platforms", ["cuda", "cpu,cuda", "rocm", "tpu"])
def test_no_llvm_option_where_an_accelerator_may_compile(platforms):
    """XLA hands --xla_backend_extra_options to its GPU compilers' LLVM too, so only a run that can
    only use the CPU gets it."""
    env = {"JAX_PLATFORMS": platforms}
    assert xla_env.prepare(4, env) == "--xla_force_host_platform_device_count=4"
    assert not xla_env.cpu_only(env)


def test_without_jax_platforms_the_installed_plugins_decide(monkeypatch):
    monkeypatch.setattr(xla_env, "accelerator_plugins", lambda: ["cuda12"])
    assert not xla_env.cpu_only({})
    monkeypatch.setattr(xla_env, "accelerator_plugins", lambda: [])
    assert xla_env.cpu_only({})
    assert xla_env.prepare(0, {}) == CPU_OPTIONS


CHILD = r"""
import json, os
import jax, jax.numpy as jnp, numpy as np
x = np.random.default_rng(0).normal(size=(2, 16, 4, 32, 32)).astype(np.float32)
mask = np.tril(np.ones((32, 32), bool))
# the kind of fused loop whose unrolling made the hybrid's compile slow: exp of a masked [.., 32, 32]
y = jax.jit(lambda x: jnp.exp(jnp.where(mask, x, -jnp.inf)))(x)
print(json.dumps({"err": float(np.max(np.abs(np.asarray(y) - np.where(mask, np.exp(x), 0)))),
                  "flags": os.environ.get("XLA_FLAGS", "")}))
"""


def test_xla_accepts_the_flags_it_is_given():
    """XLA aborts a process on a flag it does not parse: the flags `prepare` writes start a
    CPU process that compiles and computes as without them."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    xla_env.prepare(2, env)
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300,
                         cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert CPU_OPTIONS in got["flags"]
    assert got["err"] < 1e-5
    assert "Unknown command line argument" not in out.stderr


def _optimised_ir_bytes(tmp_path, options: str | None) -> int:
    """Bytes of the optimised LLVM IR XLA:CPU writes for CHILD's masked exp, with the given
    --xla_backend_extra_options (None: LLVM's defaults)."""
    dump = tmp_path / (options or "default").strip("-").replace("=", "_")
    flags = [f"--xla_dump_to={dump}"] + ([f"{xla_env.BACKEND_OPTIONS_FLAG}={options}"] if options else [])
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags))
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300,
                         cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    files = [p for p in dump.rglob("*exponential*ir-with-opt.ll")]
    assert files, sorted(p.name for p in dump.rglob("*.ll"))[:20]
    return sum(p.stat().st_size for p in files)


def test_the_option_stops_llvm_unrolling_the_short_loops(tmp_path):
    """What the option is for, without timing a compile: the masked exp's kernel comes out of
    LLVM several times smaller (its 32-wide loops no longer unrolled with the exp copied into
    each iteration)."""
    default = _optimised_ir_bytes(tmp_path, None)
    ours = _optimised_ir_bytes(tmp_path, xla_env.CPU_CODEGEN_OPTIONS)
    assert ours * 3 < default, (ours, default)
