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

# Training: gpt2-s-moe under torchrun on every GPU, then `weft train` spawning NCCL ranks itself.
export WEFT_CACHE="$WORK/cache"
if [ "${SKIP_TRAIN:-0}" != 1 ]; then
  torchrun --standalone --nproc_per_node="$NGPU" -m weft train --preset gpt2-s-moe --steps "${TRAIN_STEPS:-40}" \
    --batch-size 8 --out "$WORK/train_gpt2-s-moe" --sample-tokens 0 > "$WORK/train_gpt2-s-moe.log" 2>&1 || status=1
  python3 -m weft train --steps 60 --out "$WORK/train_tiny" --sample-tokens 100 > "$WORK/train_tiny.log" 2>&1 || status=1
  python3 -m weft plot "$WORK/train_tiny" > /dev/null 2>&1 || status=1
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
for run in "$WORK"/train_*/; do
  [ -f "$run/metrics.jsonl" ] || continue
  echo "== $(basename "$run") =="; tail -n 2 "$WORK/$(basename "$run").log"
  python3 - "$run/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
steady = rows[5:] or rows
mfu = [r["mfu"] for r in steady if r.get("mfu") is not None]
print(f"steps {len(rows)}  final loss {rows[-1]['loss']:.3f}  median tokens/s {statistics.median(r['tokens_per_s'] for r in steady):,.0f}"
      + (f"  median MFU {statistics.median(mfu):.1%}" if mfu else ""))
PY
done
for f in "$WORK"/layer_*.log; do echo "== $(basename "$f" .log) =="; grep -A8 "weft bench layer" "$f" || tail -n 20 "$f"; done
# Checkpoints and the token cache stay behind: they are gigabytes.
tar -czf "$OUT/gpu_check.tar.gz" -C "$WORK" --exclude=checkpoints --exclude=cache .
exit $status
