"""One micro-step of training (forward, loss, backward) as a function of the batch, eager or
replayed as a CUDA graph (`weft.graphs`).

The micro-step returns what the loop logs as tensors computed inside it (losses, expert counts,
dropped slots), so that a replayed graph reports the values of the replay, not those of the
capture (module attributes such as `MoE.stats` are assigned once, at capture).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from weft.graphs import CaptureError, GraphedStep, time_graphed
from weft.models import GPT
from weft.moe.config import FIXED_SIZE_ALGO, FIXED_SIZE_ALGOS, FIXED_SIZE_FORMS, OWN_APART_ALGO
from weft.moe.grads import OverlappedReduce
from weft.ops.wgrad import plan_line
from weft.overlap import OverlapPlan
from weft.overlap.passes import GRAPHED_MIN_GAIN, apply, choose_passes, forget_wgrad_plans
from weft.precision import training_autocast
from weft.tune.dictionary import DEGREES, tuned_seconds

# (x, y) -> (losses (4,): total, ce, aux, dropped slots; expert counts (layers, E))
MicroStep = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def eager_micro_step(model: GPT, grad_accum: int, backward: Callable[[torch.Tensor], None] | None = None,
                     reducer: OverlappedReduce | None = None) -> MicroStep:
    """Forward, loss and backward of one micro-batch; gradients accumulate into `.grad`
    (`backward`: e.g. Lancet's plan.backward; default loss.backward). `reducer`: the gradients'
    data-parallel sums run during the backward (`weft.moe.grads.OverlappedReduce`, armed for it,
    finished after it)."""
    backward = backward or torch.Tensor.backward

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with training_autocast(x.device):
            _, loss = model(x, y)
        if reducer is None:
            backward(loss / grad_accum)
        else:
            with reducer.armed():
                backward(loss / grad_accum)
            reducer.finish()
        moes = model.moe_layers()
        dropped = sum((moe.stats.dropped.float() for moe in moes), torch.zeros((), device=x.device))
        losses = torch.stack([loss.detach().float(), model.last_ce_loss.float(), model.last_aux_loss.float(), dropped])
        counts = torch.stack([moe.stats.expert_counts.float() for moe in moes]) if moes else \
            torch.zeros(0, model.config.num_experts, device=x.device)
        return losses, counts

    return step


def graph_blocker(model: GPT, device: torch.device, overlap: str, fixed_size: bool = False) -> str | None:
    """Why the micro-step cannot be one CUDA graph (None: it can): it must have static shapes and
    no host synchronisation, so padded capacity (cf > 0) or expert choice, and not Lancet's
    partitioned forward (each partition's all-to-allv sends its kept slots, counted on the host);
    Lancet's dW schedule is captured (`choose_wgrad_schedule`: from its second backward on it
    follows a fixed plan, each all-to-all launched, the weight gradients the plan gives it run,
    then waited, which a graph keeps as its stream order; under the linear all-to-all only, so
    `fixed_size` does not apply to it). Tutel's pipelining
    is captured at the degree whose graph replays fastest (`choose_fastest`), its chunks'
    all-to-alls with it. A tensor-parallel step is captured with its all-reduces, Domino's
    asynchronous ones and their side streams included (`weft bench tp --modes domino+graph` on 2
    GPUs: docs/tp.md). `--a2a-algo auto` is captured with the all-to-all whose graph replays
    fastest (linear or dedup). Dropless layers on one GPU, with `--a2a-algo dedup-fixed`, or with
    `--kernels comet` where the GPUs reach each other's memory (`MoE.counts_stay_on_device`), read
    nothing on the host and are captured too, Pro-Prophet's copies with them (`--balance
    pro-prophet`: in replica slots, whose placement each replay reads on the device, written
    after each replay by `follow_loads`; `--cuda-graphs auto` keeps that step eager:
    `_auto_blocker`); `fixed_size`: as if the dropless layers at `--a2a-algo auto` that
    would time dedup (`MoE.tunes_dedup`) ran dedup-fixed, which that setting may choose
    (`choose_fixed_size`)."""
    if device.type != "cuda":
        return "CUDA graphs need a GPU"
    if model.balanced and not all(moe.copies_in_slots() for moe in _balanced_layers(model)):
        return ("--balance pro-prophet plans each call's copies on the host from the earlier calls' loads (a graph "
                "holds them with --kernels comet where the GPUs reach each other's memory)")
    if overlap == "lancet":
        if model.unit_runner is not None:
            return "--overlap lancet's partitioned forward ranges read their all-to-allv sizes on the host"
        fixed_size = False  # its dW schedule runs under the linear all-to-all's exchanges, not dedup-fixed's
    for i, moe in enumerate(model.moe_layers()):
        cf = moe.capacity_factor
        fixed = cf is None and (moe.a2a_algo in FIXED_SIZE_ALGOS  # dropless in fixed-size exchanges
                                or fixed_size and moe.a2a_algo == "auto" and moe.tunes_dedup()
                                or overlap != "lancet" and moe.counts_stay_on_device())  # one GPU's, Comet's
        if moe.gate != "expert_choice" and (cf is None or cf <= 0) and not fixed:
            return (f"MoE layer {i} runs capacity_factor={cf} ({'dropless' if cf is None else 'no-drop'}): its "
                    "sizes are read on the host every step" + (" (--a2a-algo dedup-fixed reads none, nor does "
                                                                "--kernels comet where the GPUs reach each other's "
                                                                "memory)" if cf is None else ""))
    return None


def _balanced_layers(model: GPT) -> list:
    return [moe for moe in model.moe_layers() if moe.balancer is not None]


def shape_for_any_placement(model: GPT) -> None:
    """Every balanced layer's graphs shaped for any placement (`graph_placement="updated"`): what
    a graphed step replays, its copies following the load (`follow_loads`)."""
    for moe in _balanced_layers(model):
        moe.graph_placement = "updated"


def follow_loads(step: MicroStep, model: GPT) -> MicroStep:
    """A graphed micro-step of a balanced model (`graph_placement="updated"`): after each replay,
    every balanced layer's `update_placement()` plans its copies for the next one from the loads
    of the replays before and writes them where the graph reads its placement (Pro-Prophet's plan
    per iteration, a replay behind, so that the host never waits for the GPU; the first replay
    runs the placement the warm-up's last eager call planned)."""
    layers = _balanced_layers(model)
    if not layers:
        return step

    def run(x: torch.Tensor, y: torch.Tensor):
        out = step(x, y)
        for moe in layers:
            moe.update_placement()
        return out

    return run


def lancet_partitions_forward(model: GPT, device: torch.device, cuda_graphs: str) -> bool:
    """Whether `--overlap lancet` plans its partitioned forward: only where the steps run eagerly
    (`--cuda-graphs off`, or a step no graph can hold); a step that can replay as a CUDA graph
    gets the dW schedule only (its partitions would read all-to-allv sizes on the host)."""
    return cuda_graphs == "off" or graph_blocker(model, device, "none") is not None or \
        cuda_graphs == "auto" and _auto_blocker(model) is not None


def _auto_blocker(model: GPT) -> str | None:
    """Why `--cuda-graphs auto` runs a step eagerly that a graph could hold: a balanced model's
    graph whose copies follow the load (`follow_loads`) replays only when asked for. Its eager
    step plans each call's copies on the host and runs the copies' path only on ranks that hold
    copies, by the copy engine; the graph runs that path on every rank at every call, moving the
    bytes by link kernels (docs/balance.md, "Eager against graphed": the eager step is faster)."""
    if model.balanced:
        return ("--cuda-graphs auto keeps a --balance pro-prophet step eager, which runs the copies' path only where a "
                "call copies; --cuda-graphs on replays it as a CUDA graph whose copies follow the load")
    return None


# The dropless form of Comet's kernels over the linear all-to-all: its counts stay on the GPU, so
# the step graphs (weft.moe.exchange.comet); beside `FIXED_SIZE_FORMS` where `comet_form_offered`.
COMET_FORM = "comet"


def comet_form_offered(model: GPT) -> bool:
    """Whether `--a2a-algo auto` times Comet's dropless graph beside the fixed-size forms: every
    MoE layer on a GPU whose ranks map each other's memory, at kernels "auto" (which then means
    the Triton kernels; Comet's computes the same function: `MoE.counts_stay_on_device`)."""
    layers = model.moe_layers()
    return bool(layers) and all(moe.kernels == "auto" and moe.graphs_dropless_comet() for moe in layers)


def dropless_forms(model: GPT) -> tuple[str, ...]:
    """The graphed forms a dropless step at `--a2a-algo auto` is timed in."""
    return (*FIXED_SIZE_FORMS, COMET_FORM) if comet_form_offered(model) else FIXED_SIZE_FORMS


def set_dropless_form(model: GPT, form: str | None) -> None:
    """Every MoE layer at `form`: one of `FIXED_SIZE_FORMS`, `COMET_FORM` (Comet's kernels over the
    linear all-to-all) or None (back to a2a_algo "auto"). Layers at Comet's kernels go back to
    "auto" first: only layers at "auto" are offered Comet's form, and a dedup all-to-all refuses
    them."""
    if form == COMET_FORM:
        set_layers(model, "a2a_algo", "linear")
        set_layers(model, "kernels", "comet")
        return
    if any(moe.kernels == "comet" for moe in model.moe_layers()):
        set_layers(model, "kernels", "auto")
    set_layers(model, "a2a_algo", form or "auto")


def with_dropless_forms(model: GPT, step: MicroStep) -> Callable[[str], MicroStep]:
    """Dropless form -> the micro-step with every MoE layer at that form (`set_dropless_form`)."""
    def step_of(form: str) -> MicroStep:
        def run(x: torch.Tensor, y: torch.Tensor):
            set_dropless_form(model, form)
            return step(x, y)
        return run
    return step_of


def choose_fixed_size(model: GPT, eager: MicroStep, eager_timer: Callable[[MicroStep], float],
                      graph_timer: StepTimer,
                      forms: Sequence[str] | None = None) -> tuple[str | None, float, dict[str, float]]:
    """`--a2a-algo auto` on dropless MoE layers with CUDA graphs allowed: the ways the step can
    run, each timed as it would run, and the fastest kept. Eagerly, the layers read their sizes on
    the host and tune linear against dedup per call (`eager_timer(eager)`: once that tuning has
    decided); in fixed-size exchanges (dedup-fixed) the step is one CUDA graph, in each of
    `FIXED_SIZE_FORMS` (degree 1, its chunks pipelined at degree 2, or the own pairs apart), with
    no launch cost but exchanges sized for the worst case (T rows, T * k records per rank pair);
    and where the GPUs map each other's memory, Comet's kernels with the counts on the device
    (`COMET_FORM`); `forms` (default `dropless_forms(model)`) each timed by `graph_timer(step_of,
    forms)`, e.g. `weft.graphs.time_graphed`. None wins everywhere: the graph halves a qwen2-like
    layer's step, while a qwen2-moe-2l step of 8 x 4096 tokens per GPU ran faster eagerly with
    P2P disabled (docs/benchmarks.md). All compute the plain layer's function. Sets every layer to
    the winner (`set_dropless_form`), or back to "auto" at the degree it had, whose tuning is
    kept; returns (the form chosen or None, eager seconds, seconds per form)."""
    forms = tuple(forms if forms is not None else dropless_forms(model))
    degrees = [(moe, moe.overlap_degree) for moe in model.moe_layers()]
    eager_s = eager_timer(eager)
    graph_s = dict(zip(forms, graph_timer(with_dropless_forms(model, eager), forms)))
    best = min(graph_s, key=graph_s.__getitem__)
    chosen = best if graph_s[best] < eager_s else None
    set_dropless_form(model, chosen)
    if chosen is None:
        for moe, degree in degrees:
            moe.overlap_degree = degree
    return chosen, eager_s, graph_s


def _as_graphs(seconds: dict[str, float]) -> str:
    return "as CUDA graphs " + ", ".join(f"{form} {s * 1e3:.1f} ms" for form, s in seconds.items())


def describe_fixed_size(form: str) -> str:
    """How the log names a dropless form: "a2a_algo=dedup-fixed" (at overlap_degree 2), or
    "kernels=comet"."""
    if form == COMET_FORM:
        return "kernels=comet (its dropless counts left on the GPU)"
    values = LAYER_VALUES[("a2a_algo", form)]
    degree = values["overlap_degree"]
    return f"a2a_algo={values['a2a_algo']}" + (f" at overlap_degree {degree}" if degree > 1 else "")


def time_tuned_eager(model: GPT, step: MicroStep, example: tuple[torch.Tensor, torch.Tensor]) -> float:
    """Wall seconds of the eager micro-step on `example` once the MoE layers' own tuning has decided
    (`tuned_seconds`: its measuring calls synchronise and try slow settings); leaves every `.grad`
    None, as it found them."""
    dictionaries = list({id(moe.tuning): moe.tuning for moe in model.moe_layers()}.values())
    seconds = tuned_seconds(lambda: step(*example), lambda: sum(d.measurements for d in dictionaries),
                            example[0].device)
    model.zero_grad(set_to_none=True)
    return seconds


StepTimer = Callable[[Callable[[int], MicroStep], Sequence[int]], list[float]]  # (step_of, candidates) -> seconds


def choose_fastest(model: GPT, step_of: Callable[[object], MicroStep], timer: StepTimer, setting: str,
                   candidates: Sequence) -> tuple[object, list[float]]:
    """The value of the MoE layers' `setting` (e.g. "overlap_degree", "a2a_algo") among
    `candidates` whose micro-step replays fastest as a CUDA graph (`timer`, e.g.
    `weft.graphs.time_graphed`, over `step_of(value)`: the step with every layer at that value).
    The layers' own tuning times eager calls, whose launch costs a replay does not pay (and a
    capture cannot time anything), so it would choose for another step than the one that runs.
    Sets the value on every layer; returns it and the seconds per candidate."""
    seconds = timer(step_of, candidates)
    best = candidates[seconds.index(min(seconds))]
    set_layers(model, setting, best)
    return best, seconds


def with_layers_at(model: GPT, step: MicroStep, setting: str) -> Callable[[object], MicroStep]:
    """Candidate value -> the micro-step with every MoE layer's `setting` at that value."""
    def step_of(value) -> MicroStep:
        def run(x: torch.Tensor, y: torch.Tensor):
            set_layers(model, setting, value)
            return step(x, y)
        return run
    return step_of


# A graphed micro-step's choices time their candidates in two rounds, the second in the reverse
# order (`weft.graphs.time_graphed`): with P2P disabled one round timed the same gpt2-l-moe graph
# 46.0 ms first and 48.3 ms last (docs/benchmarks.md, forty-first session), which chose its degree.
CHOICE_ROUNDS = 2
# The per-layer settings a graphed micro-step chooses by timing graphs, and their candidates:
# `--overlap tutel`'s pipelining degree (Tutel 3.2) and `--a2a-algo auto`'s all-to-all.
GRAPH_TUNED = {"overlap_degree": DEGREES, "a2a_algo": ("linear", "dedup", "dedup-d2")}
# The layer attributes of a value that is more than the attribute it tunes: "dedup-d2" is dedup with
# overlap_degree=2 (a rank's own pairs computed while the others' rows travel in: weft.moe.dedup).
# `set_layers` moves a layer through degree 1 (valid with every all-to-all), then sets the values in
# this order, the all-to-all first, so every step between two of them is a valid layer.
LAYER_VALUES = {("a2a_algo", "linear"): {"a2a_algo": "linear", "overlap_degree": 1},
                ("a2a_algo", "dedup"): {"a2a_algo": "dedup", "overlap_degree": 1},
                ("a2a_algo", "dedup-d2"): {"a2a_algo": "dedup", "overlap_degree": 2},
                # FIXED_SIZE_FORMS
                ("a2a_algo", "dedup-fixed"): {"a2a_algo": FIXED_SIZE_ALGO, "overlap_degree": 1},
                ("a2a_algo", "dedup-fixed-d2"): {"a2a_algo": FIXED_SIZE_ALGO, "overlap_degree": 2},
                ("a2a_algo", OWN_APART_ALGO): {"a2a_algo": OWN_APART_ALGO, "overlap_degree": 1}}


def set_layers(model: GPT, setting: str, value) -> None:
    """Every MoE layer's `setting` at `value` (with the attributes `LAYER_VALUES` adds; where those
    are an all-to-all and a degree, through degree 1, which every all-to-all runs: e.g. from
    dedup-fixed-own, which runs degree 1 only, to dedup-fixed at degree 2). A change makes every dW
    scheduler on the model plan afresh (`weft.overlap.passes.forget_wgrad_plans`)."""
    values = LAYER_VALUES.get((setting, value), {setting: value})
    changed = any(getattr(moe, name, None) != layer_value
                  for moe in model.moe_layers() for name, layer_value in values.items())
    for moe in model.moe_layers():
        if "overlap_degree" in values:
            moe.overlap_degree = 1
        for name, layer_value in values.items():
            setattr(moe, name, layer_value)
    if changed:  # other collectives: Lancet's dW schedule plans for them afresh
        forget_wgrad_plans(model)


def graph_candidates(model: GPT, setting: str) -> tuple:
    """`GRAPH_TUNED[setting]` worth a capture: the dedup all-to-alls only where some MoE layer would
    time dedup itself (`MoE.tunes_dedup`: it could send fewer rows, e.g. not with top_k 1)."""
    found = GRAPH_TUNED[setting]
    if setting == "a2a_algo" and not any(moe.tunes_dedup() for moe in model.moe_layers()):
        found = tuple(c for c in found if not c.startswith("dedup"))
    return found


@dataclass(frozen=True)
class MicroSteps:
    """How a training step runs its micro-batches: `run` (eager or a graph replay) and who owns the
    gradients between optimizer steps.

    - eager: gradients are freed after the optimizer step (the next backward creates them);
    - a graph that accumulates (grad_accum > 1): zeroed in place, the graph adds into them;
    - a graph that owns them (grad_accum == 1): left alone, the next replay overwrites them.
    """

    run: MicroStep
    graphed: bool = False
    owns_grads: bool = False
    wgrad_scheduled: bool = False  # Lancet's dW schedule runs in the step (`--overlap lancet` keeps it)
    reduced: OverlappedReduce | None = None  # sums gradients over the data-parallel ranks in a backward
    # the step's last micro-batch where it is not `run`: with several, only its backward sums (`reduced`)
    last: MicroStep | None = None

    def of(self, micro: int, grad_accum: int) -> MicroStep:
        """The micro-step that runs micro-batch `micro` of `grad_accum`."""
        return self.last if self.last is not None and micro == grad_accum - 1 else self.run

    def summed(self, micro: int, grad_accum: int) -> Callable[[torch.nn.Parameter], bool] | None:
        """Which weights' step sums micro-batch `micro`'s backward sent (`reduced.covers`; None:
        none), for `MasterWeights.stage_gradients`: the last micro-batch's, where `reduced`."""
        return self.reduced.covers if self.reduced is not None and micro == grad_accum - 1 else None

    def clear_grads(self, optimizer: torch.optim.Optimizer) -> None:
        """After the optimizer step: make the gradients ready for the next step's micro-batches."""
        if not self.owns_grads:
            optimizer.zero_grad(set_to_none=not self.graphed)


def _last_and_other_graphs(last: MicroStep, other: MicroStep, example: tuple[torch.Tensor, torch.Tensor],
                           params: list[torch.nn.Parameter], device: torch.device) -> tuple[GraphedStep, GraphedStep]:
    """Several micro-batches a step, the last one's backward armed: its step (`last`) and the
    others' (`other`, the same step unarmed) as two CUDA graphs that accumulate the gradients and
    share one memory pool (one set of activations). The armed one is captured first, after its
    eager warm-up (which records and builds the reducer's buckets); the other's ops are among
    its, so it is captured with no warm-up of its own: no eager step runs beside a graph's pool,
    so building them holds one step's activations at a time. The second capture runs inside
    `torch.random.fork_rng`, so the random numbers drawn (sampled routing) are those of one
    graph's build, as with the sums after the backward."""
    armed = GraphedStep(last, example, grads_of=params)
    with torch.random.fork_rng(devices=[device]):
        unarmed = GraphedStep(other, example, grads_of=params, warmup=0, stream=armed.stream, pool=armed.pool)
    return armed, unarmed


def choose_wgrad_schedule(model: GPT, plan: OverlapPlan, grad_accum: int, timer: StepTimer,
                          reducer: OverlappedReduce | None = None) -> tuple[bool, list[float]]:
    """`--overlap lancet` in a graphed micro-step: Lancet's dW schedule (`plan.scheduler`, weight
    gradients run under the backward all-to-alls) kept only where its step replays faster as a
    CUDA graph than the plain step (`timer(step_of, ("none", "backward"))`, e.g.
    `weft.graphs.time_graphed`; by `weft.overlap.passes.choose_passes` with the graphs' margin,
    `GRAPHED_MIN_GAIN`, as `optimize` keeps a pass by eager timing: a graph has no host cost to pay
    for, so the eager check would judge another step than the one that runs). Both compute the
    same gradients. Leaves the choice applied; returns whether the schedule is kept and the
    seconds of (none, backward)."""
    def step_of(name: str) -> MicroStep:
        scheduled = name == "backward"
        inner = eager_micro_step(model, grad_accum, plan.backward if scheduled else None, reducer)

        def run(x: torch.Tensor, y: torch.Tensor):
            apply(model, [], plan.scheduler if scheduled else None)
            return inner(x, y)
        return run

    names = ("none", "backward")
    seconds = timer(step_of, names)
    kept = choose_passes(dict(zip(names, seconds)), GRAPHED_MIN_GAIN) == "backward"
    apply(model, [], plan.scheduler if kept else None)
    return kept, seconds


def build_micro_step(model: GPT, grad_accum: int, mode: str, example: tuple[torch.Tensor, torch.Tensor],
                     overlap: str = "none", plan: OverlapPlan | None = None,
                     log: Callable[[str], None] = print, reducer: OverlappedReduce | None = None) -> MicroSteps:
    """The micro-step for `mode` ("auto", "on", "off" CUDA graphs). "on" raises CaptureError
    naming why a graph cannot be used; "auto" tells `log` and runs eagerly. Building a graph runs
    the step a few times to warm up, with no effect on the gradients: with one micro-batch per
    step the graph owns them (each replay writes the step's gradients); with several, it
    accumulates into zeroed ones. `plan`: Lancet's (`--overlap lancet`), whose backward the step
    runs; graphed, its dW schedule is kept only where it replays faster (`choose_wgrad_schedule`).
    `reducer`: sums the gradients it covers in the backward (`eager_micro_step`): with one
    micro-batch per step every micro-step built here, the timed candidates too; with several,
    only the step's last micro-batch (`MicroSteps.last`: eager, or a graph of its own sharing one
    memory pool with the other's, `_last_and_other_graphs`), whose reducer adds the earlier
    micro-batches' sums (its `earlier`);
    not a balanced model's graph (Pro-Prophet's replays leave their loads in the one graph's
    tensors): there the sums run after the backward (`MicroSteps.reduced` None)."""
    backward = plan.backward if plan is not None and plan.scheduler is not None else None
    scheduled = backward is not None
    each = reducer if grad_accum == 1 else None  # the reducer of every micro-batch's backward
    eager = eager_micro_step(model, grad_accum, backward, each)

    def micro_steps(step: MicroStep, graphed: bool = False, last: MicroStep | None = None, **kwargs) -> MicroSteps:
        if reducer is not None and not graphed:  # its buckets follow the step that runs, not the last one timed
            reducer.forget()
        if reducer is not None and each is None and not graphed:
            last = eager_micro_step(model, grad_accum, backward, reducer)
        return MicroSteps(step, graphed=graphed, reduced=reducer, last=last, **kwargs)
    if mode == "off":
        return micro_steps(eager, wgrad_scheduled=scheduled)
    device = example[0].device
    accumulate = grad_accum > 1  # else the graph owns its gradients; the candidates are timed the same way
    graph_timer = functools.partial(time_graphed, args=example, grads_of=list(model.parameters()),
                                    accumulate=accumulate, rounds=CHOICE_ROUNDS)
    blocker = graph_blocker(model, device, overlap)
    if blocker is None and mode == "auto" and _auto_blocker(model) is not None:
        log(f"weft train: eager steps ({_auto_blocker(model)})")
        return micro_steps(eager, wgrad_scheduled=scheduled)
    if blocker is not None and graph_blocker(model, device, overlap, fixed_size=True) is None:
        if mode == "on":  # a graph asked for: the dropless layers' graphable exchange, the faster form
            forms = dropless_forms(model)
            seconds = graph_timer(with_dropless_forms(model, eager), forms)
            chosen = forms[seconds.index(min(seconds))]
            set_dropless_form(model, chosen)
            measured = _as_graphs(dict(zip(forms, seconds)))
            log(f"weft train: every MoE layer runs {describe_fixed_size(chosen)} (dropless; --cuda-graphs on; "
                f"measured {measured})")
        else:
            chosen, eager_s, graph_s = choose_fixed_size(
                model, eager, lambda step: time_tuned_eager(model, step, example), graph_timer)
            measured = f"eager with a2a_algo auto {eager_s * 1e3:.1f} ms, {_as_graphs(graph_s)}"
            if chosen is None:
                log(f"weft train: eager steps, MoE layers at a2a_algo auto (dropless; measured: {measured})")
                return micro_steps(eager, wgrad_scheduled=scheduled)
            log(f"weft train: every MoE layer runs {describe_fixed_size(chosen)} (dropless; measured: {measured})")
        blocker = graph_blocker(model, device, overlap)
    if blocker is None:
        shape_for_any_placement(model)  # balanced layers read the placement `follow_loads` writes
        try:
            for setting in GRAPH_TUNED:
                if not any(getattr(moe, setting) == "auto" for moe in model.moe_layers()):
                    continue
                candidates = graph_candidates(model, setting)
                if len(candidates) == 1:
                    set_layers(model, setting, candidates[0])
                    log(f"weft train: every MoE layer runs {setting}={candidates[0]} (dedup would send no fewer rows)")
                    continue
                best, seconds = choose_fastest(model, with_layers_at(model, eager, setting), graph_timer, setting,
                                               candidates)
                log(f"weft train: every MoE layer runs {setting}={best} (measured as CUDA graphs: "
                    + ", ".join(f"{c} {t * 1e3:.1f} ms" for c, t in zip(candidates, seconds)) + ")")
            if backward is not None:
                kept, (plain_s, scheduled_s) = choose_wgrad_schedule(model, plan, grad_accum, graph_timer, each)
                log(f"weft train: --overlap lancet {'keeps' if kept else 'drops'} its weight-gradient schedule "
                    f"(measured as CUDA graphs: plain {plain_s * 1e3:.1f} ms, scheduled {scheduled_s * 1e3:.1f} ms)")
                if kept and plan.scheduler.planned:  # what each replay runs under its all-to-alls
                    log(f"weft train: {plan_line(plan.scheduler.planned)}")
                if not kept:
                    backward, scheduled = None, False
                    eager = eager_micro_step(model, grad_accum, reducer=each)
            if reducer is not None:  # the graph's warm-up records the order of the step it captures
                reducer.forget()
            if reducer is not None and each is None and model.balanced:
                log("weft train: the gradients are summed over the data-parallel ranks after the backward "
                    "(--balance pro-prophet: each replay leaves its loads where its one graph captured them, which "
                    "a second graph for the last micro-batch would take over)")
                reducer = None
            if reducer is None or each is not None:
                graph = GraphedStep(eager, example, grads_of=list(model.parameters()), accumulate=accumulate)
                return micro_steps(follow_loads(graph, model), graphed=True, owns_grads=not accumulate,
                                   wgrad_scheduled=scheduled)
            last, run = _last_and_other_graphs(eager_micro_step(model, grad_accum, backward, reducer), eager, example,
                                               list(model.parameters()), device)
            return micro_steps(follow_loads(run, model), graphed=True, last=follow_loads(last, model),
                               wgrad_scheduled=scheduled)
        except CaptureError as e:
            if mode == "on":
                raise
            blocker = str(e)
    if mode == "on":
        raise CaptureError(f"--cuda-graphs on: {blocker}")
    if device.type == "cuda":
        log(f"weft train: eager steps (no CUDA graph: {blocker})")
    return micro_steps(eager, wgrad_scheduled=scheduled)
