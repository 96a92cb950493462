"""One micro-step of training (forward, loss, backward) as a function of the batch, eager or
replayed as a CUDA graph (`weft.graphs`).

The micro-step returns what the loop logs as tensors computed inside it (losses, expert counts,
dropped slots), so that a replayed graph reports the values of the replay, not those of the
capture (module attributes such as `MoE.stats` are assigned once, at capture).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from weft.graphs import CaptureError, GraphedStep
from weft.models import GPT
from weft.precision import training_autocast
from weft.tune import run_until_tuned

# (x, y) -> (losses (4,): total, ce, aux, dropped slots; expert counts (layers, E))
MicroStep = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def eager_micro_step(model: GPT, grad_accum: int, backward: Callable[[torch.Tensor], None] | None = None) -> MicroStep:
    """Forward, loss and backward of one micro-batch; gradients accumulate into `.grad`
    (`backward`: e.g. Lancet's plan.backward; default loss.backward)."""
    backward = backward or torch.Tensor.backward

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with training_autocast(x.device):
            _, loss = model(x, y)
        backward(loss / grad_accum)
        moes = model.moe_layers()
        dropped = sum((moe.stats.dropped.float() for moe in moes), torch.zeros((), device=x.device))
        losses = torch.stack([loss.detach().float(), model.last_ce_loss.float(), model.last_aux_loss.float(), dropped])
        counts = torch.stack([moe.stats.expert_counts.float() for moe in moes]) if moes else \
            torch.zeros(0, model.config.num_experts, device=x.device)
        return losses, counts

    return step


def graph_blocker(model: GPT, device: torch.device, overlap: str) -> str | None:
    """Why the micro-step cannot be one CUDA graph (None: it can): it must have static shapes and
    no host synchronisation, so padded capacity (cf > 0) or expert choice, and not Lancet (its
    backward schedules weight gradients from the host as all-to-alls complete). Tutel's adaptive
    pipelining is captured once its tuning is done (`tune_before_capture`), its chunks'
    all-to-alls with it. A tensor-parallel step is captured with its all-reduces, Domino's
    asynchronous ones and their side streams included (`weft bench tp --modes domino+graph` on 2
    GPUs: docs/tp.md)."""
    if device.type != "cuda":
        return "CUDA graphs need a GPU"
    if overlap == "lancet":
        return "--overlap lancet schedules its backward on the host"
    for i, moe in enumerate(model.moe_layers()):
        cf = moe.capacity_factor
        if moe.gate != "expert_choice" and (cf is None or cf <= 0):
            return (f"MoE layer {i} runs capacity_factor={cf} ({'dropless' if cf is None else 'no-drop'}): its "
                    "sizes are read on the host every step")
    return None


def tune_before_capture(model: GPT, run_once: Callable[[], object]) -> int:
    """Run the eager micro-step (`run_once`) until the MoE layers' tuning dictionaries time nothing
    new (Tutel 3.3's adaptive choice, made before the capture: a replayed graph runs the settings
    captured in it, and a capture cannot time anything); returns the steps run. Eager timing
    carries the host's launch costs, which the graph does not, so it may choose a lower
    pipelining degree than the graph would run fastest. The gradients these steps leave are
    cleared: the training steps start from none, as without tuning."""
    dictionaries = list({id(moe.tuning): moe.tuning for moe in model.moe_layers()}.values())
    device = next(model.parameters()).device
    steps = run_until_tuned(lambda _: run_once(), lambda: sum(d.measurements for d in dictionaries), device)
    model.zero_grad(set_to_none=True)
    return steps


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

    def clear_grads(self, optimizer: torch.optim.Optimizer) -> None:
        """After the optimizer step: make the gradients ready for the next step's micro-batches."""
        if not self.owns_grads:
            optimizer.zero_grad(set_to_none=not self.graphed)


def build_micro_step(model: GPT, grad_accum: int, mode: str, example: tuple[torch.Tensor, torch.Tensor],
                     overlap: str = "none", backward=None,
                     log: Callable[[str], None] = print) -> MicroSteps:
    """The micro-step for `mode` ("auto", "on", "off" CUDA graphs). "on" raises CaptureError
    naming why a graph cannot be used; "auto" tells `log` and runs eagerly. Building a graph runs
    the step a few times to warm up, with no effect on the gradients: with one micro-batch per
    step the graph owns them (each replay writes the step's gradients); with several, it
    accumulates into zeroed ones."""
    eager = eager_micro_step(model, grad_accum, backward)
    if mode == "off":
        return MicroSteps(eager)
    blocker = graph_blocker(model, example[0].device, overlap)
    if blocker is None:
        accumulate = grad_accum > 1
        tuned = []  # Tutel's degrees are tuned eagerly first, on the capture's stream
        settle = (lambda run_once: tuned.append(tune_before_capture(model, run_once))) if overlap == "tutel" else None
        try:
            graph = GraphedStep(eager, example, grads_of=list(model.parameters()), accumulate=accumulate,
                                settle=settle)
            if tuned:
                chosen = sorted({name for moe in model.moe_layers() for name in moe.tuning.chosen()})
                log(f"weft train: --overlap tutel tuned in {tuned[0]} eager micro-steps before the capture, chose "
                    f"{', '.join(chosen) or 'nothing (no exchange to tune)'}")
            return MicroSteps(graph, graphed=True, owns_grads=not accumulate)
        except CaptureError as e:
            if mode == "on":
                raise
            blocker = str(e)
    if mode == "on":
        raise CaptureError(f"--cuda-graphs on: {blocker}")
    if example[0].device.type == "cuda":
        log(f"weft train: eager steps (no CUDA graph: {blocker})")
    return MicroSteps(eager)
