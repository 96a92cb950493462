"""`weft bench layer`: forward+backward of one MoE layer, every mode side by side in one run.

For each capacity setting, one layer is built and each mode runs it with its per-call settings:
`plain` (the reference layer), `no-comm` (the all-to-alls removed, the same expert work: the optimum overlap
can reach) and the peers (`torchtitan`, `megatron`) when installed. Before timing, each mode's
output and input gradient are compared with `plain` on the same input. Timing: CUDA events
(perf_counter on the CPU), the modes interleaved (one step of each per round, order rotated;
`weft.bench.timing`), warm-up rounds, median, min and interquartile range over the counted
rounds, each step's slowest rank, inputs rotated.
On GPUs the profiler splits a step into exposed communication, overlap and exposed compute.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from weft.bench.breakdown import comm_cells, print_breakdowns, profile_parts
from weft.bench.peers import build_peer
from weft.bench.timing import (
    TIMINGS,
    ProgressLog,
    Run,
    energy_per_step,
    gpu_state,
    gpu_state_line,
    quartiles,
    slowest,
)
from weft.cliargs import (
    ACTIVATION_CHOICES,
    DTYPES,
    arg,
    capacity_list,
    names,
    non_negative_float,
    non_negative_int,
    positive_int,
)
from weft.comm.peers import held_peer_bytes
from weft.distributed import init_distributed
from weft.graphs import GraphedStep, time_graphed
from weft.jsonfile import write_json
from weft.moe import MoE
from weft.moe.backward_sgd import BackwardSGD
from weft.moe.config import FIXED_SIZE_ALGOS, FIXED_SIZE_FORMS, GRAPH_PLACEMENTS
from weft.moe.exchange import Transfer
from weft.moe.gates import logit_shift, zipf_bias
from weft.overlap import install_unpriced_time, measure_layer_cost_model, measure_unpriced_time
from weft.profiling import stage, time_candidates
from weft.tune import Setting, run_until_tuned, tuned_seconds


@dataclass(frozen=True)
class LayerConfig:
    dim: int
    hidden_dim: int
    num_experts: int
    top_k: int
    tokens_per_rank: int = 4096


CONFIGS = {
    "mixtral": LayerConfig(4096, 14336, 8, 2),
    "qwen2": LayerConfig(2048, 1408, 64, 4),
    "phi35": LayerConfig(4096, 6400, 16, 2),
    "deepseek": LayerConfig(7168, 2048, 256, 8, tokens_per_rank=1024),
    "tiny": LayerConfig(64, 128, 8, 2, tokens_per_rank=256),
}


PLAIN = {"overlap_degree": 1, "a2a_algo": "linear", "parallel": 1}

# Mode name -> the per-call settings it runs the layer with (`weft.MoE.forward`'s keywords); the
# benchmark's layer is built "adaptive" with a2a_algo "auto" so every mode can run on the same
# weights. Modes compute the plain layer's function, except `no-comm`, which is a measurement
# device. `dN`: Tutel's pipelining with degree N; `2dh`: Tutel's two-level all-to-all (nodes of
# LOCAL_WORLD_SIZE ranks); `dedup`: each token sent to a rank once, its outputs summed there
# (weft.moe.dedup; `dedup-fixed`: dropless in fixed-size exchanges, nothing read on the host, so
# its dropless step graphs too; `dedup-fixed-dN`: those exchanges in N chunks of tokens, Tutel's
# pipelining, dropless; padded: dedup at that degree, d2 only; `dedup-fixed-own`: a rank's own pairs
# left out of those exchanges, computed while the others' sums return, `-d2` the others' in 2 chunks;
# padded: dedup); `r0`:
# data-parallel experts (Tutel 3.1, r = 0); `rN` (N > 1, fewer experts than ranks): N model-parallel
# slices per expert (fig. 7); `auto`: Tutel 3.3's tuning
# dictionary picks among them. `torch`: plain with PyTorch's index ops for dispatch and combine (the
# path before the Triton kernels; `plain` takes the layer's default, "auto"). `comet`: Comet's fused
# expert kernels (weft.moe.exchange.Comet; the NCCL path, with a warning, where the GPUs cannot
# address each other's memory).
MODES: dict[str, dict] = {
    "plain": PLAIN,
    "torch": {**PLAIN, "kernels": "torch"},
    "comet": {**PLAIN, "kernels": "comet"},
    "no-comm": {**PLAIN, "communicate": False},
    "d2": {**PLAIN, "overlap_degree": 2},
    "d4": {**PLAIN, "overlap_degree": 4},
    "d8": {**PLAIN, "overlap_degree": 8},
    "2dh": {**PLAIN, "a2a_algo": "2dh"},
    "dedup": {**PLAIN, "a2a_algo": "dedup"},
    "dedup-d2": {**PLAIN, "a2a_algo": "dedup", "overlap_degree": 2},
    "dedup-fixed": {**PLAIN, "a2a_algo": "dedup-fixed"},
    "dedup-fixed-d2": {**PLAIN, "a2a_algo": "dedup-fixed", "overlap_degree": 2},
    "dedup-fixed-d4": {**PLAIN, "a2a_algo": "dedup-fixed", "overlap_degree": 4},
    "dedup-fixed-own": {**PLAIN, "a2a_algo": "dedup-fixed-own"},
    "dedup-fixed-own-d2": {**PLAIN, "a2a_algo": "dedup-fixed-own", "overlap_degree": 2},
    "r0": {**PLAIN, "parallel": 0},
    "r1": PLAIN,
    "r2": {**PLAIN, "parallel": 2},
    "r4": {**PLAIN, "parallel": 4},
    "r8": {**PLAIN, "parallel": 8},
    "auto": {"overlap_degree": "auto", "a2a_algo": "auto"},
}


def mode_forward(mode: str, moe: MoE, expert_step: BackwardSGD | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The layer's forward in `mode` (with `expert_step`: its SGD step of the experts in the
    backward); ValueError (naming the mode's setting) where the layer cannot run it."""
    overrides = MODES[mode] if expert_step is None else {**MODES[mode], "expert_step": expert_step}
    r = overrides.get("parallel")
    if r not in (None, 1) and r not in moe.parallel_choices():
        raise ValueError(f"r = {r} needs a divisor of the ranks per expert; this layer takes {moe.parallel_choices()}")
    moe.call_with(**overrides)  # checks the settings before any timing
    return lambda x: moe(x, **overrides)


