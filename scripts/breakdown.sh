#!/usr/bin/env bash
# `weft bench layer --breakdown` for the issue's three layer configs on every GPU of the machine,
# one config after another in one device call; logs and JSON under $OUT.
#   CONFIGS="qwen2 phi35 mixtral" MODES=plain,no-comm OUT=$OUT bash scripts/breakdown.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=${SRC:-$PWD/src}
OUT=${OUT:-./breakdown_out}
mkdir -p "$OUT"
NGPU=$(python3 -c "import torch; print(max(1, torch.cuda.device_count()))")
for config in ${CONFIGS:-qwen2 phi35 mixtral}; do
  torchrun --standalone --nproc_per_node="$NGPU" -m weft bench layer --config "$config" \
    --modes "${MODES:-plain,no-comm}" --dtype bf16 --activation relu --optimizer sgd --breakdown \
    --profile-steps 3 --json "$OUT/$config.json" ${BENCH_ARGS:-} > "$OUT/$config.log" 2>&1 \
    || echo "$config failed (exit $?)"
  grep -v "^W1\|^\[W\|OMP_NUM" "$OUT/$config.log" | tail -n 60
done
