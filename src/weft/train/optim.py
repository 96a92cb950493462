"""The optimizer of `weft train`: AdamW that applies gradient clipping's coefficient itself
(`step(grad_scale=c)`), over float32 parameters (`ClippedAdamW`, torch's fused kernel) or over
bf16 parameters with float32 master weights (`MasterAdamW`).

bf16 parameters with float32 master weights are the storage of mixed-precision training
(Micikevicius et al., "Mixed Precision Training", sec. 3.1; Megatron-LM's
Float16OptimizerWithFloat16Params), where it changes no arithmetic.

Under bf16 autocast a float32 matmul weight is cast to bf16 in every forward, its bf16 gradient
cast to float32 in every backward, and clipping and AdamW then read and write it in float32
(for MoE models, with many parameters per active one, a large share of the step: docs/benchmarks.md,
"Hardware speed, step 5"). Here
such a weight is stored in bf16 (the values autocast would have cast it to), its float32 value
kept as a master copy, and one pass (`weft.kernels.adamw`) reads the bf16 gradient, applies the
clipping coefficient, updates master and moments and writes the new bf16 weight.

Invariant, what makes it an equivalent transform: the forward sees the same bf16 weights, the
backward computes the same bf16 gradients, the update is AdamW's in float32 on the master from
those gradients (the float32 parameter's update, to rounding). That holds for a weight whose
gradient is used as the backward wrote it. A gradient summed with another in bf16 would round
where the float32 one did not: accumulated over micro-batches, all-reduced over data-parallel
ranks, accumulated by a deferred or queued weight-gradient scheduler. `master_weights_blocker`
says which runs have none of those for any weight (one micro-batch per step, no overlap engine,
no tensor parallelism, no expert replication), `low_precision_parameters` which weights then
qualify: those consumed only through autocast's casts to bf16 (the linears of attention and
dense MLPs, the expert weight stacks) whose gradients no rank sums with another's (the linears
on one data-parallel rank; the experts of expert parallelism, each rank's own). Embeddings
(looked up in float32), the tied head, norms and routers (float32 by design) stay float32,
updated by the same optimizer.

Checkpoints hold float32 weights and AdamW's state, as without master weights (so either kind of
run loads them): `MasterWeights.full_precision()` puts the masters in the parameters for the
time a checkpoint is written or read, then refreshes the bf16 weights from them.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from weft.distributed import MoEGroups, group_size
from weft.kernels.adamw import AdamWHyper, adamw_step
from weft.models import GPT
from weft.moe import MoE
from weft.ops.wgrad import Linear


def low_precision_parameters(model: GPT, groups: MoEGroups) -> list[nn.Parameter]:
    """The weights that every forward reads only through autocast's bf16 casts and whose bf16
    gradient no step sums with another rank's: the linears of the blocks (attention, dense MLP)
    on one data-parallel rank; the experts' weight stacks where each rank holds whole experts of
    its own (`parallel="ep"`, one expert-data-parallel rank) and the division of their gradients by
    the data-parallel size (`reduce_gradients`) is exact, a power of two."""
    dp, edp = group_size(groups.dp), group_size(groups.edp)
    params: list[nn.Parameter] = []
    for block in model.blocks:
        for module in block.modules():
            if isinstance(module, Linear) and dp == 1:
                params.extend(p for p in module.parameters(recurse=False) if p.requires_grad)
        moe = block.ffn if isinstance(block.ffn, MoE) else None
        if moe is not None and moe.parallel == "ep" and moe.expert_shards == 1 and edp == 1 and dp & (dp - 1) == 0:
            params.extend(p for p in moe.experts.parameters() if p.requires_grad)
    return params


def master_weights_blocker(model: GPT, device: torch.device, grad_accum: int, overlap: str) -> str | None:
    """Why a run keeps float32 parameters (None: bf16 with masters changes no arithmetic for the
    weights `low_precision_parameters` picks)."""
    if device.type != "cuda":
        return "the CPU trains in float32 (no autocast)"
    if grad_accum > 1:
        return f"--grad-accum {grad_accum} accumulates gradients over micro-batches, in float32 only with float32 " \
               "parameters"
    if overlap != "none":
        return f"--overlap {overlap} defers weight gradients and accumulates them"
    if model.tp is not None:
        return "tensor parallelism: Domino accumulates weight gradients over its micro-batches (weft.tp keeps " \
               "float32 parameters)"
    if model.balanced:
        return "expert replication (Pro-Prophet) sums the replicas' gradients"
    return None


class MasterWeights:
    """Stores `params` in `dtype` (each parameter's `.data`), their float32 values kept as masters.

    The parameters keep their identity (optimizers, checkpoints and parameter sets by id see the
    same objects); only their storage changes. The low-precision tensors are never replaced, only
    written in place, so a CUDA graph that captured them replays on current weights."""

    def __init__(self, params: Iterable[nn.Parameter], dtype: torch.dtype = torch.bfloat16):
        self._masters: dict[int, torch.Tensor] = {}
        self._pairs: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]] = []
        for p in params:
            if p.dtype != torch.float32:
                raise TypeError(f"master weights start from float32 parameters, got {p.dtype}")
            master, low = p.data, p.data.to(dtype)
            p.data = low
            self._masters[id(p)] = master
            self._pairs.append((p, master, low))

    def __len__(self) -> int:
        return len(self._pairs)

    def master(self, p: nn.Parameter) -> torch.Tensor | None:
        """The float32 master of `p`, None for a parameter stored in float32 itself."""
        return self._masters.get(id(p))

    @contextlib.contextmanager
    def full_precision(self) -> Iterator[None]:
        """The masters in the parameters for the time of the block (to write or read checkpoints);
        afterwards the low-precision weights are the (possibly loaded) masters rounded."""
        for p, master, _ in self._pairs:
            p.data = master
        try:
            yield
        finally:
            with torch.no_grad():
                for p, master, low in self._pairs:
                    low.copy_(master)
                    p.data = low


class ClippedAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` with `step(grad_scale=c)`: the gradients multiplied by c in place (one
    multi-tensor pass) before the update."""

    @torch.no_grad()
    def step(self, closure=None, grad_scale: float = 1.0):
        if grad_scale != 1.0:
            torch._foreach_mul_([p.grad for g in self.param_groups for p in g["params"] if p.grad is not None],
                                grad_scale)
        return super().step(closure)


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's param groups: matrices (and expert weight stacks) decay, vectors (norms) do not."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class MasterAdamW(torch.optim.AdamW):
    """AdamW whose update of a parameter held by `masters` runs on its float32 master and writes the
    parameter from it; other parameters (float32) are updated in place. Same hyperparameters,
    param groups and state (`step`, `exp_avg`, `exp_avg_sq`, float32) as `torch.optim.AdamW`, so
    their state dicts load into each other. `step(grad_scale=c)` multiplies the gradients by c
    inside the update (clipping without a pass of its own)."""

    def __init__(self, params, masters: MasterWeights, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.masters = masters

    @torch.no_grad()
    def step(self, closure=None, grad_scale: float = 1.0):
        if closure is not None:
            raise ValueError("MasterAdamW.step takes no closure")
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"]:
                raise ValueError("MasterAdamW runs plain AdamW (amsgrad and maximize off)")
        for group, p in ((g, p) for g in self.param_groups for p in g["params"] if p.grad is not None):
            beta1, beta2 = group["betas"]
            master = self.masters.master(p)
            target = p.data if master is None else master
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(target, dtype=torch.float32)
                state["exp_avg_sq"] = torch.zeros_like(target, dtype=torch.float32)
            elif state["step"].device.type != "cpu":  # loaded from fused AdamW's state (a device tensor)
                state["step"] = state["step"].cpu()
            state["step"] += 1
            hyper = AdamWHyper(group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                               int(state["step"]))
            adamw_step(target, p.grad, state["exp_avg"], state["exp_avg_sq"], hyper, grad_scale,
                       copy=None if master is None else p.data)
        return None