# Pro-Prophet (dropless only): a twin of the layer built with balance="pro-prophet", the same weights,
# planning each call from the previous calls' loads (one untimed call first gives it a load).
BALANCE_MODE = "balance"
# ... and that twin with the load's heaviest expert copied to every other rank in every call, the
# planner overruled: what one copy costs, beside `plain`, and with --breakdown where it goes.
COPY_MODE = "balance-copy"
# ... and that twin's calls on Comet's dropless path (kernels="comet"), the copies in replica slots
# through peer memory, nothing read on the host: "+graph" applies (beside comet+graph, its plain form).
SLOTS_MODE = "balance-comet"
BALANCE_MODES = (BALANCE_MODE, COPY_MODE, SLOTS_MODE)
NOT_THE_LAYER_FUNCTION = {"no-comm", "torchtitan", "megatron"}
PEER_MODES = ("torchtitan", "megatron")
# "<mode>+graph": the mode's forward and backward captured once as a CUDA graph and replayed
# (weft.graphs); the same kernels without their host launch cost. Dropless on several ranks reads
# its counts on the host, except `dedup-fixed` and `comet` (`GRAPHS_DROPLESS`) and `no-comm`; on one
# rank every mode graphs (`dropless_graph_blocker`). "auto+graph" times each of auto's candidate settings as
# a graph and captures the fastest (`graphed_auto`; auto's eager tuning synchronises, so it cannot
# run inside a capture, and it would time launch costs a replay does not pay).
GRAPH_SUFFIX = "+graph"
# A weft mode with "+sgd-in-backward" (before any "+graph") takes its SGD step (--optimizer sgd) as a
# `weft.BackwardSGD`: the expert weights stepped inside their gradient GEMMs where the path fuses
# it (Comet's exchange), the rest by the optimizer's step() as in the "sgd" rows
STEP_SUFFIX = "+sgd-in-backward"
# the modes whose dropless calls read nothing on the host (dedup-fixed's; comet's, where the GPUs reach
# each other's memory: `MoE.counts_stay_on_device`), and auto, which graphs dedup-fixed (at degree 1 or 2,
# or with the own pairs apart) where that is faster than its eager call (`graphed_auto_dropless`)
GRAPHS_DROPLESS = (*(mode for mode, call in MODES.items() if call.get("a2a_algo") in FIXED_SIZE_ALGOS), "comet",
                   "auto")


def dropless_graph_blocker(mode: str, moe: MoE) -> str | None:
    """Why `mode`'s dropless call cannot be a CUDA graph on this layer (None: it can): a graph
    needs a call that reads nothing on the host. One rank's calls read nothing (no exchange to
    size), nor do no-comm's on several ranks (nothing crosses a rank), where the grouped GEMM runs
    on the GPU (`MoE.counts_stay_on_device`); on several ranks, dedup-fixed's fixed-size exchanges
    and Comet's counts left on the GPUs (where they map each other's memory:
    `MoE.graphs_dropless_comet`) read nothing."""
    base = base_mode(mode)
    if base in ("comet", SLOTS_MODE):
        return None if moe.graphs_dropless_comet() else (
            "a dropless comet call is a CUDA graph only on 2+ CUDA ranks that map each other's memory (its counts "
            "stay on the GPUs); here it reads them on the host")
    if base in GRAPHS_DROPLESS or moe.counts_stay_on_device(moe.call_with(**MODES[base]) if base in MODES else None):
        return None
    allowed = ", ".join(GRAPHS_DROPLESS)
    return (f"--modes {mode}: a CUDA graph needs a call that reads nothing on the host; a dropless call on "
            f"{moe.ep_size} ranks reads its counts there ({allowed} graph dropless on several ranks; every mode "
            "on one, and no-comm on several, where the grouped GEMM runs on the GPU: bf16 on sm90+)")


# A mode's forward and backward: (x, output gradient) -> (y, input gradient), detached.
FwdBwd = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def setting_overrides(setting: Setting) -> dict:
    """A tuned setting as the call overrides that run it."""
    return {"overlap_degree": setting.overlap_degree, "a2a_algo": setting.a2a_algo, "parallel": setting.parallel,
            **({"kernels": "comet"} if setting.comet else {})}


# (step_of, candidates, args, grads_of) -> seconds per candidate: `weft.graphs.time_graphed`
GraphTimer = Callable[..., list[float]]


def graphed_auto(moe: MoE, x: torch.Tensor, grad: torch.Tensor,
                 timer: GraphTimer = time_graphed) -> tuple[Callable[[torch.Tensor], torch.Tensor], dict[str, float]]:
    """auto+graph: every candidate setting of the layer's auto call (`MoE.candidates`: degrees,
    all-to-all algorithms, r, Comet) timed as a CUDA graph of its forward and backward on (x, grad)
    (`timer`), as `weft train` chooses for a graphed step (`weft.train.step.choose_fastest`).
    Returns the forward at the fastest setting and the milliseconds of each candidate by name."""
    settings = moe.candidates(moe.call_with(**MODES["auto"]))

    def step_of(setting: Setting):
        overrides = setting_overrides(setting)
        return _fwd_bwd_step(moe, lambda x: moe(x, **overrides))

    seconds = timer(step_of, settings, args=[x.detach().requires_grad_(), grad], grads_of=list(moe.parameters()))
    _some_captured(seconds, [s.name for s in settings])
    best = setting_overrides(settings[seconds.index(min(seconds))])
    return (lambda x: moe(x, **best)), {s.name: t * 1e3 for s, t in zip(settings, seconds)}


def graphed_auto_dropless(moe: MoE, x: torch.Tensor, grad: torch.Tensor, timer: GraphTimer = time_graphed,
                          eager_timer: Callable | None = None,
                          comet: bool | None = None) -> tuple[Callable[[torch.Tensor], torch.Tensor], bool,
                                                              dict[str, float]]:
    """auto+graph on a dropless layer: auto's eager call (sizes read on the host, linear or dedup
    tuned per call; `eager_timer(step, args)`, default `tuned_eager_seconds`) against dedup-fixed
    (fixed-size exchanges, nothing read on the host) in each of `FIXED_SIZE_FORMS`, where the
    GPUs reach each other's memory Comet's call (its counts left on the device:
    `MoE.graphs_dropless_comet`; `comet` True or False overrides that test), and on one rank the
    plain call (`MoE.counts_stay_on_device`: nothing to exchange), each timed as a CUDA
    graph (`timer`); the fastest runs, as `weft train --a2a-algo auto` chooses among eager and the
    fixed-size forms (weft.train.step.choose_fixed_size). Returns its forward, whether it is to be
    captured, and the milliseconds of each."""
    def step_of(mode: str):
        return _fwd_bwd_step(moe, mode_forward(mode, moe))

    if comet is None:
        comet = moe.graphs_dropless_comet()
    forms = (*FIXED_SIZE_FORMS, "comet") if comet else FIXED_SIZE_FORMS
    if moe.ep_size == 1 and moe.counts_stay_on_device():  # one rank: its plain call graphs too
        forms = ("plain", *forms)
    args = [x.detach().requires_grad_(), grad]
    eager_s = (eager_timer or functools.partial(tuned_eager_seconds, moe=moe))(step_of("auto"), args)
    graph_s = dict(zip(forms, timer(step_of, forms, args=args, grads_of=list(moe.parameters()))))
    moe.record(None)
    _some_captured(list(graph_s.values()), list(forms))
    best = min(graph_s, key=graph_s.__getitem__)
    graphed = graph_s[best] < eager_s
    times_ms = {"auto (eager)": eager_s * 1e3, **{f"{form} (graph)": s * 1e3 for form, s in graph_s.items()}}
    return mode_forward(best if graphed else "auto", moe), graphed, times_ms


