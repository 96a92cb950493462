#!/usr/bin/env bash
# The 2-GPU measurements the open issues wait on, in parts that each fit one device call (<= 600 s)
# on nvidia-h200-x2. Logs and JSON under $OUT/<part>/; each part's tables are printed last.
#   PARTS="tests balance" OUT=$OUT bash scripts/x2_pending.sh
# A device call returns at most 8 files: by default (PACK=1, below) the run is packed into two; PACK=0 streams.
# The peers of the domino part come as wheels: `bash scripts/peer_wheels.sh` here, then carry .whl.
# Parts:
#   tests    the GPU tests of Pro-Prophet's copies and block-wise schedule, of TP for MoE models, of
#            bf16 master weights with expert parallelism, of asynchronous host copies and of the one
#            synchronisation of a dropless call (several minutes:
#            each master-weights test trains four short runs)
#   balance  Pro-Prophet: the qwen2 layer at skew 1.2 and 0, phi35 and mixtral at skew 1.2 (plain vs
#            balance, the plan's predicted time, the load max/mean per expert and per rank; for qwen2 at
#            1.2 also balance-copy, the heaviest expert copied whatever the plan, and every mode's GPU
#            time by stage), and whole
#            iterations of qwen2-moe-2l, dropless, skewed (none / balance / balance-inline: the share
#            of Trans and Agg under computation); BALANCE_LAYERS (config:skew) and BALANCE_MODEL=0 to split it,
#            BALANCE_STEPS (default 20) for less noise (the no-skew cost, goal <= 2%, sat inside the IQR at 20)
#   slots    Pro-Prophet's copies in replica slots on Comet's dropless path: its GPU test (with Pro-Prophet's
#            NCCL copies' and Comet's dropless graph's), and the layer as CUDA graphs, comet+graph against
#            balance-comet+graph twice each, for SLOTS_LAYERS (config:skew; phi35 at 1.2, 2 and 0, qwen2 and
#            mixtral at 2; config:skew:rounds for --balance-rounds), NVLink; SLOTS_OVERHEAD=none plans without
#            the copy overhead (default measured: for +graph timed as graphs); SLOTS_TESTS=0 skips the tests,
#            SLOTS_TESTS_K picks them (pytest -k), SLOTS_PLACEMENT=updated times the graph shaped for any
#            placement (as graphed training runs it),
#            SLOTS_PROFILE=1 SLOTS_TRACE=1 keep one profiled step's traces; SLOTS_TOKENS (tokens per rank, default the
#            bench's 4096)
#   domino   Domino: gpt3-2.7b iterations with TP 2 (tp / domino / no-comm) and 4 of its blocks beside
#            Megatron-Core's block and DeepSpeed's Domino (bench tp, batch 8, weft's schedules eager and
#            graphed, domino-copy with NVLink; wheels carried in .whl/), and the
#            blocks' steps as CUDA graphs (none+graph / domino+graph), NVLink and NCCL_P2P_DISABLE=1,
#            and `--tp-overlap auto`'s choice in a short run
#   dominopreset  Domino on all 32 gpt3-2.7b blocks (bench tp, batch 8, graphed): none / domino-copy (NVLink)
#            or domino (NCCL_P2P_DISABLE=1) / no-comm, each Domino and none twice (REGIMES to pick)
#   tpmoe    TP 2 on the MoE presets' attention: qwen2-moe-2l iterations (tp / domino / no-comm)
#   tpgraph  TP training steps as CUDA graphs: their GPU test (graphed losses = eager losses), then
#            `weft train --preset gpt3-2.7b --tp 2` graphed with --tp-overlap none and domino (and
#            domino-copy with NVLink), NVLink and NCCL_P2P_DISABLE=1 (tokens/s and MFU, medians after step 4;
#            one regime per call: REGIMES=nvlink)
#   settle   what Comet's and Hardware speed's Done-when still wait on (~5 min: PACK_S=400): every Comet GPU test
#            on 2 GPUs but comet_kernels_match (a one-GPU kernel test, 388 s, passed on one H200 at a969514;
#            SETTLE_KERNELS=1 adds it last) and the no-comm dropless graph's, the dropless layer for qwen2, phi35 and mixtral against the
#            dropless no-comm bound as a graph (comet+graph / no-comm+graph / dedup-fixed-own+graph, Comet and
#            no-comm twice), and the expert matmuls' rate at cf 1.0 (no-comm / plain / comet eager with
#            --breakdown: the experts stage's TFLOP/s, the issue's >= 600 for no-comm), NVLink
#   p2ptrace where phi35's pipelined step loses to the link (issue: Overlap that pays; ~2 min): phi35 at cf 1.0 with
#            NCCL_P2P_DISABLE=1, plain+graph / d2+graph / no-comm+graph, one profiled step each kept as a trace and
#            d2's and plain's kernel timelines per stream printed (scripts/trace_timeline.py). A link-bound model of
#            d2 (two full exchanges each way at the measured ~1.53 ms, the experts and weight gradients under them,
#            then SGD) gives ~7.3 ms; it ran 8.5-8.6
#   comet    Comet: its GPU tests on 2 GPUs (symmetric memory), the layer (plain+graph / comet+graph /
#            no-comm+graph, NVLink, cf 1.0) for qwen2, phi35 and mixtral, qwen2 dropless (plain /
#            comet / auto, which times comet as a candidate; eager), and qwen2-moe-2l training
#            with --kernels comet against auto (losses step by step, tokens/s)
#   cometdropless  dropless Comet with its counts on the GPU (issue: Comet; ~6 min): its GPU tests (no sync in a
#            call, the step replayed as a graph, the map kernel), the dropless layer (plain / comet+graph / comet /
#            dedup-fixed+graph / no-comm, then auto+graph, which times Comet's graph) for qwen2, phi35 and mixtral with
#            NVLink, and qwen2-moe-2l dropless training, batch 8: --kernels triton / comet (14 steps), --a2a-algo auto /
#            --kernels comet (30 steps, medians of steps 16-30)
#   cometfused  Comet with the activation in layer0's epilogue (issues: Comet, Hardware speed; over 10 min in all:
#            split it with COMET_NVLINK=0, COMET_CONFIGS, COMET_TRAIN=0): every Comet GPU test on 2 GPUs (with
#            the one-pass routing's and the plain layer's topk equivalence, the routing kernels on CUDA, the
#            bench's dropless auto+graph with Comet's candidate and the no-comm dropless graph), layer0 across NVLink
#            with its own rows read in place against every row copied first (scripts/comet_nvlink.py), the issue's
#            layer tables for qwen2, phi35 and mixtral (cf 1.0: plain+graph / comet+graph / no-comm+graph /
#            comet+graph; dropless: plain / comet+graph / no-comm+graph / comet+graph), and
#            qwen2-moe-2l training, batch 8, --kernels triton / comet, padded (the preset's cf 1.25, swiglu:
#            its backward fused) and dropless (12 steps, medians of steps 6-12)
#   overlap  Tutel's pipelining and Lancet (issue: overlap that pays): the layer (plain / auto / d2 /
#            no-comm) for qwen2, phi35 and mixtral at cf 1.0, and gpt2-s-moe iterations (none / tutel /
#            lancet), with NCCL_P2P_DISABLE=1 (the multi-node stand-in) and with NVLink (REGIMES="p2p_disabled nvlink")
#   dedup    each token to a rank once (a2a_algo="dedup"; issues: Overlap that pays, Hardware speed): its
#            GPU test (reference, graph replay, bitwise runs; with those of auto+graph and of the metrics'
#            read), the layer (plain / dedup / dedup-d2 / auto / no-comm, eager at cf 1.0 and dropless,
#            and as CUDA graphs at cf 1.0 with auto+graph) for qwen2, phi35 and mixtral,
#            NCCL_P2P_DISABLE=1 and NVLink (REGIMES="p2p_disabled nvlink"; one regime per call fits)
#   autograph  the issue's layer tables with auto as CUDA graphs (issue: Overlap that pays; ~4 min): its GPU tests,
#            then qwen2, phi35 and mixtral with NCCL_P2P_DISABLE=1 at cf 1.0 (plain+graph / auto+graph / no-comm+graph)
#            and dropless (plain / auto+graph / no-comm), and with NVLink at cf 1.0 against the fixed settings (dedup,
#            d2, comet; as graphs)
#   kernels  where the graphed layer's time goes (issue: Hardware speed): qwen2, phi35 and mixtral at cf 1.0,
#            plain+graph / no-comm+graph / dedup+graph with --breakdown (the top kernels by name per mode),
#            NVLink (REGIMES to change it)
#   deduptrain  qwen2-moe-2l training, batch 8, graphed, with --a2a-algo in ALGOS (default linear, dedup,
#            dedup-d2, auto, then linear and dedup-d2 again), P2P disabled and NVLink (one regime per call)
#   fixed    dropless dedup in fixed-size exchanges (a2a_algo="dedup-fixed") and auto's choice of it (issues:
#            Overlap that pays, Hardware speed): their GPU tests, the dropless layer (FIXED_MODES, default plain /
#            auto+graph, the fastest of auto's eager call and the dedup-fixed forms as graphs /
#            dedup-fixed+graph, its pipelined d2 graph and its own-pairs-apart graph) for qwen2, phi35 and mixtral
#            (FIXED_TRACE=1: phi35's FIXED_TRACE_MODE graph, default dedup-fixed-own+graph, profiled too, its kernel
#            timeline per stream printed by scripts/trace_timeline.py), and
#            qwen2-moe-2l dropless training (batch 8, --a2a-algo in FIXED_ALGOS: default auto, which says what it
#            measured, then dedup), P2P disabled and NVLink (REGIMES; one regime per call fits)
#   tutel    `weft train --overlap tutel` graphed (the degree measured fastest as a CUDA graph) against
#            `none`, qwen2-moe-2l batch 8, NCCL_P2P_DISABLE=1 and NVLink: its GPU test, tokens/s, MFU,
#            the chosen degree and the losses (issues: Overlap that pays, Hardware speed)
#   lancet   `weft train --overlap lancet` graphed (the MoE layers' pipelining degree timed as graphs, as tutel's, and
#            its dW schedule kept if its graph replays faster) against `none` and `tutel` (LANCET_OVERLAPS),
#            gpt2-s-moe batch 8 (LANCET_RUNS), P2P disabled and NVLink (REGIMES): its GPU tests (with the dW items
#            under pipelined chunks and the eager passes on NCCL), tokens/s, MFU, what each chose (issue: Overlap
#            that pays)
#   modelgraph  whole training iterations per overlap mode with each mode's step one CUDA graph (bench model
#            --cuda-graphs on; none / tutel / lancet / none) for gpt2-s-moe (topk, bpr; batch 8) and gpt2-l-moe
#            (batch 4, as its eager tables) (MODELS, preset:gate:batch),
#            NCCL_P2P_DISABLE=1 and NVLink (REGIMES; one regime per call). Every mode's graph and gradients stay
#            alive for the timing: gpt2-l-moe fits two modes on 80 GiB, so it runs none,tutel,none then
#            none,lancet,none (~60 s each on 2 x H100); MODEL_MODES (a space-separated list of mode lists) to
#            choose; 20 s before MODEL_TIMEOUT (default 280) every rank prints its Python stacks
#   mfu      weft train's MFU (issue: Hardware speed): qwen2-moe-2l batch 12 and gpt2-s-moe batch 16,
#            bf16 master weights on and off
#   balancetrain  Pro-Prophet in training (issue: Pro-Prophet): qwen2-moe-2l dropless, batch 2, `weft train
#            --balance` none / pro-prophet / none / pro-prophet (BALANCE_RUNS), bf16 master weights in both;
#            tokens/s (median after step 5), the copies, the losses (~200 s on 4 x H100: run it on every GPU of the
#            machine, where the rank loads are higher); BALANCE_TRAIN_KERNELS=comet BALANCE_TRAIN_ARGS="--cuda-graphs
#            on": Comet's path, where both runs replay CUDA graphs (the balanced one's copies following the loads),
#            else eager (a dropless layer reads its counts); BALANCE_TRAIN_BATCH, BALANCE_TRAIN_STEPS,
#            BALANCE_TRAIN_PRESET (default qwen2-moe-2l), BALANCE_TRAIN_SKEW (the model's routing_skew: a
#            Zipf(S) prior on the routers' logits, a load that stays skewed; default 0), BALANCE_TRAIN_AUX (its
#            aux_loss_coef, default 0.01: 0 leaves nothing pushing the load back to balance); the 1.2x run of
#            docs/balance.md: BALANCE_TRAIN_PRESET=phi35-moe-2l BALANCE_TRAIN_SKEW=1.5 BALANCE_TRAIN_AUX=0
#            BALANCE_TRAIN_STEPS=16 with "--balance-rounds 2 --lr 3e-4" in BALANCE_TRAIN_ARGS (at the old
#            default lr 3e-3 its routers collapsed onto one expert a rank by step 7; the default is now 1.9e-4)
#   ckpt     how long a checkpoint holds training, in the step against in the background (the main job):
#            scripts/checkpoint_stall.py on gpt3-2.7b (2.5B parameters with AdamW state, one GPU) and
#            gpt2-s, then `weft train --preset gpt3-2.7b --tp 2` 12 steps with a checkpoint every 4,
#            --async-checkpoint on and off (the run's wall time; the step times leave the save out)
#   gradsum  the gradients' sums over the data-parallel ranks (issue: Overlap that pays; ~6 min, run
#            with PARTS=gradsum): their GPU tests (the mean inside NCCL's all-reduce in bf16 and on its
#            own group, the sums during the backward, the weights some ranks lack a gradient for), then
#            `--grad-reduce after` against `overlap` on gpt2-s-moe batch 8 (after's per-step host
#            exchange), and `--ep-size 1 --grad-accum 2` (peak memory with the adopted accumulators)
#   sgdbw    the experts' SGD step in their weight-gradient GEMMs (issue: Hardware speed; run
#            with PARTS=sgdbw): its GPU test on both GPUs, then Tutel's protocol (`--optimizer sgd`) for
#            qwen2, phi35 and mixtral at cf 1.0 and dropless, comet+graph against
#            comet+sgd-in-backward+graph, comet+graph timed twice (the goals: 2.0 / 4.5 / 8.5 ms), and
#            the plain exchange's plain+sgd-in-backward (eager: its dropless calls read counts); one
#            process per capacity, with each mode's energy a step (~7 min)
#   qkv      the qkv split's backward in one pass and the norms that write bf16 (issue: Hardware speed;
#            one GPU is enough; run with PARTS=qkv OLD=_old/src MID=_mid/src, the trees before both and
#            before the norms, carried from `git archive df73cbe src` and `git archive 7c8318a src`): their
#            GPU tests, then `weft train` on GPU 0, QKV_RUNS (default gpt2-l-moe:8; gpt2-s-moe:8 in a
#            second call), old / mid / new twice (`scripts/train_mfu.sh`: medians after step 5; ~6 min;
#            without MID old / new)
#   quality  gpt2-s-moe against its dense twin gpt2-s, 600 steps, the issue's global batch, seeds 1337,
#            1 and 2 (issue: training quality): drops after step 200, validation losses and their
#            means over the seeds, overlay plot (~300 s on 2 x H100)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}"
OUT=${OUT:-./x2_out}
# Only 8 files come back from a device call: PACK=1 (the default) runs the parts under a time limit (PACK_S, default 540 s)
# and leaves $OUT holding two files, the printed tables (summary.txt) and every log and JSON (x2.tgz).
if [ "${PACK:-1}" = 1 ]; then
  mkdir -p "$OUT"
  PACK=0 timeout "${PACK_S:-540}" bash "$0" > /tmp/x2_summary.txt 2>&1
  echo "(exit $?)" >> /tmp/x2_summary.txt
  tar czf /tmp/x2.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/x2.tgz "$OUT/"
  cp /tmp/x2_summary.txt "$OUT/summary.txt"
  cat /tmp/x2_summary.txt
  exit 0
