"""The interface of every way routed rows reach their experts and come back.

An exchange takes the rows a rank dispatches, in one of two layouts, and returns the experts'
outputs for exactly those rows, in the same order:

- `Padded(capacity)`: (E * C, dim) rows, slot c of expert e at row e * C + c (zeros where unused);
  every rank sends the same amount (Tutel's fixed-size all-to-all);
- `Grouped(counts_E, counts_WE)`: the routed rows sorted by expert, `counts_E[e]` of them for expert e
  (dropless: all-to-allv, grouped GEMM).

Every strategy computes the same function as the plain layer (same outputs and gradients); they
differ in where the work and the bytes go. The layer picks one per call (`weft.moe.exchange.select`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.distributed as dist

from weft.comm import all_to_all
from weft.comm.all_to_all import ALL_GATHER
from weft.distributed import HierarchicalGroups, group_rank, group_size
from weft.hostcopy import device_tensor
from weft.moe.exchange.replica_slots import ReplicaCall
from weft.moe.experts import Experts
from weft.profiling import stage
from weft.tune.dictionary import TuningDictionary


@dataclass(frozen=True)
class Padded:
    """Rows (E * C, dim): slot c of expert e at row e * C + c."""

    capacity: int


@dataclass(frozen=True)
class Grouped:
    """Rows sorted by expert: `counts_E[e]` rows for expert e (on the device), and `counts_WE`,
    the same counts of every rank of the exchange's group on the host (`counts_WE[r][e]`; this
    rank's row is `counts_WE[rank]`). The host matrix is what a dropless call needs the host to
    know (the all-to-allv's splits, a tuned call's bucket, Pro-Prophet's load history): it is read
    once per call (`gather_counts`), and every strategy computes from it instead of reading the
    device again."""

    counts_E: torch.Tensor
    counts_WE: tuple[tuple[int, ...], ...]
    rank: int = 0

    @property
    def mine(self) -> tuple[int, ...]:
        """This rank's rows per expert."""
        return self.counts_WE[self.rank]

    def most_slots(self) -> int:
        """The most rows any rank of the group dispatches."""
        return max(sum(row) for row in self.counts_WE)


def gather_counts(counts_E: torch.Tensor, group: dist.ProcessGroup | None) -> Grouped:
    """The layout of a dropless call: `counts_E` and every rank's counts on the host, by one
    all-gather over `group` (None or one rank: none) and one device-to-host copy, the call's one
    synchronisation."""
    world = group_size(group)
    if world == 1:
        return Grouped(counts_E, (tuple(counts_E.tolist()),))
    gathered = counts_E.new_empty(world * counts_E.numel())
    with stage("all_to_all"):
        ALL_GATHER(gathered, counts_E.contiguous(), group=group)
        counts_WE = tuple(map(tuple, gathered.view(world, -1).tolist()))
    return Grouped(counts_E, counts_WE, group_rank(group))


@dataclass(frozen=True)
class GroupedOnDevice:
    """Rows sorted by expert, as `Grouped`, with every rank's counts left on the device: `counts_WE`
    (W, E), gathered by one all-gather and never read on the host, so a CUDA graph can hold the
    call. Every rank dispatches `rows` rows (T * k, the same on every rank: the layer checks that
    the ranks route as many tokens), and a rank's experts receive at most `most_received` (W *
    min(T * k, T * El)). Only an exchange that places rows by counts on the device takes it:
    Comet's, which reads the rows from the sources' buffers by address, and the all-to-all's where
    nothing crosses a rank (one rank, or no-comm), whose grouped GEMM takes the groups' ends there."""

    counts_E: torch.Tensor
    counts_WE: torch.Tensor
    rank: int
    rows: int
    most_received: int
    replicas: ReplicaCall | None = None


def gather_counts_on_device(counts_E: torch.Tensor, group: dist.ProcessGroup | None, rows: int,
                            most_received: int, replicas: ReplicaCall | None = None) -> GroupedOnDevice:
    """Every rank's `counts_E` gathered over `group` on the device (one all-gather of W * E
    numbers; nothing read on the host). `replicas`: the call's Pro-Prophet copies (Comet's path)."""
    world = group_size(group)
    if world == 1:
        return GroupedOnDevice(counts_E, counts_E.view(1, -1), 0, rows, most_received)
    gathered = counts_E.new_empty(world, counts_E.numel())
    with stage("all_to_all"):
        ALL_GATHER(gathered.view(-1), counts_E.contiguous(), group=group)
    return GroupedOnDevice(counts_E, gathered, group_rank(group), rows, most_received, replicas)


Layout = Padded | Grouped | GroupedOnDevice


@dataclass(frozen=True)
class ExpertPlacement:
    """Where the experts live on the expert-parallel group (docs/moe.md, "Distribution").

    E = `num_experts` over W = `ep_size` ranks: `num_local` = E / W experts per rank (E >= W), or,
    with fewer experts than ranks, `expert_shards` = m = W / E ranks per expert, each holding a
    1 / m shard of its hidden dimension (Tutel fig. 7). `groups_2dh`: the group's node-level split
    for 2DH (None unless built); `slice_groups[r]`: the m / r ranks sharing one slice for r."""

    group: dist.ProcessGroup | None
    ep_size: int
    num_experts: int
    num_local: int
    expert_shards: int
    groups_2dh: HierarchicalGroups | None
    slice_groups: dict[int, dist.ProcessGroup]


@dataclass(frozen=True)
class ExchangeContext:
    """What an exchange needs for one call: the experts, their placement, whether to communicate
    at all (False: the no-communication benchmark bound, every row stays on its rank; not the
    layer's function), Lancet's weight-gradient scheduler (None: off), the group's peer
    buffers for Comet's fused kernels (`weft.comm.peers`; None: `kernels` is not "comet", or the
    ranks cannot address each other's memory) and the layer's tuning dictionary, where kernels
    keep the parameters they time (Comet's copy programs; None: defaults, nothing timed)."""

    experts: Experts
    placement: ExpertPlacement
    communicate: bool = True
    scheduler: object | None = None
    peers: object | None = None
    tuning: TuningDictionary | None = None
    expert_step: object | None = None  # a weft.BackwardSGD: fused into the weight gradients where a path can

    def all_to_all(self, x: torch.Tensor, output_splits=None, input_splits=None, algo: str = "linear"):
        """All-to-all of x over the EP group (equal splits, or the given ones); x when not communicating."""
        if not self.communicate:
            return x
        placement = self.placement
        with stage("all_to_all"):
            if output_splits is None and algo == "2dh":
                return all_to_all(x, placement.group, algo="2dh", groups_2dh=placement.groups_2dh)
            return all_to_all(x, placement.group, output_splits, input_splits, scheduler=self.scheduler)

    def expert_counts(self, layout: Grouped) -> tuple[torch.Tensor, list, list]:
        """The dropless exchange's counts, from the layout's host matrix (nothing read from the
        device): the rows this rank receives per (source, local expert) as a flat device tensor,
        and both directions as nested lists, `sent[r][i]` rows to rank r's local expert i and
        `received[s][i]` rows from rank s for local expert i. Not communicating, every row stays:
        a rank receives what it sends."""
        local = self.placement.num_local
        mine = layout.mine
        sent = [list(mine[r * local:(r + 1) * local]) for r in range(self.placement.ep_size)]
        if not self.communicate:
            return layout.counts_E, sent, [list(row) for row in sent]
        cut = slice(layout.rank * local, (layout.rank + 1) * local)
        received = [list(row[cut]) for row in layout.counts_WE]
        recv_counts = device_tensor([n for row in received for n in row], layout.counts_E.device,
                                    layout.counts_E.dtype)
        return recv_counts, sent, received


@dataclass(frozen=True)
class Staging:
    """Where an exchange wants the rows it is given (`rows_ND`) and their gradient (`grads_ND`):
    tensors of the dispatched rows' shape and dtype that the dispatch writes its rows into and the
    combine's backward its gradient, so the exchange need not copy them there (Comet's peer
    buffers). Either may be None: anywhere.

    `transient_out`: where the rows it was given are in `rows_ND`, the exchange returns its
    outputs in a buffer that its next call overwrites, before this call's backward (it copies
    nothing out); the combine then keeps its own copy of the rows its backward reads, made as its
    forward reads them (`weft.moe.dispatch.combine_rows`'s `keep_rows`)."""

    rows_ND: torch.Tensor | None
    grads_ND: torch.Tensor | None
    transient_out: bool = False


class Exchange(ABC):
    """Rows of one layout -> their experts' outputs, same rows, same order. Subclasses implement
    the layouts they support; `select` never hands them another."""

    def __init__(self, ctx: ExchangeContext):
        self.ctx = ctx

    def staging(self, layout: Layout, num_rows: int, like: torch.Tensor) -> Staging | None:
        """Where this exchange wants `num_rows` rows of `like`'s width, dtype and device (and their
        gradient), if anywhere (`Staging`); None, as here: anywhere. Writing there is an option,
        not a contract: the exchange takes rows wherever they are."""
        return None

    def __call__(self, rows: torch.Tensor, layout: Layout) -> torch.Tensor:
        if isinstance(layout, Padded):
            return self.padded(rows, layout.capacity)
        if isinstance(layout, GroupedOnDevice):
            return self.grouped_on_device(rows, layout)
        return self.grouped(rows, layout)

    def grouped_on_device(self, rows_ND: torch.Tensor, layout: GroupedOnDevice) -> torch.Tensor:
        """Rows sorted by expert with the counts on the device only; most exchanges need them on
        the host (the all-to-allv's splits)."""
        raise ValueError(f"{type(self).__name__} needs the dropless counts on the host; only Comet's exchange "
                         "places rows by counts left on the device")

    @abstractmethod
    def padded(self, rows_RD: torch.Tensor, capacity: int) -> torch.Tensor:
        """(E * C, dim) rows in the padded layout -> expert outputs in the same layout."""

    @abstractmethod
    def grouped(self, rows_ND: torch.Tensor, layout: Grouped) -> torch.Tensor:
        """Rows sorted by expert (`layout.counts_E` per expert) -> their expert outputs."""