def _some_captured(seconds: list[float], names: list[str]) -> None:
    """auto+graph needs at least one candidate that could be captured (`time_graphed` times the
    others as infinite, warning why)."""
    if not any(map(math.isfinite, seconds)):
        raise RuntimeError(f"auto+graph: none of its candidates ({', '.join(names)}) could be captured as a CUDA "
                           f"graph (the warnings above say why)")


def tuned_eager_seconds(step: Callable, args: list[torch.Tensor], moe: MoE) -> float:
    """Wall seconds of `step(*args)` once `moe`'s tuning has decided (`weft.tune.tuned_seconds`);
    `moe`'s gradients and the input's left None."""
    seconds = tuned_seconds(lambda: step(*args), lambda: moe.tuning.measurements, args[0].device)
    moe.zero_grad(set_to_none=True)
    args[0].grad = None
    return seconds


def _fwd_bwd_step(moe: MoE, forward: Callable[[torch.Tensor], torch.Tensor]):
    """(x, output gradient) -> (y, input gradient) of `forward`, as a graph timer captures it.
    The layer's last call keeps its aux loss, whose autograd graph holds the gradient accumulators
    (see weft.graphs): it is dropped when the step is made (a capture of it, which follows, refuses
    to start while that graph lives: an earlier mode's, the eager call's or the last candidate's)
    and before every call."""
    moe.record(None)

    def step(x: torch.Tensor, grad: torch.Tensor):
        moe.record(None)
        y = forward(x)
        y.backward(grad)
        return y.detach(), x.grad
    return step


def base_mode(mode: str) -> str:
    """The layer mode of a (possibly "+sgd-in-backward" and "+graph") benchmark mode."""
    return mode.removesuffix(GRAPH_SUFFIX).removesuffix(STEP_SUFFIX)


def steps_in_backward(mode: str) -> bool:
    return mode.removesuffix(GRAPH_SUFFIX).endswith(STEP_SUFFIX)


def is_graphed(mode: str) -> bool:
    return mode.endswith(GRAPH_SUFFIX)


def expert_flops(cfg: LayerConfig, tokens: int, activation: str) -> float:
    """Forward+backward FLOPs of the routed expert matmuls (3x forward), per rank."""
    mats = 3 if activation == "swiglu" else 2
    return 3 * 2 * tokens * cfg.top_k * cfg.dim * cfg.hidden_dim * mats


def experts_stage_tflops(breakdown: dict | None, flops: float) -> float | None:
    """The routed expert matmuls' `flops` over the GPU time of the profiler's "experts" stage
    (forward and backward kernels: the GEMMs, their activation and, in Comet's modes, the
    exchange fused into them), in TFLOP/s per rank; None without that stage (no breakdown, or a
    `+graph` mode, whose replayed kernels have no launching op to name their stage)."""
    experts = ((breakdown or {}).get("stages") or {}).get("experts")
    ms = experts["forward_ms"] + experts["backward_ms"] if experts else 0.0
    return flops / (ms * 1e-3) / 1e12 if ms > 0 else None


def _max_error(fwd_bwd: FwdBwd, x: torch.Tensor, grad: torch.Tensor, reference) -> float:
    y, x_grad = fwd_bwd(x, grad)
    err = max(float((y.float() - reference[0]).abs().max()), float((x_grad.float() - reference[1]).abs().max()))
    return slowest(err, x.device)


@dataclass
class LayerBenchConfig:
    """`weft bench layer`: every mode of one layer config, for every capacity factor."""

    config: str = arg("tiny", "layer config: mixtral, qwen2, phi35, deepseek or tiny")
    tokens_per_rank: int | None = arg(None, "tokens per rank (default 4096; deepseek 1024, tiny 256)",
                                      parse=positive_int)
    num_experts: int | None = arg(None, "override the config's expert count (fewer than ranks: experts sharded, "
                                  "modes rN)", parse=positive_int)
    top_k: int | None = arg(None, "override the config's top-k", parse=positive_int)
    modes: tuple[str, ...] = arg(("plain", "no-comm"), "comma-separated: plain, torch (plain with torch "
                                 "dispatch/combine), no-comm, d2, d4, d8 (Tutel pipelining), 2dh (two-level "
                                 "all-to-all), dedup (each token sent to a rank once), dedup-d2 (dedup with a "
                                 "rank's own pairs computed while the others' rows travel in; padded), "
                                 "dedup-fixed (dedup, dropless in fixed-size exchanges: graphs dropless), "
                                 "dedup-fixed-d2/d4 (those exchanges pipelined in 2/4 chunks of tokens), "
                                 "dedup-fixed-own(-d2) (a rank's own pairs kept out of them; the others' in 2 "
                                 "chunks), "
                                 "r0 (data-parallel experts), r1/r2/r4/r8 "
                                 "(Tutel's r with fewer experts than ranks), auto (tuning dictionary), balance "
                                 "(Pro-Prophet's replicated experts, dropless), balance-copy (the heaviest expert "
                                 "copied to every rank in every call, whatever the plan), balance-comet (balance "
                                 "on Comet's path, the copies in replica slots; graphs), comet (Comet's fused "
                                 "expert kernels "
                                 "over peer memory), torchtitan, megatron; any with '+graph' (captured as a "
                                 "CUDA graph; padded capacity; dropless: dedup-fixed, comet, no-comm, every mode "
                                 "on one GPU, and auto, the fastest of its eager call and the dedup-fixed and "
                                 "comet forms as graphs); weft's modes but auto with '+sgd-in-backward' before "
                                 "any '+graph' (--optimizer sgd as weft.BackwardSGD: the experts stepped in "
                                 "their weight-gradient GEMMs where the path fuses it, comet's) "
                                 "(default plain,no-comm)",
                                 parse=names)
    baseline: str = arg("plain", "mode the ratios are relative to")
    capacity: tuple[float | None, ...] = arg((1.0, None), "comma-separated capacity factors, 'dropless' for None "
                                             "(default 1.0,dropless)", parse=capacity_list)
    activation: str = arg("relu", "expert activation", choices=ACTIVATION_CHOICES)
    dtype: str = arg("bf16", "parameter and input dtype (fp32 on the CPU)", choices=tuple(DTYPES))
    optimizer: str = arg("none", "also time an optimizer step, at learning rate 0 so the layer and its "
                         "routing stay as checked (Tutel's reference numbers include SGD; "
                         "sgd: single-tensor updates, adamw: torch's default)",
                         choices=("none", "sgd", "adamw"))
    steps: int = arg(20, "timed rounds, the modes interleaved; median reported", parse=positive_int)
    warmup: int = arg(5, "untimed rounds first", parse=positive_int)
    timing: str = arg("interleaved", "interleaved: a barrier, then one step of each mode per round, each step's time "
                      "its slowest rank's (CUDA events); sequential: Tutel's helloworld protocol, each mode's "
                      "--warmup + --steps steps one after another, each timed on the host between two "
                      "synchronisations, no barrier, rank 0's times (JSON mean_ms: Tutel's mean; e.g. --warmup 20 "
                      "--steps 10); back-to-back: each mode's steps launched one after another with no "
                      "synchronisation between them, as training runs them (CUDA events between steps, the "
                      "slowest rank's)", choices=tuple(TIMINGS))
    energy_s: float = arg(0.0, "after the timing, run each mode's steps back to back for about this many seconds "
                          "in all (blocks interleaved over 3 rounds) and read the GPU's energy counter (NVML) around "
                          "each block: joules a step and mean watts per GPU (GPU; 0: off)", parse=non_negative_float)
    json: str | None = arg(None, "write the results to this JSON file")
    trace: str | None = arg(None, "folder for Chrome traces of each mode (GPU)")
    profile_steps: int = arg(5, "profiled steps per mode for the time decomposition (GPU; 0: none)",
                             parse=non_negative_int)
    breakdown: bool = arg(False, "print each mode's GPU time by stage (router, routing, dispatch, all-to-all, "
                          "experts, combine; forward and backward) and the GPU's idle time, from the profiled steps")
    skew: float = arg(0.0, "route with a Zipf(S) skew: every input carries one shift that the router maps to the "
                      "logit bias -S ln(rank) over a fixed random ranking of the experts (0: no skew)",
                      parse=non_negative_float)
    copy_overhead: str = arg("measured", "balance mode: Pro-Prophet's planner adds what the layer's call spends "
                             "beyond its model (each copy's overhead, the rest of the call), measured on the layer "
                             "('measured'), or plans with the paper's model alone, eqs. 1-8 ('none')",
                             choices=("measured", "none"))
    balance_rounds: int = arg(1, "balance modes: the times Pro-Prophet's greedy search may take one rank (1: the "
                              "paper's Alg. 1, one copy from each rank; more let a hot rank give away several)",
                              parse=positive_int)
    graph_placement: str = arg("captured", "balance-comet+graph: the graph replays the placement of its capture, "
                               "only the holders computing slot rows, the copies by the copy engine ('captured'), "
                               "or is shaped for any placement as graphed training runs it, every rank running the "
                               "slot path, the copies by SM kernels ('updated'; weft.MoE's graph_placement)",
                               choices=GRAPH_PLACEMENTS)

    def validate(self) -> None:
        """ValueError naming the flag of the first bad setting."""
        if self.config not in CONFIGS:
            raise ValueError(f"unknown --config {self.config!r}; choose from {', '.join(CONFIGS)}")
        known = list(MODES) + list(BALANCE_MODES) + list(PEER_MODES)
        unknown = [m for m in self.modes if base_mode(m) not in known]
        if not self.modes or unknown:
            raise ValueError(f"--modes {','.join(self.modes)!r}: choose from {', '.join(known)}, each optionally "
                             f"with {GRAPH_SUFFIX} (unknown modes {unknown})")
        for mode in filter(is_graphed, self.modes):
            if base_mode(mode) not in (*MODES, SLOTS_MODE):
                raise ValueError(f"--modes {mode}: {GRAPH_SUFFIX} applies to weft's modes and {SLOTS_MODE} "
                                 f"(not a peer, {BALANCE_MODE} or {COPY_MODE})")
        for mode in filter(steps_in_backward, self.modes):
            if base_mode(mode) not in MODES or base_mode(mode) == "auto" or self.optimizer != "sgd":
                raise ValueError(f"--modes {mode}: {STEP_SUFFIX} applies to weft's modes but auto, with "
                                 "--optimizer sgd")
        if self.baseline not in self.modes:
            raise ValueError(f"--baseline {self.baseline!r} must be one of the --modes")


