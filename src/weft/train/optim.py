"""The optimizer of `weft train`: AdamW that applies gradient clipping's coefficient itself
(`step(grad_scale=c, skip=s)`, both device tensors where the step runs on a GPU, so nothing waits
for the norm they come from), over float32 parameters (`ClippedAdamW`, torch's fused kernel) or
over bf16 parameters with float32 master weights (`MasterAdamW`).

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
backward computes the same bf16 gradients, and every sum of gradients and the update run in
float32 as they did: AdamW's update on the master (the float32 parameter's, to rounding). A weight
whose gradient nothing sums (one micro-batch per step, its gradient on no other rank) is `direct`:
the optimizer reads its bf16 gradient as the backward wrote it. Otherwise it is `staged`: after
each micro-step its bf16 gradient goes into a float32 accumulator (what autograd's accumulation
into a float32 `.grad` did), and the reduction over ranks, the norm and the update see that
accumulator. Which weights qualify (`low_precision_parameters`): those consumed only through
autocast's casts to bf16 (the linears of attention and dense MLPs, the expert weight stacks) and
whose gradients the backward itself does not sum across ranks (so not experts whose weights are
gathered from other ranks). Embeddings (looked up in float32), the tied head, norms and routers
(float32 by design) stay float32, updated by the same optimizer. `master_weights_blocker` names
the runs that keep float32 parameters throughout (CPU, Lancet's partitioned forward, tensor
parallelism); Lancet's dW schedule alone (a graphed step) keeps master weights. So does expert
replication (Pro-Prophet): Agg adds the sum of a copied expert's gradients (reduced over the
ranks in the compute dtype, as with float32 weights) into rows of the owner's gradient that
nothing else wrote, since the owner computes its own rows of that expert from the copy too
(`weft.moe.exchange.replicated`): zeros plus a bf16 value, exact in bf16 as in float32. Tutel's
pipelining of padded layers keeps master weights: its weight gradients are one batched matmul
over every chunk's rows, as without chunks; a dropless layer's chunks each give a weight
gradient, which float32 parameters sum in float32.

Checkpoints hold float32 weights and AdamW's state, as without master weights (so either kind of
run loads them): `MasterWeights.full_precision()` puts the masters in the parameters for the
time a checkpoint is written or read, then refreshes the bf16 weights from them.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from weft.distributed import MoEGroups, group_size
from weft.kernels.adamw import AdamWHyper, AdamWUpdate, adamw_steps
from weft.models import GPT
from weft.moe import MoE
from weft.ops.wgrad import Linear


@dataclass(frozen=True)
class MasterPlan:
    """Which weights go to bf16: `direct` ones whose bf16 gradient the optimizer reads as the
    backward wrote it, `staged` ones whose bf16 gradient is moved into a float32 accumulator
    after every micro-step, before anything sums it (micro-batches, ranks)."""

    direct: list[nn.Parameter]
    staged: list[nn.Parameter]

    def __len__(self) -> int:
        return len(self.direct) + len(self.staged)


def low_precision_parameters(model: GPT, groups: MoEGroups, grad_accum: int = 1) -> MasterPlan:
    """The weights that every forward reads only through autocast's bf16 casts and whose
    gradients nothing inside the backward sums: the linears of the blocks (attention, dense MLP)
    and the experts' weight stacks where each rank holds whole experts of its own
    (`parallel="ep"`; weights gathered across ranks would have their gradients reduce-scattered
    in bf16 by the backward itself). Direct where no step sums a gradient afterwards either: one
    micro-batch per step, and the linears on one data-parallel rank, the experts on one
    expert-data-parallel rank with an exact division by the data-parallel size (a power of two,
    `reduce_gradients`); staged otherwise."""
    dp, edp = group_size(groups.dp), group_size(groups.edp)
    direct: list[nn.Parameter] = []
    staged: list[nn.Parameter] = []
    for block in model.blocks:
        for module in block.modules():
            if isinstance(module, Linear):
                weights = [p for p in module.parameters(recurse=False) if p.requires_grad]
                (direct if dp == 1 and grad_accum == 1 else staged).extend(weights)
        moe = block.ffn if isinstance(block.ffn, MoE) else None
        if moe is not None and moe.parallel == "ep" and moe.expert_shards == 1:
            weights = [p for p in moe.experts.parameters() if p.requires_grad]
            unsummed = edp == 1 and dp & (dp - 1) == 0 and grad_accum == 1
            (direct if unsummed else staged).extend(weights)
    return MasterPlan(direct, staged)


def master_weights_blocker(model: GPT, device: torch.device, overlap: str, lancet_partitions: bool = True
                           ) -> str | None:
    """Why a run keeps float32 parameters (None: bf16 with masters changes no arithmetic for the
    weights `low_precision_parameters` picks). `lancet_partitions`: whether `--overlap lancet`
    plans its partitioned forward (`weft.train.step.lancet_partitions_forward`), whose ranges call
    a weight once per partition, its gradient summed over them; its dW schedule alone writes each
    weight's gradient once per micro-step, computed in bf16 as autograd's is (`weft.ops.wgrad`)."""
    if device.type != "cuda":
        return "the CPU trains in float32 (no autocast)"
    if overlap == "lancet" and lancet_partitions:
        return "--overlap lancet's partitioned forward sums each weight's gradient over its partitions"
    if overlap == "tutel" and any(moe.capacity_factor is None for moe in model.moe_layers()):
        return "--overlap tutel sums a dropless layer's weight gradients over its chunks"
    if model.tp is not None:
        return "tensor parallelism: Domino accumulates weight gradients over its micro-batches (weft.tp keeps " \
               "float32 parameters)"
    return None


@dataclass
class _Master:
    param: nn.Parameter
    master: torch.Tensor  # float32
    low: torch.Tensor  # bf16, the parameter's data outside `full_precision` / `float32_gradients`
    accumulator: torch.Tensor | None  # float32, staged weights only
    filled: bool = False  # the accumulator holds this step's gradient (staged weights)


class MasterWeights:
    """Stores the plan's weights in `dtype` (each parameter's `.data`), their float32 values kept
    as masters; staged weights also get a float32 gradient accumulator.

    The parameters keep their identity (optimizers, checkpoints and parameter sets by id see the
    same objects); only their storage changes. The low-precision tensors are never replaced, only
    written in place, so a CUDA graph that captured them replays on current weights.

    A step with staged weights: `stage_gradients()` after every micro-step (the bf16 gradients
    added into the accumulators, then zeroed in place: the next backward, eager or graphed,
    accumulates onto zero, which is exact), then `float32_gradients()` around everything that
    reads gradients (reduction over ranks, the norm, the optimizer): inside it a staged weight's
    `.data` is its master and its `.grad` its accumulator, as if it were a float32 parameter."""

    def __init__(self, plan: MasterPlan, dtype: torch.dtype = torch.bfloat16):
        self._entries: dict[int, _Master] = {}
        for p, staged in [*((p, False) for p in plan.direct), *((p, True) for p in plan.staged)]:
            if p.dtype != torch.float32:
                raise TypeError(f"master weights start from float32 parameters, got {p.dtype}")
            master, low = p.data, p.data.to(dtype)
            p.data = low
            self._entries[id(p)] = _Master(p, master, low, torch.zeros_like(master) if staged else None)
        self._staged = [e for e in self._entries.values() if e.accumulator is not None]

    def __len__(self) -> int:
        return len(self._entries)

    def master(self, p: nn.Parameter) -> torch.Tensor | None:
        """The float32 master of `p`, None for a parameter stored in float32 itself."""
        entry = self._entries.get(id(p))
        return None if entry is None else entry.master

    def low(self, p: nn.Parameter) -> torch.Tensor:
        """The low-precision storage of a parameter this object holds."""
        return self._entries[id(p)].low

    @torch.no_grad()
    def stage_gradients(self, summed: Callable[[nn.Parameter], bool] | None = None) -> None:
        """After a micro-step: each staged weight's bf16 gradient into its float32 accumulator
        (copied the first time in the step, added after), then zeroed in place. `summed`: the
        weights whose step's sum the micro-step's backward already sent (the last micro-batch's,
        `weft.moe.grads.OverlappedReduce.covers`): their buckets hold this accumulator's value
        (float32: the earlier sums plus this gradient; the bucket slot is the accumulator where
        it adopted it, else `write_back` copies it there), so they are only marked as holding a
        gradient where they have one; their
        bf16 gradients are left as they are (between steps `MicroSteps.clear_grads` clears them,
        or a graph that owns them overwrites them)."""
        staged = self._staged
        if summed is not None:
            sent = {id(e) for e in staged if summed(e.param)}
            for e in staged:
                e.filled = e.filled or (id(e) in sent and e.param.grad is not None)
            staged = [e for e in staged if id(e) not in sent]
        with_grad = [e for e in staged if e.param.grad is not None]
        for fill in (True, False):
            entries = [e for e in with_grad if e.filled != fill]
            if not entries:
                continue
            grads, accumulators = [e.param.grad for e in entries], [e.accumulator for e in entries]
            (torch._foreach_copy_ if fill else torch._foreach_add_)(accumulators, grads)
            torch._foreach_zero_(grads)
            for e in entries:
                e.filled = True

    def adopt(self, p: nn.Parameter, tensor: torch.Tensor) -> bool:
        """From now on keep staged weight `p`'s float32 gradient accumulator in `tensor` (float32,
        `p`'s shape; e.g. its slot in `weft.moe.grads.OverlappedReduce`'s buckets, which then sum
        the accumulator itself: no second float32 copy of the gradients, no copy back). The old
        accumulator's value is copied in (mid-step, it holds the earlier micro-batches' sum), and
        the old tensor is no longer referenced here. False where `p` is not a staged weight
        (nothing changes)."""
        e = self._entries.get(id(p))
        if e is None or e.accumulator is None:
            return False
        if tensor.shape != p.shape or tensor.dtype != torch.float32:
            raise ValueError(f"MasterWeights.adopt: a {tuple(tensor.shape)} {tensor.dtype} accumulator for a weight "
                             f"of shape {tuple(p.shape)}: float32 of its shape expected")
        with torch.no_grad():
            tensor.copy_(e.accumulator)
        e.accumulator = tensor
        return True

    def accumulators(self) -> dict[int, torch.Tensor]:
        """The staged weights' float32 gradient accumulators by parameter id: during a step, the
        sums of the micro-batches staged so far (`weft.moe.grads.OverlappedReduce`'s `earlier`
        adds them to the last micro-batch's gradients; `zero_unfilled` first)."""
        return {id(e.param): e.accumulator for e in self._staged}

    @torch.no_grad()
    def zero_unfilled(self) -> None:
        """Zero the accumulators no micro-step of this step has written yet (they still hold an
        earlier step's sum: `stage_gradients` copies into them the first time), so that every
        accumulator holds this step's sum so far. They stay unfilled: a weight with no gradient in
        any micro-batch still has none in `float32_gradients`. A graphed step fills them all."""
        unfilled = [e.accumulator for e in self._staged if not e.filled]
        if unfilled:
            torch._foreach_zero_(unfilled)

    @contextlib.contextmanager
    def float32_gradients(self) -> Iterator[None]:
        """Staged weights as float32 parameters (master data, accumulated gradient: None if no
        micro-step gave one) for the time of the block; afterwards their bf16 storage and gradient
        tensors are back, and the next `stage_gradients` starts a new step."""
        if not self._staged:
            yield
            return
        kept = [(e, e.param.grad) for e in self._staged]
        for e, _ in kept:
            e.param.data = e.master
            e.param.grad = e.accumulator if e.filled else None
        try:
            yield
        finally:
            for e, grad in kept:
                e.param.grad = None
                e.param.data = e.low
                e.param.grad = grad
                e.filled = False

    @contextlib.contextmanager
    def full_precision(self) -> Iterator[None]:
        """The masters in the parameters for the time of the block (to write or read checkpoints);
        afterwards the low-precision weights are the (possibly loaded) masters rounded."""
        for e in self._entries.values():
            e.param.data = e.master
        try:
            yield
        finally:
            with torch.no_grad():
                for e in self._entries.values():
                    e.low.copy_(e.master)
                    e.param.data = e.low


class ClippedAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` with `step(grad_scale=c, skip=s)`: the update of the gradients times c,
    none where s. c and s may be device tensors (clipping's coefficient and "the norm is not
    finite", computed on the GPU): the fused implementation takes both into its kernel, as it
    takes GradScaler's (its `grad_scale` divides, so it gets 1 / c; its `found_inf` skips the
    update and the step count), and the host never waits for them. The multi-tensor and
    per-tensor implementations scale in one pass first and read `skip` on the host."""

    @torch.no_grad()
    def step(self, closure=None, grad_scale: float | torch.Tensor = 1.0, skip: torch.Tensor | None = None):
        if closure is not None:
            raise ValueError("ClippedAdamW.step takes no closure")
        unscaled = isinstance(grad_scale, float) and grad_scale == 1.0
        if all(group["fused"] for group in self.param_groups):
            # torch reads these two as attributes (GradScaler's protocol), hence set for the call only
            device = self.param_groups[0]["params"][0].device
            self.grad_scale = None if unscaled else \
                torch.as_tensor(grad_scale, dtype=torch.float32, device=device).reciprocal()
            self.found_inf = None if skip is None else skip.float()
            try:
                return super().step()
            finally:
                del self.grad_scale, self.found_inf
        if skip is not None and bool(skip):
            return None
        if not unscaled:
            torch._foreach_mul_([p.grad for g in self.param_groups for p in g["params"] if p.grad is not None],
                                grad_scale)
        return super().step()

    def skipped(self) -> None:
        """The last step's `skip` was true: nothing to undo (the fused kernel kept the step counts,
        the others did not step)."""


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's param groups: matrices (and expert weight stacks) decay, vectors (norms) do not."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class MasterAdamW(torch.optim.AdamW):
    """AdamW whose update of a parameter held by `masters` runs on its float32 master and writes the
    parameter from it; other parameters (float32) are updated in place. Same hyperparameters,
    param groups and state (`step`, `exp_avg`, `exp_avg_sq`, float32) as `torch.optim.AdamW`, so
    their state dicts load into each other. `step(grad_scale=c, skip=s)` multiplies the gradients
    by c inside the update (clipping without a pass of its own) and writes nothing where s; both
    may be device tensors the kernel reads (no host synchronisation). The step counts, which the
    bias corrections need at launch, advance on the host: `skipped()` takes them back."""

    def __init__(self, params, masters: MasterWeights, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.masters = masters
        self._stepped: list[torch.Tensor] = []  # the step counts the last step advanced (`skipped`)

    @torch.no_grad()
    def step(self, closure=None, grad_scale: float | torch.Tensor = 1.0, skip: torch.Tensor | None = None):
        if closure is not None:
            raise ValueError("MasterAdamW.step takes no closure")
        self._stepped = []
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"]:
                raise ValueError("MasterAdamW runs plain AdamW (amsgrad and maximize off)")
        updates = []
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
            self._stepped.append(state["step"])
            hyper = AdamWHyper(group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                               int(state["step"]))
            updates.append(AdamWUpdate(target, p.grad, state["exp_avg"], state["exp_avg_sq"], hyper,
                                       None if master is None else self.masters.low(p)))
        adamw_steps(updates, grad_scale, skip)  # one launch per kind of tensor, not one per tensor
        return None

    def skipped(self) -> None:
        """The last step's `skip` was true (the kernels wrote nothing): its step counts go back."""
        for count in self._stepped:
            count.sub_(1)
        self._stepped = []
