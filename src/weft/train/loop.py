"""`weft train`: the training loop of an MoE GPT with expert parallelism, or of a dense GPT
with tensor parallelism.

Every rank runs `train(cfg)`. Non-expert gradients are averaged over all data-parallel ranks
and expert gradients over their expert-data-parallel replicas (`weft.reduce_gradients`); the
global gradient norm counts each expert shard and each tensor-parallel slice once. With `--tp N`
the ranks of a tensor-parallel group read the same batches and hold slices of every block.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from weft.comm.peers import peers_unavailable
from weft.distributed import MoEGroups, build_moe_groups, group_rank, group_size, init_distributed
from weft.graphs import CaptureError, time_graphed
from weft.hostcopy import host_tensor_async
from weft.jsonfile import write_json
from weft.kernels.sumsq import sum_of_squares
from weft.launch import ReportedError
from weft.models import GPT
from weft.moe.grads import OverlappedReduce, expert_parameters, overlapped_reduce, reduce_gradients
from weft.overlap import fit_balance_models, optimize
from weft.overlap.passes import OverlapPlan, layer_degrees, predicted_as_run
from weft.precision import training_autocast
from weft.tp import make_schedule, sharded_parameters
from weft.tp.search import choose_schedule
from weft.train.checkpoint import CheckpointWriter, latest_checkpoint, load_checkpoint
from weft.train.config import BASE_LR_WIDTH, TrainConfig, config_changes, read_run_config, saved_train_config
from weft.train.data import BatchSampler, ByteTokenizer, prepare_data
from weft.train.metrics import MetricsLog, Progress, peak_flops
from weft.train.optim import (
    ClippedAdamW,
    MasterAdamW,
    MasterPlan,
    MasterWeights,
    decay_groups,
    low_precision_parameters,
    master_weights_blocker,
)
from weft.train.runlock import RunFolderInUse, RunLock, in_use
from weft.train.step import (
    MicroSteps,
    build_micro_step,
    graph_blocker,
    lancet_partitions_forward,
    set_layers,
    shape_for_any_placement,
)
from weft.tune.dictionary import DEGREES


class DataError(ReportedError):
    """The training data cannot be used (missing, no text, a damaged cache, ...)."""


class UnrunnableSetting(ReportedError):
    """A setting these ranks cannot run (e.g. copies through peer memory the GPUs do not reach)."""


class TrainingStopped(ReportedError):
    """The run cannot go on (e.g. its loss or gradients are no longer finite); the message says
    why, at which step, and what was kept."""


def data_repeat_warning(train_tokens: int, tokens_per_step: int, steps: int) -> str | None:
    """What to tell the user when `steps` steps read the training split more than once (None if not)."""
    planned = tokens_per_step * steps
    if planned <= train_tokens:
        return None
    return (f"{steps} steps read {planned / 1e6:.1f}M tokens from a training split of {train_tokens / 1e6:.1f}M "
            f"tokens: it is read {planned / max(train_tokens, 1):.2f} times over, so a large model can memorise it "
            f"(validation loss turning up); point --data at more text or train fewer --steps")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to the peak learning rate (`cfg.peak_lr`), then cosine decay to it times
    min_lr_ratio at step `lr_decay_steps` (default: the last step)."""
    peak = cfg.peak_lr
    if step <= cfg.warmup_steps:
        return peak * step / max(cfg.warmup_steps, 1)
    horizon = cfg.lr_decay_steps or cfg.steps
    progress = (step - cfg.warmup_steps) / max(horizon - cfg.warmup_steps, 1)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return peak * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def build_optimizer(model: GPT, cfg: TrainConfig, masters: MasterWeights | None = None) -> torch.optim.AdamW:
    """AdamW; matrices (and expert weight stacks) decay, vectors (norms) do not. With `masters`
    (bf16 parameters, weft.train.optim) `MasterAdamW`, one Triton pass (a launch per kind of tensor). Otherwise on GPUs
    torch's fused implementation (one kernel per step and dtype; `train.fused_optimizer = false`
    switches to its multi-tensor one): the same update up to float rounding."""
    groups = decay_groups(model, cfg.weight_decay)
    if masters is not None and len(masters):
        return MasterAdamW(groups, masters, lr=cfg.peak_lr, betas=cfg.betas)
    fused = cfg.fused_optimizer and all(p.is_cuda for p in model.parameters())
    return ClippedAdamW(groups, lr=cfg.peak_lr, betas=cfg.betas, fused=fused or None)


def build_master_weights(model: GPT, cfg: TrainConfig, device: torch.device, groups: MoEGroups,
                         log) -> MasterWeights:
    """`cfg.master_weights`: "auto" stores the weights `low_precision_parameters` picks in bf16
    with float32 masters where that changes no arithmetic (`master_weights_blocker`), "on" also,
    or stops naming why not, "off" never (an empty `MasterWeights`: every step of it does
    nothing)."""
    none = MasterWeights(MasterPlan([], []))
    if cfg.master_weights == "off":
        return none
    blocker = master_weights_blocker(model, device, cfg.overlap,
                                     lancet_partitions_forward(model, device, cfg.cuda_graphs))
    plan = low_precision_parameters(model, groups, cfg.grad_accum) if blocker is None else MasterPlan([], [])
    if blocker is None and not len(plan):
        blocker = "no weight of this model is read only through autocast's casts (or every one is gathered " \
                  "across ranks)"
    if blocker is not None:
        if cfg.master_weights == "on":
            raise TrainingStopped(f"--master-weights on: {blocker} (run with --master-weights auto or off)")
        if device.type == "cuda":
            log(f"weft train: float32 parameters (no bf16 master weights: {blocker})")
        return none
    values = sum(p.numel() for p in [*plan.direct, *plan.staged]) / 1e6
    log(f"weft train: {len(plan)} weight tensors ({values:.1f}M values) stored in bf16 with float32 masters, "
        f"{len(plan.staged)} of them with float32 gradient accumulators (--master-weights off: float32)")
    return MasterWeights(plan)