def run(bench: LayerBenchConfig) -> dict:
    """Benchmark every mode for every capacity factor; returns {"meta": ..., "results": [...]}.

    `num_experts` and `top_k` override the config's; the layer is built with
    `parallel="adaptive"` (fewer experts than ranks: experts sharded over W / E ranks; `plain` is
    r = 1)."""
    bench.validate()
    config, steps, warmup, modes = bench.config, bench.steps, bench.warmup, bench.modes
    num_experts, top_k, activation, optimizer = bench.num_experts, bench.top_k, bench.activation, bench.optimizer
    dtype = DTYPES[bench.dtype]
    ctx = init_distributed()
    overrides = {k: v for k, v in (("num_experts", num_experts), ("top_k", top_k)) if v is not None}
    cfg = dataclasses.replace(CONFIGS[config], **overrides)
    tokens = bench.tokens_per_rank or cfg.tokens_per_rank
    if ctx.device.type == "cpu" and dtype != torch.float32:
        dtype = torch.float32  # bf16 matmuls on the CPU measure nothing useful
    results = []
    for cf in bench.capacity:
        results += _bench_capacity(cfg, config, cf, tokens, activation, dtype, steps, warmup, modes, optimizer,
                                   bench.trace, bench.profile_steps, bench.breakdown, bench.skew, ctx,
                                   copy_overhead=bench.copy_overhead == "measured", balance_rounds=bench.balance_rounds,
                                   graph_placement=bench.graph_placement, timing=bench.timing,
                                   energy_s=bench.energy_s)
    baseline = bench.baseline
    for row in results:
        base = next((r for r in results if r["mode"] == baseline and r["capacity_factor"] == row["capacity_factor"]
                     and r.get("median_ms")), None)
        row["ratio"] = row["median_ms"] / base["median_ms"] if base and row.get("median_ms") else None
    exchange_hidden(results)
    meta = {**_meta(config, cfg, tokens, activation, dtype, optimizer, baseline, ctx), "skew": bench.skew,
            "timing": bench.timing}
    report = {"meta": meta, "results": results}
    if ctx.rank == 0:
        print_table(report)
        write_report(report, bench.json)
    return report


def write_report(report: dict, json_path: str | None) -> None:
    """Write a benchmark report as JSON (nothing when no path is given)."""
    if json_path:
        write_json(json_path, report)


