#!/usr/bin/env bash
# `weft train --grad-reduce overlap` against `after` on every GPU of the machine, interleaved
# (preset by preset, the modes back to back, ROUNDS times): median tokens/s, MFU and peak memory
# after WARM (scripts/train_mfu.sh), and each run's per-step losses side by side. Logs and
# metrics under $OUT/<mode><round>/.
#   RUNS="gpt2-s-moe:8 gpt2-l-moe:4" ROUNDS=1 STEPS=16 NCCL_P2P_DISABLE=1 OUT=$OUT bash scripts/grad_reduce_train.sh
# EXTRA_ARGS: more `weft train` flags for every run (e.g. "--ep-size 1": the experts replicated, their
# gradients summed over the replicas too).
set -uo pipefail
OUT=${OUT:-./grad_reduce_out}
for round in $(seq 1 "${ROUNDS:-1}"); do
  for run in ${RUNS:-gpt2-s-moe:8}; do
    preset=${run%%:*}; batch=${run##*:}
    for mode in ${MODES:-overlap after}; do
      dir=$OUT/$mode$round
      RUNS="$run" KERNELS=auto STEPS=${STEPS:-16} WARM=${WARM:-6} OUT=$dir TRAIN_ARGS="--grad-reduce $mode ${EXTRA_ARGS:-}" \
        bash scripts/train_mfu.sh | sed "s/^/$mode round $round: /"
      cp "/tmp/weft_mfu/${preset}_b${batch}_auto_graphs-auto_master-auto/metrics.jsonl" "$dir/${preset}_metrics.jsonl"
    done
  done
done
python3 - "$OUT" <<'PY'
import glob, json, os, sys
for path in sorted(glob.glob(f"{sys.argv[1]}/*/*_metrics.jsonl")):
    rows = [r for r in map(json.loads, open(path)) if "loss" in r]
    run = os.path.relpath(path, sys.argv[1]).replace("_metrics.jsonl", "")
    print(f"{run:32s} losses " + " ".join(f"{r['loss']:.4f}" for r in rows[:8]))
PY
