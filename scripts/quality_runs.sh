#!/usr/bin/env bash
# Training-quality runs, back to back on every GPU of the machine, same data, seed and steps:
# each RUNS entry NAME=PRESET[,field=value...] (NAME: letters, digits, - and _; the device returns
# no file whose path holds a comma) trains PRESET with those GPTConfig fields (written
# to a [model] TOML table) for STEPS steps with TRAIN_ARGS, one checkpoint at CKPT_INTERVAL
# (default STEPS); metrics.jsonl, config.json and the log of each land in $OUT/NAME (checkpoints
# are deleted), and `weft plot` overlays them all in $OUT/compare.png with a table of losses and
# drops after step DROPS_AFTER. With SEEDS (e.g. "1 2 3") every run is trained once per seed (as
# NAME-sSEED, with --seed SEED) and the mean final validation loss of each NAME over the seeds is
# printed last: a 600-step run's final loss moves by up to ~0.14 with the seed (docs/benchmarks.md).
#   RUNS="moe=gpt2-s-moe moe-bias=gpt2-s-moe,expert_bias_rate=0.001 dense=gpt2-s" STEPS=600 \
#     TRAIN_ARGS="--batch-size 8 --grad-accum 2" OUT=$OUT bash scripts/quality_runs.sh
#   RUNS="moe=gpt2-s-moe dense=gpt2-s" SEEDS="1 2 3" STEPS=600 TRAIN_ARGS="--batch-size 8" OUT=$OUT \
#     bash scripts/quality_runs.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=${SRC:-$PWD/src}
OUT=${OUT:-./quality_out}
STEPS=${STEPS:-600}
mkdir -p "$OUT"
export WEFT_CACHE=${WEFT_CACHE:-$OUT/cache}
dirs=()
for seed in ${SEEDS:-""}; do
for run in ${RUNS:?set RUNS, e.g. RUNS=\"moe=gpt2-s-moe dense=gpt2-s\"}; do
  name=${run%%=*}${seed:+-s$seed}; spec=${run#*=}; preset=${spec%%,*}
  dir=/tmp/weft_quality/$name
  rm -rf "$dir"; mkdir -p "$dir" "$OUT/$name"
  # one checkpoint, at the end (a gpt2-s-moe checkpoint is ~6 GB: one per 100 steps fills the disk)
  printf '[train]\nckpt_interval = %s\n[model]\n' "${CKPT_INTERVAL:-$STEPS}" > "$dir/model.toml"
  if [ "$spec" != "$preset" ]; then
    tr ',' '\n' <<< "${spec#*,}" | sed 's/=/ = /' >> "$dir/model.toml"
  fi
  start=$(date +%s)
  python3 -m weft train --preset "$preset" --config "$dir/model.toml" --steps "$STEPS" --sample-tokens 0 \
    --out "$dir" ${TRAIN_ARGS:-} ${seed:+--seed "$seed"} > "$OUT/$name/train.log" 2>&1 || { echo "$name failed"; tail -5 "$OUT/$name/train.log"; }
  echo "$name ($spec): $(( $(date +%s) - start )) s"
  cp "$dir/metrics.jsonl" "$dir/config.json" "$OUT/$name/" 2>/dev/null
  rm -rf "$dir/checkpoints"
  dirs+=("$OUT/$name")
done
done
python3 -m weft plot "${dirs[@]}" --out "$OUT" --drops-after "${DROPS_AFTER:-200}"
if [ -n "${SEEDS:-}" ]; then  # each NAME's mean final validation loss over the seeds
  python3 - "$OUT/compare.json" ${RUNS} <<'PY'
import json, statistics, sys
final = {r["name"]: r["final_val_loss"] for r in json.load(open(sys.argv[1]))["runs"]}
for name in (run.split("=")[0] for run in sys.argv[2:]):
    seeds = {k.rsplit("-s", 1)[1]: v for k, v in final.items() if k.rsplit("-s", 1)[0] == name and v is not None}
    if seeds:
        listed = ", ".join(f"{s}: {v:.4f}" for s, v in seeds.items())
        print(f"{name}: mean final val loss {statistics.mean(seeds.values()):.4f} over seeds ({listed})")
PY
fi
