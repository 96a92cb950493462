#!/usr/bin/env bash
# Training-quality runs, back to back on every GPU of the machine, same data, seed and steps:
# each RUNS entry NAME=PRESET[,field=value...] (NAME: letters, digits, - and _; the device returns
# no file whose path holds a comma) trains PRESET with those GPTConfig fields (written
# to a [model] TOML table) for STEPS steps with TRAIN_ARGS, one checkpoint at CKPT_INTERVAL
# (default STEPS); metrics.jsonl, config.json and the log of each land in $OUT/NAME (checkpoints
# are deleted), and `weft plot` overlays them all in $OUT/compare.png with a table of losses and
# drops after step DROPS_AFTER.
#   RUNS="moe=gpt2-s-moe moe-bias=gpt2-s-moe,expert_bias_rate=0.001 dense=gpt2-s" STEPS=600 \
#     TRAIN_ARGS="--batch-size 8 --grad-accum 2" OUT=$OUT bash scripts/quality_runs.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=${SRC:-$PWD/src}
OUT=${OUT:-./quality_out}
STEPS=${STEPS:-600}
mkdir -p "$OUT"
export WEFT_CACHE=${WEFT_CACHE:-$OUT/cache}
dirs=()
for run in ${RUNS:?set RUNS, e.g. RUNS=\"moe=gpt2-s-moe dense=gpt2-s\"}; do
  name=${run%%=*}; spec=${run#*=}; preset=${spec%%,*}
  dir=/tmp/weft_quality/$name
  rm -rf "$dir"; mkdir -p "$dir" "$OUT/$name"
  # one checkpoint, at the end (a gpt2-s-moe checkpoint is ~6 GB: one per 100 steps fills the disk)
  printf '[train]\nckpt_interval = %s\n[model]\n' "${CKPT_INTERVAL:-$STEPS}" > "$dir/model.toml"
  if [ "$spec" != "$preset" ]; then
    tr ',' '\n' <<< "${spec#*,}" | sed 's/=/ = /' >> "$dir/model.toml"
  fi
  start=$(date +%s)
  python3 -m weft train --preset "$preset" --config "$dir/model.toml" --steps "$STEPS" --sample-tokens 0 \
    --out "$dir" ${TRAIN_ARGS:-} > "$OUT/$name/train.log" 2>&1 || { echo "$name failed"; tail -5 "$OUT/$name/train.log"; }
  echo "$name ($spec): $(( $(date +%s) - start )) s"
  cp "$dir/metrics.jsonl" "$dir/config.json" "$OUT/$name/" 2>/dev/null
  rm -rf "$dir/checkpoints"
  dirs+=("$OUT/$name")
done
python3 -m weft plot "${dirs[@]}" --out "$OUT" --drops-after "${DROPS_AFTER:-200}"
