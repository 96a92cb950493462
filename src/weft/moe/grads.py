"""Gradient reduction of expert-parallel training (docs/moe.md, "Gradients").

The MoE layer reduces nothing itself: after `backward`, a rank's router (and every other
replicated parameter) holds its own tokens' gradient, and an expert's owner holds the gradient of
every EP rank's tokens routed to it. `reduce_gradients` turns both into the gradient of the mean
loss over all data-parallel ranks: replicated parameters are summed over every rank, expert
parameters over their expert-data-parallel replicas, and both are divided by the world size.

Under tensor parallelism (weft.tp) each rank of a TP group routes its own share of the group's
tokens: its routers' gradients are the share's, so they are first summed over the TP group; the
data-parallel size is then the number of TP groups, and an expert's gradient, summed over every
rank's share by the all-to-all backward, already counts each group's tokens once.

`OverlappedReduce` (`overlapped_reduce`) runs that reduction during backward, bucket by bucket,
as PyTorch's DistributedDataParallel does; `reduce_gradients(..., reduced=it)` then takes its
results instead of reducing those gradients itself.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from weft.distributed import MoEGroups, group_size, host_group, own_group
from weft.moe.experts import Experts
from weft.moe.layer import MoE


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters that are sharded over the EP group (the weights of every `weft` expert block)."""
    params: list[nn.Parameter] = []
    for module in model.modules():
        if isinstance(module, Experts):
            params.extend(module.parameters())
    return params


def token_split_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of MoE layers that are not experts (routers): under tensor parallelism each
    rank's gradient of them is its share of the tokens'."""
    experts = {id(p) for p in expert_parameters(model)}
    return [p for m in model.modules() if isinstance(m, MoE) for p in m.parameters() if id(p) not in experts]


# dtypes whose NCCL all-reduce takes PREMUL_SUM's factor as torch passes it (bf16's factor reached
# NCCL as zeros in torch builds of 2026, pytorch/pytorch#190745)
PREMUL_DTYPES = (torch.float32, torch.float64)


def mean_reduction(group: dist.ProcessGroup | None, divisor: int, device: torch.device,
                   dtype: torch.dtype = torch.float32) -> tuple[dist.ReduceOp, int]:
    """The all-reduce op over `group` for a sum divided by `divisor` of `dtype` values on
    `device`, and the divisor left for the caller to divide the result by (1: nothing left). On
    GPUs with NCCL, float32 and float64 values are multiplied by 1 / divisor inside NCCL's
    all-reduce kernel (PREMUL_SUM): no pass over the result after it (gpt2-s-moe's 963M float32
    gradients: 1.9 ms a step on an H200, docs/benchmarks.md, forty-seventh session). With a power
    of two the same values as the sum divided after it (the products are exact, subnormals
    aside); otherwise float rounding apart. Elsewhere (gloo, other dtypes) the sum, then the
    caller's division."""
    backend = str(dist.get_backend(group))
    nccl = backend == "nccl" or "cuda:nccl" in backend
    if divisor > 1 and device.type == "cuda" and dtype in PREMUL_DTYPES and nccl:
        return dist._make_nccl_premul_sum(1.0 / divisor), 1
    return dist.ReduceOp.SUM, divisor


def _all_reduce_mean(grads: list[torch.Tensor], group: dist.ProcessGroup | None, divisor: int) -> None:
    """Sum `grads` over `group` in one flat bucket per dtype, divided by `divisor`
    (`mean_reduction`; a group of one rank: divided in place, without the bucket's copies)."""
    if group_size(group) == 1:
        torch._foreach_div_(grads, divisor)
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for bucket in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in bucket])
        op, left = mean_reduction(group, divisor, flat.device, flat.dtype)
        dist.all_reduce(flat, op=op, group=group)
        if left != 1:
            flat.div_(left)
        parts = flat.split([g.numel() for g in bucket])
        torch._foreach_copy_(bucket, [part.view_as(g) for part, g in zip(parts, bucket)])


def _may_have_grad(p: nn.Parameter) -> bool:
    """Whether `reduce_gradients` considers `p`: it requires a gradient, or has one."""
    return p.requires_grad or p.grad is not None


