"""The cluster launch files: the SLURM script runs (with a stand-in srun), the Kubernetes manifests
are consistent with each other and with megajax's detection (training) or its server (serving), and
the Dockerfile is well formed."""

import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import yaml

from megajax.cli import parse_args
from megajax.config import DistributedConfig, load_config
from megajax.distributed import plan_processes
from megajax.inference.serve_metrics import GAUGES, REQUESTS_WAITING
from megajax.inference.server import _Handler

ROOT = Path(__file__).resolve().parent.parent
SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"
K8S = ROOT / "scripts" / "k8s"


def _config_from_args(argv: list[str]):
    """The config `megajax <argv>` would train with, parsed by megajax's own command line."""
    args = parse_args(argv)
    assert args.command == "train", argv
    return load_config(args.config, args.overrides)


def test_sbatch_is_valid_bash_with_one_task_per_node():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", SBATCH.read_text(), re.M))
    assert directives["ntasks-per-node"] == "1" and directives["gpus-per-node"] == "8"
    assert directives["signal"].startswith("TERM@")  # preemption notice -> checkpoint


def test_sbatch_launches_megajax_under_srun(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$SRUN_ARGS"\n')
    (bin_dir / "srun").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SRUN_ARGS": str(tmp_path / "args"), "SLURM_JOB_ID": "77",
           "SLURM_JOB_NAME": "llama", "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_NUM_NODES": "4"}
    p = subprocess.run(["bash", str(SBATCH), "--config", "mesh/4x8-gpu", "train.steps=10"], env=env,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    args = (tmp_path / "args").read_text().splitlines()
    assert "--ntasks-per-node=1" in args and "--kill-on-bad-exit=1" in args
    command = args[args.index(f"{tmp_path}/.venv/bin/megajax"):]
    assert command[1] == "train" and command[-3:] == ["--config", "mesh/4x8-gpu", "train.steps=10"]
    assert f"train.run_dir={tmp_path}/runs/llama" in command and (tmp_path / "runs" / "llama").is_dir()
    cfg = _config_from_args(command[1:])  # exactly the argv srun runs, options after overrides included
    assert cfg.distributed.cluster == "slurm" and cfg.mesh.dcn.data == 4 and cfg.mesh.tensor == 8

    # What one of those tasks then finds in its environment.
    task = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_NODEID": "2",
            "SLURM_TASKS_PER_NODE": "1(x4)", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    plan = plan_processes(cfg.distributed, env=task)
    assert (plan.process_id, plan.num_processes, plan.detection) == (2, 4, "slurm")
    assert plan.local_device_ids == tuple(range(8))


def test_kubernetes_manifests_fit_together():
    docs = [d for d in yaml.safe_load_all((K8S / "megajax.yaml").read_text()) if d]
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"Service", "Job"} and all(d.get("apiVersion") for d in docs)
    service, job = kinds["Service"], kinds["Job"]
    assert service["apiVersion"] == "v1" and job["apiVersion"] == "batch/v1"
    assert service["spec"]["clusterIP"] == "None"  # headless
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}

    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    assert pod["restartPolicy"] == "Never" and pod["subdomain"] == service["metadata"]["name"]
    assert pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    (container,) = pod["containers"]
    assert container["command"] == ["megajax", "train"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    env = {e["name"]: e["value"] for e in container["env"]}
    host, port = env["JAX_COORDINATOR_ADDRESS"].rsplit(":", 1)
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"  # pod 0 via the Service
    assert int(port) in [p["port"] for p in service["spec"]["ports"]]
    assert int(port) in [p["containerPort"] for p in container["ports"]]
    assert int(env["JAX_NUM_PROCESSES"]) == spec["completions"]

    cfg = _config_from_args(container["command"][1:] + container["args"])
    assert cfg.mesh.dcn.data == spec["completions"]  # one node per process across data
    assert cfg.train.run_dir.startswith(next(m["mountPath"] for m in container["volumeMounts"]
                                             if m["name"] == "runs"))
    claim = next(v for v in pod["volumes"] if v["name"] == "runs")["persistentVolumeClaim"]["claimName"]
    pvc = yaml.safe_load((K8S / "pvc.yaml").read_text())
    assert pvc["kind"] == "PersistentVolumeClaim" and pvc["metadata"]["name"] == claim
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]

    # What pod 1 then finds in its environment.
    pod_env = {**env, "KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "1"}
    plan = plan_processes(DistributedConfig(), env=pod_env)
    assert (plan.process_id, plan.num_processes, plan.coordinator_address) == (
        1, spec["completions"], env["JAX_COORDINATOR_ADDRESS"])


def _port(container: dict, port) -> int:
    """A probe's or Service's port (a number, or the name of one of the container's ports) as a number."""
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p["name"] == port)


