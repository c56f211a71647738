# megajax on NVIDIA GPUs: a CUDA base with Python, and the project with its `cuda` extra (JAX's
# CUDA wheels, which bring their own CUDA libraries; the host needs only the NVIDIA driver).
#
#   docker build -t megajax .
#   docker run --gpus all --shm-size=16g -v $PWD/runs:/workspace/runs megajax train --config mesh/gpu-8
#
# Used by scripts/slurm/train.sbatch (MEGAJAX_IMAGE) and scripts/k8s/megajax.yaml.
ARG BASE_IMAGE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/megajax \
    PATH=/opt/megajax/bin:$PATH

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/megajax

WORKDIR /workspace/megajax
# Dependencies first, so that code changes do not reinstall them.
COPY pyproject.toml README.md ./
COPY megajax/__init__.py megajax/__init__.py
RUN pip install --upgrade pip && pip install ".[cuda,ops]"
COPY megajax megajax
COPY pallas_kernels pallas_kernels
COPY configs configs
COPY scripts scripts
# Editable, so that configs/ next to the package is found (--config mesh/gpu-8).
RUN pip install --no-deps -e . && megajax --help > /dev/null

WORKDIR /workspace
# The coordinator (process 0) and the Prometheus endpoint (ops.prometheus_port).
EXPOSE 6379 9090
ENTRYPOINT ["megajax"]
CMD ["train", "--help"]