def _agreed_gradients(params: list[nn.Parameter], group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """The gradients of `params` to sum over `group`, for the same parameters on every rank: each
    parameter with a gradient on any of the group's ranks, in `params`' order, a zero one made
    where a rank has none (so its `.grad` ends as the mean, as every rank's does); those without
    one anywhere stay None. The hosts agree with one small all-reduce (`host_group`: CPU tensors,
    no device wait). Each rank leaving out only its own missing gradients made the ranks' flat
    buckets differ: the all-reduce hung, or summed one parameter's values with another's. (A step
    replayed as a CUDA graph that owns its gradients drops a `.grad` made here before its next
    replay, as an eager step starts from None: `weft.graphs.GraphedStep`.)"""
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
    if params and group_size(group) > 1:
        dist.all_reduce(present, op=dist.ReduceOp.MAX, group=host_group(group))
    agreed = [p for p, anywhere in zip(params, present.tolist()) if anywhere]
    for p in agreed:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in agreed]


def reduce_gradients(model: nn.Module, groups: MoEGroups, reduced: OverlappedReduce | None = None) -> None:
    """Make every gradient the gradient of the mean loss over all data-parallel ranks.

    Call after `backward` and before the optimizer step. Expert gradients (already summed over
    the EP group by the all-to-all backward) are summed over expert-data-parallel replicas;
    all other gradients over every rank; both are divided by the data-parallel world size. A
    parameter with a gradient on some of a group's ranks only (a branch some ranks skip) counts as
    zeros on the others, whose `.grad` then holds the mean too; one with no gradient on any rank
    keeps None (the hosts agree on which, `_agreed_gradients`).
    With tensor parallelism the routers' gradients are summed over the TP group first.
    `reduced`: an `OverlappedReduce` (`overlapped_reduce`) that summed some of these gradients
    during the backward (its `finish()` called): theirs are its results, the same sums; the
    others are reduced here.
    """
    if groups.tp_size > 1:
        routers = _agreed_gradients([p for p in token_split_parameters(model) if _may_have_grad(p)], groups.tp)
        if routers:
            _all_reduce_mean(routers, groups.tp, 1)
    world = group_size(groups.dp)
    if world == 1:
        return
    experts = {id(p) for p in expert_parameters(model)}
    expert_params, dense_params = [], []
    for p in model.parameters():
        if not _may_have_grad(p) or (reduced is not None and reduced.covers(p)):
            continue
        (expert_params if id(p) in experts else dense_params).append(p)
    expert_grads = _agreed_gradients(expert_params, groups.edp)
    dense_grads = _agreed_gradients(dense_params, groups.dp)
    if expert_grads:
        _all_reduce_mean(expert_grads, groups.edp, world)
    if dense_grads:
        _all_reduce_mean(dense_grads, groups.dp, world)
    if reduced is not None:
        reduced.write_back()


def overlapped_reduce(model: nn.Module, groups: MoEGroups, experts: bool = True, bucket_mb: float = 25.0,
                      earlier: Mapping[int, torch.Tensor] | None = None,
                      adopt: Callable[[nn.Parameter, torch.Tensor], bool] | None = None) -> OverlappedReduce:
    """`reduce_gradients`' sums as an `OverlappedReduce`: the replicated parameters over every
    data-parallel rank and, with `experts` and expert-data-parallel replicas (`edp_size` > 1),
    the expert parameters over their replicas; divided by the data-parallel size (`earlier`,
    `adopt`: `OverlappedReduce`'s). Not under
    tensor parallelism, whose routers' gradients are summed over the TP group first. Collective:
    every rank calls it, in the same order."""
    if groups.tp_size > 1:
        raise ValueError("overlapped_reduce: under tensor parallelism the routers' gradients are summed over the "
                         "TP group first; use reduce_gradients")
    expert_ids = {id(p) for p in expert_parameters(model)}
    parts = [([p for p in model.parameters() if id(p) not in expert_ids], groups.dp)]
    if experts and groups.edp_size > 1:
        parts.append(([p for p in model.parameters() if id(p) in expert_ids], groups.edp))
    return OverlappedReduce([(params, group) for params, group in parts if params], group_size(groups.dp), bucket_mb,
                            earlier, adopt)