def _load(ckpt: Path, model: GPT, optimizer: torch.optim.Optimizer, groups: MoEGroups, full_precision) -> dict:
    """Load a checkpoint (float32 weights, with master weights put in the parameters for the
    time). The optimizer keeps the implementation this run chose (fused, foreach): a checkpoint's
    param groups carry those of the run that wrote it."""
    chosen = [{k: group[k] for k in ("fused", "foreach")} for group in optimizer.param_groups]
    with full_precision():
        extra = load_checkpoint(ckpt, model, optimizer, groups)
    for group, flags in zip(optimizer.param_groups, chosen):
        group.update(flags)
    return extra


def gradient_norm(model: GPT, groups: MoEGroups) -> torch.Tensor:
    """The global gradient norm (a float32 scalar on the device: nothing waits for it):
    replicated gradients once, each expert shard once (sum over EP), each tensor-parallel slice
    once (sum over TP). On GPUs a launch or two for the whole model (`weft.kernels.sumsq`)."""
    experts = {id(p) for p in expert_parameters(model)}
    sliced = {id(p) for p in sharded_parameters(model)}
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return torch.zeros((), dtype=torch.float32, device=next(model.parameters()).device)
    device = params[0].grad.device
    dense_sq = _squared_norm([p.grad for p in params if id(p) not in experts and id(p) not in sliced], device)
    expert_sq = _squared_norm([p.grad for p in params if id(p) in experts], device)
    sliced_sq = _squared_norm([p.grad for p in params if id(p) in sliced], device)
    if group_size(groups.ep) > 1:
        dist.all_reduce(expert_sq, group=groups.ep)
    if group_size(groups.tp) > 1:
        dist.all_reduce(sliced_sq, group=groups.tp)
    return (dense_sq + expert_sq + sliced_sq).sqrt()


def clip_scale(norm: torch.Tensor, max_norm: float) -> torch.Tensor | float:
    """The factor clipping by the global norm multiplies every gradient by (1: no clipping),
    computed where the norm is (on the device: the optimizer reads it there)."""
    if max_norm <= 0:
        return 1.0
    return torch.where(norm > max_norm, max_norm / (norm + 1e-6), torch.ones_like(norm))


def _squared_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of squares of every element of `grads`, in float32 (a fresh tensor): one pass over
    them on GPUs (`weft.kernels.sumsq`), each tensor's norm squared in the list's order on CPUs."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return sum_of_squares(grads)


