#!/usr/bin/env bash
# GPU check on a lent machine (see CONTRIBUTING.md): the GPU tests on NCCL, a short training run,
# `weft bench comm`, then `weft bench layer` for every config with NVLink and with
# NCCL_P2P_DISABLE=1. Logs and JSON go to a work folder packed into $OUT/gpu_check.tar.gz
# (default OUT: ./gpu_out); the tables are printed last.
# Then `weft bench model` (Lancet's modes) for each MODELS entry preset:gate:batch, in the
# REGIMES listed (default p2p_disabled nvlink).
# Knobs: CONFIGS (layer configs; "" skips the layer benchmarks), PEER_CONFIGS, MODES, STEPS, OPTIMIZER,
# ACTIVATION, PEER_ACTIVATION, MODELS ("" skips), MODEL_MODES, REGIMES, SKIP_TESTS, SKIP_TRAIN, SKIP_COMM,
# TRAIN_STEPS, BUDGET_S (no new benchmark starts after that many seconds).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}"
if ls .whl/*.whl > /dev/null 2>&1; then  # optional peers (torchtitan, megatron-core), carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
OUT=${OUT:-./gpu_out}
WORK=$(mktemp -d /tmp/weft_gpu_check.XXXX)
mkdir -p "$OUT"
export WEFT_CACHE="$WORK/cache"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
CONFIGS=${CONFIGS-"qwen2 mixtral phi35 deepseek"}
MODELS=${MODELS-"gpt2-s-moe:topk:8 gpt2-s-moe:bpr:8 gpt2-l-moe:topk:4 gpt2-l-moe:bpr:4"}
REGIMES=${REGIMES:-"p2p_disabled nvlink"}
MODES=${MODES:-"plain,no-comm,torchtitan,megatron"}
STEPS=${STEPS:-20}
OPTIMIZER=${OPTIMIZER:-sgd}
ACTIVATION=${ACTIVATION:-relu}
PEER_ACTIVATION=${PEER_ACTIVATION:-swiglu}
RUN="torchrun --standalone --nproc_per_node=$NGPU -m weft"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"; date -u; } > "$WORK/machine.txt" 2>&1

status=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider > "$WORK/gpu_tests.log" 2>&1 || status=1
fi

if [ "${SKIP_TRAIN:-0}" != 1 ]; then
  $RUN train --preset gpt2-s-moe --steps "${TRAIN_STEPS:-40}" --batch-size 8 --out "$WORK/train_gpt2-s-moe" \
    --sample-tokens 0 > "$WORK/train_gpt2-s-moe.log" 2>&1 || status=1
  for overlap in none lancet; do  # same seed: the losses must agree
    $RUN train --preset gpt2-s-moe --steps 10 --batch-size 8 --overlap $overlap --out "$WORK/overlap_$overlap" \
      --sample-tokens 0 > "$WORK/overlap_$overlap.log" 2>&1 || status=1
  done
  python3 -m weft train --steps 60 --out "$WORK/train_tiny" --sample-tokens 100 > "$WORK/train_tiny.log" 2>&1 || status=1
  python3 -m weft plot "$WORK/train_tiny" > /dev/null 2>&1 || status=1
fi

deadline=$((SECONDS + ${BUDGET_S:-100000}))  # stop starting benchmarks after BUDGET_S seconds
have_time() { [ "$SECONDS" -lt "$deadline" ] || { echo "budget spent: skipping $*" >> "$WORK/skipped.txt"; return 1; }; }
p2p_env() { [ "$1" = p2p_disabled ] && echo "NCCL_P2P_DISABLE=1"; }
bench_comm() {  # regime
  [ "${SKIP_COMM:-0}" = 1 ] && return 0; have_time "comm $1" || return 0
  env $(p2p_env "$1") $RUN bench comm --json "$WORK/comm_$1.json" > "$WORK/comm_$1.log" 2>&1 || status=1
}
bench_layer() {  # config activation regime
  have_time "layer $*" || return 0
  env $(p2p_env "$3") $RUN bench layer --config "$1" --capacity 1.0,dropless --activation "$2" --dtype bf16 \
    --steps "$STEPS" --optimizer "$OPTIMIZER" --modes "$MODES" \
    --json "$WORK/layer_$1_$2_$3.json" > "$WORK/layer_$1_$2_$3.log" 2>&1 || status=1
}
bench_model() {  # preset:gate:batch regime
  have_time "model $*" || return 0
  IFS=: read -r preset gate batch <<< "$1"
  env $(p2p_env "$2") $RUN bench model --preset "$preset" --gate "$gate" --batch-size "$batch" --steps "$STEPS" \
    --modes "${MODEL_MODES:-none,tutel,lancet-bw,lancet-fw,lancet}" \
    --json "$WORK/model_${preset}_${gate}_$2.json" > "$WORK/model_${preset}_${gate}_$2.log" 2>&1 || status=1
}
for regime in $REGIMES; do for m in $MODELS; do bench_model "$m" "$regime"; done; done
# Most important first, so a time budget cuts the least useful runs: NVLink, then the peers'
# gated (swiglu) experts, then the bandwidth-limited regime.
[ -n "$CONFIGS" ] && bench_comm nvlink
for cfg in $CONFIGS; do bench_layer "$cfg" "$ACTIVATION" nvlink; done
if [ -n "$PEER_ACTIVATION" ] && [ "$PEER_ACTIVATION" != "$ACTIVATION" ]; then
  for cfg in ${PEER_CONFIGS:-$CONFIGS}; do bench_layer "$cfg" "$PEER_ACTIVATION" nvlink; done
fi
[ -n "$CONFIGS" ] && bench_comm p2p_disabled
for cfg in $CONFIGS; do bench_layer "$cfg" "$ACTIVATION" p2p_disabled; done

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
for f in "$WORK"/comm_*.log; do [ -f "$f" ] && { echo "== $(basename "$f" .log) =="; grep -E "all_to_all|all_reduce" "$f" | tail -n 20; }; done
[ -f "$WORK/skipped.txt" ] && cat "$WORK/skipped.txt"
for f in "$WORK"/overlap_*.log; do [ -f "$f" ] && { echo "== $(basename "$f" .log) =="; grep -E "step +10|plan|moe|predicted" "$f" | tail -n 8; }; done
for f in "$WORK"/overlap_*/metrics.jsonl; do [ -f "$f" ] && python3 -c "import json,sys; print(sys.argv[1].split('/')[-2], [round(json.loads(l)['loss'], 6) for l in open(sys.argv[1]) if '\"loss\"' in l])" "$f"; done
for f in "$WORK"/model_*.log; do
  [ -f "$f" ] && { echo "== $(basename "$f" .log) =="; grep -A8 "weft bench model" "$f" || tail -n 20 "$f"; }
done
for f in "$WORK"/layer_*.log; do
  [ -f "$f" ] || continue
  echo "== $(basename "$f" .log) =="; grep -A12 "weft bench layer" "$f" || tail -n 20 "$f"
done
# Checkpoints and the token cache stay behind: they are gigabytes.
tar -czf "$OUT/gpu_check.tar.gz" -C "$WORK" --exclude=checkpoints --exclude=cache .
exit $status