class OverlappedReduce:
    """Sums over process groups of some parameters' gradients (`reduce_gradients`' sums:
    `overlapped_reduce` builds it), launched during backward: the overlap of PyTorch's
    DistributedDataParallel (Li et al., "PyTorch Distributed", VLDB 2020, sec. 3.2.3: gradient
    bucketing, overlap with backward through autograd hooks, buckets rebuilt in the order the
    first iteration produced the gradients, launched in bucket order).

    `parts`: (parameters, group) pairs, each part's gradients summed over its group; no
    parameter in two parts. Each part's parameters go in buckets of about `bucket_mb` MB of
    float32, in the order the first armed backward finished their gradients
    (`register_post_accumulate_grad_hook`; Lancet's dW scheduler fires those hooks itself when it
    writes a gradient late), the order of the group's first rank (exchanged, so every rank's
    buckets hold the same parameters); the parameters any rank finished more than once in that
    backward go last, in buckets sent only at `finish()`.

    From the second armed backward on, a bucket is complete once autograd has accumulated all its
    gradients; the part's buckets are then sent in bucket order, each as soon as it and those
    before it are complete: its gradients copied in (as float32, one multi-tensor copy) and
    all-reduced asynchronously over a communicator of the part's own (`own_group`: the MoE
    layers' all-to-alls do not queue behind it, nor it behind them; every rank launches a
    communicator's buckets in the same order). `finish()` after the backward launches the
    buckets still missing a gradient (a parameter without one this backward counts as zeros; where
    another rank had one, `write_back` gives it the mean, as `reduce_gradients` does),
    waits for every bucket; the sums come divided by `divisor` (the data-parallel size; NCCL's
    all-reduce multiplies by 1 / divisor before it sums, gloo's result is divided after it:
    `mean_reduction`); `write_back()` then copies the results into the gradients, where
    `reduce_gradients` reads them.

    Invariant: the sums of `reduce_gradients` - each gradient in float32 (a bf16 one copied
    exactly, as `weft.train.optim.MasterWeights` stages it), summed over the ranks and divided,
    with the same op.
    On 2 ranks bitwise equal; on more, the collective's order of summation may follow the
    buckets (float32 rounding). A gradient finished again after its bucket was sent (a weight
    whose Lancet items drain twice in a backward; the dW scheduler's plans, timed on each rank,
    may differ between ranks) makes every rank send that bucket again at `finish()`: the hosts
    agree on those buckets with one small all-reduce (gloo), so the ranks' collectives pair up.

    Only an armed backward (`armed()`: the training micro-step's) moves anything; other
    backwards (timing, profiling) leave the buckets alone. A CUDA graph that captures an armed
    backward and its `finish()` keeps the copies, launches, waits and divisions, so each replay
    reduces; the first armed backward (which builds the buckets and talks to the other ranks on
    the host) must run before any capture. Several micro-batches per optimizer step: each armed
    backward would send a partial sum, so arm only the last one's and give the sums of the ones
    before it as `earlier` (DDP's `no_sync` for the others: Li et al. sec. 3.2.4).

    `earlier`: float32 tensors by parameter id (e.g. `weft.train.optim.MasterWeights`
    accumulators), each the sum of that parameter's gradients over the step's micro-batches
    before the armed one. A bucket adds them to those gradients (in float32) when it is sent, so
    the armed backward sends the step's whole sum: the value the accumulator holds after the last
    micro-batch (float32 addition commutes: bitwise the same). A CUDA graph keeps the tensors, so
    they stay in place and hold zeros where nothing was summed yet. A parameter not in `earlier`
    accumulates its micro-batches in its own `.grad`.

    `adopt(p, slot)`: called whenever the buckets are built, for each parameter with its slot
    (float32, its shape); True where the caller now keeps that parameter's float32 gradient there
    (`MasterWeights.adopt`: the staged weight's accumulator, its value copied in). Such a
    gradient is the bucket itself: no second float32 copy of it, and `write_back` has nothing to
    copy (it skips a `.grad` that is its slot). With one micro-batch per step the bucket copies
    the gradient into the slot when it is sent. With `earlier` too (several micro-batches), the
    adopted slot already holds the earlier micro-batches' sum and the bucket adds the last one's
    gradient into it (the same float32 additions as `earlier`'s, in the other order: bitwise the
    same); the reducer then drops its reference to the old accumulator. Such a slot cannot be
    sent again (its sum is spent), so a gradient that changes after its bucket left (Lancet's dW
    scheduler, whose plans may differ between ranks) is an error there: build such a reducer
    without `adopt`."""

    def __init__(self, parts: list[tuple[list[nn.Parameter], dist.ProcessGroup | None]], divisor: int,
                 bucket_mb: float = 25.0, earlier: Mapping[int, torch.Tensor] | None = None,
                 adopt: Callable[[nn.Parameter, torch.Tensor], bool] | None = None):
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        trained = [([p for p in params if p.requires_grad], group) for params, group in parts]
        trained = [(params, group) for params, group in trained if params]
        if not trained:
            raise ValueError("OverlappedReduce needs parameters that require gradients")
        owner = [id(p) for params, _ in trained for p in params]
        if len(owner) != len(set(owner)):
            raise ValueError("OverlappedReduce: a parameter is in two parts")
        self.adopt = adopt
        self.several = earlier is not None  # several micro-batches a step: adopted slots accumulate
        earlier = dict(earlier or {})
        for p in (p for params, _ in trained for p in params if id(p) in earlier):
            if earlier[id(p)].shape != p.shape or earlier[id(p)].dtype != torch.float32:
                raise ValueError(f"OverlappedReduce: an earlier sum ({tuple(earlier[id(p)].shape)}, "
                                 f"{earlier[id(p)].dtype}) for a parameter of shape {tuple(p.shape)}: float32 of "
                                 "its shape expected")
        self._parts = [_Part(params, group, earlier, divisor) for params, group in trained]
        self.bucket_numel = max(1, int(bucket_mb * 2**20) // 4)
        self._armed = False
        self._built = False
        self._part_of = {id(p): part for part in self._parts for p in part.params}
        for part in self._parts:
            for p in part.params:
                p.register_post_accumulate_grad_hook(self._finished)
            # NCCL sets a communicator up at its first collective, which must not be inside a graph capture
            dist.all_reduce(torch.zeros(1, device=part.params[0].device), group=part.group)

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for part in self._parts for p in part.params]

    def covers(self, p: nn.Parameter) -> bool:
        """Whether `p`'s gradient is one this object sums."""
        return id(p) in self._part_of

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """The backward run inside sends its gradients as they finish; call `finish()` after it."""
        self._armed = True
        try:
            yield
        finally:
            self._armed = False

    def _finished(self, p: nn.Parameter) -> None:
        """Autograd's hook: `p.grad` holds this backward's gradient."""
        if self._armed:
            self._part_of[id(p)].finished(p, self._built)

    def finish(self) -> None:
        """After the armed backward: every bucket sent (the first time, all of them now), waited
        for and divided by `divisor`."""
        if not self._built:
            for part in self._parts:
                part.build(self.bucket_numel)
                if self.adopt is not None:  # before any bucket is sent
                    for bucket in part.buckets:
                        for i, (p, slot) in enumerate(zip(bucket.params, bucket.slots)):
                            if self.adopt(p, slot.view_as(p)) and self.several:
                                bucket.accumulate(i)
                                part.earlier.pop(id(p), None)  # the slot holds it now
            self._built = True
        for part in self._parts:
            part.launch_rest()
        for part in self._parts:
            part.wait_and_divide()

    def forget(self) -> None:
        """Drop the buckets: the next armed backward records the order again (e.g. once the
        step's form is chosen, before its CUDA graph is captured, so the buckets follow the form
        that runs, not the last one timed). Between backwards only (after `finish()`); collective
        in effect: every rank calls it at the same point."""
        for part in self._parts:
            part.forget()
        self._built = False

    def write_back(self) -> None:
        """The reduced gradients into the parameters' current `.grad` (a None one stays None unless
        another rank had a gradient for it at `finish`; then it gets the mean too)."""
        for part in self._parts:
            for bucket in part.buckets:
                bucket.write_back()


