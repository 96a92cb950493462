#!/usr/bin/env bash
# `weft train` throughput on every GPU of the machine, for each RUNS entry preset:batch and each
# KERNELS, GRAPHS (--cuda-graphs) and MASTER (--master-weights) setting, interleaved (preset by
# preset, the settings back to back); prints the median tokens/s, MFU and peak memory over the
# steps after WARM (no checkpoints: --ckpt-interval 0). Logs under $OUT. GPUS=0 limits the runs to
# the listed GPUs.
#   RUNS="gpt2-s-moe:8 qwen2-moe-2l:2" KERNELS="torch auto" GRAPHS="off auto" MASTER="auto off" STEPS=30 OUT=$OUT bash scripts/train_mfu.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=${SRC:-$PWD/src}
OUT=${OUT:-./train_mfu_out}
STEPS=${STEPS:-30}
WARM=${WARM:-10}
mkdir -p "$OUT"
[ -n "${GPUS:-}" ] && export CUDA_VISIBLE_DEVICES=$GPUS  # e.g. GPUS=0 for one GPU
export WEFT_CACHE=${WEFT_CACHE:-$OUT/cache}
for run in ${RUNS:-gpt2-s-moe:8 qwen2-moe-2l:2}; do
  preset=${run%%:*}; batch=${run##*:}
  for kernels in ${KERNELS:-torch auto}; do
  for graphs in ${GRAPHS:-auto}; do
  for master in ${MASTER:-auto}; do
    name=${preset}_b${batch}_${kernels}_graphs-${graphs}_master-${master}${GPUS:+_gpu$GPUS}
    dir=/tmp/weft_mfu/$name
    rm -rf "$dir"
    python3 -m weft train --preset "$preset" --batch-size "$batch" --steps "$STEPS" --kernels "$kernels" \
      --cuda-graphs "$graphs" --master-weights "$master" --sample-tokens 0 --ckpt-interval 0 --out "$dir" \
      ${TRAIN_ARGS:-} > "$OUT/$name.log" 2>&1 \
      || { echo "$name failed"; tail -5 "$OUT/$name.log"; }
    python3 - "$dir/metrics.jsonl" "$preset" "$batch" "$kernels" "$graphs" "$master" "$WARM" <<'PY'
import json, statistics, sys
path, preset, batch, kernels, graphs, master, warm = sys.argv[1:]
rows = [r for r in map(json.loads, open(path)) if "tokens_per_s" in r and r["step"] > int(warm)]
med = lambda k: statistics.median(r[k] for r in rows) if rows and rows[0].get(k) is not None else float("nan")
print(f"{preset:<14} batch {batch:<3} kernels {kernels:<6} graphs {graphs:<4} master {master:<4} steps {len(rows):>3}  "
      f"tokens/s {med('tokens_per_s'):>10,.0f}  MFU {100 * med('mfu'):5.1f}%  peak {med('peak_mem_gib'):6.1f} GiB  "
      f"dropped {med('dropped_share'):.3f}")
PY
  done
  done
  done
done
