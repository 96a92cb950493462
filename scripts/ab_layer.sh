#!/usr/bin/env bash
# A/B `weft bench layer` between this tree and another weft source tree, alternating (new, old,
# new, old, ...) in one device call so both see the same machine state; prints each run's median
# ms per mode and the new/old ratio with the spread of the repeats, and each side's peak MiB (the
# most over its runs); a row that could not run prints its error.
#   OLD=.old_tree/src CONFIG=qwen2 MODES=plain,d2 ROUNDS=2 bash scripts/ab_layer.sh
# (make the old tree with: mkdir -p .old_tree && git archive COMMIT src | tar -x -C .old_tree, and
# carry `.old_tree`, which .git/info/exclude should ignore). Extra bench flags: BENCH_ARGS.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OLD=${OLD:?set OLD to the other tree\'s src folder}
CONFIG=${CONFIG:-qwen2}
MODES=${MODES:-plain,d2}
ROUNDS=${ROUNDS:-2}
OUT=${OUT:-./ab_out}
mkdir -p "$OUT"
NGPU=$(python3 -c "import torch; print(max(1, torch.cuda.device_count()))")
status=0
for round in $(seq 1 "$ROUNDS"); do
  for side in new old; do
    src=$PWD/src; [ "$side" = old ] && src=$(cd "$OLD" && pwd)
    PYTHONPATH="$src" torchrun --standalone --nproc_per_node="$NGPU" -m weft bench layer --config "$CONFIG" \
      --modes "$MODES" --json "$OUT/ab_${side}_${round}.json" ${BENCH_ARGS:-} > "$OUT/ab_${side}_${round}.log" 2>&1 \
      || { status=1; tail -n 20 "$OUT/ab_${side}_${round}.log"; }
  done
done
python3 - "$OUT" <<'PY'
import glob, json, statistics, sys
runs, peaks = {}, {}
for path in sorted(glob.glob(f"{sys.argv[1]}/ab_*.json")):
    side = path.split("ab_")[-1].split("_")[0]
    for row in json.load(open(path))["results"]:
        key = (row["mode"], "dropless" if row["capacity_factor"] is None else f"cf{row['capacity_factor']:g}")
        if row.get("median_ms") is None:
            print(f"{key[0]} {key[1]} ({side}): {row.get('error') or 'no time'}")
            continue
        runs.setdefault(key, {}).setdefault(side, []).append(row["median_ms"])
        if row.get("peak_mib") is not None:
            peaks.setdefault(key, {}).setdefault(side, []).append(row["peak_mib"])
print(f"{'mode':<12} {'capacity':<9} {'new ms (runs)':<24} {'old ms (runs)':<24} {'new/old':>8}  peak MiB new / old")
for (mode, cap), sides in sorted(runs.items()):
    new, old = sides.get("new", []), sides.get("old", [])
    ratio = statistics.mean(new) / statistics.mean(old) if new and old else float("nan")
    peak = {side: max(values) for side, values in peaks.get((mode, cap), {}).items()}
    peak_cell = " / ".join(f"{peak[side]:,.0f}" if side in peak else "-" for side in ("new", "old"))
    print(f"{mode:<12} {cap:<9} {', '.join(f'{v:.3f}' for v in new):<24} {', '.join(f'{v:.3f}' for v in old):<24} "
          f"{ratio:>8.3f}  {peak_cell}")
PY
exit $status