class _Part:
    """One process group's parameters, in buckets launched in order (`OverlappedReduce`)."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup | None,
                 earlier: Mapping[int, torch.Tensor], divisor: int):
        self.params = params
        self.earlier = {id(p): earlier[id(p)] for p in params if id(p) in earlier}
        self.group = own_group(group)
        # the sum's op, and what is left to divide after it (`mean_reduction`)
        self.op, self.left = mean_reduction(self.group, divisor, params[0].device)  # the buckets: float32
        # the hosts agree there on the buckets to send again (`launch_rest`)
        self.host = own_group(group, backend="gloo") if group_size(self.group) > 1 else None
        self.forget()

    def forget(self) -> None:
        self.order: list[nn.Parameter] = []  # the first armed backward's order of finished gradients
        self.buckets: list[_Bucket] = []
        self.where: dict[int, tuple[_Bucket, int]] = {}
        self.next = 0  # the first bucket not launched yet

    def finished(self, p: nn.Parameter, built: bool) -> None:
        if not built:
            self.order.append(p)
            return
        bucket, i = self.where[id(p)]
        bucket.take(i)
        while self.next < len(self.buckets) and self.buckets[self.next].early and self.buckets[self.next].complete():
            self.buckets[self.next].launch(self.group, self.op)
            self.next += 1

    def build(self, bucket_numel: int) -> None:
        """Buckets in the order the first armed backward finished the gradients on the group's
        first rank, then those it did not finish; the parameters any rank finished more than once
        last, in buckets sent only at `finish` (sent early, such a bucket would be sent again at
        every `finish`). One exchange of the ranks' orders on the host."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("OverlappedReduce: the first armed backward builds the buckets and must not be captured")
        index = {id(p): i for i, p in enumerate(self.params)}
        counts = Counter(index[id(p)] for p in self.order)
        mine = ([i for i in counts if counts[i] == 1], sorted(i for i in counts if counts[i] > 1))
        every = [mine]
        if group_size(self.group) > 1:
            every = [None] * group_size(self.group)
            dist.all_gather_object(every, mine, group=self.group)
        late = set().union(*(twice for _, twice in every))
        first = [i for i in every[0][0] if i not in late]
        placed = set(first) | late
        unfinished = [i for i in reversed(range(len(self.params))) if i not in placed]
        self.buckets = (self._chunk(first + unfinished, bucket_numel, early=True)
                        + self._chunk(sorted(late), bucket_numel, early=False))
        self.where = {id(p): (bucket, i) for bucket in self.buckets for i, p in enumerate(bucket.params)}
        self.order = []

    def _chunk(self, order: list[int], bucket_numel: int, early: bool) -> list[_Bucket]:
        buckets, chunk, numel = [], [], 0
        for i in order:
            chunk.append(self.params[i])
            numel += self.params[i].numel()
            if numel >= bucket_numel:
                buckets.append(_Bucket(chunk, early, self.earlier))
                chunk, numel = [], 0
        return buckets + ([_Bucket(chunk, early, self.earlier)] if chunk else [])

    def launch_rest(self) -> None:
        """Every bucket complete (missing gradients as zeros) and sent once, in bucket order; then
        every bucket whose gradient changed after it was sent, on any rank, sent again by every
        rank, in bucket order, so that the ranks' collectives pair up. The ranks agree on those
        with one small all-reduce between the hosts (a graph capture records its outcome)."""
        for bucket in self.buckets:
            bucket.take_missing()
        for bucket in self.buckets:
            if bucket.work is None:
                bucket.launch(self.group, self.op)
        stale, present = self._anywhere()
        for bucket, again, anywhere in zip(self.buckets, stale, present):
            bucket.present = anywhere
            if again and bucket.accumulating:
                raise RuntimeError("OverlappedReduce: a gradient changed after its bucket was sent, and the bucket's "
                                   "slots accumulate the step's micro-batches (adopt with earlier), so its sum cannot "
                                   "be sent again: build the reducer without adopt")
            if again:
                bucket.wait()
                bucket.launch(self.group, self.op)
        self.next = 0

    def _anywhere(self) -> tuple[list[bool], list[list[bool]]]:
        """Which buckets are stale on any rank, and which of each bucket's parameters have a
        gradient on any rank (one all-reduce between the hosts)."""
        local = [bucket.stale for bucket in self.buckets]
        local += [p.grad is not None for bucket in self.buckets for p in bucket.params]
        flags = torch.tensor(local, dtype=torch.int32)
        if self.host is not None:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.host)
        values = [bool(f) for f in flags.tolist()]
        stale, at = values[:len(self.buckets)], len(self.buckets)
        present = []
        for bucket in self.buckets:
            present.append(values[at:at + len(bucket.params)])
            at += len(bucket.params)
        return stale, present

    def wait_and_divide(self) -> None:
        for bucket in self.buckets:
            bucket.wait()
            if self.left != 1:
                bucket.flat.div_(self.left)
            bucket.reset()