def _meta(config, cfg, tokens, activation, dtype, optimizer, baseline, ctx) -> dict:
    name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    return {
        "config": config, **cfg.__dict__, "tokens_per_rank": tokens, "activation": activation,
        "dtype": str(dtype).replace("torch.", ""), "optimizer": optimizer, "baseline": baseline,
        "world_size": ctx.world_size, "device": name, "torch": torch.__version__,
        "p2p_disabled": os.environ.get("NCCL_P2P_DISABLE") == "1",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def zipf_shift(router_weight_ED: torch.Tensor, skew: float, seed: int = 0) -> torch.Tensor:
    """(dim,) the input shift u with W u = b for the router weight W (E, dim) and b the
    `zipf_bias`: softmax routing then prefers expert e by rank_e^-skew. Least squares (exact for
    E <= dim)."""
    return logit_shift(router_weight_ED, zipf_bias(router_weight_ED.shape[0], skew, seed))


def load_imbalance(counts_E: torch.Tensor, ep_size: int = 1) -> tuple[float, float]:
    """max / mean of the experts' routed slots summed over the ranks, and of the same slots summed
    by the `ep_size` ranks owning the experts (expert e on rank e // (E / ep_size)): the second bounds
    what any placement of the work gains on the experts and the all-to-alls (a layer whose busiest
    rank holds 1.2x the mean is at most 1.2x faster there when balanced perfectly)."""
    total = counts_E.detach().to(torch.float64).clone()
    if dist.is_initialized():
        dist.all_reduce(total)
    # fewer experts than ranks: each rank of an expert's group computes all its rows (a hidden-dim
    # slice of each), so the ranks' loads are the experts'
    per_rank = total.view(ep_size, -1).sum(1) if total.numel() >= ep_size else total
    return (float(total.max() / total.mean().clamp_min(1e-9)),
            float(per_rank.max() / per_rank.mean().clamp_min(1e-9)))


def _bench_capacity(cfg, config, cf, tokens, activation, dtype, steps, warmup, modes, optimizer, trace_dir,
                    profile_steps, with_breakdown, skew, ctx, copy_overhead: bool = True,
                    balance_rounds: int = 1, graph_placement: str = "captured", timing: str = "interleaved",
                    energy_s: float = 0.0) -> list[dict]:
    device = ctx.device
    progress = ProgressLog("layer", ctx.rank)
    torch.manual_seed(0)
    moe = MoE(cfg.dim, cfg.hidden_dim, cfg.num_experts, cfg.top_k, capacity_factor=cf, activation=activation,
              device=device, dtype=dtype, parallel="adaptive", a2a_algo="auto")
    gen = torch.Generator(device=device).manual_seed(1000 + ctx.rank)
    inputs = [torch.randn(tokens, cfg.dim, device=device, dtype=dtype, generator=gen) for _ in range(4)]
    grads = [torch.randn(tokens, cfg.dim, device=device, dtype=dtype, generator=gen) for _ in range(4)]
    if skew:
        shift = zipf_shift(moe.router.weight, skew).to(dtype)
        inputs = [x + shift for x in inputs]

    y0, x0_grad = _eager(mode_forward("plain", moe))(inputs[0], grads[0])
    reference = (y0.float(), x0_grad.float())
    x0 = inputs[0]
    dropped = slowest(float(moe.stats.dropped) / (tokens * cfg.top_k), device)
    imbalance, rank_imbalance = load_imbalance(moe.stats.expert_counts, ctx.world_size)
    moe.zero_grad(set_to_none=True)

    # Check every mode against plain before any timing: the optimizer steps of the timing loop
    # change the weights, so a later check would compare against stale reference outputs.
    built, rows = {}, []
    for mode in modes:
        row = {"config": config, "mode": mode, "capacity_factor": cf, "activation": activation,
               "tokens_per_rank": tokens, "world_size": ctx.world_size, "dropped_share": dropped,
               "expert_load_max_over_mean": imbalance, "rank_load_max_over_mean": rank_imbalance}
        rows.append(row)
        try:
            graphed = is_graphed(mode)
            step_opt = _backward_sgd(mode, optimizer, moe) if steps_in_backward(mode) else None
            forward, params, description = _mode_forward(base_mode(mode), moe, cfg, cf, activation, dtype, device,
                                                         ctx.world_size, x0, copy_overhead, balance_rounds,
                                                         graphed and cf is None, graph_placement, step_opt)
            if graphed and base_mode(mode) == "auto" and cf is None:
                _need_cuda(device)
                forward, graphed, row["candidates_ms"] = graphed_auto_dropless(moe, x0, grads[0])
                row["tuned"] = [min(row["candidates_ms"], key=row["candidates_ms"].get)]
                description = f"weft auto: {row['tuned'][0]}, the fastest of its eager call and the graphs"
            elif graphed and base_mode(mode) == "auto":
                _need_cuda(device)
                forward, row["candidates_ms"] = graphed_auto(moe, x0, grads[0])
                row["tuned"] = [min(row["candidates_ms"], key=row["candidates_ms"].get)]
                description = f"weft auto: {row['tuned'][0]}, the fastest of its candidates as CUDA graphs"
            blocker = dropless_graph_blocker(mode, moe) if graphed and cf is None else None
            if blocker is not None:
                raise ValueError(blocker)
            row["graphed"] = graphed
            fwd_bwd = _eager(forward)
            if graphed:
                _warm(fwd_bwd, params, x0, grads[0])
                twin = getattr(forward, "twin", None)  # balance-comet's layer
                for layer in (moe,) if twin is None else (moe, twin):
                    layer.record(None)  # its aux loss keeps an eager call's autograd graph alive (see weft.graphs)
                fwd_bwd, row["peak_mib"] = _graphed(forward, params, x0, grads[0], device)
                description += " as one CUDA graph"
        except Exception as e:  # a peer that cannot run here is reported, not fatal
            row.update(median_ms=None, error=f"{type(e).__name__}: {e}")
            continue
        row["description"] = description
        check = base_mode(mode) not in NOT_THE_LAYER_FUNCTION
        row["max_abs_error"] = _max_error(fwd_bwd, x0, grads[0], reference) if check else None
        if base_mode(mode) == COPY_MODE:
            row["copied_experts"] = sorted(forward.copies)
        if base_mode(mode) in (BALANCE_MODE, SLOTS_MODE):  # what the checked call copied, and its plan's time
            balancer = forward.twin.balancer if base_mode(mode) == SLOTS_MODE else forward.balancer
            row["copied_experts"] = balancer.last_copied
            plan = balancer.last_plan
            if plan is not None:
                row.update(predicted_ms=plan.predicted_s * 1e3, plain_predicted_ms=plan.plain_s * 1e3,
                           planned_rank_load=plan.rank_load, planned_plain_rank_load=plan.plain_rank_load,
                           cost_model=dataclasses.asdict(balancer.model))
        if not graphed:  # a graph keeps its gradient tensors (each replay overwrites them)
            moe.zero_grad(set_to_none=True)
        built[mode] = (fwd_bwd, params, step_opt)
        progress.phase(f"{config} {'dropless' if cf is None else f'cf {cf}'} {mode} built and checked")
    timed = [row for row in rows if row["mode"] in built]
    runs, optimizers = [], []
    for row in timed:
        fwd_bwd, params, step_opt = built[row["mode"]]
        switch = lambda: None  # noqa: E731  (modes are per-call settings: nothing to switch)
        optimizers.append(step_opt if step_opt is not None else _optimizer(optimizer, params))
        step = _step_fn(fwd_bwd, params, inputs, grads, optimizers[-1], row["graphed"])
        if base_mode(row["mode"]) == "auto" and not row["graphed"]:
            # tuning calls synchronise and try slow settings: keep them out of the timing
            run_until_tuned(step, lambda: moe.tuning.measurements, device)
            row["tuned"] = moe.tuning.chosen()
        runs.append(Run(switch, step))
    samples = TIMINGS[timing](runs, steps, warmup, device, progress=progress.round)[:, 0] if runs else []
    state = gpu_state(device)  # what the timed rounds ran at (this rank's GPU)
    for row, sample in zip(timed, samples):  # no runs: every mode failed to build; their rows say why
        row["gpu_after_timing"] = state
        q1, row["median_ms"], q3 = quartiles(sample)
        row.update(min_ms=float(sample.min()), mean_ms=float(sample.mean()), iqr_ms=q3 - q1)
        row["tflops_per_rank"] = expert_flops(cfg, tokens, activation) / (row["median_ms"] * 1e-3) / 1e12
    if energy_s > 0 and runs:
        energies = energy_per_step(runs, [row["median_ms"] for row in timed], energy_s, device,
                                   progress=progress.round)
        for row, energy in zip(timed, energies or []):
            row["energy"] = energy
    for row, run in zip(timed, runs):
        if not row["graphed"]:
            row["peak_mib"] = _peak_mib(run, device)
        runs_comet = base_mode(row["mode"]) in ("comet", SLOTS_MODE) or \
            any(t.endswith("-comet") for t in row.get("tuned", []))
        if runs_comet:  # Comet's exchange holds its rows in peer buffers, outside the peak's count
            row["peer_buffers_mib"] = held_peer_bytes(device) / 2**20
        if runs_comet and moe.tuning.kernels:  # Comet 3.2.2: the copy programs it timed
            row["comet_copy_programs"] = {key: entry["best"] for key, entry in moe.tuning.kernels.items()}
    for row, opt in zip(timed, optimizers):  # the model predicts the layer: its optimizer apart
        if opt is not None and (base_mode(row["mode"]) in (BALANCE_MODE, SLOTS_MODE) or row["mode"] == "plain"):
            row["optimizer_ms"] = _optimizer_ms(opt, device)
    _prediction_errors(rows)
    if device.type == "cuda" and profile_steps > 0:
        for row, run in zip(timed, runs):
            path = None
            if trace_dir:
                cap = "dropless" if cf is None else f"cf{cf:g}"
                path = Path(trace_dir) / f"{config}_{cap}_{row['mode']}_rank{ctx.rank}.json"
            run.switch()
            row.update(profile_parts(lambda: run.step(0), profile_steps, path, with_breakdown,
                                     slot_copies=row["mode"].startswith("balance-comet")))
            row["experts_tflops_per_rank"] = experts_stage_tflops(row.get("breakdown"),
                                                                  expert_flops(cfg, tokens, activation))
    return rows


def balanced_twin(moe: MoE, cf: float | None, warm_input: torch.Tensor, copy_overhead: bool = True,
                  rounds: int = 1, overrides: dict | None = None, graphed: bool = False,
                  graph_placement: str = "captured") -> MoE:
    """`moe`'s weights in a layer built with balance="pro-prophet" (ValueError unless dropless),
    its planner's cost model measured here (`weft.overlap.measure_layer_cost_model`, and with
    `copy_overhead` `with_unpriced_time`, timing graphs of `graph_placement`'s shape where
    `graphed`; the nominal one on a single rank), after an untimed call on `warm_input` so that
    the next call has a load to plan from."""
    if cf is not None:
        raise ValueError("balance runs dropless layers only (--capacity dropless)")
    measured = measure_layer_cost_model(moe, warm_input)[0] if moe.ep_size > 1 else None
    # the layer's tuning dictionary: Comet's copy programs, picked per shape by timing, are then the
    # plain rows' on the same shape (a pick of its own could differ: docs/benchmarks.md)
    twin = MoE(moe.dim, moe.hidden_dim, moe.num_experts, moe.top_k, moe.gate, None, moe.experts.activation,
               group=moe.group, balance="pro-prophet", balance_model=measured, balance_rounds=rounds,
               graph_placement=graph_placement, tuning=moe.tuning, device=warm_input.device,
               dtype=moe.experts.w1.dtype)
    twin.load_state_dict(moe.state_dict())
    with torch.no_grad():
        twin(warm_input)
    if copy_overhead and moe.ep_size > 1:  # what a copy and the rest of the call (with `overrides`, as a
        unpriced = measure_unpriced_time(twin, warm_input, overrides=overrides, graphed=graphed)  # graph) cost
        install_unpriced_time(twin, unpriced)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"weft bench layer: Pro-Prophet's fit timed (ms) {fit_calls_line(unpriced.calls)}", flush=True)
    return twin


