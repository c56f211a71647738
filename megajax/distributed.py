"""Multi-process runs: joining the JAX distributed runtime, from config or the cluster environment.

A multi-node run is one process per node (driving all of that node's GPUs) or
one process per GPU. Process 0 hosts the coordinator service that every
process connects to; the runtime then exchanges device topologies, runs
heartbeats (a process that stops answering for `heartbeat_timeout` seconds
makes every other process exit with an error, instead of hanging in a
collective) and relays a scheduler's SIGTERM to all processes so that they
checkpoint the same step (`preemption_sync_point`).

Where each value comes from, first found wins:

1. the `distributed` config section (`coordinator_address`, `num_processes`,
   `process_id`, `local_device_ids`);
2. the environment: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID,
   JAX_LOCAL_DEVICE_IDS (comma-separated);
3. the scheduler (`distributed.cluster`, default auto):
   - SLURM (`srun`): SLURM_NTASKS, SLURM_PROCID; the coordinator is the
     job's first node, on a port derived from the job id (JAX's detection);
   - Open MPI (`mpirun`): OMPI_COMM_WORLD_SIZE / _RANK; the coordinator is
     the launcher's address (JAX's detection);
   - Kubernetes indexed Job / JobSet: JOB_COMPLETION_INDEX is the process id;
     the number of processes and the coordinator (pod 0 through the headless
     service) come from the manifest's JAX_NUM_PROCESSES and
     JAX_COORDINATOR_ADDRESS (JAX's own Kubernetes detection needs the
     `kubernetes` package and API permissions, which this does not).

With none of these, or one process, nothing is initialised: a single-process run.

Accelerators per process: with one process on a node it drives every
accelerator it can see; with several, the node's accelerators are split
evenly among them in local-rank order (one GPU each when counts match).
`distributed.local_device_ids` overrides this.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Mapping

from megajax.config import Config, DistributedConfig
from megajax.errors import ConfigError, DistributedError

ENV_ADDRESS, ENV_NUM, ENV_ID, ENV_LOCAL_IDS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
                                               "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE_IDS")


@dataclass(frozen=True)
class Cluster:
    """What a scheduler's environment says about this process."""
    name: str  # slurm | ompi | k8s
    num_processes: int | None
    process_id: int | None
    local_rank: int = 0
    local_size: int = 1  # processes on this node
    devices_per_task: bool = False  # the scheduler bound accelerators to each task


@dataclass(frozen=True)
class ProcessPlan:
    """How this process joins the runtime."""
    source: str  # where the values came from: config/environment, or a scheduler's name
    coordinator_address: str | None  # None: derived by JAX's detection of `detection`
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None  # None: every visible device (or JAX's per-rank default)
    detection: str  # JAX's cluster_detection_method: slurm | ompi | deactivate

    def describe(self) -> str:
        devices = "all visible" if self.local_device_ids is None else list(self.local_device_ids)
        coordinator = self.coordinator_address or f"derived by JAX from the {self.source} environment"
        return (f"process {self.process_id} of {self.num_processes} ({self.source}); coordinator "
                f"{coordinator}; local devices {devices}")


# ----------------------------------------------------------------------------
# Detection (pure: reads only the mapping it is given, and /proc or /sys for GPU counts)
# ----------------------------------------------------------------------------