def _all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum of t over `group` (in place); t itself without torch.distributed."""
    if group_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


@torch.no_grad()
def evaluate(model: GPT, sampler: BatchSampler, batches: int, device: torch.device, groups: MoEGroups) -> float:
    """Mean validation cross-entropy over `batches` batches of every data-parallel rank."""
    model.eval()
    total = torch.zeros((), device=device)
    for x, y in sampler.eval_batches(batches):
        with training_autocast(device):
            model(x.to(device), y.to(device))
        total += model.last_ce_loss.float()
    model.train()
    total = _all_reduce(total, groups.dp) / (batches * group_size(groups.dp))
    return float(total)


@torch.no_grad()
def sample(model: GPT, prompt: str, tokens: int, device: torch.device, groups: MoEGroups,
           temperature: float = 0.8, top_k: int = 40, seed: int = 0) -> str:
    """Autoregressive sampling; collective in a distributed run (every rank must call it, and
    every rank continues rank 0's text).

    Token-choice MoE layers run dropless while sampling (a per-call setting) so a short batch
    never drops tokens (expert choice keeps its capacity: it has no dropless form).
    """
    tok = ByteTokenizer()
    model.eval()
    moe_overrides = {} if model.config.gate == "expert_choice" else {"capacity_factor": None}
    gen = torch.Generator(device="cpu").manual_seed(seed)
    idx = torch.tensor([tok.encode(prompt) or [10]], dtype=torch.long, device=device)
    try:
        for _ in range(tokens):
            with training_autocast(device):
                logits, _ = model(idx[:, -model.config.block_size:], moe_overrides=moe_overrides)
            logits = logits[0, -1].float().cpu() / max(temperature, 1e-5)
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits[logits < kth] = -math.inf
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).to(device)
            if dist.is_initialized() and dist.get_world_size() > 1:  # every rank continues the same text
                dist.broadcast(nxt, src=0)
            idx = torch.cat([idx, nxt.view(1, 1)], dim=1)
    finally:
        model.train()
    return tok.decode(idx[0].tolist())


def token_cache_dir() -> Path:
    """Where tokenized corpora are cached: $WEFT_CACHE, else ~/.cache/weft/tokens."""
    root = os.environ.get("WEFT_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "weft"
    return Path(root) / "tokens"


def check_run_dir(cfg: TrainConfig) -> None:
    """Refuse to start a fresh run over an existing one, or to write over a config.json that is
    not a weft run's: nothing written is lost."""
    run_dir = cfg.run_dir
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"--out {run_dir} is a file, not a folder")
    if not cfg.resume and ((run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists()):
        raise ValueError(
            f"{run_dir} already holds a run; pass --resume to continue it or --out to start a new one"
        )
    read_run_config(run_dir)  # ValueError for a config.json that is not a weft run's


def _write_run_config(run_dir: Path, cfg: TrainConfig, start: int) -> None:
    """config.json: the run's configuration, and under "history" every change a resume made to it
    (with --override), atomically (a crash leaves the old file or the new one)."""
    saved = read_run_config(run_dir)
    history = list(saved.get("history", [])) if saved else []
    if saved is not None and cfg.resume:
        changed = {k: list(v) for k, v in config_changes(saved_train_config(saved), cfg).items() if k != "resume"}
        if changed:
            history.append({"resumed_at_step": start, "changed": changed})
    doc = {"train": cfg.to_dict(), "model": cfg.model_config().to_dict(), "history": history}
    write_json(run_dir / "config.json", doc)


def train(cfg: TrainConfig) -> dict:
    """Train on every rank of the current world; returns a summary (rank 0's view)."""
    cfg.validate()
    ctx = init_distributed(backend="gloo" if cfg.device == "cpu" else None)
    device = ctx.device
    model_cfg = cfg.model_config()
    groups = build_moe_groups(cfg.ep_size, tp_size=cfg.tp, experts=model_cfg.moe_every > 0)
    run_dir = cfg.run_dir
    check_run_dir(cfg)
    lock = _lock_run_dir(run_dir, ctx.rank, device)  # nobody writes before every rank has checked
    try:
        return _train(cfg, ctx, groups, model_cfg)
    finally:
        if lock is not None:
            lock.release()


def _lock_run_dir(run_dir: Path, rank: int, device: torch.device) -> RunLock | None:
    """Rank 0 takes the run folder's lock; every rank raises RunFolderInUse if it could not."""
    lock, error = None, None
    if rank == 0:
        try:
            lock = RunLock(run_dir).acquire()
        except RunFolderInUse as e:
            error = e
    busy = torch.tensor([0.0 if error is None else 1.0], device=device)
    if dist.is_initialized():
        dist.all_reduce(busy)
    if busy.item():
        raise error or in_use(run_dir)
    return lock


def _train(cfg: TrainConfig, ctx, groups: MoEGroups, model_cfg) -> dict:
    device, run_dir = ctx.device, cfg.run_dir
    if cfg.tp_overlap == "domino-copy" and (why := peers_unavailable(groups.tp, device)) is not None:
        raise UnrunnableSetting(f"--tp-overlap domino-copy copies through the peers' memory, which these ranks cannot "
                                f"reach ({why}); use --tp-overlap domino")

    torch.manual_seed(cfg.seed)
    model = GPT(model_cfg, group=groups.ep, kernels=cfg.kernels,
                balance=None if cfg.balance == "none" else cfg.balance, balance_n=cfg.balance_n,
                balance_rounds=cfg.balance_rounds, tp_group=groups.tp,
                tp_schedule=make_schedule("none" if cfg.tp_overlap == "auto" else cfg.tp_overlap, cfg.domino_p1,
                                          cfg.domino_p2)).to(device)
    set_layers(model, "a2a_algo", cfg.a2a_algo)
    log0 = (lambda line: print(line, flush=True)) if ctx.rank == 0 else (lambda line: None)
    masters = build_master_weights(model, cfg, device, groups, log0)
    optimizer = build_optimizer(model, cfg, masters)
    try:
        data = prepare_data(cfg.data, token_cache_dir(), val_fraction=cfg.val_fraction,
                            vocab_size=model_cfg.vocab_size)
    except (ValueError, OSError) as e:  # the data names the problem: one line, not a rank's traceback
        raise DataError(f"data: {e}") from e
    block = model_cfg.block_size
    # the ranks of a tensor-parallel group read the same batches: data parallel over groups.dp
    dp_rank, dp_size = group_rank(groups.dp), group_size(groups.dp)
    train_batches = BatchSampler(data.train, cfg.batch_size, block, dp_rank, dp_size, cfg.seed)
    val_batches = BatchSampler(data.val, cfg.batch_size, block, dp_rank, dp_size, cfg.seed)

    start = 0
    ckpt = latest_checkpoint(run_dir) if cfg.resume else None
    if ckpt is not None:
        start = int(_load(ckpt, model, optimizer, groups, masters.full_precision)["step"])
    elif cfg.resume and ctx.rank == 0:
        print(f"weft train: --resume but no complete checkpoint in {run_dir / 'checkpoints'}; starting at step 0",
              flush=True)
    log = MetricsLog(run_dir / "metrics.jsonl", resume_from=start if cfg.resume else None) if ctx.rank == 0 else None
    if ctx.rank == 0:
        _write_run_config(run_dir, cfg, start)
        print(f"weft train: {cfg.preset} ({model.num_parameters() / 1e6:.2f}M params, "
              f"{model.num_parameters(active_only=True) / 1e6:.2f}M active) on {ctx.world_size} x {device.type}"
              f"{'' if groups.ep_size == 1 or not model_cfg.moe_every else f', expert parallel over {groups.ep_size}'}"
              f"{'' if groups.tp_size == 1 else f', tensor parallel over {groups.tp_size} ({cfg.tp_overlap})'}; "
              f"data: {data.source}, {data.num_tokens / 1e6:.1f}M tokens; run dir {run_dir}"
              + (f"; resumed from {ckpt.name}" if ckpt else ""), flush=True)
        if cfg.lr is None and model_cfg.dim > BASE_LR_WIDTH:
            print(f"weft train: peak learning rate {cfg.peak_lr:.2e}, the default for {model_cfg.dim}-wide models "
                  f"(--lr sets it)", flush=True)

    plan = _setup_overlap(model, cfg, train_batches, start, device, ctx.rank)
    _measure_balance_model(model, cfg, train_batches, start, device, ctx.rank, groups.ep_size)
    _choose_tp_schedule(model, cfg, train_batches, start, device, ctx.rank, ctx.world_size)
    tokens_per_step = cfg.batch_size * block * cfg.grad_accum * dp_size
    warning = data_repeat_warning(len(data.train), tokens_per_step, cfg.steps)
    if warning and ctx.rank == 0:
        print(f"weft train: warning: {warning}", flush=True)
    peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    flops_per_token = model.flops_per_token(block)
    progress = Progress(start, cfg.steps, cfg.log_interval)
    val_loss, micro_steps, pending = None, None, None
    late = reads_late(device)
    since = time.perf_counter()  # when the last logged step was read (or the loop, an evaluation, a checkpoint ended)

    def timed(row: dict) -> dict:
        """A step just read on the host, with its time: the host's since the step before was read
        (in steady state one step: the host reads each step while the next one's micro-batches run)."""
        nonlocal since
        now = time.perf_counter()
        elapsed, since = now - since, now
        # tokens: read by the end of this step (steps times this run's batch shape)
        row.update(tokens=row["step"] * tokens_per_step, tokens_per_s=tokens_per_step / elapsed, elapsed_s=elapsed,
                   mfu=(flops_per_token * tokens_per_step / ctx.world_size / elapsed / peak) if peak else None,
                   peak_mem_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None)
        return row

    def record(row: dict, val_loss: float | None) -> None:
        if log is not None:
            log.write(row)
            if val_loss is not None:
                log.write({"step": row["step"], "tokens": row["tokens"], "val_loss": val_loss})
            line = progress.line(row["step"], row["loss"], row["tokens_per_s"], row["lr"], val_loss)
            if line:
                print(line, flush=True)

    # every rank, here: its gloo group is made collectively
    checkpoints = CheckpointWriter(run_dir, cfg.keep_last, background=cfg.async_checkpoint, report=log0)
    try:
        for step in range(start + 1, cfg.steps + 1):
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            if micro_steps is None:  # built at the first step: a graph captures the step as it runs
                micro_steps = _micro_steps(model, cfg, plan, train_batches.get(step, 0), device, ctx.rank, groups,
                                           masters)
            finished, pending = _train_step(model, optimizer, train_batches, step, cfg, groups, device, micro_steps,
                                            masters, lr, pending)
            if finished is not None:
                record(timed(finished), None)
            evaluates = step % cfg.eval_interval == 0 or step == cfg.steps
            saves = cfg.ckpt_interval > 0 and (step % cfg.ckpt_interval == 0 or step == cfg.steps)
            if late and not (evaluates or saves):
                continue  # read while the next step runs
            # read now: on the CPU, or where an evaluation or a checkpoint needs the step (skipped or not)
            finished, pending = timed(_read_step(pending, model, optimizer, cfg)), None
            val_loss = evaluate(model, val_batches, cfg.eval_batches, device, groups) if evaluates else None
            record(finished, val_loss)
            if saves:
                extra = {"step": step, "train": cfg.to_dict(), "model": model_cfg.to_dict(), "data": data.source}
                with masters.full_precision():  # the state is copied (or written) inside: masters as the weights
                    checkpoints.save(step, model, optimizer, groups, extra)
            since = time.perf_counter()
    except BaseException:
        checkpoints.wait_quietly()  # a checkpoint in flight is still published; the error raised is this one
        raise

    text = ""
    if cfg.sample_tokens:  # while the last checkpoint is written
        text = sample(model, cfg.sample_prompt, cfg.sample_tokens, device, groups, seed=cfg.seed)
    if checkpoints.pending is not None and ctx.rank == 0:
        print(f"weft train: writing the checkpoint of step {checkpoints.pending}", flush=True)
    checkpoints.wait()
    if log is not None:
        log.close()
        if text:
            print("\n--- sample ---\n" + text + "\n--------------", flush=True)
        saved = f"checkpoints in {run_dir / 'checkpoints'}" if cfg.ckpt_interval else \
            "no checkpoints (--ckpt-interval 0)"
        print(f"weft train: done; metrics in {run_dir / 'metrics.jsonl'}, {saved}; plots: weft plot {run_dir}",
              flush=True)
    return {"val_loss": val_loss, "steps": cfg.steps, "sample": text, "run_dir": str(run_dir),
            **where_reduced(model, groups, micro_steps.reduced if micro_steps is not None else None)}


def _setup_overlap(model: GPT, cfg: TrainConfig, batches: BatchSampler, start: int, device: torch.device,
                   rank: int):
    """--overlap: tutel tunes each MoE layer's pipelining degree; lancet profiles, plans and applies
    weft.overlap (returns the plan, whose backward() the steps use), and where the step is graphed
    tunes the degree too (its dW items then run under the chunks' backward exchanges)."""
    if cfg.overlap == "tutel":
        for moe in model.moe_layers():
            moe.overlap_degree = "auto"
        return None
    if cfg.overlap != "lancet":
        return None

    x, _ = batches.get(start + 1, 0)
    if not lancet_partitions_forward(model, device, cfg.cuda_graphs):
        # dW scheduling, kept where its graph replays faster (`weft.train.step.choose_wgrad_schedule`),
        # not by the eager check; of the partitioned forward, what a graph can hold: each MoE layer's
        # own chunks (Tutel's degree, timed as graphs), its neighbours' partitions reading sizes on the host.
        plan = optimize(model, x.to(device), forward=False, partitions=(1,), measure=0, graphed=True,
                        degrees=DEGREES,  # priced at the degree the graphs choose (`_micro_steps`)
                        in_step=True)  # and with the graphed step's in-step corrections
        for moe in model.moe_layers():
            moe.overlap_degree = "auto"
        note = ("(the micro-step replays as a CUDA graph: each MoE layer's pipelining degree and the weight-gradient "
                "schedule, each kept if its graph replays faster; --cuda-graphs off for the partitioned forward)\n")
    else:
        plan, note = optimize(model, x.to(device)), ""
    if rank == 0:
        print("weft train: --overlap lancet " + note + plan.summary(), flush=True)
    return plan


def _measure_balance_model(model: GPT, cfg: TrainConfig, batches: BatchSampler, start: int, device: torch.device,
                           rank: int, ep_size: int) -> None:
    """--balance pro-prophet with --balance-model measured: Pro-Prophet's performance model of
    every MoE layer measured on this machine (weft.overlap.fit_balance_models) before the first
    step; with --cuda-graphs on, a copy's cost timed as CUDA graphs shaped as the step's
    (`graph_placement="updated"`) where the copies go into replica slots."""
    if not model.balanced or cfg.balance_model != "measured" or ep_size == 1:
        return
    if model.tp is not None:  # the measured model times sub-layer units, which TP blocks do not have
        if rank == 0:
            print("weft train: --balance-model measured needs the model's sub-layer profile, which tensor-parallel "
                  "blocks (run as one stack) do not give: Pro-Prophet plans with the nominal model", flush=True)
        return
    x, _ = batches.get(start + 1, 0)
    graphed = cfg.cuda_graphs == "on" and device.type == "cuda"  # a balanced step replays only when asked
    if graphed:  # the copies' cost timed as the step's graphs will pay it (`weft.train.step.follow_loads`)
        shape_for_any_placement(model)
    fitted = fit_balance_models(model, x.to(device), autocast=functools.partial(training_autocast, device),
                                graphed=graphed)
    if rank == 0 and fitted:
        first = fitted[0]
        print(f"weft train: Pro-Prophet's model measured: all-to-all {first.bandwidth / 1e9:.2f} GB/s per rank, "
              f"experts {first.throughput:,.0f} rows/s per rank (layer 0), non-MoE forward / backward hiding "
              "Trans / Agg " + ", ".join(f"{m.forward_non_moe_s * 1e3:.2f} / {m.backward_non_moe_s * 1e3:.2f}"
                                         for m in fitted) + " ms per layer; a copy's overhead " +
              ", ".join(f"{m.copy_overhead_s * 1e3:.2f}" for m in fitted) + " ms, the rows' scale " +
              ", ".join(f"{m.expert_scale:.2f}" for m in fitted) + ", the copied rows' scale " +
              ", ".join(f"{m.slot_scale:.2f}" for m in fitted) + " per layer", flush=True)


def _choose_tp_schedule(model: GPT, cfg: TrainConfig, batches: BatchSampler, start: int, device: torch.device,
                        rank: int, world: int) -> None:
    """--tp-overlap auto: time Megatron's schedule and Domino's splits on a training batch and run
    the fastest (weft.tp.search), the decision cached in $WEFT_CACHE/tp_schedules.json. Where the
    micro-step will replay as a CUDA graph each candidate is timed as one (`time_graphed`): eagerly
    Domino's split step is host-bound and would lose to a schedule it beats once graphed."""
    if cfg.tp_overlap != "auto":
        return
    x, y = (t.to(device) for t in batches.get(start + 1, 0))

    def fwd_bwd(schedule):
        def run(x_in: torch.Tensor, y_in: torch.Tensor) -> None:
            with training_autocast(device):
                _, loss = model(x_in, y_in, tp_schedule=schedule)
            loss.backward()
        return run

    def step(schedule) -> None:
        fwd_bwd(schedule)(x, y)
        model.zero_grad(set_to_none=True)

    graphed = cfg.cuda_graphs != "off" and graph_blocker(model, device, cfg.overlap) is None
    timer = (lambda schedules: time_graphed(fwd_bwd, schedules, (x, y), model.parameters(),
                                            accumulate=cfg.grad_accum > 1)) if graphed else None
    shape = hashlib.sha256(json.dumps(model.config.to_dict(), sort_keys=True).encode()).hexdigest()[:12]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    # Domino's all-reduces copied through peer memory: a candidate where the GPUs reach each other's
    copy = device.type == "cuda" and peers_unavailable(model.tp[0], device) is None
    key = (f"model-{shape}-batch{x.shape[0]}x{x.shape[1]}-tp{cfg.tp}-world{world}-{name}-torch{torch.__version__}"
           f"-kernels-{cfg.kernels}{'-graphed' if graphed else ''}{'-copy' if copy else ''}")
    schedule, report = choose_schedule(step, x.shape[0], model.config.dim, device, key,
                                       token_cache_dir().parent / "tp_schedules.json", timer=timer, copy=copy)
    model.use_tp_schedule(schedule)
    if rank == 0:
        measured = "measured as CUDA graphs" if graphed else "measured"
        how = "from the cache" if report["from_cache"] else f"{measured}: " + ", ".join(
            f"{n} {t:.1f} ms" for n, t in report["times_ms"].items())
        print(f"weft train: --tp-overlap auto runs {report['chosen']} ({how})", flush=True)


def _micro_steps(model: GPT, cfg: TrainConfig, plan, batch, device: torch.device, rank: int,
                 groups: MoEGroups, masters: MasterWeights) -> MicroSteps:
    """The micro-step, eager or a CUDA graph (`cfg.cuda_graphs`), summing the gradients
    over the data-parallel ranks in its backward where `cfg.grad_reduce` says so (`gradient_reducer`)."""
    log = (lambda line: print(line, flush=True)) if rank == 0 else (lambda line: None)
    example = tuple(t.to(device) for t in batch)
    reducer = gradient_reducer(model, cfg, groups, device, log, masters)
    try:
        steps = build_micro_step(model, cfg.grad_accum, cfg.cuda_graphs, example, cfg.overlap, plan, log, reducer)
    except CaptureError as e:
        raise TrainingStopped(f"{e} (run with --cuda-graphs off or auto)") from e
    if steps.graphed:
        log("weft train: each micro-step replays as one CUDA graph (--cuda-graphs off: eager)")
    if isinstance(plan, OverlapPlan):
        log(lancet_prediction(plan, model, steps.wgrad_scheduled))
    return steps


def gradient_reducer(model: GPT, cfg: TrainConfig, groups: MoEGroups, device: torch.device,
                     log: Callable[[str], None], masters: MasterWeights | None = None) -> OverlappedReduce | None:
    """The `OverlappedReduce` of the gradients' sums over the data-parallel ranks (the replicated
    parameters over every rank, the experts over their expert-data-parallel replicas where
    `--ep-size` leaves some: `overlapped_reduce`) where `reduced_after` says they run during the
    backward (None: `reduce_gradients` sums them after it; why, logged; a balanced model's expert
    gradients always after it, see below). With several micro-batches a
    step, the last one's backward sends them, adding `masters`' float32 accumulators (the earlier
    micro-batches' sums of the staged weights; the others accumulate in their `.grad`). The staged
    weights' accumulators are the buckets' slots where `adopts_accumulators` says so."""
    if cfg.grad_reduce == "after" or group_size(groups.dp) == 1:
        return None
    slow = peers_unavailable(groups.dp, device) if device.type == "cuda" else None
    adopt = adopts_accumulators(cfg, masters)
    # Pro-Prophet adds its copied experts' gradients into the owners' at the end of the backward,
    # after their buckets would have left: a balanced model's expert sums run after the backward
    replicas = 1 if model.balanced else groups.edp_size
    why = reduced_after(cfg, groups.tp_size, device, slow, replicas, adopt and cfg.grad_accum == 1)
    if why is not None:
        log(f"weft train: the gradients are summed over the data-parallel ranks after the backward ({why})")
        return None
    several = cfg.grad_accum > 1 and masters is not None
    reducer = overlapped_reduce(model, groups, experts=replicas > 1,
                                earlier=masters.accumulators() if several else None,
                                adopt=masters.adopt if adopt else None)
    expert_ids = {id(p) for p in expert_parameters(model)}
    dense = sum(p.numel() for p in reducer.params if id(p) not in expert_ids) / 1e6
    experts = sum(p.numel() for p in reducer.params if id(p) in expert_ids) / 1e6
    what = f"replicated gradients ({dense:.1f}M) over the {group_size(groups.dp)} data-parallel ranks"
    if experts:
        what += f" and the expert gradients ({experts:.1f}M) over their {groups.edp_size} replicas"
    if cfg.grad_reduce == "overlap":
        chosen = "--grad-reduce overlap"
    else:
        chosen = "--grad-reduce auto: " + (slow or ("the experts have replicas" if replicas > 1 else
                                                   "the buckets are the master weights' accumulators"))
    when = "each backward" if cfg.grad_accum == 1 else \
        f"the backward of each step's last of {cfg.grad_accum} micro-batches"
    log(f"weft train: the {what} are summed during {when}, in buckets of ~25 MB ({chosen})")
    return reducer


def adopts_accumulators(cfg: TrainConfig, masters: MasterWeights | None) -> bool:
    """Whether the gradient sums' buckets keep the staged weights' float32 accumulators in their
    slots (`MasterWeights.adopt`: the float32 gradients held once): wherever there are staged
    weights, except with several micro-batches a step under Lancet, whose dW scheduler may make
    a bucket be sent again, which a slot accumulating the micro-batches cannot be."""
    return (masters is not None and bool(masters.accumulators())
            and (cfg.grad_accum == 1 or cfg.overlap != "lancet"))


def where_reduced(model: GPT, groups: MoEGroups, reducer: OverlappedReduce | None) -> dict[str, str]:
    """The run summary's account of where the data-parallel sums ran: the replicated gradients'
    and the expert gradients' ("during the backward", "after it", or "nowhere" for experts with
    no replicas)."""
    experts = expert_parameters(model)
    covered = reducer is not None and any(reducer.covers(p) for p in experts)
    return {"replicated_gradients_reduced": "during the backward" if reducer is not None else
            "nowhere" if group_size(groups.dp) == 1 else "after it",
            "expert_gradients_reduced": "nowhere" if groups.edp_size == 1 or not experts else
            "during the backward" if covered else "after it"}


def reduced_after(cfg: TrainConfig, tp_size: int, device: torch.device, slow: str | None,
                  expert_replicas: int = 1, adopted: bool = False) -> str | None:
    """Why `--grad-reduce overlap|auto` sums the gradients after the backward (None: during it,
    `OverlappedReduce`; with several micro-batches a step, in the last one's backward). Not with
    tensor parallelism (whose routers' gradients are summed over the TP group first). On GPUs
    `auto` overlaps where it measured at least as fast as the sum after the backward
    (docs/benchmarks.md, forty-fourth to forty-seventh sessions):
    - where the ranks do not reach each other's memory (`slow`: `peers_unavailable`'s reason,
      several nodes or NCCL_P2P_DISABLE=1: 1.06-1.18x the tokens/s of gpt2-s-moe and gpt2-l-moe
      on 2 x H200 with P2P disabled);
    - where the experts have `expert_replicas` > 1 (`--ep-size` below the world: their gradients,
      most of the model's, are summed too; gpt2-s-moe with `--ep-size 1` 1.42x with NVLink);
    - where the buckets' slots are the master weights' float32 accumulators (`adopted`: one
      micro-batch a step, staged weights; `MasterWeights.adopt`), so the copies into the buckets
      are the staging the sum after the backward does too: 1.00x and 1.01x with NVLink
      (gpt2-s-moe, gpt2-l-moe), 0.2-0.8 GiB less memory.
    With NVLink and the replicated gradients alone, `auto` sums after the backward with float32
    weights (no accumulators: the bucket copies come on top, 0.96-0.99x measured before the
    adoption) and with several micro-batches a step (adopted since, not measured). On the CPU the
    ranks share its cores."""
    if tp_size > 1:
        return "--tp: the routers' gradients are summed over the tensor-parallel group first"
    if cfg.grad_reduce == "auto" and device.type != "cuda":
        return "--grad-reduce auto: on the CPU the ranks share its cores"
    if cfg.grad_reduce == "auto" and slow is None and expert_replicas == 1 and not adopted:
        return ("--grad-reduce auto: the GPUs reach each other's memory, only the replicated gradients are summed and "
                "the buckets would copy them beside the master weights' accumulators, where the sum beside the "
                "backward measured slower")
    return None


def lancet_prediction(plan: OverlapPlan, model: GPT, wgrad_scheduled: bool) -> str:
    """One log line: Lancet's predicted forward + backward of a micro-step as it was built (its MoE
    layers' pipelining degrees, its dW schedule kept or dropped; `passes.predicted_as_run`)."""
    predicted, form = predicted_as_run(plan, wgrad_scheduled, layer_degrees(model))
    if predicted is None:
        return f"weft train: Lancet's model has no prediction for this micro-step ({form})"
    return f"weft train: Lancet predicts {predicted * 1e3:.2f} ms forward+backward a micro-step ({form})"


def reads_late(device: torch.device) -> bool:
    """Whether the loop reads a step's metrics only after launching the next step's micro-batches:
    on GPUs, whose kernels run behind the host. On the CPU every op has finished when it returns,
    so there is nothing to overlap, and a late read would time each step from the middle of the
    next one."""
    return device.type == "cuda"


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch on `device`. On CUDA through pinned memory with a non-blocking copy: a copy from
    pageable memory waits for every kernel queued before it, which would stop the host from
    launching a step while the GPU runs the last one."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class PendingStep:
    """A training step launched on the device whose metrics the host has not read yet. `values`
    (on the host once `ready` has completed; None: at once): losses (total, ce, aux: means over
    the step's micro-batches and data-parallel ranks), dropped slots, slots per expert of every
    MoE layer (summed over all ranks), then the global gradient norm."""

    step: int
    lr: float
    values: torch.Tensor
    ready: torch.cuda.Event | None
    num_moes: int
    copied_experts: list | None  # Pro-Prophet: per layer, the experts its last call copied
    # ... and the busiest rank's rows over the mean its plan predicted, [plain, with the copies] (None: no plan yet)
    planned_rank_load: list | None = None


def _train_step(model: GPT, optimizer, batches: BatchSampler, step: int, cfg: TrainConfig,
                groups: MoEGroups, device: torch.device, micro_steps: MicroSteps, masters: MasterWeights,
                lr: float, previous: PendingStep | None = None) -> tuple[dict | None, PendingStep]:
    """Launch one training step and read the `previous` one's metrics while its micro-batches run
    on the device: returns (the previous step's metrics, or None; this step, pending). The host
    reads the previous step before this step's optimizer update, whose launch depends on it (a
    skipped step's optimizer step counts go back; --on-nonfinite stop stops before it)."""
    loss_sum = torch.zeros(4, device=device)  # total, ce, aux, dropped slots
    counts = None
    for micro in range(cfg.grad_accum):
        x, y = batches.get(step, micro)
        run = micro_steps.of(micro, cfg.grad_accum)
        if run is micro_steps.last:  # its backward sends every accumulator plus its own gradients
            masters.zero_unfilled()
        losses, layer_counts = run(to_device(x, device), to_device(y, device))
        masters.stage_gradients(micro_steps.summed(micro, cfg.grad_accum))
        loss_sum += losses  # added now: a graphed step's outputs are overwritten by its next replay
        counts = layer_counts.clone() if counts is None else counts + layer_counts
    finished = None if previous is None else _read_step(previous, model, optimizer, cfg)
    with masters.float32_gradients():
        reduce_gradients(model, groups, micro_steps.reduced)
        # The global gradient norm is the same on every rank (reduced gradients), so all ranks take
        # the same decision; a NaN/inf loss on any rank makes it non-finite too. The clipping
        # coefficient and the skip of a non-finite step are decided on the device: the host
        # launches the update without waiting for the norm, and reads it with the step's metrics.
        norm = gradient_norm(model, groups)
        finite = torch.isfinite(norm)
        optimizer.step(grad_scale=clip_scale(norm, cfg.grad_clip), skip=~finite)
    micro_steps.clear_grads(optimizer)

    loss_sum[:3] /= cfg.grad_accum * group_size(groups.dp)
    stats = _all_reduce(torch.cat([loss_sum, counts.flatten()]), groups.dp)
    num_moes = counts.shape[0]
    if num_moes and groups.tp_size > 1:  # each TP rank routed its own share: drops and loads over all ranks
        stats[3:] = _all_reduce(stats[3:].contiguous(), groups.tp)
    if model.config.expert_bias_rate:  # the step's global loads: the same bias on every rank; none if skipped
        for moe, counts_E in zip(model.moe_layers(), stats[4:].view(num_moes, model.config.num_experts)):
            moe.update_expert_bias(counts_E * finite, model.config.expert_bias_rate)
    copied = [list(moe.balancer.last_copied) for moe in model.moe_layers()] if model.balanced else None
    rank_loads = [_planned_rank_load(moe.balancer.last_plan) for moe in model.moe_layers()] if model.balanced else None
    values, ready = host_tensor_async(torch.cat([stats, norm.view(1).to(stats.dtype)]))
    return finished, PendingStep(step, lr, values, ready, num_moes, copied, rank_loads)


def _planned_rank_load(plan) -> list[float] | None:
    """A Pro-Prophet plan's busiest rank over the mean, [plain, with its copies] (None: no plan)."""
    return None if plan is None else [round(plan.plain_rank_load, 4), round(plan.rank_load, 4)]


def _read_step(pending: PendingStep, model: GPT, optimizer, cfg: TrainConfig) -> dict:
    """The step's metrics on the host (the first wait for the device since it was launched); a
    non-finite gradient norm takes the skipped step's optimizer counts back, or stops the run."""
    if pending.ready is not None:
        pending.ready.synchronize()
    step, stats = pending.step, pending.values[:-1]
    grad_norm = float(pending.values[-1])
    finite = math.isfinite(grad_norm)
    if not finite:
        optimizer.skipped()
        if cfg.on_nonfinite == "stop":
            raise TrainingStopped(
                f"step {step}: the gradient norm is {grad_norm} (the loss diverged); stopped with the optimizer "
                f"step skipped, so the latest checkpoint is the last good state (lower train.lr, or --on-nonfinite "
                f"skip)")
    if finite and not math.isfinite(float(stats[0])) and cfg.on_nonfinite == "stop":
        raise TrainingStopped(f"step {step}: the loss is {float(stats[0])}; stopped (the optimizer step was taken: "
                              "resume from the latest checkpoint with a lower train.lr)")
    num_moes = pending.num_moes
    slots = stats[4:].sum().clamp_min(1)
    counts = stats[4:].view(num_moes, model.config.num_experts)  # (0, E) for a dense model
    mean = counts.mean(1).clamp_min(1e-9)
    return {
        "step": step, "lr": pending.lr,
        "loss": float(stats[0]), "ce_loss": float(stats[1]), "aux_loss": float(stats[2]),
        "grad_norm": grad_norm, "skipped": not finite, "dropped_share": float(stats[3] / slots),
        "expert_load": counts.long().tolist(),
        "imbalance": (counts.amax(1) / mean).tolist() if num_moes else [],
        **({"copied_experts": pending.copied_experts} if pending.copied_experts is not None else {}),
        **({"planned_rank_load": pending.planned_rank_load} if pending.planned_rank_load is not None else {}),
    }
