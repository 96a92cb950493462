#!/usr/bin/env bash
# Why gpt2-s-moe trains worse on 2 GPUs than on one (docs/benchmarks.md, "gpt2-s-moe against its
# dense twin on 2 GPUs"): the same global batch (2 x 8 sequences of 1024 bytes) and steps, run as
#   one-moe / one-dense  one GPU each, --grad-accum 2 (the two run side by side, one per GPU)
#   ep2-eager            both GPUs, experts split 16 + 16, eager steps (--cuda-graphs off)
#   ep1                  both GPUs, every expert on every rank (--ep-size 1: data parallel only)
# metrics.jsonl of each in $OUT/NAME, and `weft plot`'s overlay and table of them all in $OUT.
#   OUT=$OUT STEPS=600 bash scripts/quality_ep.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=${SRC:-$PWD/src}
OUT=${OUT:-./quality_ep_out}
STEPS=${STEPS:-600}
export WEFT_CACHE=${WEFT_CACHE:-$OUT/cache}

train() {  # NAME PRESET ARGS...: one run, its checkpoint deleted afterwards
  local name=$1 preset=$2 dir=/tmp/weft_quality_ep/$1
  shift 2
  rm -rf "$dir"; mkdir -p "$dir" "$OUT/$name"
  local start=$SECONDS
  python3 -m weft train --preset "$preset" --steps "$STEPS" --sample-tokens 0 --batch-size 8 --out "$dir" "$@" \
    > "$OUT/$name/train.log" 2>&1 || { echo "$name failed"; tail -n 5 "$OUT/$name/train.log"; }
  echo "$name ($preset $*): $(( SECONDS - start )) s"
  cp "$dir/metrics.jsonl" "$dir/config.json" "$OUT/$name/" 2>/dev/null
  rm -rf "$dir"
}

CUDA_VISIBLE_DEVICES=0 train one-moe gpt2-s-moe --grad-accum 2 &
CUDA_VISIBLE_DEVICES=1 train one-dense gpt2-s --grad-accum 2 &
wait
train ep2-eager gpt2-s-moe --cuda-graphs off
train ep1 gpt2-s-moe --ep-size 1
python3 -m weft plot "$OUT/one-moe" "$OUT/one-dense" "$OUT/ep2-eager" "$OUT/ep1" --out "$OUT" --drops-after 200
