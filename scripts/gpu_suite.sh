#!/usr/bin/env bash
# Every GPU check in one run, from the repository with no install: versions and devices, the Pallas
# flash-attention check (correctness, then a timing table against cuDNN and XLA), the Pallas SSD scan
# check (correctness, then timing against the chunked jnp scan), and the ~1.2B
# Llama bench (bf16, MFU) with cuDNN and with Pallas attention, plus the Megatron-Core baseline when
# megatron-core is installed, and tensor parallelism 2 with and without the overlap of its collectives
# (2 or more GPUs). Under 8 minutes on one GPU; each section writes $OUT/<name>.txt and
# $OUT/<name>.json as it goes (OUT defaults to ./gpu_results), and a summary table ends the run.
#
#   bash scripts/gpu_suite.sh                  # on a machine with an NVIDIA (or AMD) GPU
#   CPU_SMOKE=1 bash scripts/gpu_suite.sh      # every section's code path on CPU at toy sizes
#   SECTIONS=attention bash scripts/gpu_suite.sh
#
# PYTHON picks the interpreter (default python3). See scripts/gpu_suite.py for the sections.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" scripts/gpu_suite.py "$@"