def _int(env: Mapping[str, str], key: str) -> int | None:
    value = env.get(key, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {key}={value!r}: expected an integer.") from None


def expand_tasks_per_node(spec: str) -> list[int]:
    """SLURM's compressed task counts, e.g. '2(x3),1' -> [2, 2, 2, 1]."""
    out: list[int] = []
    for part in filter(None, spec.split(",")):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            return []
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def _slurm(env: Mapping[str, str]) -> Cluster | None:
    if "SLURM_JOB_ID" not in env or "SLURM_PROCID" not in env:
        return None
    per_node = expand_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", ""))
    node = _int(env, "SLURM_NODEID") or 0
    local_size = per_node[node] if node < len(per_node) else 1
    return Cluster("slurm", _int(env, "SLURM_NTASKS") or _int(env, "SLURM_NPROCS"), _int(env, "SLURM_PROCID"),
                   local_rank=_int(env, "SLURM_LOCALID") or 0, local_size=local_size,
                   devices_per_task=bool(env.get("SLURM_GPUS_PER_TASK")))


def _ompi(env: Mapping[str, str]) -> Cluster | None:
    if "OMPI_COMM_WORLD_SIZE" not in env:
        return None
    return Cluster("ompi", _int(env, "OMPI_COMM_WORLD_SIZE"), _int(env, "OMPI_COMM_WORLD_RANK"),
                   local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK") or 0,
                   local_size=_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE") or 1)


def _k8s(env: Mapping[str, str]) -> Cluster | None:
    if "KUBERNETES_SERVICE_HOST" not in env or "JOB_COMPLETION_INDEX" not in env:
        return None
    return Cluster("k8s", None, _int(env, "JOB_COMPLETION_INDEX"))


DETECTORS = {"slurm": _slurm, "ompi": _ompi, "k8s": _k8s}


def detect_cluster(cluster: str, env: Mapping[str, str]) -> Cluster | None:
    """The scheduler environment this process runs in (`cluster`: auto, none, or one name)."""
    if cluster == "none":
        return None
    if cluster != "auto":
        found = DETECTORS[cluster](env)
        if found is None:
            need = {"slurm": "SLURM_JOB_ID and SLURM_PROCID (run under srun)",
                    "ompi": "OMPI_COMM_WORLD_SIZE (run under mpirun)",
                    "k8s": "KUBERNETES_SERVICE_HOST and JOB_COMPLETION_INDEX (an indexed Job)"}[cluster]
            raise ConfigError(f"distributed.cluster = {cluster!r} but this process's environment lacks {need}; "
                              f"use distributed.cluster=auto, or none with explicit distributed.* values.")
        return found
    for detector in DETECTORS.values():
        found = detector(env)
        if found is not None:
            return found
    return None


def visible_accelerators(env: Mapping[str, str]) -> int | None:
    """How many GPUs this process can see, without starting a JAX backend (None: unknown / none)."""
    for key in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        if key in env:
            return len([d for d in env[key].split(",") if d.strip()])
    nvidia = Path("/proc/driver/nvidia/gpus")
    if nvidia.is_dir():
        return len(list(nvidia.iterdir()))
    count = 0
    for gpu_id in Path("/sys/class/kfd/kfd/topology/nodes").glob("*/gpu_id"):
        try:
            count += gpu_id.read_text().strip() not in ("", "0")
        except OSError:
            pass
    return count or None


def local_devices_for(cluster: Cluster | None, visible: int | None) -> tuple[int, ...] | None:
    """Accelerator ordinals this process drives: all it sees when it is alone on its node or the
    scheduler bound devices per task, else an even share of the node's (None: no restriction)."""
    if cluster is None or visible is None:
        return None
    if cluster.local_size <= 1 or cluster.devices_per_task or visible < cluster.local_size:
        return tuple(range(visible))
    if visible % cluster.local_size:
        raise ConfigError(f"{cluster.local_size} processes on this node cannot split its {visible} visible "
                          f"accelerators evenly; set distributed.local_device_ids for each process, or "
                          f"launch one process per node or per GPU.")
    share = visible // cluster.local_size
    return tuple(range(cluster.local_rank * share, (cluster.local_rank + 1) * share))


def plan_processes(cfg: DistributedConfig, env: Mapping[str, str] | None = None) -> ProcessPlan | None:
    """How this process joins a multi-process run, or None for a single-process run."""
    env = os.environ if env is None else env
    cluster = detect_cluster(cfg.cluster, env)
    address = cfg.coordinator_address or env.get(ENV_ADDRESS) or None
    num = cfg.num_processes if cfg.num_processes is not None else _int(env, ENV_NUM)
    pid = cfg.process_id if cfg.process_id is not None else _int(env, ENV_ID)
    explicit = {k for k, v in (("coordinator_address", address), ("num_processes", num), ("process_id", pid))
                if v is not None}
    if num is None and cluster is not None:
        num = cluster.num_processes
    if num is None or num == 1:
        if cluster is not None and cluster.name == "k8s" and num is None:
            raise ConfigError(f"Kubernetes indexed Job detected (JOB_COMPLETION_INDEX={env['JOB_COMPLETION_INDEX']}) "
                              f"but the number of processes is unknown: set {ENV_NUM} in the pod spec (the Job's "
                              f"parallelism) or distributed.num_processes.")
        if explicit - {"num_processes"}:
            raise ConfigError(f"distributed.{sorted(explicit - {'num_processes'})[0]} is set but the number of "
                              f"processes is {num}; set distributed.num_processes (or {ENV_NUM}) to the process "
                              f"count of the job.")
        return None
    if pid is None and cluster is not None:
        pid = cluster.process_id
    if pid is None:
        raise ConfigError(f"distributed.num_processes = {num} but this process's id is unknown: set "
                          f"distributed.process_id (or {ENV_ID}), or launch under SLURM, Open MPI or a "
                          f"Kubernetes indexed Job.")
    if not 0 <= pid < num:
        raise ConfigError(f"process id {pid} is outside 0..{num - 1} for {num} processes.")
    detection = "deactivate"
    if address is None:
        if cluster is None or cluster.name == "k8s":
            where = "the pod spec" if cluster is not None else "the environment"
            raise ConfigError(f"{num} processes but no coordinator address: set distributed.coordinator_address "
                              f"(host:port of process 0) or {ENV_ADDRESS} in {where}.")
        detection = cluster.name  # JAX derives the address from the scheduler's variables
    if cfg.local_device_ids is not None:
        local: tuple[int, ...] | None = tuple(cfg.local_device_ids)
    elif env.get(ENV_LOCAL_IDS):
        local = tuple(int(i) for i in env[ENV_LOCAL_IDS].split(",") if i.strip())
    else:
        local = local_devices_for(cluster, visible_accelerators(env))
    source = "config/environment" if cluster is None else cluster.name
    if cluster is not None and explicit:
        source += " + config/environment"
    return ProcessPlan(source=source, coordinator_address=address, num_processes=num, process_id=pid,
                       local_device_ids=local, detection=detection)


# ----------------------------------------------------------------------------
# Joining the runtime
# ----------------------------------------------------------------------------

def wait_for_coordinator(address: str, timeout: float, process_id: int) -> None:
    """Polls the coordinator's TCP port, so that an unreachable process 0 is a clear error."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=min(5.0, timeout)):
                return
        except (OSError, ValueError) as e:
            if time.monotonic() >= deadline or isinstance(e, ValueError):
                raise DistributedError(
                    f"process {process_id}: no coordinator answered at {address} within {timeout:.0f} s "
                    f"(distributed.initialization_timeout) ({e}). Check that process 0 started, that the "
                    f"address names its host and a free port, and that this node can reach it.") from None
            time.sleep(0.5)


def initialize(cfg: Config) -> ProcessPlan | None:
    """Joins the distributed runtime when this is a multi-process run; call before JAX touches devices.

    Processes other than 0 then log to `<train.run_dir>/logs/process_<i>.log`, and every process
    writes a Python stack dump there if the runtime aborts it."""
    d = cfg.distributed
    plan = plan_processes(d)
    if plan is None:
        return None
    if not cfg.train.run_dir:
        raise ConfigError(f"a run of {plan.num_processes} processes needs train.run_dir, a directory on a "
                          f"filesystem every process shares (checkpoints and logs go there, and restarting "
                          f"with the same directory resumes).")
    import jax
    if d.coordinator_port is not None:
        if plan.coordinator_address is not None:
            raise ConfigError(f"distributed.coordinator_port = {d.coordinator_port} with an explicit coordinator "
                              f"address {plan.coordinator_address!r}: put the port in the address instead.")
        os.environ["JAX_COORDINATOR_PORT"] = str(d.coordinator_port)  # read by JAX's scheduler detection
    if plan.coordinator_address is not None and plan.process_id != 0:
        wait_for_coordinator(plan.coordinator_address, d.initialization_timeout, plan.process_id)
    try:
        jax.distributed.initialize(
            coordinator_address=plan.coordinator_address, num_processes=plan.num_processes,
            process_id=plan.process_id,
            local_device_ids=list(plan.local_device_ids) if plan.local_device_ids is not None else None,
            cluster_detection_method=plan.detection, initialization_timeout=d.initialization_timeout,
            heartbeat_timeout_seconds=d.heartbeat_timeout)
    except (RuntimeError, ValueError, TypeError) as e:
        raise DistributedError(f"process {plan.process_id} could not join the distributed runtime "
                               f"({plan.describe()}): {e}") from None
    _process_logs(Path(cfg.train.run_dir), plan.process_id)
    print(f"megajax: joined the distributed runtime as {plan.describe()}; heartbeat timeout "
          f"{d.heartbeat_timeout} s", file=sys.stderr if plan.process_id == 0 else _LOG, flush=True)
    return plan


_LOG = None  # this process's log file in a multi-process run


# ----------------------------------------------------------------------------
# Supervision: a clear error when the runtime aborts a process
# ----------------------------------------------------------------------------

SUPERVISED_ENV = "MEGAJAX_SUPERVISED"  # set in the child that does the work
PEER_FAILURE_EXIT_STATUS = 4


def _die_with_parent() -> None:
    """In the child, before exec: the kernel kills it when the supervising process dies."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def supervise(argv: list[str], plan: ProcessPlan, cfg: DistributedConfig, run_dir: str) -> int:
    """Runs `megajax <argv>` in a child process and returns its exit status.

    When a process of the job dies, JAX's runtime aborts every other process once it has had no
    heartbeat from it for `heartbeat_timeout` seconds (SIGABRT and a C++ stack trace). The
    supervisor, which never touches JAX, turns that into one clear message and exit status 4.
    SIGTERM, SIGINT and SIGHUP sent to the supervisor are passed on to the child (which is in its
    own session, so a signal sent to the whole process group arrives once).

    The child's standard output passes through `forward_output`, which keeps the collectives
    library's connection lines off the console."""
    child = subprocess.Popen([sys.executable, "-m", "megajax.cli", *argv],
                             env={**os.environ, SUPERVISED_ENV: "1", "PYTHONUNBUFFERED": "1"},
                             stdout=subprocess.PIPE, start_new_session=True, preexec_fn=_die_with_parent)
    log = Path(run_dir) / "logs" / f"process_{plan.process_id}.log"
    pump = threading.Thread(target=forward_output, args=(child.stdout, sys.stdout.buffer, log),
                            name="megajax-output", daemon=True)
    pump.start()

    def forward(signum, frame):
        if child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    status = child.wait()
    pump.join(timeout=10)
    if status >= 0:
        return status
    if status == -signal.SIGABRT:
        print(f"megajax train: error: process {plan.process_id} of {plan.num_processes} was aborted by the "
              f"distributed runtime, most likely because another process died or stopped sending "
              f"heartbeats for distributed.heartbeat_timeout={cfg.heartbeat_timeout} s (the runtime's "
              f"reason is above; Python stacks are in {run_dir}/logs/process_{plan.process_id}.log). "
              f"Restart the job with the same train.run_dir to resume from the last checkpoint.",
              file=sys.stderr, flush=True)
        return PEER_FAILURE_EXIT_STATUS
    return 128 - status  # killed by a signal: the shell's convention


GLOO_PREFIX = b"[Gloo] "
# Pieces of gloo's connection message. Its threads write the message in several pieces, which can
# interleave: a line may start mid-message ('0 is connected to 1 peer ranks. Expected ...') or hold
# only a rank count.
_GLOO_PIECE = re.compile(rb"\[Gloo\]|is connected to \d+ peer ranks|Expected number of connected peer ranks|"
                         rb"^\s*(Rank\s*)?\d*\s*$")


def _split_gloo(line: bytes) -> tuple[bytes, bytes]:
    """(the part of a line for the console, the part from gloo): a line with a gloo piece goes to
    the log, except the text before a '[Gloo]' prefix in mid-line (a console line gloo broke into)."""
    if not line.strip() or not _GLOO_PIECE.search(line):
        return line, b""
    at = line.find(GLOO_PREFIX)
    if at > 0 and not _GLOO_PIECE.search(line[:at]):
        return line[:at] + b"\n", line[at:]
    return b"", line


def forward_output(stream: BinaryIO, out: BinaryIO, log_path: Path) -> None:
    """Copies `stream` to `out` line by line, except the lines the gloo library prints on CPU
    collectives ('[Gloo] Rank 0 is connected to 3 peer ranks ...', once per communicator, from
    its C++ side to standard output, sometimes in interleaved pieces), which go to the process's
    log file `log_path` instead."""
    log = None
    try:
        for line in iter(stream.readline, b""):
            console, gloo = _split_gloo(line)
            if gloo:
                if log is None:
                    log_path.parent.mkdir(parents=True, exist_ok=True)
                    log = open(log_path, "ab")
                log.write(gloo)
                log.flush()
            if console:
                out.write(console)
                out.flush()
    finally:
        if log is not None:
            log.close()


def _process_logs(run_dir: Path, process_id: int) -> None:
    """This process's log file `<run_dir>/logs/process_<i>.log`: every process's Python stacks are
    written there if it is aborted (e.g. by the runtime's heartbeat check); processes other than 0
    also send their standard output and Python logging there, so the console shows process 0."""
    global _LOG
    path = run_dir / "logs" / f"process_{process_id}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    _LOG = open(path, "a", buffering=1)
    faulthandler.enable(file=_LOG, all_threads=True)
    if process_id != 0:
        sys.stdout.flush()
        os.dup2(_LOG.fileno(), sys.stdout.fileno())  # also catches output of the runtime's C++ side
        root = logging.getLogger()
        for handler in list(root.handlers):
            root.removeHandler(handler)
        root.addHandler(logging.StreamHandler(_LOG))


def preemption_sync_point(step: int) -> bool:
    """True on every process at the same step once any process got SIGTERM (JAX's preemption sync).

    Must be called once per step by every process, from the same starting step."""
    from jax.experimental import multihost_utils
    return multihost_utils.reached_preemption_sync_point(step)


# The key JAX's preemption service writes to the coordination service when any process receives SIGTERM
# (its notifier, xla/tsl preemption_notifier; the same notice reached_preemption_sync_point acts on).
PREEMPTION_NOTICE_KEY = "RECEIVED_PREEMPTION_NOTICE"


def preemption_noticed() -> bool:
    """Whether any process of the job has received SIGTERM (JAX's preemption notice, seen by every process
    within a round trip to the coordinator); False in a one-process run or before the runtime starts."""
    from jax._src import distributed as jax_distributed
    client = jax_distributed.global_state.client
    if client is None:
        return False
    try:
        client.key_value_try_get(PREEMPTION_NOTICE_KEY)
    except Exception:  # not found (no notice), or the coordinator is gone
        return False
    return True


def barrier(name: str, timeout_s: float = 24 * 3600.0) -> None:
    """Waits until every process of the job has reached `name` (the coordination service's barrier)."""
    from jax._src import distributed as jax_distributed
    client = jax_distributed.global_state.client
    if client is not None:
        client.wait_at_barrier(name, int(timeout_s * 1000))


def leave_job() -> None:
    """Disconnects this process from the job (every process doing so together passes the shutdown barrier,
    and none is aborted for a peer that left)."""
    import jax
    jax.distributed.shutdown()
