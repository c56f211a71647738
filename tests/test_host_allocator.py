"""MEGAJAX_HOST_ALLOCATOR=tuned (megajax/host_allocator.py): when it leaves glibc alone, and that
the tuned allocator lets a repeated program reuse its freed buffers, which the system's does not."""

import subprocess
import sys
import textwrap

import pytest

from megajax import host_allocator


def test_tuned_only_when_asked_and_the_user_chose_nothing_else():
    assert host_allocator.reason_to_leave({}) == "MEGAJAX_HOST_ALLOCATOR=tuned not set"
    assert host_allocator.reason_to_leave({"MEGAJAX_HOST_ALLOCATOR": "system"}) == \
        "MEGAJAX_HOST_ALLOCATOR=tuned not set"
    assert host_allocator.reason_to_leave({"MEGAJAX_HOST_ALLOCATOR": "tuned"}) is None
    tuned = {"MEGAJAX_HOST_ALLOCATOR": "tuned"}
    assert "MALLOC_ARENA_MAX" in host_allocator.reason_to_leave({**tuned, "MALLOC_ARENA_MAX": "4"})
    assert "MALLOC_TRIM_THRESHOLD_" in host_allocator.reason_to_leave({**tuned, "MALLOC_TRIM_THRESHOLD_": "0"})
    assert "jemalloc" in host_allocator.reason_to_leave({**tuned, "LD_PRELOAD": "/usr/lib/libjemalloc.so.2"})
    bad = host_allocator.reason_to_leave({"MEGAJAX_HOST_ALLOCATOR": "fast"})
    assert "'fast'" in bad and "tuned, system" in bad


# One process: tune (or not), then run a program with 128 MiB of temporaries ten times; the fewest
# page faults of a run after the first two. The tuned allocator does not reuse the block every
# time (when a small allocation took the start of its hole, the heap grows instead), but it
# does in most runs; the system's allocator never does.
PROBE = textwrap.dedent("""
    import resource
    from megajax import host_allocator
    print(host_allocator.tune())
    import jax, jax.numpy as jnp
    f = jax.jit(lambda x: (jnp.exp(jnp.sin(x) * 2.0) @ jnp.ones((4096, 8))).sum())
    x = jnp.ones((8192, 4096))
    faults = []
    for i in range(10):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        f(x).block_until_ready()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(min(faults[2:]))
""")


def _faults_per_run(setting: str) -> tuple[str, int]:
    env = {"MEGAJAX_HOST_ALLOCATOR": setting, "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    described, faults = out.stdout.strip().splitlines()[-2:]
    return described, int(faults)


@pytest.mark.skipif(host_allocator._glibc() is None, reason="glibc's malloc only")
def test_tuned_allocator_reuses_a_programs_buffers():
    described, tuned = _faults_per_run("tuned")
    assert described.startswith("glibc malloc tuned: one arena"), described
    system_described, system = _faults_per_run("system")
    assert system_described == "system default (MEGAJAX_HOST_ALLOCATOR=tuned not set)"
    # 128 MiB of temporaries first-touched again each run: ~32,000 pages with the system's allocator.
    assert system > 10_000, system
    assert tuned < 1_000, tuned
