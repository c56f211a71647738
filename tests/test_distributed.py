"""Multi-process runs: how a process finds its place (config, environment, schedulers), and real
two-process runs on localhost (2 processes x 4 simulated CPU devices, gloo collectives):
parity with one process, agreement on SIGTERM, and a clear failure when a peer dies."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from megajax.checkpoint.integrity import RECORD, damage
from megajax.checkpoint.manager import CheckpointSource
from megajax.checkpoint.source import flatten
from megajax.config import DistributedConfig, load_config
from megajax.data.corpus import stdlib_corpus
from megajax.distributed import (PEER_FAILURE_EXIT_STATUS, detect_cluster, expand_tasks_per_node,
                                 local_devices_for, plan_processes, wait_for_coordinator)
from megajax.errors import ConfigError, DistributedError
from megajax.train.loop import train

from conftest import SMALL, xla_flags
from layout_parity import PARITY, Run, assert_same_run, reference

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------
# Planning (pure)
# ----------------------------------------------------------------------------

def test_gloo_connection_lines_go_to_the_log_not_the_console(tmp_path):
    import io
    from megajax.distributed import forward_output
    child = io.BytesIO(b"[Gloo] Rank 0 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\n"
                       b"step 1/2 | loss 5.5\n[Gloo] Rank 1 is connected to 1 peer ranks.\npartial line")
    console = io.BytesIO()
    forward_output(child, console, tmp_path / "logs" / "process_0.log")
    assert console.getvalue() == b"step 1/2 | loss 5.5\npartial line"
    assert (tmp_path / "logs" / "process_0.log").read_bytes().count(b"[Gloo] Rank") == 2
    # gloo's threads write their message in pieces that interleave (as seen with 4 devices a process):
    # the pieces go to the log too, a console line gloo broke into keeps its own text.
    child = io.BytesIO(b"[Gloo] Rank [Gloo] Rank 3 is connected to 7 peer ranks. Expected number of connected peer "
                       b"ranks is : 7\n0 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7"
                       b"\n7\nstep 2/2 | loss 5.1[Gloo] Rank 1 is connected to 7 peer ranks.\n\nmegajax: done\n")
    console = io.BytesIO()
    forward_output(child, console, tmp_path / "logs" / "process_1.log")
    assert console.getvalue() == b"step 2/2 | loss 5.1\n\nmegajax: done\n"
    assert (tmp_path / "logs" / "process_1.log").read_bytes().count(b"peer ranks") == 5


def test_single_process_without_any_settings():
    assert plan_processes(DistributedConfig(), env={}) is None
    assert plan_processes(DistributedConfig(num_processes=1), env={}) is None


def test_explicit_config_wins_over_environment():
    env = {"JAX_COORDINATOR_ADDRESS": "envhost:1", "JAX_NUM_PROCESSES": "8", "JAX_PROCESS_ID": "7"}
    plan = plan_processes(DistributedConfig(coordinator_address="h0:1234", num_processes=2, process_id=1), env=env)
    assert (plan.coordinator_address, plan.num_processes, plan.process_id) == ("h0:1234", 2, 1)
    plan = plan_processes(DistributedConfig(), env={**env, "JAX_LOCAL_DEVICE_IDS": "4,5"})
    assert (plan.coordinator_address, plan.num_processes, plan.process_id) == ("envhost:1", 8, 7)
    assert plan.local_device_ids == (4, 5) and plan.detection == "deactivate"


def test_slurm_detection_two_tasks_per_node_split_the_gpus():
    env = {"SLURM_JOB_ID": "42", "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_NODEID": "1",
           "SLURM_LOCALID": "1", "SLURM_TASKS_PER_NODE": "2(x2)", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    plan = plan_processes(DistributedConfig(), env=env)
    assert (plan.num_processes, plan.process_id, plan.detection) == (4, 3, "slurm")
    assert plan.coordinator_address is None  # JAX derives it from SLURM_STEP_NODELIST
    assert plan.local_device_ids == (4, 5, 6, 7)
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]


def test_openmpi_and_kubernetes_detection():
    plan = plan_processes(DistributedConfig(), env={"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"})
    assert (plan.num_processes, plan.process_id, plan.detection) == (2, 1, "ompi")
    k8s = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "2",
           "JAX_COORDINATOR_ADDRESS": "megajax-0.megajax:6379", "JAX_NUM_PROCESSES": "4"}
    plan = plan_processes(DistributedConfig(), env=k8s)
    assert (plan.coordinator_address, plan.num_processes, plan.process_id) == ("megajax-0.megajax:6379", 4, 2)
    assert detect_cluster("none", k8s) is None


def test_gpus_split_evenly_or_clear_error():
    cluster = detect_cluster("ompi", {"OMPI_COMM_WORLD_SIZE": "6", "OMPI_COMM_WORLD_RANK": "4",
                                      "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "3"})
    assert local_devices_for(cluster, 6) == (2, 3)
    with pytest.raises(ConfigError, match="cannot split its 8 visible accelerators"):
        local_devices_for(cluster, 8)


@pytest.mark.parametrize("cfg, env, words", [
    (DistributedConfig(num_processes=2), {}, ["process's id is unknown", "distributed.process_id"]),
    (DistributedConfig(num_processes=2, process_id=1), {}, ["no coordinator address",
                                                              "distributed.coordinator_address"]),
    (DistributedConfig(process_id=1), {}, ["distributed.process_id is set", "distributed.num_processes"]),
    (DistributedConfig(cluster="slurm"), {}, ["distributed.cluster = 'slurm'", "SLURM_PROCID"]),
    (DistributedConfig(), {"KUBERNETES_SERVICE_HOST": "x", "JOB_COMPLETION_INDEX": "0"}, ["JAX_NUM_PROCESSES"]),
    (DistributedConfig(), {"JAX_NUM_PROCESSES": "two"}, ["JAX_NUM_PROCESSES='two'", "integer"]),
    (DistributedConfig(num_processes=2), {"JAX_PROCESS_ID": "5", "JAX_COORDINATOR_ADDRESS": "h:1"},
     ["process id 5", "0..1"]),
])
def test_incomplete_settings_are_clear_errors(cfg, env, words):
    with pytest.raises(ConfigError) as e:
        plan_processes(cfg, env=env)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("override, words", [
    ("distributed.num_processes=0", ["distributed.num_processes = 0", "> 0"]),
    ("distributed.heartbeat_timeout=-1", ["distributed.heartbeat_timeout = -1"]),
    ("distributed.coordinator_port=70000", ["distributed.coordinator_port = 70000", "1..65535"]),
    ("distributed.cluster=lsf", ["distributed.cluster", "lsf", "slurm"]),
    ("distributed.local_device_ids=[0,-1]", ["distributed.local_device_ids", "[0, -1]"]),
    ("distributed.coordinator_adress=h:1", ["did you mean distributed.coordinator_address"]),
])
def test_bad_distributed_keys(override, words):
    overrides = [override] + (["distributed.process_id=2"] if "num_processes" in override else [])
    with pytest.raises(ConfigError) as e:
        load_config(overrides=overrides)
    for w in words:
        assert w in str(e.value)


def test_unreachable_coordinator_is_a_clear_error():
    port = _free_port()
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match=f"no coordinator answered at localhost:{port} within 1 s"):
        wait_for_coordinator(f"localhost:{port}", 1, process_id=1)
    assert time.monotonic() - t0 < 5


# ----------------------------------------------------------------------------
# Two real processes on localhost
# ----------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """The three two-process runs compile the same programs: share them. Also builds the embedded
    corpus's dataset once, here, rather than in both processes of the first run."""
    cfg = load_config(overrides=SMALL)
    stdlib_corpus(cfg.data.tokenizer, cfg.data.corpus_max_mb)
    return tmp_path_factory.mktemp("jit")


