"""SGD whose step of an MoE layer's expert weights runs inside the backward's weight-gradient GEMMs.

An optimizer applied in the backward (as torchtune's `optimizer_in_bwd` or LOMO do) needs no
gradient kept until the step; weft goes one further for the experts' weights, whose gradients are
whole GEMMs of their own: the update w <- (1 - lr wd) w - lr x^T dy is that GEMM's epilogue
(cuBLAS's beta = 1 - lr wd, alpha = -lr where every expert has the same rows; the grouped
weight-gradient kernel's `into` where the rows vary: `weft.kernels.comet.segment_wgrad_into`). The
gradient is never written and the weight is read and written once, inside a compute-bound GEMM,
instead of the gradient written, then read with the weight and the weight written by a separate
memory-bound step (docs/benchmarks.md measures the difference).

    sgd = weft.BackwardSGD(moe.parameters(), lr=0.1)
    y = moe(x, kernels="comet", expert_step=sgd)
    loss(y).backward()                 # the expert weights the backward could fuse are stepped
    sgd.step()                         # everything else: the router, weights it could not fuse
    sgd.zero_grad()

Invariants: `BackwardSGD` is `torch.optim.SGD` without momentum (no state: the update is the same
whenever it runs) and its `step()` is SGD's on every parameter that has a gradient, except the
weights the backward stepped since the last `step()`: they get no gradient, and one they hold
anyway (zeros from `zero_grad(set_to_none=False)` or `weft.reduce_gradients`) is dropped before the
step, which would otherwise decay them twice. A weight whose gradient autograd does not want
(`requires_grad` False) is not stepped; note that `torch.autograd.grad` or `backward(inputs=...)`
naming other tensors still runs the layer's backward, and so the step. A layer whose experts run
twice in one forward fails in the second call's backward (autograd's in-place check: the first
call's weights changed). A weight it could not fuse (a path other than Comet's fused exchange and
the plain exchange's dropless calls and Flexible-layout padded ones, a weight cast to another
compute dtype) gets its gradient as usual and `step()` applies the same update. Either way each
weight takes exactly one SGD step per backward and step: the same weights as the plain layer with
`torch.optim.SGD`, to the rounding of the fused epilogue (the product is not rounded to the
weight's dtype before the update). The step uses each weight's gradient on this rank alone, so it
is wrong where an expert's gradient is summed over ranks (replicated experts over data-parallel
ranks must not use it; Pro-Prophet's copies: `MoE.call_with` refuses them), and before
`weft.reduce_gradients`' division by the world size (give the experts lr / world size to take the
mean loss's step). It applies once per backward: not for gradient accumulation over several micro-
batches, not with gradient clipping; a CUDA graph holds the learning rate it was captured with, and
its warm-up calls step the weights too.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SGDUpdate:
    """One weight's SGD update as a GEMM epilogue takes it: w <- beta w + alpha g."""

    lr: float
    weight_decay: float

    @property
    def alpha(self) -> float:
        return -self.lr

    @property
    def beta(self) -> float:
        return 1.0 - self.lr * self.weight_decay


class BackwardSGD(torch.optim.SGD):
    """`torch.optim.SGD` (lr, weight_decay; no momentum) whose update of the expert weights it holds
    runs in their weight-gradient GEMMs during the backward, where the layer's path can fuse it
    (module docstring). Param groups, learning-rate schedulers and `state_dict` work as SGD's."""

    def __init__(self, params: Iterable, lr: float = 1e-3, weight_decay: float = 0.0, foreach: bool | None = None):
        if lr < 0 or weight_decay < 0:
            raise ValueError(f"BackwardSGD: lr and weight_decay must be >= 0; got lr={lr}, "
                             f"weight_decay={weight_decay}")
        super().__init__(params, lr=lr, weight_decay=weight_decay, foreach=foreach)
        self._stepped: dict[int, torch.Tensor] = {}  # the weights the backward stepped since the last step()

    def stepped(self, weight: torch.Tensor) -> None:
        """Record that the backward stepped `weight` (its next `step()` leaves it alone)."""
        self._stepped[id(weight)] = weight

    @torch.no_grad()
    def step(self, closure=None):
        """SGD's step on every parameter with a gradient but the ones the backward stepped."""
        for weight in self._stepped.values():
            weight.grad = None
        self._stepped.clear()
        return super().step(closure)

    def fuse(self, weight: torch.Tensor, epilogue: Callable[[float, float], bool]) -> bool:
        """Step `weight` by `epilogue(alpha, beta)` (its gradient GEMM with the update in its epilogue,
        which returns whether it could run) if this optimizer holds it; whether it was stepped."""
        update = self.update_of(weight)
        if update is None or not epilogue(update.alpha, update.beta):
            return False
        self.stepped(weight)
        return True

    def update_of(self, weight: torch.Tensor) -> SGDUpdate | None:
        """The update of `weight` (the very tensor, not a copy or a cast) if this optimizer holds
        it in a group without momentum, else None."""
        for group in self.param_groups:
            if group["momentum"] == 0 and not group["maximize"] and any(p is weight for p in group["params"]):
                return SGDUpdate(float(group["lr"]), float(group["weight_decay"]))
        return None
