#!/usr/bin/env bash
# The bench sections of the GPU suite alone: MFU of a ~1.2B Llama (configs/model/llama-1b.yaml:
# bf16, seq 4096, selective recompute) with the cuDNN and the Pallas flash attention, then the
# Megatron-Core baseline (GPTModel, local spec, bf16) interleaved in the same process when
# megatron-core is installed. Reports land in $OUT (default ./gpu_results) as <section>.{txt,json};
# a summary table is printed last. BENCH_STEPS sets the timed steps (default 5).
#
#   bash scripts/gpu_bench.sh            # on a machine with one NVIDIA GPU
set -euo pipefail
export SECTIONS="${SECTIONS:-bench_llama1b_cudnn,bench_llama1b_flash,bench_llama1b_megatron}"
exec bash "$(dirname "$0")/gpu_suite.sh" "$@"