def _launch(tmp_path: Path, run_dir: Path, cache: Path, *overrides: str) -> list[subprocess.Popen]:
    """`megajax train` as process 0 and 1 of a 2-process job, 4 simulated CPU devices each;
    data=2 across the processes x tensor=4 inside each (mesh.dcn.data=2)."""
    port = _free_port()
    env = dict(os.environ, XLA_FLAGS=xla_flags(4),
               JAX_PLATFORMS="cpu",
               PYTHONPATH=str(ROOT), JAX_COMPILATION_CACHE_DIR=str(cache),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    args = [*SMALL, "mesh.data=1", "mesh.tensor=4", "mesh.dcn.data=2", f"train.run_dir={run_dir}",
            f"distributed.coordinator_address=localhost:{port}", "distributed.num_processes=2", *overrides]
    return [subprocess.Popen([sys.executable, "-m", "megajax.cli", "train", *args, f"distributed.process_id={i}"],
                             env=env, cwd=ROOT, stdout=open(tmp_path / f"out{i}.txt", "w"),
                             stderr=subprocess.STDOUT) for i in range(2)]


def _output(tmp_path: Path, i: int) -> str:
    return (tmp_path / f"out{i}.txt").read_text(errors="replace")


def _wait_for_logged_steps(run_dir: Path, procs: list, n: int, timeout: float = 180) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while not (metrics.is_file() and metrics.read_text().count("\n") >= n):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "run did not start"
        time.sleep(0.05)


def _metric(run_dir: Path, key: str) -> list[float]:
    return [json.loads(line)[key] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.fixture
def reap():
    procs: list[subprocess.Popen] = []
    yield procs.extend
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_two_processes_match_one_process(tmp_path, small_config, reap, compile_cache):
    run = tmp_path / "run"
    procs = _launch(tmp_path, run, compile_cache, "train.steps=3", *PARITY)
    reap(procs)
    for i, p in enumerate(procs):
        assert p.wait(timeout=240) == 0, _output(tmp_path, i)
    out0 = _output(tmp_path, 0)
    assert "on 8 cpu devices" in out0 and "mesh data=2 x tensor=4" in out0 and "step 3/3" in out0
    assert "[Gloo]" not in out0 and "[Gloo] Rank 0 is connected" in (run / "logs" / "process_0.log").read_text()
    assert "step 3/3" not in _output(tmp_path, 1)  # process 1 prints nothing of the run ...
    log1 = (run / "logs" / "process_1.log").read_text()
    assert "joined the distributed runtime as process 1 of 2" in log1  # ... it logs to its own file

    # Per-step loss and grad norm against one device; the parameters (after the last step, from the
    # run's checkpoint) against one process running the same mesh.
    got = Run(np.asarray(_metric(run, "loss")), np.asarray(_metric(run, "grad_norm")), None)
    ref = reference(small_config)
    assert_same_run(got, ref.first(3), params=False)
    one = train(small_config(*PARITY, "mesh.data=2", "mesh.tensor=4", steps=3))
    np.testing.assert_allclose(got.losses, one.losses, rtol=1e-5)
    saved = CheckpointSource(run)
    for name, want in flatten(jax.device_get(one.state.params)):
        np.testing.assert_allclose(saved.get(name), want, rtol=1e-5, atol=1e-7, err_msg=name)
    # Process 0's record of the step's files lists process 1's too (written before the commit).
    recorded = json.loads((saved.step_dir / RECORD).read_text())["files"]
    assert any(n.startswith("state/ocdbt.process_1/") for n in recorded) and damage(saved.step_dir) is None


def test_sigterm_to_one_process_stops_both_at_one_step_and_resumes(tmp_path, small_config, reap, compile_cache):
    run = tmp_path / "run"
    procs = _launch(tmp_path, run, compile_cache, "train.steps=1000", "checkpoint.every=0")
    reap(procs)
    _wait_for_logged_steps(run, procs, 2)
    procs[1].send_signal(signal.SIGTERM)  # a scheduler preempting one node
    for i, p in enumerate(procs):
        assert p.wait(timeout=120) == 0, _output(tmp_path, i)
    saved = sorted(int(d.name) for d in (run / "checkpoints").iterdir() if d.name.isdigit())
    assert len(saved) == 1, saved  # one collective save: both processes stopped at the same step
    step = saved[0]
    assert f"SIGTERM received: saved a checkpoint at step {step}" in _output(tmp_path, 0)

    # The same run directory resumes, here on one process with 8 devices (the same mesh).
    resumed = train(small_config("mesh.data=2", "mesh.tensor=4", f"train.run_dir={run}", steps=step + 1))
    assert [r["step"] for r in resumed.records] == [step + 1]


def test_a_killed_process_makes_the_other_exit_with_an_error(tmp_path, reap, compile_cache):
    run = tmp_path / "run"
    heartbeat = 5
    procs = _launch(tmp_path, run, compile_cache, "train.steps=100000", "checkpoint.every=0",
                    f"distributed.heartbeat_timeout={heartbeat}")
    reap(procs)
    _wait_for_logged_steps(run, procs, 2)
    worker = _children(procs[1].pid)  # the process doing the work under `megajax train`'s supervisor
    assert len(worker) == 1
    os.kill(worker[0], signal.SIGKILL)
    t0 = time.monotonic()
    status = procs[0].wait(timeout=heartbeat + 60)
    elapsed = time.monotonic() - t0
    out0 = _output(tmp_path, 0)
    assert status == PEER_FAILURE_EXIT_STATUS, out0[-3000:]
    assert elapsed < heartbeat + 10, elapsed
    assert "megajax train: error: process 0 of 2 was aborted by the distributed runtime" in out0
    assert f"distributed.heartbeat_timeout={heartbeat} s" in out0
    assert procs[1].wait(timeout=10) == 128 + signal.SIGKILL
    print(f"peer failure detected after {elapsed:.1f} s (heartbeat timeout {heartbeat} s)")