class _Bucket:
    """Some parameters' gradients side by side in one float32 buffer, sent as one all-reduce.
    The gradients are copied in when the bucket is sent (added, into slots that accumulate the
    step's micro-batches: `accumulate`), with one multi-tensor copy (a copy per
    parameter as each finished cost 3.6x more on gpt2-s-moe's replicated gradients:
    docs/benchmarks.md, forty-fifth session)."""

    def __init__(self, params: list[nn.Parameter], early: bool = True,
                 earlier: Mapping[int, torch.Tensor] | None = None):
        self.params = params
        self.early = early  # sent as soon as complete (else only at `finish`)
        sizes = [p.numel() for p in params]
        self.flat = torch.zeros(sum(sizes), dtype=torch.float32, device=params[0].device)
        self.slots = list(self.flat.split(sizes))
        earlier = earlier or {}
        # (slot, the earlier micro-batches' sum) pairs, added when sent (`OverlappedReduce`)
        self.earlier = [(slot, earlier[id(p)].reshape(-1)) for slot, p in zip(self.slots, params) if id(p) in earlier]
        self.accumulating: set[int] = set()  # slots that hold the earlier sum and add the gradient
        self.taken = [False] * len(params)
        self.missing = len(params)
        self.work = None
        self.stale = False  # a gradient changed after the launch: send again
        # which parameters had a gradient on some rank at the last `finish` (kept: a CUDA graph that
        # captured `finish` replays its sums, not its host exchange, and `write_back` runs after each)
        self.present = [False] * len(params)

    def take(self, i: int) -> None:
        """Parameter i's gradient is final (for now: it may finish again)."""
        self.stale = self.stale or self.work is not None
        self.missing -= not self.taken[i]
        self.taken[i] = True

    def complete(self) -> bool:
        return self.missing == 0

    def take_missing(self) -> None:
        """At `finish`: every gradient final (a missing one counts as zeros)."""
        self.taken = [True] * len(self.params)
        self.missing = 0

    def accumulate(self, i: int) -> None:
        """Slot i is now where the earlier micro-batches' sum is kept (adopted): the bucket adds
        the gradient into it instead of copying it and adding the earlier sum."""
        self.accumulating.add(i)
        self.earlier = [(slot, sum_) for slot, sum_ in self.earlier if slot is not self.slots[i]]

    def launch(self, group: dist.ProcessGroup | None, op: dist.ReduceOp) -> None:
        """The gradients into the buffer (float32; zeros for a parameter without one; added into
        an accumulating slot), then its all-reduce (`op`), asynchronously."""
        copies, adds, empty = [], [], []
        for i, (slot, p) in enumerate(zip(self.slots, self.params)):
            if p.grad is not None:
                (adds if i in self.accumulating else copies).append((slot, p.grad.reshape(-1)))
            elif i not in self.accumulating:
                empty.append(slot)
        _foreach_pairs(torch._foreach_copy_, copies)
        _foreach_pairs(torch._foreach_add_, adds)
        if empty:
            torch._foreach_zero_(empty)
        _foreach_pairs(torch._foreach_add_, self.earlier)
        self.work = dist.all_reduce(self.flat, op=op, group=group, async_op=True)

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()

    def reset(self) -> None:
        self.taken = [False] * len(self.params)
        self.missing = len(self.params)
        self.work, self.stale = None, False

    def write_back(self) -> None:
        # a parameter without a gradient here but with one on another rank takes the sum too (its
        # slot summed zeros from this rank), as `reduce_gradients` makes it; an adopted slot is
        # the .grad itself: nothing to copy
        for p, anywhere in zip(self.params, self.present):
            if p.grad is None and anywhere:
                p.grad = torch.empty_like(p)
        _foreach_pairs(torch._foreach_copy_, [(p.grad, slot.view_as(p.grad)) for p, slot in zip(self.params, self.slots)
                                              if p.grad is not None and p.grad.data_ptr() != slot.data_ptr()])


def _foreach_pairs(op: Callable[[list[torch.Tensor], list[torch.Tensor]], None],
                   pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """`op(firsts, seconds)` (a `torch._foreach_*_` op, in place on the firsts) over (first, second)
    pairs, one multi-tensor launch; nothing for no pairs."""
    if pairs:
        op(*map(list, zip(*pairs)))