def fit_calls_line(calls: tuple[tuple[str, int, float], ...]) -> str:
    """The fit's timed calls (`UnpricedTime.calls`) in words: each input (`x` the planned one,
    `hot` the steered one) with the experts copied and the milliseconds timed."""
    return ", ".join(f"{on} {copies} copied {seconds * 1e3:.3f}" for on, copies, seconds in calls) or "nothing"


class HeaviestCopied:
    """The balanced layer `twin`'s forward with the heaviest expert of its recorded load (most rows
    over all ranks; the lowest id among equals) copied to every rank but its owner in every call,
    the call copying it itself (`Transfer`, eq. 6's form) whatever the planner would choose."""

    def __init__(self, twin: MoE):
        if twin.ep_size < 2 or not len(twin.balancer.history):
            raise ValueError("balance-copy needs 2 or more expert-parallel ranks and a recorded load")
        counts = twin.balancer.history.predict_counts()
        self.expert = max(range(twin.num_experts), key=lambda e: (sum(row[e] for row in counts), -e))
        owner = twin.balancer.owner_E[self.expert]
        self.copies = {self.expert: frozenset(r for r in range(twin.ep_size) if r != owner)}
        self.twin = twin

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        twin = self.twin
        transfer = Transfer(twin.experts, twin.placement, self.copies, twin.group, twin.experts.compute_dtype(x))
        return twin(x, transfer=transfer)


class InSlots:
    """The balanced layer `twin`'s forward on Comet's dropless path (`kernels="comet"`): its copies
    in replica slots, planned from the loads of its earlier calls (`weft.moe.exchange.replica_slots`),
    with each copy's overhead measured on such calls (`--copy-overhead measured`; `+graph`: each
    placement's step timed as a CUDA graph, as the mode's graph pays it)."""

    OVERRIDES = {"kernels": "comet"}

    def __init__(self, twin: MoE):
        if not twin.copies_in_slots(twin.call_with(**self.OVERRIDES)):
            raise ValueError(f"{SLOTS_MODE} needs 2+ ranks that map each other's memory (Comet's dropless path)")
        self.twin = twin

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.twin(x, **self.OVERRIDES)


def capacity_label(cf: float | None) -> str:
    """A capacity factor as the tables name it: "dropless" or "cf 1.25"."""
    return "dropless" if cf is None else f"cf {cf:g}"


def exchange_hidden(rows: list[dict]) -> None:
    """Each row's share of the exchange's time that it hides, from the step times alone: (plain -
    mode) / (plain - no-comm), against `plain` and `no-comm` of the same capacity (both `+graph`
    for a graphed row; their first rows). Over 100% where the mode's step is shorter than
    no-comm's. The profiler's "hidden" column counts collective kernels under computation and
    cannot see an exchange fused into the GEMMs (Comet's); this one can (the share of the
    communication Comet hides; its paper reports 86.5%). Set as `exchange_hidden` where both
    references ran and the exchange costs plain anything."""
    def first(mode: str, cf) -> float | None:
        return next((r["median_ms"] for r in rows if r["mode"] == mode and r["capacity_factor"] == cf
                     and r.get("median_ms")), None)

    for row in rows:
        base, suffix = base_mode(row["mode"]), GRAPH_SUFFIX if is_graphed(row["mode"]) else ""
        if base == "plain" or base in NOT_THE_LAYER_FUNCTION or not row.get("median_ms"):  # no-comm's among them
            continue
        if steps_in_backward(row["mode"]):  # a step cheaper than the references' would count as hidden exchange
            continue
        cf = row["capacity_factor"]
        plain, bound = first("plain" + suffix, cf), first("no-comm" + suffix, cf)
        if plain is not None and bound is not None and plain > bound:
            row["exchange_hidden"] = (plain - row["median_ms"]) / (plain - bound)