fi
if ls .whl/*.whl > /dev/null 2>&1; then  # optional peers (megatron-core, deepspeed), carried as wheels (bench/peers.py)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
export WEFT_CACHE=${WEFT_CACHE:-/tmp/weft_cache}
RUN="torchrun --standalone --nproc_per_node=$(python3 -c 'import torch; print(max(1, torch.cuda.device_count()))') -m weft"
QUIET='^W1\|^\[W\|OMP_NUM\|UserWarning\|warnings.warn\|return func'

stacks_at() {  # SECONDS: then every weft rank prints its Python stacks (weft's SIGUSR1 handler): where a run
  # that is about to be cut by its timeout waits. Found through /proc: the device image has no pgrep
  sleep "$1"
  for proc in /proc/[0-9]*; do
    cmd=$(tr '\0' ' ' < "$proc/cmdline" 2>/dev/null) || continue
    case "$cmd" in *torchrun*) ;; *"-m weft "*) kill -USR1 "${proc#/proc/}" 2>/dev/null ;; esac
  done
}

keep_metrics() {  # RUN_DIR DEST: a training run's metrics and config, not its checkpoints (GBs: they
  # would not come back from the device, and nor would a tarball holding them)
  mkdir -p "$2" && cp "$1/metrics.jsonl" "$1/config.json" "$2/" 2>/dev/null
  rm -rf "$1"
}

part_tests() {
  python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider \
    -k "replicated or blockwise or tensor_parallel_moe or tensor_parallel_peers or master_weights or host_values or synchronises_once or every_exchange_computes" > "$1/tests.log" 2>&1
  tail -n 15 "$1/tests.log"
}

part_balance() {
  for layer in ${BALANCE_LAYERS:-qwen2:1.2 qwen2:0 phi35:1.2 mixtral:1.2}; do
    config=${layer%%:*}; skew=${layer##*:}
    # qwen2 skewed: one copy's cost (balance-copy) and every mode's time by stage as well
    extra=""; [ "$layer" = qwen2:1.2 ] && extra="balance-copy,"
    breakdown=""; [ "$layer" = qwen2:1.2 ] && breakdown="--breakdown"
    $RUN bench layer --config "$config" --capacity dropless --skew "$skew" \
      --modes "plain,balance,${extra}plain,balance" $breakdown \
      --dtype bf16 --activation relu --optimizer sgd --steps ${BALANCE_STEPS:-20} --json "$1/layer_${config}_skew$skew.json" \
      > "$1/layer_${config}_skew$skew.log" 2>&1
    grep -v "$QUIET" "$1/layer_${config}_skew$skew.log" | tail -n 40
  done
  [ "${BALANCE_MODEL:-1}" = 1 ] || return 0
  $RUN bench model --preset qwen2-moe-2l --capacity dropless --skew 1 --batch-size 2 \
    --modes none,balance,balance-inline,balance --steps 10 --warmup 3 --json "$1/model.json" > "$1/model.log" 2>&1
  grep -v "$QUIET" "$1/model.log" | tail -n 14
}

part_slots() {
  if [ "${SLOTS_TESTS:-1}" = 1 ]; then
    python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider \
      -k "${SLOTS_TESTS_K:-replica_slots or replicated_experts or dropless_comet_replays}" > "$1/tests.log" 2>&1
    tail -n 15 "$1/tests.log"
  fi
  for layer in ${SLOTS_LAYERS:-phi35:1.2 phi35:2 phi35:0 qwen2:2 mixtral:2 phi35:1.2:2 phi35:2:2 phi35:2:3}; do
    IFS=: read -r config skew rounds <<< "$layer"; rounds=${rounds:-1}; name="${config}_skew${skew}_r$rounds"
    timeout ${SLOTS_RUN_S:-150} $RUN bench layer --config "$config" --capacity dropless --skew "$skew" --balance-rounds "$rounds" \
      --copy-overhead ${SLOTS_OVERHEAD:-measured} \
      --modes "comet+graph,balance-comet+graph,comet+graph,balance-comet+graph" --baseline comet+graph \
      --dtype bf16 --activation relu --optimizer sgd --steps ${SLOTS_STEPS:-20} --profile-steps ${SLOTS_PROFILE:-0} \
      --graph-placement ${SLOTS_PLACEMENT:-captured} ${SLOTS_TOKENS:+--tokens-per-rank "$SLOTS_TOKENS"} \
      ${SLOTS_TRACE:+--trace "$1/trace"} --json "$1/slots_$name.json" > "$1/slots_$name.log" 2>&1
    echo "-- $name"; grep -v "$QUIET" "$1/slots_$name.log" | grep -A4 "capacity  *mode"
  done
}

part_domino() {
  for regime in nvlink p2p_disabled; do
    [ "$regime" = p2p_disabled ] && export NCCL_P2P_DISABLE=1 || unset NCCL_P2P_DISABLE
    $RUN bench model --preset gpt3-2.7b --tp 2 --batch-size 4 --modes tp,domino,no-comm,tp --steps 10 \
      --warmup 3 --json "$1/model_$regime.json" > "$1/model_$regime.log" 2>&1
    grep -v "$QUIET" "$1/model_$regime.log" | tail -n 10
    # the peers (eager) in the same run as weft's graphed schedules (domino-copy where the GPUs reach each other)
    $RUN bench tp --config gpt3-2.7b --layers 4 --batch-size 8 \
      --modes none,domino,no-comm,megatron,deepspeed,none+graph,domino+graph$([ "$regime" = nvlink ] && echo ,domino-copy+graph),no-comm+graph \
      --steps 10 --warmup 3 --json "$1/blocks_$regime.json" > "$1/blocks_$regime.log" 2>&1
    grep -v "$QUIET" "$1/blocks_$regime.log" | tail -n 11
    # the steps captured as CUDA graphs with their NCCL all-reduces (apart: a failed capture stops the run)
    timeout 240 $RUN bench tp --config gpt3-2.7b --layers 4 --batch-size 4 \
      --modes none,none+graph,domino+graph,domino,none+graph$([ "$regime" = nvlink ] && echo ,domino-copy+graph) \
      --steps 10 --warmup 3 \
      --json "$1/graphs_$regime.json" > "$1/graphs_$regime.log" 2>&1
    grep -v "$QUIET" "$1/graphs_$regime.log" | tail -n 7
  done
  unset NCCL_P2P_DISABLE
  $RUN train --preset gpt3-2.7b --tp 2 --tp-overlap auto --batch-size 4 --steps 6 \
    --sample-tokens 0 --out /tmp/weft_x2/train_auto > "$1/train_auto.log" 2>&1
  keep_metrics /tmp/weft_x2/train_auto "$1/train_auto"
  grep "tp-overlap auto\|step 6" "$1/train_auto.log"
}

part_dominopreset() {
  # the whole dense preset (all 32 blocks), graphed: the issue's best Domino per regime against plain TP, twice each
  for regime in ${REGIMES:-nvlink p2p_disabled}; do
    [ "$regime" = p2p_disabled ] && export NCCL_P2P_DISABLE=1 || unset NCCL_P2P_DISABLE
    best=$([ "$regime" = nvlink ] && echo domino-copy || echo domino)
    timeout 200 $RUN bench tp --config gpt3-2.7b --layers 32 --batch-size 8 \
      --modes none+graph,$best+graph,no-comm+graph,none+graph,$best+graph --steps 10 --warmup 3 --profile-steps 0 \
      --json "$1/preset_$regime.json" > "$1/preset_$regime.log" 2>&1
    grep -v "$QUIET" "$1/preset_$regime.log" | tail -n 6
  done
  unset NCCL_P2P_DISABLE
}

part_tpmoe() {
  $RUN bench model --preset qwen2-moe-2l --tp 2 --batch-size 2 --modes tp,domino,no-comm,tp --steps 10 \
    --warmup 3 --json "$1/model.json" > "$1/model.log" 2>&1
  grep -v "$QUIET" "$1/model.log" | tail -n 10
}

part_tpgraph() {
  gpu_tests "$1" tensor_parallel_training_replays
  for regime in ${REGIMES:-p2p_disabled nvlink}; do
    [ "$regime" = p2p_disabled ] && export NCCL_P2P_DISABLE=1 || unset NCCL_P2P_DISABLE
    for overlap in none domino $([ "$regime" = nvlink ] && echo domino-copy); do
      timeout 110 python3 -m weft train --preset gpt3-2.7b --tp 2 --tp-overlap "$overlap" --batch-size 4 --steps 10 \
        --sample-tokens 0 --out "/tmp/weft_x2/tp_${regime}_$overlap" > "$1/train_${regime}_$overlap.log" 2>&1
      keep_metrics "/tmp/weft_x2/tp_${regime}_$overlap" "$1/train_${regime}_$overlap"
      python3 - "$1/train_${regime}_$overlap/metrics.jsonl" "$regime $overlap" <<'PY'
import json, os, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])] if os.path.exists(sys.argv[1]) else []
steps = [r for r in rows if "tokens_per_s" in r and r["step"] > 4]
print(f"{sys.argv[2]:<22}", "no metrics" if not steps else
      f"tokens/s {statistics.median(r['tokens_per_s'] for r in steps):>9,.0f}  MFU "
      f"{100 * statistics.median(r['mfu'] for r in steps):5.1f}%  losses "
      + " ".join(f"{r['loss']:.4f}" for r in rows if "loss" in r))
PY
      grep -h "CUDA graph\|eager steps" "$1/train_${regime}_$overlap.log" | head -1
    done
  done
  unset NCCL_P2P_DISABLE
}

part_comet() {
  python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -k "comet" > "$1/tests.log" 2>&1
  tail -n 5 "$1/tests.log"
  for config in qwen2 phi35 mixtral; do
    $RUN bench layer --config "$config" --capacity 1.0 --dtype bf16 --activation relu --optimizer sgd \
      --modes plain+graph,comet+graph,no-comm+graph,plain+graph,comet+graph --baseline plain+graph --steps 20 \
      --warmup 5 --json "$1/layer_$config.json" > "$1/layer_$config.log" 2>&1
    grep -v "$QUIET" "$1/layer_$config.log" | tail -n 8
  done
  $RUN bench layer --config qwen2 --capacity dropless --dtype bf16 --activation relu --optimizer sgd \
    --modes plain,comet,auto,plain,comet --steps 10 --warmup 3 --json "$1/layer_qwen2_dropless.json" \
    > "$1/layer_qwen2_dropless.log" 2>&1
  grep -v "$QUIET" "$1/layer_qwen2_dropless.log" | tail -n 6
  for kernels in auto comet; do
    $RUN train --preset qwen2-moe-2l --kernels "$kernels" --batch-size 2 --steps 16 --sample-tokens 0 \
      --out "/tmp/weft_x2/train_$kernels" > "$1/train_$kernels.log" 2>&1
    keep_metrics "/tmp/weft_x2/train_$kernels" "$1/train_$kernels"
    grep "step 16" "$1/train_$kernels.log"
  done
}

part_cometdropless() {
  gpu_tests "$1" "dropless_comet_replays or comets_map_kernel"
  for config in qwen2 phi35 mixtral; do
    for modes in plain,comet+graph,comet,dedup-fixed+graph,no-comm,plain,comet+graph plain,auto+graph,comet+graph,plain; do
      name=${modes//[+,]/_}
      $RUN bench layer --config "$config" --capacity dropless --dtype bf16 --activation relu --optimizer sgd \
        --modes "$modes" --steps 20 --warmup 5 --json "$1/${config}_$name.json" > "$1/${config}_$name.log" 2>&1
      grep -v "$QUIET" "$1/${config}_$name.log" | grep -A 8 "capacity  *mode"
    done
  done
  printf '[model]\ncapacity_factor = "dropless"\n[train]\nckpt_interval = 1000\n' > "$1/dropless.toml"
  for run in "14 5 --kernels triton" "14 5 --kernels comet" "30 15 --a2a-algo auto" "30 15 --kernels comet"; do
    read -r steps after args <<< "$run"; name="${steps}_${args//[ -]/}"
    $RUN train --preset qwen2-moe-2l $args --batch-size 8 --steps "$steps" --sample-tokens 0 \
      --config "$1/dropless.toml" --out "/tmp/weft_x2/train_$name" > "$1/train_$name.log" 2>&1
    keep_metrics "/tmp/weft_x2/train_$name" "$1/train_$name"
    grep -h "CUDA graph\|eager steps\|dropless; measured" "$1/train_$name.log" | head -1
    python3 - "$1/train_$name/metrics.jsonl" "$after" <<'PY'
import json, statistics, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "loss" in r]
late = [r for r in rows if r["step"] > int(sys.argv[2])]
print(f"  median tokens/s {statistics.median(r['tokens_per_s'] for r in late):,.0f}, losses "
      + " ".join(f"{r['loss']:.4f}" for r in rows))
PY
  done
}

part_settle() {
  gpu_tests "$1" "(comet and not comet_kernels_match) or no_comm_dropless"
  for config in qwen2 phi35 mixtral; do
    $RUN bench layer --config "$config" --capacity dropless --dtype bf16 --activation relu --optimizer sgd \
      --modes comet+graph,no-comm+graph,dedup-fixed-own+graph,comet+graph,no-comm+graph --baseline no-comm+graph \
      --steps 20 --warmup 5 --json "$1/dropless_$config.json" > "$1/dropless_$config.log" 2>&1
    grep -v "$QUIET" "$1/dropless_$config.log" | grep -A 6 "capacity  *mode\\|^exchange hidden\\|^GPU at the end"
    $RUN bench layer --config "$config" --capacity 1.0 --dtype bf16 --activation relu --optimizer sgd \
      --modes no-comm,plain,comet --steps 10 --warmup 3 --profile-steps 2 --breakdown \
      --json "$1/experts_$config.json" > "$1/experts_$config.log" 2>&1
    grep -v "$QUIET" "$1/experts_$config.log" | grep -A 4 "capacity  *mode\|^experts stage"
  done
  if [ "${SETTLE_KERNELS:-0}" = 1 ]; then  # a one-GPU test: passed on one H200 at a969514 (388 s)
    mkdir -p "$1/kernels" && gpu_tests "$1/kernels" comet_kernels_match
  fi
}

part_p2ptrace() {
  set_regime p2p_disabled
  $RUN bench layer --config phi35 --capacity 1.0 --dtype bf16 --activation relu --optimizer sgd \
    --modes plain+graph,d2+graph,no-comm+graph --baseline plain+graph --steps 10 --warmup 3 --profile-steps 1 \
    --trace /tmp/weft_p2ptrace > "$1/phi35.log" 2>&1  # the traces stay there (large); their timelines are printed
  grep -v "$QUIET" "$1/phi35.log" | grep -A 5 "capacity  *mode\\|^exchange hidden\\|^GPU at the end"
  for mode in d2+graph plain+graph; do
    python3 scripts/trace_timeline.py "/tmp/weft_p2ptrace/phi35_cf1_${mode}_rank0.json" | head -n 60
  done
  unset NCCL_P2P_DISABLE
}

part_cometfused() {
  gpu_tests "$1" "comet or one_pass or (matches_dense_reference_on_nccl and topk) or routing_kernels_match or runs_dropless_auto or no_comm_dropless"
  # layer0 across NVLink with its own rows read in place (remote copies first) against every row copied first
  if [ "${COMET_NVLINK:-1}" = 1 ]; then
    torchrun --standalone --nproc_per_node=2 scripts/comet_nvlink.py --configs qwen2 phi35 mixtral --n-comm 32 \
      --block-copy 128 > "$1/nvlink.log" 2>&1
    grep -E "^[a-z0-9]+:|pull .* in place|push " "$1/nvlink.log"
  fi
  for config in ${COMET_CONFIGS:-qwen2 phi35 mixtral}; do
    for run in "1.0 plain+graph,comet+graph,no-comm+graph,comet+graph" "dropless plain,comet+graph,no-comm+graph,comet+graph"; do
      read -r cap modes <<< "$run"
      $RUN bench layer --config "$config" --capacity "$cap" --dtype bf16 --activation relu --optimizer sgd \
        --modes "$modes" --baseline "${modes%%,*}" --steps 20 --warmup 5 --json "$1/${config}_$cap.json" \
        > "$1/${config}_$cap.log" 2>&1
      grep -v "$QUIET" "$1/${config}_$cap.log" | grep -A 5 "capacity  *mode\\|^exchange hidden\\|^GPU at the end"
    done
  done
  [ "${COMET_TRAIN:-1}" = 1 ] || return 0
  printf '[model]\ncapacity_factor = "dropless"\n[train]\nckpt_interval = 1000\n' > "$1/dropless.toml"
  printf '[train]\nckpt_interval = 1000\n' > "$1/padded.toml"
  for run in "padded triton" "padded comet" "dropless triton" "dropless comet"; do
    read -r cap kernels <<< "$run"; name="${cap}_$kernels"
    $RUN train --preset qwen2-moe-2l --kernels "$kernels" --batch-size 8 --steps 12 --sample-tokens 0 \
      --config "$1/$cap.toml" --out "/tmp/weft_x2/train_$name" > "$1/train_$name.log" 2>&1
    keep_metrics "/tmp/weft_x2/train_$name" "$1/train_$name"
    python3 - "$1/train_$name/metrics.jsonl" "$name" <<'PY'
import json, statistics, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "loss" in r]
late = [r for r in rows if r["step"] > 5]
peak = max((r.get("peak_mem_gib") or 0) for r in rows)
print(f"{sys.argv[2]}: median tokens/s {statistics.median(r['tokens_per_s'] for r in late):,.0f}, peak "
      f"{peak:.2f} GiB, losses " + " ".join(f"{r['loss']:.4f}" for r in rows))
PY
  done
}

part_overlap() {
  for regime in ${REGIMES:-p2p_disabled nvlink}; do
    [ "$regime" = p2p_disabled ] && export NCCL_P2P_DISABLE=1 || unset NCCL_P2P_DISABLE
    for config in qwen2 phi35 mixtral; do
      $RUN bench layer --config "$config" --capacity 1.0 --dtype bf16 --activation relu --optimizer sgd \
        --modes plain,auto,d2,no-comm,plain --steps 20 --warmup 5 --json "$1/layer_${config}_$regime.json" \
        > "$1/layer_${config}_$regime.log" 2>&1
      grep -v "$QUIET" "$1/layer_${config}_$regime.log" | tail -n 7
    done
    $RUN bench model --preset gpt2-s-moe --batch-size 8 --modes none,tutel,lancet,none --steps 10 --warmup 3 \
      --json "$1/model_$regime.json" > "$1/model_$regime.log" 2>&1
    grep -v "$QUIET" "$1/model_$regime.log" | tail -n 8
  done
  unset NCCL_P2P_DISABLE
}

gpu_tests() {  # DIR PATTERN: the GPU tests matching PATTERN, their summary line (GPU_TESTS=0: none, run already)
  [ "${GPU_TESTS:-1}" = 0 ] && return 0
  python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -k "$2" > "$1/tests.log" 2>&1
  tail -n 2 "$1/tests.log"
}

set_regime() {  # nvlink | p2p_disabled (NCCL_P2P_DISABLE=1, the multi-node stand-in)
  if [ "$1" = p2p_disabled ]; then export NCCL_P2P_DISABLE=1; else unset NCCL_P2P_DISABLE; fi
}

part_dedup() {
  gpu_tests "$1" "dedup or captures_auto or step_s_metrics"
  for regime in ${REGIMES:-p2p_disabled nvlink}; do
    set_regime "$regime"
    for config in qwen2 phi35 mixtral; do
      $RUN bench layer --config "$config" --capacity 1.0,dropless --dtype bf16 --activation relu --optimizer sgd \
        --modes plain,dedup,dedup-d2,auto,no-comm,plain,dedup --steps 20 --warmup 5 \
        --json "$1/layer_${config}_$regime.json" > "$1/layer_${config}_$regime.log" 2>&1
      grep -v "$QUIET" "$1/layer_${config}_$regime.log" | tail -n 16
      $RUN bench layer --config "$config" --capacity 1.0 --dtype bf16 --activation relu --optimizer sgd \
        --modes plain+graph,dedup+graph,dedup-d2+graph,auto+graph,no-comm+graph,plain+graph,dedup+graph \
        --baseline plain+graph \
        --steps 20 --warmup 5 \
        --json "$1/graph_${config}_$regime.json" > "$1/graph_${config}_$regime.log" 2>&1
      grep -v "$QUIET" "$1/graph_${config}_$regime.log" | tail -n 9
    done
  done
  unset NCCL_P2P_DISABLE
}

part_autograph() {
  gpu_tests "$1" "captures_auto or runs_dropless_auto"
  for regime in ${REGIMES:-p2p_disabled nvlink}; do
    set_regime "$regime"
    for config in qwen2 phi35 mixtral; do
      if [ "$regime" = p2p_disabled ]; then
        modes=plain+graph,auto+graph,no-comm+graph,plain+graph
      else
        modes=plain+graph,dedup+graph,d2+graph,comet+graph,auto+graph,no-comm+graph
      fi
      $RUN bench layer --config "$config" --capacity 1.0 --dtype bf16 --activation relu --optimizer sgd \
        --modes "$modes" --baseline plain+graph --steps 20 --warmup 5 \
        --json "$1/graph_${config}_$regime.json" > "$1/graph_${config}_$regime.log" 2>&1
      grep -v "$QUIET" "$1/graph_${config}_$regime.log" | grep -A 8 "capacity  *mode\\|^exchange hidden\\|^GPU at the end"
      [ "$regime" = p2p_disabled ] || continue
      $RUN bench layer --config "$config" --capacity dropless --dtype bf16 --activation relu --optimizer sgd \
        --modes plain,auto+graph,no-comm,plain --steps 20 --warmup 5 \
        --json "$1/dropless_${config}_$regime.json" > "$1/dropless_${config}_$regime.log" 2>&1
      grep -v "$QUIET" "$1/dropless_${config}_$regime.log" | grep -A 6 "capacity  *mode\\|^exchange hidden\\|^GPU at the end"
    done
  done
  unset NCCL_P2P_DISABLE
}

part_kernels() {
  for regime in ${REGIMES:-nvlink}; do
    set_regime "$regime"
    for config in qwen2 phi35 mixtral; do
      $RUN bench layer --config "$config" --capacity 1.0 --dtype bf16 --activation relu --optimizer sgd \
        --modes plain+graph,no-comm+graph,dedup+graph --baseline plain+graph --steps 10 --warmup 3 \
        --profile-steps 2 --breakdown --json "$1/kernels_${config}_$regime.json" > "$1/kernels_${config}_$regime.log" 2>&1
      grep -v "$QUIET" "$1/kernels_${config}_$regime.log" | grep -A 14 "^ capacity\|(rank 0)"
    done
  done
  unset NCCL_P2P_DISABLE
}

train_algos() {  # DIR LABEL "ALGOS" LOG_PATTERN [TRAIN ARGS...]: qwen2-moe-2l batch 8 graphed, one run per
  # --a2a-algo in ALGOS (tokens/s, MFU), then the line of its log matching LOG_PATTERN (what it ran)
  local dir=$1 label=$2 algos=$3 pattern=$4
  shift 4
  for algo in $algos; do
    echo "-- $label --a2a-algo $algo"
    RUNS="qwen2-moe-2l:8" KERNELS=auto GRAPHS=auto MASTER=auto STEPS=18 WARM=6 OUT="$dir" \
      TRAIN_ARGS="$* --a2a-algo $algo" bash scripts/train_mfu.sh | tail -n 1
    grep -h "$pattern" "$dir"/*.log | tail -n 1
  done
}

part_fixed() {
  gpu_tests "$1" "fixed_size or dropless_auto or dropless_training_at_auto or pipelined_dropless or own_pairs_apart"
  printf '[model]\ncapacity_factor = "dropless"\n' > /tmp/weft_dropless.toml
  for regime in ${REGIMES:-p2p_disabled nvlink}; do
    set_regime "$regime"
    for config in qwen2 phi35 mixtral; do
      $RUN bench layer --config "$config" --capacity dropless --dtype bf16 --activation relu --optimizer sgd \
        --modes ${FIXED_MODES:-plain,auto+graph,dedup-fixed+graph,dedup-fixed-d2+graph,dedup-fixed-own+graph,plain,auto+graph} \
        --steps 20 --warmup 5 \
        --json "$1/layer_${config}_$regime.json" > "$1/layer_${config}_$regime.log" 2>&1
      grep -v "$QUIET" "$1/layer_${config}_$regime.log" | tail -n 9
    done
    if [ "${FIXED_TRACE:-0}" = 1 ]; then  # the traces stay here (large); their timelines are printed
      $RUN bench layer --config phi35 --capacity dropless --dtype bf16 --activation relu --optimizer sgd \
        --modes "plain,${FIXED_TRACE_MODE:-dedup-fixed-own+graph}" --steps 6 --warmup 2 --profile-steps 1 \
        --trace "/tmp/weft_trace_$regime" > "$1/trace_phi35_$regime.log" 2>&1
      python3 scripts/trace_timeline.py "/tmp/weft_trace_$regime/"*"${FIXED_TRACE_MODE:-dedup-fixed-own+graph}_rank0.json"
    fi
    train_algos "$1/$regime" "$regime dropless" "${FIXED_ALGOS:-auto dedup}" "a2a_algo\|eager steps" \
      --config /tmp/weft_dropless.toml
  done
  unset NCCL_P2P_DISABLE
}

part_deduptrain() {
  for regime in ${REGIMES:-p2p_disabled nvlink}; do
    set_regime "$regime"
    train_algos "$1/$regime" "$regime" "${ALGOS:-linear dedup dedup-d2 auto linear dedup-d2}" "runs a2a_algo"
  done
  unset NCCL_P2P_DISABLE
}

part_tutel() {
  gpu_tests "$1" tutel_training_replays
  for regime in ${REGIMES:-p2p_disabled nvlink}; do
    set_regime "$regime"
    for overlap in none tutel none; do
      echo "-- $regime --overlap $overlap"
      RUNS="qwen2-moe-2l:8" KERNELS=auto GRAPHS=auto MASTER=auto STEPS=18 WARM=6 OUT="$1/$regime" \
        TRAIN_ARGS="--overlap $overlap" bash scripts/train_mfu.sh | tail -n 1
      grep -h "every MoE layer runs" "$1/$regime"/*.log | tail -n 1
      python3 -c "import json, sys; rows = [json.loads(l) for l in open(sys.argv[1])]; \
print('losses', ' '.join(f\"{r['loss']:.4f}\" for r in rows if 'loss' in r and r['step'] % 5 in (0, 1)))" \
        /tmp/weft_mfu/qwen2-moe-2l_b8_auto_graphs-auto_master-auto/metrics.jsonl
    done
  done
  unset NCCL_P2P_DISABLE
}

part_lancet() {
  gpu_tests "$1" "lancets_dw_schedule or lancets_dw_items or lancet_passes or lancet_training_replays or graphed_lancet_profile or holds_one_calls or own_their_gradients"
  for regime in ${REGIMES:-p2p_disabled nvlink}; do
    set_regime "$regime"
    for run in ${LANCET_RUNS:-gpt2-s-moe:8}; do
      i=0
      for overlap in ${LANCET_OVERLAPS:-none tutel lancet none}; do
        i=$((i + 1)); dir="$1/${regime}_${run%%:*}-$i-$overlap"  # two levels under $OUT: deeper ones do not come back
        echo "-- $regime $run --overlap $overlap"
        RUNS="$run" KERNELS=auto GRAPHS=auto MASTER=auto STEPS=${STEPS:-18} WARM=6 OUT="$dir" \
          TRAIN_ARGS="--overlap $overlap" bash scripts/train_mfu.sh | tail -n 1
        grep -h "every MoE layer runs\|weight-gradient schedule\|eager steps\|forward:" "$dir"/*.log | tail -n 2
      done
    done
  done
  unset NCCL_P2P_DISABLE
}

part_modelgraph() {
  # the issue's model-level table as weft trains: each mode's forward + backward one CUDA graph
  for regime in ${REGIMES:-p2p_disabled nvlink}; do
    set_regime "$regime"
    for model in ${MODELS:-gpt2-s-moe:topk:8 gpt2-s-moe:bpr:8 gpt2-l-moe:topk:4}; do  # preset:gate:batch
      IFS=: read -r preset gate batch <<< "$model"
      fits="none,tutel,lancet,none"; [ "$preset" = gpt2-l-moe ] && fits="none,tutel,none none,lancet,none"
      for modes in ${MODEL_MODES:-$fits}; do
        name="${preset}_${gate}_${regime}_${modes//,/-}"  # no commas: such names do not come back from the device
        stacks_at $(( ${MODEL_TIMEOUT:-280} - 20 )) & watch=$!
        timeout ${MODEL_TIMEOUT:-280} $RUN bench model --preset "$preset" --gate "$gate" --batch-size "${batch:-8}" \
          --cuda-graphs on --modes "$modes" --steps 10 --warmup 3 --json "$1/$name.json" > "$1/$name.log" 2>&1
        kill $watch 2>/dev/null
        grep -v "$QUIET\|^weft bench model: .*(.* s)$\|^weft bench model: round" "$1/$name.log" | tail -n 12
      done
    done
  done
  unset NCCL_P2P_DISABLE
}

part_balancetrain() {
  printf '[model]\ncapacity_factor = "dropless"\nrouting_skew = %s\naux_loss_coef = %s\n' "${BALANCE_TRAIN_SKEW:-0}" \
    "${BALANCE_TRAIN_AUX:-0.01}" > "$1/dropless.toml"
  i=0
  for balance in ${BALANCE_RUNS:-none pro-prophet none pro-prophet}; do
    i=$((i + 1)); run=/tmp/weft_x2/balance_${i}_$balance; rm -rf "$run"
    $RUN train --preset ${BALANCE_TRAIN_PRESET:-qwen2-moe-2l} --config "$1/dropless.toml" --balance "$balance" \
      --batch-size ${BALANCE_TRAIN_BATCH:-2} --kernels ${BALANCE_TRAIN_KERNELS:-auto} ${BALANCE_TRAIN_ARGS:-} \
      --steps ${BALANCE_TRAIN_STEPS:-14} --sample-tokens 0 --out "$run" > "$1/run${i}_$balance.log" 2>&1
    grep "weft train: \(eager\|every\|graph\)" "$1/run${i}_$balance.log" | head -n 3
    keep_metrics "$run" "$1/run${i}_$balance"
    python3 - "$1/run${i}_$balance/metrics.jsonl" "$balance" "$RUN" <<'PY'
import json, re, statistics, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "tokens_per_s" in r]
late = [r for r in rows if r["step"] > 5]
copied = sum(bool(e) for r in rows for e in (r.get("copied_experts") or []))
world = int(re.search(r"nproc_per_node=(\d+)", sys.argv[3]).group(1))

def rank_load(counts):  # max / mean of the slots each rank's experts were routed
    per = len(counts) // world
    sums = [sum(counts[w * per:(w + 1) * per]) for w in range(world)]
    return max(sums) / (sum(sums) / world)

loads = [statistics.median(rank_load(r["expert_load"][i]) for r in late) for i in range(len(late[0]["expert_load"]))]
print(f"--balance {sys.argv[2]:<12} tokens/s {statistics.median(r['tokens_per_s'] for r in late):>10,.0f}  "
      f"rank load (median, by layer) {[round(v, 2) for v in loads]}  layer-steps with copies {copied:>3}  "
      f"losses {[round(r['loss'], 4) for r in rows[:6]]}")
PY
  done
}

part_mfu() {
  RUNS="qwen2-moe-2l:12 gpt2-s-moe:16" KERNELS=auto GRAPHS=auto MASTER="on off on" STEPS=25 WARM=10 OUT="$1" \
    bash scripts/train_mfu.sh
}

part_ckpt() {
  for preset in gpt2-s gpt3-2.7b; do
    CUDA_VISIBLE_DEVICES=0 python3 scripts/checkpoint_stall.py --preset "$preset" --out /tmp/weft_x2/stall \
      --json "$1/stall_$preset.json" 2>&1 | tail -n 4
  done
  printf '[train]\nckpt_interval = 4\n' > "$1/every4.toml"
  for async in on off; do
    run=/tmp/weft_x2/ckpt_$async; rm -rf "$run"; start=$(date +%s)
    $RUN train --preset gpt3-2.7b --tp 2 --batch-size 8 --steps 12 --config "$1/every4.toml" \
      --async-checkpoint "$async" --sample-tokens 0 --out "$run" > "$1/train_$async.log" 2>&1
    rc=$?
    echo "--async-checkpoint $async: $(( $(date +%s) - start )) s for 12 steps and 3 checkpoints (rc $rc)"
    rm -rf "$run"
  done
}

part_gradsum() {
  python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider \
    -k "mean_reduction or reduced_during_the_backward or owns_its_gradients or some_gpus_lack" \
    > "$1/tests.log" 2>&1
  tail -n 3 "$1/tests.log"
  RUNS=gpt2-s-moe:8 STEPS=16 OUT="$1/after_overlap" bash scripts/grad_reduce_train.sh 2>&1 | tail -n 8
  EXTRA_ARGS="--ep-size 1 --grad-accum 2" RUNS=gpt2-s-moe:4 STEPS=16 OUT="$1/ep1_accum2" \
    bash scripts/grad_reduce_train.sh 2>&1 | tail -n 8
}

part_sgdbw() {
  python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -k "stepped_in_the_backward or without_rows" \
    > "$1/tests.log" 2>&1
  tail -n 3 "$1/tests.log"
  # one process per capacity, as Tutel runs one config per run: the second capacity of one process
  # ran up to 6% slower on a GPU at its power limit (docs/benchmarks.md, fifty-second session)
  for config in qwen2 phi35 mixtral; do
    for cf in 1.0 dropless; do
      $RUN bench layer --config "$config" --optimizer sgd --capacity "$cf" \
        --modes comet+graph,comet+sgd-in-backward+graph,comet+graph,plain+sgd-in-backward --baseline comet+graph \
        --steps 20 --warmup 5 --energy-s 8 \
        --json "$1/$config-$cf.json" 2>&1 | grep -v "^weft bench layer: \(round \|.*built\)" | tail -n 11
    done
  done
}

part_qkv() {
  gpu_tests "$1" "qkv_heads or rmsnorm"
  for tree in old ${MID:+mid} new old ${MID:+mid} new; do
    src=$PWD/src
    [ "$tree" = old ] && src=$PWD/${OLD:?OLD: the src folder of the tree before the changes}
    [ "$tree" = mid ] && src=$PWD/$MID
    SRC=$src GPUS=0 RUNS="${QKV_RUNS:-gpt2-l-moe:8}" KERNELS=auto STEPS=16 WARM=5 OUT="$1/$tree" \
      bash scripts/train_mfu.sh | sed "s/^/$tree /"
  done
}

part_quality() {
  RUNS="gpt2-s-moe=gpt2-s-moe gpt2-s=gpt2-s" SEEDS="1337 1 2" STEPS=600 DROPS_AFTER=200 TRAIN_ARGS="--batch-size 8" \
    OUT="$1" bash scripts/quality_runs.sh | tail -n 12
}

for part in ${PARTS:-tests balance slots balancetrain domino dominopreset tpmoe tpgraph comet cometdropless cometfused overlap dedup autograph kernels deduptrain fixed tutel lancet modelgraph mfu ckpt quality}; do
  dir="$OUT/$part"
  mkdir -p "$dir"
  echo "== $part"
  "part_$part" "$dir" || echo "$part failed (exit $?)"
done
