"""Pro-Prophet's lightweight expert placement (sec. IV-A, fig. 6), dropless: for one call, the
weights of a few heavy experts are copied to chosen ranks of the expert-parallel group (Trans),
each of those ranks computes its own rows for those experts locally, and only the other rows
travel in the all-to-alls. The copies' weight gradients are summed back into the owners' (Agg)
by the backward of the same transfer, so the layer's outputs and gradients are those of plain
expert parallelism, and no parameter or optimizer state moves between calls.

A `Transfer` moves one call's copies, launched when it is built and waited for when the copies
are first used, so it can start a layer early (Alg. 2, `weft.models.gpt.run_units`). Where every
copied expert goes to every rank but its owner (the paper's n = 1) and every rank owns as many of
them, it is one all-gather of each rank's (S, P) stack of flattened weights (P: one expert's w1,
w2, w3), whose backward, a reduce-scatter, is Agg; where the ranks own different numbers of them
(one hot expert: one owner), each owner broadcasts its stack and in backward receives the sum of
its copies' gradients (a reduce), so that only the owners' bytes move (an all-gather would carry
the other ranks' zero padding both ways). Otherwise (n > 1: each copy to the W - n ranks sending
its expert the most rows) the owners send each copy to its ranks point to point, and in backward
each of those ranks sends its copy's gradient back, summed by the owner.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from weft.comm.async_gather import PendingGather
from weft.comm.split import SplitCollective, start, wait
from weft.distributed import global_rank, group_rank
from weft.hostcopy import device_tensor
from weft.moe.exchange.all_to_all import AllToAll
from weft.moe.exchange.base import Exchange, ExchangeContext, ExpertPlacement, Grouped
from weft.moe.experts import Experts
from weft.profiling import stage

# The profiler stages of Trans and Agg: `weft bench` tells their kernels from the layer's other
# collectives (the counts' all-gather, the all-to-alls) by the op that launched them.
TRANS_STAGE, AGG_STAGE = "trans", "agg"


class _Works:
    """Point-to-point works waited together, then `after()` (e.g. summing received gradients)."""

    def __init__(self, works: list, after=None):
        self.works, self.after = works, after

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        if self.after is not None:
            self.after()


@dataclass
class _PendingCopies(SplitCollective):
    """The owners' copies sent point to point: forward, row `row` of this rank's (owned, P) stack to
    each group rank in `sends` [(row, dst)], the received copies into row `slot` of the output from
    `recvs` [(slot, src)], and the owned ones kept in place (`keeps` [(row, slot)]), in one order
    on every rank (copied experts ascending, then destination); backward, the reverse, each owner
    summing the gradients it receives into its own rows'."""

    group: dist.ProcessGroup | None
    sends: list[tuple[int, int]]
    recvs: list[tuple[int, int]]
    keeps: list[tuple[int, int]]
    slots: int

    def _exchange(self, outgoing: list[tuple[torch.Tensor, int]], incoming: list[tuple[torch.Tensor, int]], after=None):
        ops = [dist.P2POp(dist.isend, t, global_rank(self.group, peer), self.group) for t, peer in outgoing]
        ops += [dist.P2POp(dist.irecv, t, global_rank(self.group, peer), self.group) for t, peer in incoming]
        return _Works(dist.batch_isend_irecv(ops) if ops else [], after)

    def launch(self, stack: torch.Tensor):
        out = stack.new_empty(self.slots, stack.shape[1])
        for row, slot in self.keeps:
            out[slot].copy_(stack[row])
        return out, self._exchange([(stack[row], dst) for row, dst in self.sends],
                                   [(out[slot], src) for slot, src in self.recvs])

    def launch_backward(self, grad: torch.Tensor):
        grad_stack = grad.new_zeros(len(self.keeps), grad.shape[1])
        for row, slot in self.keeps:
            grad_stack[row].copy_(grad[slot])
        received = grad.new_empty(len(self.sends), grad.shape[1])
        rows = device_tensor([row for row, _ in self.sends], grad.device)
        return grad_stack, self._exchange([(grad[slot], src) for slot, src in self.recvs],
                                          [(received[i], dst) for i, (_, dst) in enumerate(self.sends)],
                                          after=lambda: grad_stack.index_add_(0, rows, received))