def _prediction_errors(rows: list[dict]) -> None:
    """Pro-Prophet's planner predicted the balanced call's time and the plain layer's (eqs. 1-8):
    give `plain` rows that prediction too, and every predicted row its error against the measured
    layer: the step's median less its optimizer step timed alone (`optimizer_ms`; the model
    prices the layer's forward and backward, not the update of its weights), predicted / measured - 1."""
    plain_predicted = next((r["plain_predicted_ms"] for r in rows if "plain_predicted_ms" in r), None)
    for row in rows:
        if row["mode"] == "plain" and plain_predicted is not None:
            row["predicted_ms"] = plain_predicted
        if "predicted_ms" in row and row.get("median_ms"):
            row["prediction_error"] = row["predicted_ms"] / (row["median_ms"] - row.get("optimizer_ms", 0.0)) - 1


def _optimizer_ms(opt: torch.optim.Optimizer, device: torch.device, times: int = 12) -> float:
    """The slowest rank's median ms of `opt.step()` alone (after the timed rounds: the steps move
    the weights on, as the timed steps did)."""
    return time_candidates(lambda _: opt.step(), [None], device, trials=times, warmup=0)[0] * 1e3


def _peak_mib(run: Run, device: torch.device) -> float | None:
    """Peak GPU memory (MiB, allocated by torch) of one step of `run`, above what was allocated before it."""
    if device.type != "cuda":
        return None
    run.switch()
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run.step(0)
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def _mode_forward(mode, moe, cfg, cf, activation, dtype, device, world_size, x0, copy_overhead: bool,
                  rounds: int = 1, graphed: bool = False, graph_placement: str = "captured",
                  expert_step: BackwardSGD | None = None):
    if mode in MODES:
        step = "" if expert_step is None else ", its experts' SGD step in the backward's weight-gradient GEMMs"
        return mode_forward(mode, moe, expert_step), list(moe.parameters()), f"weft {mode}{step}"
    if expert_step is not None:
        raise ValueError(f"{STEP_SUFFIX} takes one of weft's own modes ({', '.join(MODES)}), not {mode!r}")
    if mode == BALANCE_MODE:
        twin = balanced_twin(moe, cf, x0, copy_overhead, rounds)
        return twin, list(twin.parameters()), "weft plain + Pro-Prophet's replicated experts"
    if mode == SLOTS_MODE:
        if graphed:
            _need_cuda(device)
        twin = balanced_twin(moe, cf, x0, copy_overhead, rounds, InSlots.OVERRIDES, graphed, graph_placement)
        shape = "" if graph_placement == "captured" else "; its graph shaped for any placement"
        return (InSlots(twin), list(twin.parameters()),
                f"weft comet + Pro-Prophet's copies in replica slots (peer memory, nothing read on the host{shape})")
    if mode == COPY_MODE:
        twin = balanced_twin(moe, cf, x0, copy_overhead=False)
        forward = HeaviestCopied(twin)
        return forward, list(twin.parameters()), f"weft plain + expert {forward.expert} copied to every rank"
    peer = build_peer(mode, cfg.dim, cfg.hidden_dim, cfg.num_experts, cfg.top_k, cf, activation, dtype, device,
                      world_size)
    return peer.forward, list(peer.module.parameters()), peer.description


# The timed optimizer steps run at learning rate 0: every kernel of the step runs (SGD's add of
# the gradient times -lr; AdamW's moments and update), and the layer, its routing and the skew's
# load stay the ones checked against plain (an update moves the router, the more the more tokens:
# docs/benchmarks.md, thirty-seventh session).
BENCH_LR = 0.0
# ... except the SGD step in the backward's GEMMs: cuBLAS need not read a product's operands when its
# alpha (-lr) is 0, so that step runs at a learning rate that makes every kernel run and changes no
# weight of the layer's scale (|w| * 2^-24 > 1e-30 * |g| for any |w| above ~1e-20)
BENCH_BACKWARD_LR = 1e-30


def _backward_sgd(mode: str, optimizer: str, moe: MoE) -> BackwardSGD:
    """The SGD in the backward of a "+sgd-in-backward" mode, over the layer's parameters."""
    if optimizer != "sgd":
        raise ValueError(f"{mode}: {STEP_SUFFIX} times the SGD step; run with --optimizer sgd")
    if base_mode(mode) == "auto":
        raise ValueError(f"{mode}: auto's candidates are timed without {STEP_SUFFIX}; name a mode")
    return BackwardSGD(moe.parameters(), lr=BENCH_BACKWARD_LR, foreach=False)


def _optimizer(name: str, params: list[torch.nn.Parameter]):
    if name == "none":
        return None
    if name == "sgd":
        # Single-tensor updates: one elementwise kernel per parameter. The same weights, bit for bit,
        # as torch's default foreach step, which runs qwen2's few large expert tensors through
        # multi-tensor launches 24% slower on an H200 (docs/benchmarks.md, "The SGD step").
        return torch.optim.SGD(params, lr=BENCH_LR, foreach=False)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=BENCH_LR)
    raise ValueError(f"unknown optimizer {name!r}; choose none, sgd or adamw")


