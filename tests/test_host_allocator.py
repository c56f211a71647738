"""The `megajax` command's host allocator (megajax/host_allocator.py): when it restarts with
huge-page malloc, that the restart happens (the train log says so), and that huge pages take a
repeated program's page faults from tens of thousands to a few hundred."""

import subprocess
import sys
import textwrap

import pytest
from conftest import xla_flags

from megajax import host_allocator

GLIBC = host_allocator.glibc_version()
THP = host_allocator.transparent_huge_pages()
SUPPORTED = host_allocator.reason_to_leave({}, GLIBC, THP) is None


def test_when_the_command_restarts_with_huge_pages():
    ok = ((2, 36), "madvise")
    assert host_allocator.reason_to_leave({}, *ok) is None
    assert host_allocator.reason_to_leave({"MEGAJAX_HOST_ALLOCATOR": "hugepages"}, *ok) is None
    assert host_allocator.reason_to_leave({"MEGAJAX_HOST_ALLOCATOR": "system"}, *ok) == "MEGAJAX_HOST_ALLOCATOR=system"
    bad = host_allocator.reason_to_leave({"MEGAJAX_HOST_ALLOCATOR": "fast"}, *ok)
    assert "'fast'" in bad and "hugepages, system" in bad
    done = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}  # the user's, or the restart already made
    assert "GLIBC_TUNABLES sets glibc.malloc.hugetlb" == host_allocator.reason_to_leave(done, *ok)
    assert "jemalloc" in host_allocator.reason_to_leave({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, *ok)
    assert "2.31" in host_allocator.reason_to_leave({}, (2, 31), "madvise")
    assert "glibc" in host_allocator.reason_to_leave({}, None, "madvise")
    assert "never" in host_allocator.reason_to_leave({}, (2, 36), "never")
    assert host_allocator.tunables_with_huge_pages("") == "glibc.malloc.hugetlb=1"
    assert host_allocator.tunables_with_huge_pages("glibc.malloc.arena_max=2") == \
        "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"


def test_transparent_huge_page_mode(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert host_allocator.transparent_huge_pages(str(f)) == "madvise"
    assert host_allocator.transparent_huge_pages(str(tmp_path / "missing")) is None


# A program with 128 MiB of temporaries run ten times: the fewest page faults of a run after the
# first two.
PROBE = textwrap.dedent("""
    import resource
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


def _faults_per_run(tunables: str | None) -> int:
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    if tunables:
        env["GLIBC_TUNABLES"] = tunables
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not SUPPORTED, reason=f"huge-page malloc unavailable: {host_allocator.reason_to_leave({}, GLIBC, THP)}")
def test_huge_pages_take_the_page_faults_of_a_repeated_program_away():
    system = _faults_per_run(None)
    huge = _faults_per_run("glibc.malloc.hugetlb=1")
    # 128 MiB first-touched again each run: 32,768 pages of 4 KiB, or 64 of 2 MiB.
    assert system > 10_000, system
    assert huge < 2_000, huge


@pytest.mark.skipif(not SUPPORTED, reason="huge-page malloc unavailable here")
def test_the_command_restarts_itself_with_huge_pages(tmp_path):
    """`python -m megajax.cli` (as the `megajax` script) restarts once with the tunable; the train
    log names the allocator; MEGAJAX_HOST_ALLOCATOR=system keeps glibc's default."""
    import os
    args = [sys.executable, "-m", "megajax.cli", "train", "--config", "model/tiny", "train.steps=1",
            "train.seq_len=32", "train.eval_every=0", "train.global_batch=8",
            "checkpoint.every=0"]
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env["XLA_FLAGS"] = xla_flags(1)  # one device: what is checked is the restart and the log line
    for setting, want in (("hugepages", "host allocator: glibc malloc with transparent huge pages"),
                          ("system", "host allocator: system default (MEGAJAX_HOST_ALLOCATOR=system)")):
        p = subprocess.run([*args, f"train.run_dir={tmp_path / setting}"], capture_output=True, text=True,
                           env=dict(env, MEGAJAX_HOST_ALLOCATOR=setting), timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        assert want in p.stdout + p.stderr, (p.stdout + p.stderr)[-3000:]
