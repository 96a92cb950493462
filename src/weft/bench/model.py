"""`weft bench model`: full training iterations (forward + backward + optimizer) of a GPT preset
per overlap mode, side by side (Lancet fig. 11-14, 16).

Modes: `none` (the plain model), `tutel` (every MoE layer's overlap degree tuned, Tutel 3.2-3.3),
`lancet-bw` (dW scheduling only), `lancet-fw` (partitioned forward only), `lancet` (both, each
kept only where measuring it on the batch showed a gain: `weft.overlap.optimize`), and
two measurement devices with the dW scheduler on even where nothing communicates: `dw-in-place`
(its default: with no collective to fill, dW runs in place: the wrappers' own cost) and
`defer-dw` (`in_place=False`: every dW deferred to the end of backward, what deferral costs
with nothing to hide it under). With `--tp N` (dense presets: the blocks split over groups of N
ranks, weft.tp) the modes are `tp` (Megatron's schedule), `domino` (Domino's, `--p1`/`--p2`),
`domino-copy` (Domino's with its all-reduces copied through peer memory: GPUs of one node) and
`no-comm` (the TP all-reduces left out: not the model's function, so no `max_error`); an MoE
preset's experts are then expert-parallel over the whole world, each TP rank routing its share of
the tokens (weft.tp.TokenSplit; `no-comm` keeps those exchanges).
Pro-Prophet (dropless presets, `--capacity dropless`): `balance` (every MoE layer copies its
planned heavy experts, Trans and Agg moved a layer early: the block-wise schedule, Alg. 2) and
`balance-inline` (the copies moved inside each layer's call); the model is then built balanced,
its planner's model measured here as `weft train` measures it (`--balance-model measured`:
`weft.overlap.fit_balance_models`, with each layer's copy overhead; `nominal`: H200-class
constants), and `none` runs it without copies. `--skew S` biases every layer's expert selection by a Zipf(S)
ranking of the experts (the selection bias of weft.MoE's expert_bias, fixed), in every mode.

`--cuda-graphs on` (GPUs; modes none, tutel, dedup, dedup-d2, lancet) times each mode's forward
and backward replayed as one CUDA graph, captured as `weft train` captures its micro-step
(`weft.train.step.build_micro_step`): an eager gpt2-s-moe step is host-bound, so the eager modes'
differences are mostly launch costs that a graphed training step does not pay. tutel captures
the degree whose graph replays fastest, lancet plans dW scheduling only (its partitioned forward
reads sizes on the host) and keeps it only where its graph replays faster; each row's `graph`
says what was chosen, and `forward_ms` is None (no lap inside a graph).

Every mode is configured once up front (Lancet: profile and plan; tutel: tune until the tuning
dictionaries have decided) and its loss and gradients are checked against `none` on the starting
weights and the same batch (`max_error`). The modes are then timed interleaved, since drifts
within one launch (clocks, NCCL, allocator) are larger than the differences between modes: in
each round every mode runs one iteration (switch, barrier, one timed step), the order rotated
by one every round; the first `warmup` rounds are not counted. All modes share one model and
one AdamW (the weights drift; the work per step does not). A mode listed twice is switched to
the same configuration and reported as a separate row (`repeat`: 0, 1, ...): the gap between the
two is the noise floor.

Per row (milliseconds; each step's time is the slowest rank's):
- `iteration_ms`, `iteration_ms_min`, `iteration_iqr_ms`: median, minimum and interquartile
  range (q3 - q1) of forward + backward + optimizer step;
- `fwd_bwd_ms`, `fwd_bwd_ms_min`, `fwd_bwd_iqr_ms`: the same steps up to the end of backward;
- `forward_ms`, `forward_ms_min`, `forward_iqr_ms`: up to the end of the forward (the loss);
- Lancet modes: `predicted_ms` (the planner's forward + backward of the step as it ran,
  `predicted_form`: its plan, or the plain step where a graph dropped the dW schedule;
  `lancet_predicted_ms` the plan's own, `baseline_predicted_ms` without Lancet) and
  `prediction_error` (predicted / measured `fwd_bwd_ms` - 1); graphed, every price includes the
  profile's in-step corrections (`weft.overlap.profile.in_step`), and `uncorrected_predicted_ms` /
  `uncorrected_prediction_error` price the same step without them; where the dW schedule ran,
  `dw_eta_predicted_ms` / `dw_eta_prediction_error` price it with the dW items' own measured η
  (`passes.predicted_with_dw_efficiency`), and `wgrad_plan` lists the collectives of the plan
  the schedule followed (each one's expected ms, the items it took and their profiled ms;
  `wgrad_plan_line` sums them); with the plan's parts `predicted_forward_ms`
  (sub-layers), `predicted_backward_ms` (sub-layers) and `predicted_rest_ms` (embedding, head
  and loss, forward + backward) to see which part is off;
- on CUDA, `decomposition` (a profiled run of each mode after the timing rounds) and, where the
  mode ran Pro-Prophet's Trans and Agg (the collectives launched in their profiler stages),
  `transfer_decomposition`: their kernels' time and the share of it that overlapped computation;
- balance modes: `copied_experts` (per MoE layer, the experts the last timed step copied).
`meta.expert_load_max_over_mean`: per MoE layer, the busiest expert's slots over the mean.
`meta.timing` is "interleaved"; `meta.rounds` / `meta.warmup_rounds` the counted and warm-up rounds.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from weft.bench.breakdown import comm_cells, print_breakdowns, profile_parts
from weft.bench.layer import load_imbalance, write_report
from weft.bench.timing import (
    ProgressLog,
    Run,
    Timer,
    gpu_state,
    gpu_state_line,
    graphs_must_fit,
    interleaved_ms,
    quartiles,
)
from weft.cliargs import arg, names, non_negative_int, positive_int
from weft.distributed import build_moe_groups, group_rank, init_distributed
from weft.models import GPT, GPTConfig
from weft.models.presets import PresetChoice
from weft.moe.gates import EXPERT_BIAS_GATES, zipf_bias
from weft.ops.wgrad import WGradScheduler, plan_line
from weft.overlap import fit_balance_models, passes
from weft.overlap.forward import Range
from weft.precision import training_autocast
from weft.profiling import stage
from weft.tp import make_schedule
from weft.train.config import BALANCE_MODELS
from weft.train.step import LAYER_VALUES, MicroSteps, build_micro_step, set_layers
from weft.tune import run_until_tuned
from weft.tune.dictionary import DEGREES

# Pro-Prophet's modes and the balance_schedule each runs the balanced model with (weft.models.gpt).
BALANCE_MODES = {"balance": "blockwise", "balance-inline": "inline"}
MODES = ("none", "tutel", "dedup", "dedup-d2", "lancet-bw", "lancet-fw", "lancet", "dw-in-place", "defer-dw",
         *BALANCE_MODES)
TP_MODES = ("tp", "domino", "domino-copy", "no-comm")
# The modes `--cuda-graphs on` captures, each as `weft train --overlap` / `--a2a-algo` would.
GRAPHED_MODES = ("none", "tutel", "dedup", "dedup-d2", "lancet")


@dataclass
class _Setting:
    """What switches the shared model into one mode (what `_configure` set), and its check."""

    ranges: list[Range]
    scheduler: WGradScheduler | None
    moe_overrides: dict  # per-call settings of every MoE layer (weft.MoE.forward's keywords)
    plan: passes.OverlapPlan | None
    tp_schedule: object = None  # the weft.tp schedule of a tensor-parallel mode
    balance_schedule: str = "blockwise"  # a balanced model's (weft.models.gpt.run_units)
    max_error: float = 0.0


def _configure(mode: str, model: GPT, idx: torch.Tensor, max_partitions: int, p1: int, p2: int,
               graphed: bool = False) -> _Setting:
    """Set `model` up for `mode` and return what switches it back into that mode. `graphed`: for
    a CUDA graph of the step, as `weft train` plans Lancet there (dW scheduling only, its check
    left to the graphs' timing: `weft.train.step.choose_wgrad_schedule`)."""
    if mode in TP_MODES:  # a schedule passed to each forward; nothing to set up
        return _Setting([], None, {}, None, make_schedule("none" if mode == "tp" else mode, p1, p2))
    passes.apply(model, [], None)
    # dedup / dedup-d2: every MoE layer at `weft train --a2a-algo`'s settings of that name; graphed
    # lancet times the pipelining degrees too, as `weft train --overlap lancet` does where its step is graphed
    tuned = mode == "tutel" or mode == "lancet" and graphed
    moe_overrides = {"overlap_degree": "auto" if tuned else 1, **LAYER_VALUES.get(("a2a_algo", mode), {})}
    if model.balanced and mode not in BALANCE_MODES:  # the balanced model without copies
        return _Setting([], None, moe_overrides, None, balance_schedule="off")
    if mode in BALANCE_MODES:
        return _Setting([], None, moe_overrides, None, balance_schedule=BALANCE_MODES[mode])
    plan, scheduler = None, None
    if mode == "lancet" and graphed:
        plan = passes.optimize(model, idx, forward=False, partitions=(1,), measure=0, graphed=True,
                               degrees=DEGREES,  # each layer's degree is timed as graphs: price every candidate
                               in_step=True)  # priced with the profile's in-step corrections
        scheduler = plan.scheduler
    elif mode.startswith("lancet"):
        # lancet-bw / lancet-fw are ablations of one pass: applied as planned, not measured away
        plan = passes.optimize(model, idx, forward=mode != "lancet-bw", backward=mode != "lancet-fw",
                               max_partitions=max_partitions, measure=5 if mode == "lancet" else 0)
        scheduler = plan.scheduler
    elif mode in ("dw-in-place", "defer-dw"):
        scheduler = WGradScheduler(in_place=mode == "dw-in-place")
        passes.apply(model, [], scheduler)
    return _Setting(plan.ranges if plan else [], scheduler, moe_overrides, plan)


def _capture_modes(model: GPT, settings: dict[str, _Setting], example: tuple[torch.Tensor, torch.Tensor],
                   done: Callable[[str], None] = lambda what: None
                   ) -> tuple[dict[str, MicroSteps], dict[str, list[str]], dict[str, tuple[int, ...]]]:
    """Each mode's forward and backward captured as one CUDA graph, as `weft train` builds its
    micro-step (`weft.train.step.build_micro_step` with `--cuda-graphs on`: tutel's degree and
    dedup's form timed as graphs, Lancet's dW schedule kept only where its graph is faster), the
    MoE layers set to the mode's values for the capture and back to plain after it; `done` hears
    of each capture. Returns the micro-steps (their graphs own the gradients), what each build said
    and the pipelining degree each captured (one per MoE layer, in order)."""
    graphs, notes, degrees = {}, {}, {}
    device = example[0].device
    for mode, setting in settings.items():
        passes.apply(model, setting.ranges, setting.scheduler)
        notes[mode] = []
        for name in ("a2a_algo", "overlap_degree"):  # the all-to-all first: each step a valid layer
            if name in setting.moe_overrides:
                set_layers(model, name, setting.moe_overrides[name])
        overlap = "lancet" if setting.plan is not None else "tutel" if mode == "tutel" else "none"
        graphs[mode] = build_micro_step(model, 1, "on", example, overlap, setting.plan, notes[mode].append)
        degrees[mode] = passes.layer_degrees(model)
        held = f", {torch.cuda.memory_allocated(device) / 2**30:.1f} GiB allocated" if device.type == "cuda" else ""
        done(f"{mode} captured as a CUDA graph{held}")  # every mode's graph stays alive for the timing
        if device.type == "cuda":  # the warm-up calls' freed blocks, cached in the default pool, which the
            torch.cuda.empty_cache()  # next graph's private pool (and the optimizer's states) could not reuse
        set_layers(model, "a2a_algo", "linear")  # through degree 1: valid for every all-to-all
        passes.apply(model, [], None)
    return graphs, notes, degrees


def _switch(model: GPT, setting: _Setting) -> None:
    if setting.tp_schedule is None:
        passes.apply(model, setting.ranges, setting.scheduler)


def _assert_clean(model: GPT, scheduler: WGradScheduler | None) -> None:
    """No gradient and no queued dW item may carry over into the next mode's step."""
    leftover = [n for n, p in model.named_parameters() if p.grad is not None]
    stats = scheduler.stats if scheduler is not None else None
    if leftover or (stats is not None and stats.deferred != stats.run_under_comm + stats.flushed):
        raise RuntimeError(f"state left over after a step: gradients of {leftover[:3]}, scheduler {stats}")


@dataclass
class ModelBenchConfig(PresetChoice):
    """`weft bench model`: training iterations of a preset per overlap mode, interleaved."""

    modes: tuple[str, ...] = arg(("none", "tutel", "lancet-bw", "lancet-fw", "lancet"),
                                 "comma-separated: none, tutel, dedup (each token to a rank once), dedup-d2 (dedup "
                                 "with each rank's own pairs computed while the others' rows travel in), lancet-bw, "
                                 "lancet-fw, lancet, and with the dW "
                                 "scheduler on even without all-to-alls dw-in-place (its default) or defer-dw "
                                 "(every dW deferred to the end of backward); a mode listed twice is timed twice "
                                 "(its spread is the noise floor)", parse=names)
    steps: int = arg(20, "timed rounds (median, min, iqr reported)", parse=positive_int)
    warmup: int = arg(5, "untimed rounds first", parse=positive_int)
    json: str | None = arg(None, "write the results to this JSON file")
    max_partitions: int = arg(8, "Lancet's K: the most batch partitions of a pipeline", parse=positive_int)
    profile_steps: int = arg(3, "profiled iterations per mode for the time decomposition (GPU; 0: none)",
                             parse=non_negative_int)
    trace: str | None = arg(None, "folder for Chrome traces of each mode's profiled iterations, one file per mode and "
                            "rank (GPU; `scripts/trace_timeline.py` prints them as timelines)")
    breakdown: bool = arg(False, "print each mode's GPU time by sub-layer and MoE stage (embedding, attention, "
                          "mlp, router ... combine, head, loss, optimizer; forward and backward), from the "
                          "profiled iterations")
    tp: int = arg(1, "tensor parallelism (dense presets): split the blocks over groups of N ranks; modes tp, "
                  "domino, domino-copy, no-comm", parse=positive_int)
    p1: int = arg(2, "with --tp, mode domino: micro-batches", parse=positive_int)
    p2: int = arg(1, "with --tp, mode domino: column slices of each sub-layer's last linear", parse=positive_int)
    skew: float = arg(0.0, "bias every MoE layer's expert selection by -S ln(rank) over a fixed random ranking of "
                      "the experts (Zipf(S)-skewed load; 0: none)", parse=float)
    balance_model: str = arg("measured", "balance modes: Pro-Prophet's performance model measured here (with each "
                             "copy's overhead) or 'nominal' (H200-class constants, the paper's eqs. 1-8)",
                             choices=BALANCE_MODELS)
    cuda_graphs: str = arg("off", "on: time each mode's forward and backward as one CUDA graph, captured as `weft "
                           "train` captures its micro-step (tutel: the degree whose graph replays fastest; lancet: "
                           "its dW schedule, kept if its graph is faster, no partitioned forward); modes none, "
                           "tutel, dedup, dedup-d2, lancet; GPUs", choices=("off", "on"))

    def validate(self) -> None:
        super().validate()
        known = TP_MODES if self.tp > 1 else MODES
        if not self.modes or any(m not in known for m in self.modes):
            raise ValueError(f"--modes {','.join(self.modes)!r}: choose from {', '.join(known)}"
                             + (f" (with --tp {self.tp})" if self.tp > 1 else
                                " (tp, domino, domino-copy, no-comm need --tp)"))
        cfg = self.model_config()
        if self.tp > 1 and cfg.moe_every and (self.batch_size * cfg.block_size) % self.tp:
            raise ValueError(f"--tp {self.tp}: each TP rank routes 1/{self.tp} of the tokens; {self.batch_size} x "
                             f"{cfg.block_size} do not divide evenly")
        if self.tp > 1 and any(m.startswith("domino") for m in self.modes) and self.p1 > self.batch_size:
            raise ValueError(f"--p1 {self.p1} exceeds --batch-size {self.batch_size}: domino splits the batch")
        balancing = [m for m in self.modes if m in BALANCE_MODES]
        if balancing and not (cfg.moe_every and cfg.capacity_factor is None):
            raise ValueError(f"--modes {balancing[0]}: Pro-Prophet balances dropless MoE layers; add --capacity "
                             f"dropless (and an MoE preset)")
        if balancing and any(m.startswith("lancet") or m in ("dw-in-place", "defer-dw") for m in self.modes):
            raise ValueError("--modes: the balance modes run beside none and tutel only (Lancet's pipeline and the "
                             "dW scheduler copy inline)")
        dedups = [m for m in self.modes if m.startswith("dedup")]
        if dedups and (balancing or cfg.gate == "expert_choice"):
            raise ValueError(f"--modes {dedups[0]}: the deduplicating all-to-all needs a token-choice gate and runs "
                             "beside the modes without Pro-Prophet's copies")
        if "dedup-d2" in self.modes and cfg.capacity_factor is None:
            raise ValueError("--modes dedup-d2: needs a padded capacity mode (not --capacity dropless)")
        if self.skew < 0 or (self.skew and not cfg.moe_every):
            raise ValueError(f"--skew {self.skew:g}: needs an MoE preset and a value >= 0")
        if self.cuda_graphs == "on":
            ungraphed = [m for m in self.modes if m not in GRAPHED_MODES]
            if ungraphed or self.tp > 1:
                raise ValueError(f"--cuda-graphs on times modes {', '.join(GRAPHED_MODES)} without --tp, not "
                                 f"{ungraphed[0] if ungraphed else f'--tp {self.tp}'} (weft bench tp has +graph modes)")
            if not torch.cuda.is_available():
                raise ValueError("--cuda-graphs on needs GPUs (CUDA graphs); this run has none")
        if self.skew and cfg.gate not in EXPERT_BIAS_GATES:
            gates = ", ".join(EXPERT_BIAS_GATES)
            raise ValueError(f"--skew biases the expert selection of token-choice gates ({gates}), not {cfg.gate!r}")

    def bench_model_config(self) -> GPTConfig:
        """The model: the preset with the overrides, keeping a selection bias where `skew` sets one
        (its rate unused: the benchmark never moves it)."""
        cfg = self.model_config()
        return dataclasses.replace(cfg, expert_bias_rate=cfg.expert_bias_rate or 1e-3) if self.skew else cfg


def run(bench: ModelBenchConfig) -> dict:
    """Time the modes interleaved for `steps` rounds after `warmup` rounds, on every rank of the
    current world; rank 0 prints the table and writes JSON."""
    bench.validate()
    preset, batch_size, modes, steps, warmup = bench.preset, bench.batch_size, bench.modes, bench.steps, bench.warmup
    max_partitions, profile_steps = bench.max_partitions, bench.profile_steps
    ctx = init_distributed()
    device = ctx.device
    graphed = bench.cuda_graphs == "on"
    cfg = bench.bench_model_config()
    progress = ProgressLog("model", ctx.rank)
    groups = build_moe_groups(tp_size=bench.tp, experts=cfg.moe_every > 0) if bench.tp > 1 else None
    torch.manual_seed(0)
    model = GPT(cfg, group=dist.group.WORLD if dist.is_initialized() else None,
                balance="pro-prophet" if any(m in BALANCE_MODES for m in modes) else None,
                tp_group=groups.tp if groups else None).to(device)
    if bench.skew:
        for moe in model.moe_layers():
            moe.expert_bias.copy_(zipf_bias(cfg.num_experts, bench.skew))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    # the ranks of a tensor-parallel group get the same tokens
    gen = torch.Generator(device="cpu").manual_seed(100 + (group_rank(groups.dp) if groups else ctx.rank))
    batches = [torch.randint(0, cfg.vocab_size, (batch_size, cfg.block_size + 1), generator=gen).to(device)
               for _ in range(3)]
    if model.balanced and ctx.world_size > 1 and bench.balance_model == "measured":  # as `weft train` does
        fit_balance_models(model, batches[0][:, :-1], autocast=functools.partial(training_autocast, device))

    def loss_of(tokens, setting: _Setting | None = None):
        setting = setting or _Setting([], None, {}, None, balance_schedule="off")
        with training_autocast(device):
            return model(tokens[:, :-1], tokens[:, 1:], moe_overrides=setting.moe_overrides,
                         tp_schedule=setting.tp_schedule, balance_schedule=setting.balance_schedule)[1]

    def backward(setting: _Setting, loss: torch.Tensor) -> None:
        # The scheduler's context flushes every deferred dW before it closes.
        with setting.scheduler.backward() if setting.scheduler is not None else contextlib.nullcontext():
            loss.backward()

    def reference_grads(setting: _Setting | None = None):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        return loss_of(batches[0], setting)

    loss = reference_grads()
    loss.backward()
    imbalance, rank_imbalance = zip(*[load_imbalance(moe.stats.expert_counts, moe.ep_size)
                                      for moe in model.moe_layers()]) if model.moe_layers() else ((), ())
    ref_loss, ref_grads = loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters()
                                        if p.grad is not None}
    del loss  # its autograd graph would hold the parameters' gradient accumulators across the captures

    def max_error(setting: _Setting) -> float:
        """The mode's loss and gradients on the starting weights against the plain step's (its
        loss dies here, with its autograd graph)."""
        loss = reference_grads(setting)
        backward(setting, loss)
        error = max([abs(loss.item() - ref_loss)] + [float((p.grad.float() - ref_grads[n]).abs().max())
                                                      for n, p in model.named_parameters() if p.grad is not None])
        model.zero_grad(set_to_none=True)
        return error
    # Configure each distinct mode once, checked on the starting weights; a repeated mode reuses
    # its configuration, so that repeats differ by noise only.
    settings: dict[str, _Setting] = {}
    for mode in dict.fromkeys(modes):
        model.load_state_dict(start)
        setting = _configure(mode, model, batches[0][:, :-1], max_partitions, bench.p1, bench.p2, graphed)
        error = max_error(setting)  # (no-comm computes another function: nothing to report)
        setting.max_error = None if mode == "no-comm" else error
        run_until_tuned(lambda _, s=setting: loss_of(batches[0], s),
                        lambda: sum(moe.tuning.measurements for moe in model.moe_layers()), device)
        settings[mode] = setting
        progress.phase(f"{mode} configured (checked against the plain step, tuned)")
    model.load_state_dict(start)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda" or None)  # as weft train
    timer = Timer(device)

    def step(setting: _Setting, i: int) -> None:
        """One training iteration; laps mark the end of forward and of backward."""
        loss = loss_of(batches[i % len(batches)], setting)
        timer.lap()
        backward(setting, loss)
        timer.lap()
        with stage("optimizer"):
            opt.step()
        model.zero_grad(set_to_none=True)

    def must_fit():  # every mode's graph and gradients stay alive for the timing
        return graphs_must_fit(bench.modes if graphed else (), f"{bench.preset} at batch {bench.batch_size}",
                               "--cuda-graphs on", device)

    with must_fit():
        graphs, graph_notes, degrees = _capture_modes(model, settings, (batches[0][:, :-1], batches[0][:, 1:]),
                                                      progress.phase) if graphed else ({}, {}, {})

    def graph_step(mode: str, i: int) -> None:
        """One iteration: the mode's captured forward and backward replayed, then AdamW (the split
        into forward and backward is inside the graph: both laps at its end)."""
        tokens = batches[i % len(batches)]
        graphs[mode].run(tokens[:, :-1], tokens[:, 1:])
        timer.lap()
        timer.lap()
        with stage("optimizer"):
            opt.step()
        graphs[mode].clear_grads(opt)

    def run_mode(mode: str, i: int) -> None:
        """Switch to `mode` and run one iteration of it (untimed callers: the profile, the copies)."""
        if graphed:
            graph_step(mode, i)
            return
        _switch(model, settings[mode])
        step(settings[mode], i)

    if graphed:
        runs = [Run(lambda: None, lambda r, m=mode: graph_step(m, r)) for mode in modes]
    else:
        runs = [Run(lambda s=settings[mode]: _switch(model, s), lambda r, s=settings[mode]: step(s, r),
                    lambda s=settings[mode]: _assert_clean(model, s.scheduler)) for mode in modes]
    # (row, iteration/forward/fwd_bwd, round)
    with must_fit():
        times = interleaved_ms(runs, steps, warmup, device, timer, progress=progress.round)
    gpu_after_timing = gpu_state(device)  # what the timed rounds ran at (this rank's GPU)

    rows = []
    for i, mode in enumerate(modes):
        setting, plan = settings[mode], settings[mode].plan
        row = {"mode": mode, "repeat": modes[:i].count(mode), "max_error": setting.max_error}
        for name, sample in (("iteration", times[i, 0]), ("forward", times[i, 1]), ("fwd_bwd", times[i, 2])):
            q1, median, q3 = quartiles(sample)
            row.update({f"{name}_ms": median, f"{name}_ms_min": float(sample.min()), f"{name}_iqr_ms": q3 - q1})
        if graphed:  # one graph: no lap between its forward and backward
            row.update(forward_ms=None, forward_ms_min=None, forward_iqr_ms=None, graph=graph_notes[mode])
        if plan is not None:
            scheduled = graphs[mode].wgrad_scheduled if graphed else plan.scheduler is not None
            predicted, form = passes.predicted_as_run(plan, scheduled, degrees.get(mode, ()))
            row.update(lancet_predicted_ms=plan.predicted * 1e3, baseline_predicted_ms=plan.baseline * 1e3,
                       predicted_form=form, ranges=[vars(r) for r in plan.ranges], plan=plan.summary())
            if predicted is not None:
                row["predicted_ms"] = predicted * 1e3
                row["prediction_error"] = row["predicted_ms"] / row["fwd_bwd_ms"] - 1
            # the same step's other prices, beside the plan's
            for name, price in (("uncorrected", passes.predicted_uncorrected),
                                ("dw_eta", passes.predicted_with_dw_efficiency)):
                other = price(plan, scheduled, degrees.get(mode, ()))
                if other is not None:
                    row[f"{name}_predicted_ms"] = other * 1e3
                    row[f"{name}_prediction_error"] = other * 1e3 / row["fwd_bwd_ms"] - 1
            if scheduled and plan.scheduler is not None and plan.scheduler.planned:  # what the schedule ran
                row["wgrad_plan_line"] = plan_line(plan.scheduler.planned)
                row["wgrad_plan"] = [{"collective": repr(c.key), "nbytes": c.nbytes, "items": c.items,
                                      "budget_ms": None if c.budget is None else c.budget * 1e3,
                                      "item_ms": c.item_seconds * 1e3} for c in plan.scheduler.planned]
            # Where the error is: the planner's forward (sub-layers only) against the measured
            # forward (which also holds embedding, head and loss: `predicted_rest_ms` covers those
            # forward and backward).
            row.update({f"predicted_{k}_ms": v * 1e3 for k, v in plan.parts.items()})
            row["profile_s"] = plan.to_dict()["profile_s"]
        if mode in BALANCE_MODES:
            run_mode(mode, 0)  # the copies of a step of this mode
            row["copied_experts"] = [moe.balancer.last_copied for moe in model.moe_layers()]
        if device.type == "cuda" and profile_steps > 0:
            path = None
            if bench.trace:
                repeat = f"_{row['repeat'] + 1}" if row["repeat"] else ""
                path = Path(bench.trace) / f"{preset}_{cfg.gate}_{mode}{repeat}_rank{ctx.rank}.json"
            row.update(profile_parts(lambda m=mode: run_mode(m, 0), profile_steps, path,
                                     with_breakdown=bench.breakdown))
        rows.append(row)
    passes.apply(model, [], None)
    base = next((r for r in rows if r["mode"] in ("none", "tp")), rows[0])
    for row in rows:
        row["speedup"] = base["iteration_ms"] / row["iteration_ms"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {"meta": {"preset": preset, "gate": cfg.gate, "capacity_factor": cfg.capacity_factor, "top_k": cfg.top_k,
                       "batch_size": batch_size, "seq_len": cfg.block_size, "world_size": ctx.world_size,
                       "tp": bench.tp, "p1": bench.p1, "p2": bench.p2, "skew": bench.skew,
                       "expert_load_max_over_mean": list(imbalance), "rank_load_max_over_mean": list(rank_imbalance),
                       "device": name, "torch": torch.__version__,
                       "p2p_disabled": os.environ.get("NCCL_P2P_DISABLE") == "1",
                       "timing": "interleaved", "rounds": steps, "warmup_rounds": warmup,
                       "cuda_graphs": bench.cuda_graphs, "gpu_after_timing": gpu_after_timing,
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
              "results": rows}
    if ctx.rank == 0:
        print_table(report)
        write_report(report, bench.json)
    return report


def print_table(report: dict) -> None:
    meta = report["meta"]
    tp_note = "" if meta.get("tp", 1) == 1 else f", TP {meta['tp']} (domino p1 {meta['p1']} p2 {meta['p2']})"
    print(f"\nweft bench model: {meta['preset']} (gate {meta['gate']}, k{meta['top_k']}, "
          f"cf {meta['capacity_factor']}), "
          f"batch {meta['batch_size']} x {meta['seq_len']} per rank, {meta['world_size']} x {meta['device']}"
          f"{tp_note}"
          f"{', NCCL_P2P_DISABLE=1' if meta['p2p_disabled'] else ''}")
    graphs = "; each mode's forward and backward one CUDA graph" if meta.get("cuda_graphs") == "on" else ""
    print(f"timing: {meta['timing']}, median of {meta['rounds']} rounds after {meta['warmup_rounds']} warm-up "
          f"rounds; min and iqr (q3 - q1) show the noise{graphs}")
    if meta.get("gpu_after_timing"):
        print(gpu_state_line({"": meta["gpu_after_timing"]}))
    print(f"{'mode':>12} {'iter ms':>9} {'min':>8} {'iqr':>7} {'speedup':>8} {'fwd+bwd':>9} {'iqr':>7} "
          f"{'predicted':>10} {'pred err':>9} {'max err':>9} {'comm ms':>8} {'exposed':>8} {'hidden':>7}")
    for r in report["results"]:
        label = r["mode"] + (f"#{r['repeat'] + 1}" if r["repeat"] else "")
        pred = f"{r['predicted_ms']:.2f}" if "predicted_ms" in r else ""
        perr = f"{r['prediction_error']:+.1%}" if "prediction_error" in r else ""
        err = "n/a" if r["max_error"] is None else f"{r['max_error']:.1e}"
        comm, exposed, hidden = comm_cells(r)
        print(f"{label:>12} {r['iteration_ms']:>9.2f} {r['iteration_ms_min']:>8.2f} {r['iteration_iqr_ms']:>7.2f} "
              f"{r['speedup']:>7.2f}x {r['fwd_bwd_ms']:>9.2f} {r['fwd_bwd_iqr_ms']:>7.2f} {pred:>10} "
              f"{perr:>9} {err:>9} {comm:>8} {exposed:>8} {hidden:>7}")
    if meta.get("expert_load_max_over_mean"):
        skew = f"skew {meta['skew']:g}, " if meta.get("skew") else ""
        print(f"routing: {skew}expert load max/mean per MoE layer "
              + ", ".join(f"{v:.2f}" for v in meta["expert_load_max_over_mean"])
              + "; per expert-parallel rank " + ", ".join(f"{v:.2f}" for v in meta["rank_load_max_over_mean"]))
    for r in report["results"]:
        transfer = r.get("transfer_decomposition")
        if transfer or "copied_experts" in r:
            hidden = "" if not transfer or transfer["hidden_share"] is None else (
                f": {transfer['comm_ms']:.3f} ms per step of Trans and Agg kernels, "
                f"{transfer['hidden_share']:.0%} under computation")
            print(f"[{r['mode']}] copied experts per layer {r.get('copied_experts')}{hidden}")
    for r in report["results"]:
        if r.get("graph") and not r["repeat"]:
            print(f"[{r['mode']}] " + ("; ".join(line.removeprefix("weft train: ") for line in r["graph"])))
    print_breakdowns(report["results"], lambda r: r["mode"])
    for r in report["results"]:
        if r.get("plan") and not r["repeat"]:  # a repeat runs the same plan
            print(f"\n[{r['mode']}] plan:\n{r['plan']}")
            measured = (f"measured forward+backward {r['fwd_bwd_ms']:.2f} ms (one CUDA graph)"
                        if r["forward_ms"] is None else f"measured forward {r['forward_ms']:.2f} ms, "
                        f"backward {r['fwd_bwd_ms'] - r['forward_ms']:.2f} ms")
            print(f"{measured}; the plan's predicted forward {r['predicted_forward_ms']:.2f} + backward "
                  f"{r['predicted_backward_ms']:.2f} + embedding/head/loss {r['predicted_rest_ms']:.2f} ms; "
                  f"the predicted column prices the step as it ran: {r['predicted_form']}")
            if "uncorrected_predicted_ms" in r:
                print(f"the same step priced without the profile's in-step corrections (each chunk casting the "
                      f"weights, the all-to-alls as timed alone): "
                      f"{r['uncorrected_predicted_ms']:.2f} ms ({r['uncorrected_prediction_error']:+.1%})")
            if "dw_eta_predicted_ms" in r:
                print(f"the same step priced with the dW items' own overlap efficiency (a weight-gradient matmul "
                      f"beside an all-to-all, measured): {r['dw_eta_predicted_ms']:.2f} ms "
                      f"({r['dw_eta_prediction_error']:+.1%})")
            if "wgrad_plan_line" in r and "graph" not in r:  # a graphed row's notes above hold it
                print(r["wgrad_plan_line"] + " (JSON wgrad_plan: each collective's)")