def _eager(forward: Callable[[torch.Tensor], torch.Tensor]) -> FwdBwd:
    def fwd_bwd(x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.detach().requires_grad_()
        y = forward(x)
        y.backward(grad)
        return y.detach(), x.grad

    return fwd_bwd


def _warm(fwd_bwd: FwdBwd, params, x: torch.Tensor, grad: torch.Tensor) -> None:
    """One eager step, its gradients dropped: what the mode makes on its first call and keeps
    (peer buffers, tuning trials, compiled kernels) is then made before a peak is counted."""
    fwd_bwd(x, grad)
    for p in params:
        p.grad = None


def _need_cuda(device: torch.device) -> None:
    if device.type != "cuda":
        raise ValueError(f"{GRAPH_SUFFIX} modes need CUDA")


def _graphed(forward, params, x: torch.Tensor, grad: torch.Tensor, device: torch.device) -> tuple[FwdBwd, float]:
    """The mode's forward and backward captured as one CUDA graph that owns the gradients (each
    replay writes the step's gradients, as the eager step's backward into `.grad = None` does),
    and its peak GPU memory (MiB) above what was allocated before: the warm-up steps' and the
    capture's (the graph keeps that pool of activations and gradients between replays). The
    caller runs one eager step first (`_warm`), so that what a layer makes once and keeps (peer
    buffers, its tuning's trials) counts in no row, not in whichever row happens to come first;
    the peer buffers are reported on their own (`peer_buffers_mib`)."""
    _need_cuda(device)

    def step(x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = forward(x)
        y.backward(grad)
        return y.detach(), x.grad

    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    graphed = GraphedStep(step, [x.detach().requires_grad_(), grad], grads_of=params, accumulate=False)
    torch.cuda.synchronize(device)
    peak_mib = (torch.cuda.max_memory_allocated(device) - before) / 2**20
    return graphed, peak_mib  # its outputs are valid until the next replay


def _step_fn(fwd_bwd: FwdBwd, params, inputs, grads, opt, graphed: bool) -> Callable[[int], None]:
    """One timed step: forward, backward and the optimizer. The eager step starts from no
    gradients (another mode's graph may have left its own on `.grad`) and frees its own after;
    a graph keeps its gradient tensors and overwrites them when it replays."""

    def free_grads() -> None:
        for p in params:
            p.grad = None

    def step(i: int) -> None:
        if not graphed:
            free_grads()
        fwd_bwd(inputs[i % len(inputs)], grads[i % len(grads)])
        if opt is not None:
            with stage("optimizer"):
                opt.step()
        if not graphed:
            free_grads()

    return step


TIMING_NOTES = {"sequential": "; timed in sequence (Tutel's protocol: rank 0's steps, each between synchronisations; "
                              "means in JSON)",
                "back-to-back": "; timed back to back (each mode's steps with no synchronisation between them)"}


def print_table(report: dict) -> None:
    meta, rows = report["meta"], report["results"]
    print(f"\nweft bench layer: {meta['config']} (E{meta['num_experts']} k{meta['top_k']} {meta['dim']}x"
          f"{meta['hidden_dim']}), {meta['world_size']} x {meta['device']}, {meta['dtype']}, "
          f"{meta['tokens_per_rank']} tokens/rank, {meta['activation']} experts, fwd+bwd"
          f"{'' if meta['optimizer'] == 'none' else ' + ' + meta['optimizer']}"
          f"{', NCCL_P2P_DISABLE=1' if meta['p2p_disabled'] else ''}"
          f"{TIMING_NOTES.get(meta.get('timing'), '')}")
    width = max([10, *(len(r["mode"]) for r in rows)])
    head = (f"{'capacity':>9} {'mode':>{width}} {'median ms':>10} {'iqr':>6} {'vs ' + meta['baseline']:>9} "
            f"{'max err':>9} {'comm ms':>8} {'exposed':>8} {'hidden':>7} {'TFLOP/s':>8} {'peak MiB':>9}")
    print(head)
    for r in rows:
        cap = "dropless" if r["capacity_factor"] is None else f"{r['capacity_factor']:g}"
        if r.get("median_ms") is None:
            print(f"{cap:>9} {r['mode']:>{width}}  unavailable: {r.get('error', '?')[:150]}")
            continue
        err = "n/a" if r.get("max_abs_error") is None else f"{r['max_abs_error']:.1e}"
        ratio = "" if r.get("ratio") is None else f"{r['ratio']:.2f}x"
        comm, exposed, hidden = comm_cells(r)
        tuned = f"  chose {', '.join(r['tuned'])}" if r.get("tuned") else ""
        if r.get("candidates_ms"):
            tuned += " (" + ", ".join(f"{name} {ms:.2f}" for name, ms in r["candidates_ms"].items()) + " ms)"
        if r.get("copied_experts") is not None:
            tuned += f"  copied experts {r['copied_experts']} in the checked call"
        if r.get("copied_experts") and r.get("planned_rank_load") is not None:
            tuned += f" (rank load {r['planned_plain_rank_load']:.2f} -> {r['planned_rank_load']:.2f})"
        if r.get("comet_copy_programs"):
            tuned += "  copy programs " + "/".join(map(str, sorted(set(r["comet_copy_programs"].values()))))
        if r.get("prediction_error") is not None:
            apart = f" of the step less its {r['optimizer_ms']:.2f} ms optimizer" if r.get("optimizer_ms") else ""
            tuned += f"  Pro-Prophet's model: {r['predicted_ms']:.3f} ms ({r['prediction_error']:+.0%}{apart})"
            cost = r.get("cost_model") or {}
            if cost.get("expert_scale") is not None:
                tuned += (f" [rows' scale {cost['expert_scale']:.2f}, copied rows' "
                          f"{cost.get('slot_scale', 1.0):.2f}, a copy's overhead "
                          f"{cost['copy_overhead_s'] * 1e3:.3f} ms]")
        peak = "" if r.get("peak_mib") is None else f"{r['peak_mib']:.0f}"
        print(f"{cap:>9} {r['mode']:>{width}} {r['median_ms']:>10.3f} {r['iqr_ms']:>6.2f} {ratio:>9} {err:>9} "
              f"{comm:>8} {exposed:>8} {hidden:>7} {r['tflops_per_rank']:>8.1f} {peak:>9}{tuned}")
    loads = {capacity_label(r["capacity_factor"]):
             (r["expert_load_max_over_mean"], r.get("rank_load_max_over_mean"))
             for r in rows if r.get("expert_load_max_over_mean") is not None}
    skew = f"skew {meta['skew']:g}, " if meta.get("skew") else ""
    print(f"routing: {skew}expert load max/mean " + ", ".join(
        f"{cap} {e:.2f}" + ("" if r is None else f" (per rank {r:.2f})") for cap, (e, r) in loads.items()))
    held = max((r.get("peer_buffers_mib") or 0.0 for r in rows), default=0.0)
    if held:
        print(f"peer buffers (Comet's exchange: each rank's rows where the others read them): {held:.1f} MiB a "
              f"rank, held once for every mode that uses them and not in the peak MiB column")
    hidden = [r for r in rows if r.get("exchange_hidden") is not None]
    if hidden:
        print("exchange hidden, (plain - mode) / (plain - no-comm), +graph rows against +graph: " + "; ".join(
            f"{capacity_label(r['capacity_factor'])} {r['mode']} {r['exchange_hidden']:.0%}" for r in hidden))
    states = {capacity_label(r["capacity_factor"]): r["gpu_after_timing"] for r in rows if r.get("gpu_after_timing")}
    if states:
        print(gpu_state_line(states))
    spent = [r for r in rows if r.get("energy")]
    if spent:
        print("energy per GPU (NVML's counter around each mode's steps back to back): " + "; ".join(
            f"{capacity_label(r['capacity_factor'])} {r['mode']} {r['energy']['joules_per_step'] * 1e3:.1f} mJ a step "
            f"at {r['energy']['watts']:.0f} W ({r['energy']['ms_per_step']:.3f} ms a step)" for r in spent))

    def label(r: dict) -> str:
        return f"{r['mode']}, {capacity_label(r['capacity_factor'])}"

    moved = [r for r in rows if (r.get("transfer_decomposition") or {}).get("hidden_share") is not None]
    if moved:
        print("Trans and Agg (profiled steps): " + "; ".join(
            f"{label(r)} {r['transfer_decomposition']['comm_ms']:.3f} ms a step, "
            f"{r['transfer_decomposition']['hidden_share']:.0%} under computation" for r in moved))

    print_breakdowns(rows, label)
    staged = [r for r in rows if r.get("experts_tflops_per_rank")]
    if staged:
        print("experts stage (the routed matmuls' FLOPs over its kernels' time, forward and backward; eager modes): "
              + "; ".join(f"{label(r)} {r['experts_tflops_per_rank']:.0f} TFLOP/s" for r in staged))
