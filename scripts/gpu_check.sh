#!/usr/bin/env bash
# GPU check on a lent machine (see CONTRIBUTING.md): the GPU tests on NCCL, then the layer
# benchmarks on every GPU, with NVLink and with NCCL_P2P_DISABLE=1. Logs and JSON are written
# to a work folder and packed into $OUT/gpu_check.tar.gz (default OUT: ./gpu_out); the tables
# are printed last.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}"
OUT=${OUT:-./gpu_out}
WORK=$(mktemp -d /tmp/weft_gpu_check.XXXX)
mkdir -p "$OUT"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
CONFIGS=${CONFIGS:-"qwen2 mixtral"}
STEPS=${STEPS:-30}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"; date -u; } > "$WORK/machine.txt" 2>&1

status=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider > "$WORK/gpu_tests.log" 2>&1 || status=1
fi

for regime in nvlink p2p_disabled; do
  for cfg in $CONFIGS; do
    env_p2p=""; [ "$regime" = p2p_disabled ] && env_p2p="NCCL_P2P_DISABLE=1"
    env $env_p2p torchrun --standalone --nproc_per_node="$NGPU" -m weft bench layer --config "$cfg" \
      --tokens-per-rank 4096 --capacity 1.0,dropless --activation relu --dtype bf16 --steps "$STEPS" \
      --json "$WORK/layer_${cfg}_${regime}.json" > "$WORK/layer_${cfg}_${regime}.log" 2>&1 || status=1
  done
done

cat "$WORK/machine.txt"
echo "== GPU tests =="; tail -n 3 "$WORK/gpu_tests.log" 2>/dev/null
for f in "$WORK"/layer_*.log; do echo "== $(basename "$f" .log) =="; grep -A8 "weft bench layer" "$f" || tail -n 20 "$f"; done
tar -czf "$OUT/gpu_check.tar.gz" -C "$WORK" .
exit $status