@dataclass
class _BroadcastCopies(SplitCollective):
    """Every copy to every rank but its owner, the ranks owning different numbers of them: forward,
    each owner broadcasts its (owned, P) stack into its rows of the (copied, P) output, `spans`
    [(owner's global rank, begin, end)] in owner order on every rank (experts in id order, which is
    their owners' order), this rank's own stack at `mine` (begin, end); backward, each owner's rows
    of the gradient summed over the ranks into that owner (a reduce), which are its stack's
    gradient."""

    group: dist.ProcessGroup | None
    spans: list[tuple[int, int, int]]
    mine: tuple[int, int]
    rows: int

    def launch(self, stack: torch.Tensor):
        out = stack.new_empty(self.rows, stack.shape[1])
        begin, end = self.mine
        out[begin:end].copy_(stack)
        return out, _Works([dist.broadcast(out[b:e], src, group=self.group, async_op=True)
                            for src, b, e in self.spans])

    def launch_backward(self, grad: torch.Tensor):
        # in place: each owner's rows of `grad` become their sum there (the other ranks' are not read after)
        works = [dist.reduce(grad[b:e], dst, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                 for dst, b, e in self.spans]
        begin, end = self.mine
        return grad[begin:end], _Works(works)


@dataclass
class _Staged(SplitCollective):
    """`inner`'s collectives launched inside the profiler stages of Trans (forward) and Agg
    (backward); the same collectives otherwise."""

    inner: SplitCollective

    def launch(self, stack: torch.Tensor):
        with stage(TRANS_STAGE):
            return self.inner.launch(stack)

    def launch_backward(self, grad: torch.Tensor):
        with stage(AGG_STAGE):
            return self.inner.launch_backward(grad)


class _CopiedRows(torch.autograd.Function):
    """The (S, P) stack of this rank's copied experts' flattened weights (rows `rows` of each weight,
    in `dtype`, side by side), whose gradient (Agg's sum of the copies' gradients) is added
    straight into those rows of the weights' `.grad`.

    Through autograd's edge to the weights, the gradient of `w.index_select(0, rows)` is a tensor
    of the whole weight's size (zeros with the rows added), which autograd then adds to the
    experts' own weight gradient: four passes over every local expert weight (zeros written, two
    read and the sum written) on every rank, whatever few experts were copied (docs/balance.md).
    Here backward returns no gradient to the weights and adds the copied rows into `w.grad`
    itself, in place, at the end of the backward pass (autograd's final callback: after the
    experts' own weight gradients are accumulated). Invariant: when backward has finished, every
    weight's `.grad` is the plain layer's (Agg included); a gradient read through
    `torch.autograd.grad` or a post-accumulate-grad hook misses the copies' share. The rows added
    are those of copied experts, which the owner computes from its copy too, so the experts' own
    weight gradient is zero there: the add is exact, in a bf16 `.grad` (bf16 weights with float32
    masters, `weft.train.optim`) as in a float32 one."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, dtype: torch.dtype | None, *weights: torch.Tensor) -> torch.Tensor:
        ctx.rows, ctx.weights = rows, weights
        return torch.cat([w.index_select(0, rows).flatten(1).to(dtype or w.dtype) for w in weights], dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        parts, begin = [], 0
        for w in ctx.weights:
            size = math.prod(w.shape[1:])
            parts.append(grad[:, begin:begin + size].reshape(-1, *w.shape[1:]).to(w.dtype))
            begin += size
        rows, weights = ctx.rows, ctx.weights

        def add_rows() -> None:
            for w, part in zip(weights, parts):
                if w.grad is None:  # the weight got no other gradient in this backward
                    w.grad = torch.zeros_like(w, memory_format=torch.contiguous_format)
                w.grad.index_add_(0, rows, part)

        # At the end of this backward, after autograd has accumulated the experts' own weight
        # gradients (in whatever order it ran the nodes), so the add is in place into them.
        torch.autograd.Variable._execution_engine.queue_callback(add_rows)
        return (None, None) + (None,) * len(ctx.weights)


class Transfer:
    """Trans of one call's copies: `copies` maps each copied expert (global id, the same on every
    rank) to the group ranks that get a copy (never its owner). Their (w1, w2, w3) go from the
    owners over `group` (a group over the expert-parallel ranks in their order, e.g. its
    `side_group`), launched when built, in `dtype` (the experts' compute dtype: bf16 under
    autocast halves the bytes). `copies()` waits and returns the copies this rank holds (of the
    experts in `here`, in that order), differentiable: their gradients are summed into the
    owners' weights (Agg), launched when the copies' gradients are complete and waited for where
    the transfer was built. An owner computes its own rows of its copied experts from its "copy"
    too (its own weights, moved nowhere), so that every rank taking part in the transfer uses it
    and so joins its backward."""

    def __init__(self, experts: Experts, placement: ExpertPlacement, copies: Mapping[int, Collection[int]],
                 group: dist.ProcessGroup | None, dtype: torch.dtype | None = None):
        self.holders = {e: frozenset(devices) for e, devices in sorted(copies.items()) if devices}
        self.copied = tuple(self.holders)
        self.here: tuple[int, ...] = ()
        self._owner: dict[int, int] = {}
        self._copies: tuple | None = None
        if not self.copied:
            return
        ep_size, local = placement.ep_size, placement.num_local
        if not all(0 <= e < placement.num_experts for e in self.copied):
            raise ValueError(f"copied experts must be ids in [0, {placement.num_experts}), got {self.copied}")
        if placement.expert_shards > 1:
            raise ValueError("replicated experts need whole experts on each rank (E >= W)")
        owner = self._owner = {e: e // local for e in self.copied}
        for e, devices in self.holders.items():
            if owner[e] in devices or not all(0 <= d < ep_size for d in devices):
                raise ValueError(f"expert {e}: copies must go to ranks in [0, {ep_size}) other than its owner "
                                 f"{owner[e]}, got {sorted(devices)}")
        rank = group_rank(placement.group)
        self.here = tuple(sorted(self.computed_at(rank)))
        weights = experts.weights()
        present = [w for w in weights if w is not None]
        owned = [e for e in self.copied if owner[e] == rank]
        mine = device_tensor([e - rank * local for e in owned], present[0].device)
        stack = _CopiedRows.apply(mine, dtype, *present)
        self._shapes = [None if w is None else tuple(w.shape[1:]) for w in weights]
        if all(devices == set(range(ep_size)) - {owner[e]} for e, devices in self.holders.items()):
            # every rank but the owner holds a copy, so `here` is every copied expert, in id order
            owned_R = [sum(owner[e] == r for e in self.copied) for r in range(ep_size)]
            if len(set(owned_R)) == 1:  # as many on every rank: one all-gather (rows in owner order: id order)
                self._pending = _Staged(PendingGather(group))
            else:
                ends = list(itertools.accumulate(owned_R))
                spans = [(global_rank(group, r), ends[r] - n, ends[r]) for r, n in enumerate(owned_R) if n]
                self._pending = _Staged(_BroadcastCopies(group, spans, (ends[rank] - len(owned), ends[rank]),
                                                         len(self.copied)))
        else:
            sends = [(owned.index(e), d) for e in owned for d in sorted(self.holders[e])]
            recvs = [(slot, owner[e]) for slot, e in enumerate(self.here) if owner[e] != rank]
            keeps = [(owned.index(e), slot) for slot, e in enumerate(self.here) if owner[e] == rank]
            self._pending = _Staged(_PendingCopies(group, sends, recvs, keeps, len(self.here)))
        self._out = start(stack, self._pending)

    def computed_at(self, rank: int) -> frozenset[int]:
        """The copied experts whose rows group rank `rank` computes itself (that rank's `here`):
        those it holds a copy of or owns."""
        return frozenset(e for e in self.copied if rank in self.holders[e] or self._owner[e] == rank)

    @classmethod
    def none(cls) -> Transfer:
        """A transfer of no expert: the call it is given to runs unbalanced."""
        return cls(None, None, {}, None)  # type: ignore[arg-type]

    def copies(self) -> tuple:
        """The (w1, w2, w3) of the copies this rank holds, stacked in `here` order (waits for the
        transfer at the first call; later calls return the same tensors)."""
        if not self.here:
            raise ValueError("this rank holds no copy in this transfer")
        if self._copies is None:
            gathered = wait(self._out, self._pending)
            parts, begin = [], 0
            for shape in self._shapes:
                if shape is None:
                    parts.append(None)
                    continue
                size = math.prod(shape)
                parts.append(gathered[:, begin:begin + size].reshape(-1, *shape))
                begin += size
            self._copies = tuple(parts)
        return self._copies


class ReplicatedExperts(Exchange):
    """Dropless expert parallelism with the copied experts computed where a copy is (the
    transfer's `here`: this rank's own rows of them), the other rows sent to their owners (E >= W,
    unsharded experts)."""

    def __init__(self, ctx: ExchangeContext, transfer: Transfer):
        super().__init__(ctx)
        if not transfer.copied:
            raise ValueError("replicated experts need at least one copied expert")
        self.transfer = transfer
        self.copied = transfer.copied

    def padded(self, rows_RD: torch.Tensor, capacity: int) -> torch.Tensor:
        raise ValueError("replicated experts balance dropless layers only: a padded layout already computes "
                         "every expert's full capacity")

    def grouped(self, rows_ND: torch.Tensor, layout: Grouped) -> torch.Tensor:
        """Rows arrive grouped by expert in id order (`layout.counts_E[e]` rows each): the copied
        experts' rows are contiguous runs, cut out with one split and joined back with one cat
        (both differentiable as a whole), by the layout's host counts. The all-to-all carries the
        rest: every rank's counts without the experts that rank computes itself, which every rank
        knows from the transfer, so nothing more is read from the device."""
        ctx = self.ctx
        computed_at = [self.transfer.computed_at(r) for r in range(len(layout.counts_WE))]
        travelling = tuple(tuple(0 if e in at else n for e, n in enumerate(row))
                           for row, at in zip(layout.counts_WE, computed_at))
        here = list(self.transfer.here)
        if not here:  # no copy on this rank (and none of its experts copied): all its rows travel
            return AllToAll(ctx).grouped(rows_ND, Grouped(layout.counts_E, travelling, layout.rank))
        local = set(here)
        counts = layout.mine
        runs: list[tuple[bool, int]] = []  # (computed here?, rows) of consecutive experts
        for e, count in enumerate(counts):
            if runs and runs[-1][0] == (e in local):
                runs[-1] = (runs[-1][0], runs[-1][1] + count)
            else:
                runs.append((e in local, count))
        pieces = rows_ND.split([size for _, size in runs])
        sent = [p for p, (mine, _) in zip(pieces, runs) if not mine]  # none where every expert is here
        kept = [p for p, (mine, _) in zip(pieces, runs) if mine]
        sent_counts_E = device_tensor(travelling[layout.rank], layout.counts_E.device, layout.counts_E.dtype)
        sent_out = AllToAll(ctx).grouped(torch.cat(sent) if sent else rows_ND[:0],
                                         Grouped(sent_counts_E, travelling, layout.rank))
        local_out = ctx.experts.forward_grouped(torch.cat(kept), [counts[e] for e in here], self.transfer.copies())
        sent_parts = iter(sent_out.split([len(p) for p in sent]))
        local_parts = iter(local_out.to(sent_out.dtype).split([len(p) for p in kept]))
        return torch.cat([next(local_parts) if mine else next(sent_parts) for mine, _ in runs])
