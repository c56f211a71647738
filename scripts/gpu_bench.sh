#!/usr/bin/env bash
# One GPU, under 8 minutes: MFU of a ~1.2B Llama (configs/model/llama-1b.yaml: bf16, seq 4096,
# selective recompute) with the cuDNN and the Pallas flash attention, then the Megatron-Core
# baseline (GPTModel, local spec, bf16) timed interleaved in the same process when megatron-core
# is installed. Reports land in $OUT (default ./bench-gpu) as JSON; a short table is printed last.
#
#   bash scripts/gpu_bench.sh            # on a machine with one NVIDIA or AMD GPU
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-gpu}
PY=${PYTHON:-python}
mkdir -p "$OUT"
COMMON=(--config model/llama-1b mesh.data=-1 train.global_batch=8 train.micro_batch=4 train.steps=100
        --steps "${STEPS:-10}" --warmup 2)

"$PY" -m megajax.cli bench "${COMMON[@]}" model.attention_impl=cudnn --json "$OUT/cudnn.json" \
  | tee "$OUT/cudnn.txt"
"$PY" -m megajax.cli bench "${COMMON[@]}" model.attention_impl=flash --json "$OUT/flash.json" \
  | tee "$OUT/flash.txt"
if "$PY" -c "import megatron.core" 2>/dev/null; then
  "$PY" -m megajax.cli bench "${COMMON[@]}" model.attention_impl=cudnn --baseline megatron \
    --json "$OUT/megatron.json" | tee "$OUT/megatron.txt" || echo "megatron baseline failed (see above)"
else
  echo "megatron-core not installed: no Megatron-Core baseline"
fi

"$PY" - "$OUT" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print(f"\n{'run':<10}{'step ms':>10}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU %':>8}{'mem GiB':>9}  baseline")
for name in ("cudnn", "flash", "megatron"):
    p = out / f"{name}.json"
    if not p.exists():
        continue
    r = json.loads(p.read_text())
    mem = (r["memory"]["compiled"] or {}).get("total") or 0
    base = r.get("baseline")
    extra = f"megajax/{base['name']} = {base['megajax_over_baseline']:.2f}x" if base else ""
    print(f"{name:<10}{r['step_seconds']['median'] * 1e3:>10.1f}{r['tokens_per_sec']:>12,.0f}"
          f"{r['tflops_per_device']:>10.1f}{100 * (r['mfu'] or 0):>8.1f}{mem / 2**30:>9.1f}  {extra}")
PYEOF