def test_kubernetes_serve_manifest_fits_the_server():
    """serve.yaml's Deployment runs a command megajax's own parser accepts, on the port its probes, Service
    and scrape annotations use; the probe paths are the server's routes; the autoscaler's metric is one the
    server exports; the grace period outlasts the drain."""
    docs = [d for d in yaml.safe_load_all((K8S / "serve.yaml").read_text()) if d]
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"Deployment", "Service", "HorizontalPodAutoscaler"}
    deployment, service, hpa = kinds["Deployment"], kinds["Service"], kinds["HorizontalPodAutoscaler"]
    assert (deployment["apiVersion"], service["apiVersion"], hpa["apiVersion"]) == ("apps/v1", "v1", "autoscaling/v2")
    template = deployment["spec"]["template"]
    labels = template["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()

    pod = template["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["megajax", "serve"]
    args = parse_args(container["command"][1:] + container["args"])
    assert args.command == "serve" and args.host == "0.0.0.0" and args.checkpoint
    assert _port(container, "http") == args.port
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert container["resources"]["requests"]["nvidia.com/gpu"] == container["resources"]["limits"]["nvidia.com/gpu"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert args.checkpoint.startswith(mounts["runs"] + "/")
    claim = next(v for v in pod["volumes"] if v["name"] == "runs")["persistentVolumeClaim"]["claimName"]
    assert yaml.safe_load((K8S / "pvc.yaml").read_text())["metadata"]["name"] == claim

    routes = _Handler.ROUTES
    probes = {kind: container[kind]["httpGet"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    for kind, probe in probes.items():
        assert "GET" in routes[probe["path"]] and _port(container, probe["port"]) == args.port, kind
    assert probes["readinessProbe"]["path"] == "/health" and probes["livenessProbe"]["path"] == "/health/live"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # loading a large checkpoint
    notes = template["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true" and int(notes["prometheus.io/port"]) == args.port
    assert "GET" in routes[notes["prometheus.io/path"]]
    (port,) = service["spec"]["ports"]
    assert _port(container, port["targetPort"]) == args.port

    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] > args.drain_timeout + float(pre_stop[1])

    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    assert metric["pods"]["metric"]["name"] == REQUESTS_WAITING and REQUESTS_WAITING in GAUGES  # exported
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]


INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
                "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}


def _dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    logical, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip("\\").rstrip() + " "
        if not line.endswith("\\"):
            word, _, rest = current.strip().partition(" ")
            logical.append((word, rest.strip()))
            current = ""
    assert not current, "a continuation line ends the file"
    return logical


def test_dockerfile_is_well_formed():
    steps = _dockerfile_instructions((ROOT / "Dockerfile").read_text())
    assert all(word in INSTRUCTIONS for word, _ in steps), [w for w, _ in steps if w not in INSTRUCTIONS]
    words = [w for w, _ in steps]
    assert set(words[:words.index("FROM")]) <= {"ARG"}  # FROM first (after build arguments)
    base = dict(steps)["FROM"]
    default = dict(steps)["ARG"].split("=", 1)[1]
    assert base == "${BASE_IMAGE}" and "cuda" in default
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    installs = " ".join(rest for word, rest in steps if word == "RUN")
    for group in re.findall(r"\.\[([\w,]+)\]", installs):
        assert set(group.split(",")) <= set(extras), group
    assert ".[cuda" in installs
    for word, rest in steps:
        if word == "COPY":
            for source in shlex.split(rest)[:-1]:
                assert (ROOT / source).exists(), source
        if word in ("ENTRYPOINT", "CMD"):
            assert isinstance(yaml.safe_load(rest), list)  # exec form
    assert yaml.safe_load(dict(steps)["ENTRYPOINT"]) == ["megajax"]
