#!/usr/bin/env python3
"""What the GPU suite ran on: Python and package versions, JAX's devices and their memory, the
driver (nvidia-smi / rocm-smi when present), the environment variables that change JAX's behaviour,
and the source revision.

  python3 scripts/gpu_env.py [--json FILE]

Versions come from the installed distributions' metadata (nothing optional is imported), so a
missing package shows as "-" instead of failing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "jax-rocm7-plugin", "flax", "optax",
            "orbax-checkpoint", "tensorstore", "numpy", "tokenizers", "tqdm", "PyYAML", "safetensors",
            "torch", "transformers", "megatron-core", "tensorboardX", "prometheus-client", "matplotlib")
ENV_KEYS = ("JAX_PLATFORMS", "XLA_FLAGS", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
            "XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR", "CUDA_VISIBLE_DEVICES",
            "ROCR_VISIBLE_DEVICES", "NCCL_DEBUG", "PYTHONPATH")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _run(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def collect() -> dict:
    import jax
    devices = []
    for d in jax.devices():
        try:
            stats = d.memory_stats() or {}
        except Exception:
            stats = {}
        devices.append({"id": d.id, "platform": d.platform, "kind": getattr(d, "device_kind", ""),
                        "bytes_limit": stats.get("bytes_limit"), "bytes_in_use": stats.get("bytes_in_use")})
    return {
        "python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "packages": {p: _version(p) for p in PACKAGES},
        "jax_backend": jax.default_backend(), "devices": devices,
        "nvidia_smi": _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                            "--format=csv,noheader"]),
        "rocm_smi": _run(["rocm-smi", "--showproductname"]),
        "environment": {k: os.environ[k] for k in ENV_KEYS if k in os.environ},
        "revision": _run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"]),
    }


def report(info: dict) -> str:
    lines = [f"python {info['python']} ({info['executable']}) on {info['platform']}, {info['cpus']} CPUs",
             "packages   " + ", ".join(f"{p} {v}" for p, v in info["packages"].items() if v),
             "missing    " + (", ".join(p for p, v in info["packages"].items() if not v) or "-"),
             f"jax        backend {info['jax_backend']}, {len(info['devices'])} device(s)"]
    for d in info["devices"]:
        mem = (f", {d['bytes_limit'] / 2**30:.1f} GiB usable by JAX, {d['bytes_in_use'] / 2**30:.2f} in use"
               if d["bytes_limit"] else "")
        lines.append(f"  device {d['id']}: {d['platform']} {d['kind']}{mem}")
    for key in ("nvidia_smi", "rocm_smi"):
        if info[key]:
            lines.append(f"{key:<11}" + info[key].replace("\n", "\n           "))
    lines.append("env        " + (" ".join(f"{k}={v}" for k, v in info["environment"].items()) or "-"))
    lines.append(f"revision   {info['revision'] or '-'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="FILE", help="also write the findings as JSON")
    args = parser.parse_args(argv)
    info = collect()
    print(report(info), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(info, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
