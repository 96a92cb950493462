"""Pro-Prophet's copies (sec. IV-A, fig. 6) on Comet's dropless path, where nothing is read on the
host and a CUDA graph holds the call.

Every rank has R = rounds * (W - 1) replica slots per layer: Alg. 1 comes to each owner at most
`rounds` times (the paper: once), so a rank holds at most that many copies from each other rank.
The placement is a small tensor on the device, `expert_WR[h, j]` (the expert in rank h's slot j,
or -1), the same on every rank, written from the host's plan before the call. A call with
copies:

- Trans: each owner copies its copied experts' weights into a box of its own peer memory
  (`weft.kernels.replica.stage_copies`), and after a barrier each holder reads its slots' experts
  from their owners' boxes by the copy engine, then a second barrier;
- Comet's map leaves out each holder's own rows of the experts it holds (`RowMap.on_device`'s
  `served_WE`): the owner neither pulls them nor pushes their outputs back;
- a holder computes those rows itself, with the copies (`slot_experts`: the experts' grouped
  GEMMs and activation, through autograd, over the rows gathered from its own dispatched rows),
  between Comet's layer0 and layer1, where a cold
  rank otherwise waits for the hot one at layer1's barrier, and in backward between layer1's and
  layer0's, for the same reason (autograd runs ready nodes latest-created first); their outputs
  and input gradients are written into Comet's at those rows (in place, the slots' rows only). A
  rank whose slots hold nothing (the host knows the placement) runs none of this;
- Agg: at the end of the backward pass (autograd's final callback, queued on every rank by the
  output's backward, after the owners' own weight gradients are accumulated) each holder writes
  its slots' gradients into their owners' boxes by the copy engine (Trans is done with them),
  sent as soon as the backward pass has made them, under the rest of it; after a barrier each
  owner adds its box into its weights' `.grad` (`add_grads`), then a second barrier.

The holders move the bytes across the link and the owners touch only their own memory: an owner
is the hot rank that the copies are made to relieve, a holder the cold one that would otherwise
wait for it. The link's bytes go by the copy engine, which takes no SMs from the GEMMs they fly
beside (Triton programs that moved them did, and lost: docs/balance.md). The copies' addresses
come from the host's view of the placement, so a CUDA graph replays the placement it was captured
with (as its shape already does).

A call shaped for any placement (`ReplicaCall.on_device`: a capture of a layer built with
`graph_placement="updated"`) instead runs the slot path on every rank (empty groups where a
rank's slots hold nothing) and moves the link's bytes by the kernels that read the placement on
the device (`pull_copies`, `push_grads`); placements are then written in place (`in_place`) into
the one tensor its graph reads, after each replay.

Same function as the plain layer: outputs, every gradient (the copies' shares summed into the
owner's, in another order: equal to rounding) and the routed counts. No parameter or optimizer
state is added, so checkpoints are plain ones. Invariant (as Comet's buffers need): a layer's
calls run one after another on one stream, each call's backward (if any) before the layer's
next call.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

import torch

from weft.comm.peers import PeerBuffer, PeerBuffers
from weft.hostcopy import device_tensor
from weft.kernels.grouped_mm import grouped_rows_mm
from weft.kernels.replica import (
    activate_rows,
    add_grads,
    copy_entries,
    holder_entries,
    pull_copies,
    push_grads,
    read_rows,
    slot_rows,
    stage_copies,
    write_rows,
)
from weft.kernels.rows import triton_usable

# The peers' barrier channel of Trans, on its side stream beside Comet's barriers (channel 0) and
# the TP copy all-reduce's (1)
TRANS_CHANNEL = 2


@dataclass(frozen=True)
class SlotRows:
    """This rank's dispatched rows that its slots compute, on the device, in fixed sizes (a graph
    holds them). `idx_M` (int64, M): slot row m is dispatched row idx_M[m], slot j's rows ending
    at `ends_R[j]` (int32, the grouped GEMM's offsets); `used_M`: m is one of them (the rest are
    padding, row 0). `write_M`: where slot row m's values go among the dispatched rows: idx_M[m],
    or for padding a row no slot computes, which gets its own value back (duplicates of equal
    values: deterministic)."""

    idx_M: torch.Tensor
    ends_R: torch.Tensor
    used_M: torch.Tensor
    write_M: torch.Tensor


class ReplicaSlots:
    """One balanced layer's replica slots on its expert-parallel group: the placement on the
    device (and its host view), the slots' weights and the owners' boxes in peer buffers (named by
    `key`, one set per layer), and Trans and Agg."""

    def __init__(self, peers: PeerBuffers, key: str, num_experts: int, device: torch.device, rounds: int = 1):
        self.peers, self.key = peers, key
        self.world, self.rank = peers.world, peers.rank
        self.per_rank = rounds * max(1, self.world - 1)
        self.num_experts, self.num_local = num_experts, num_experts // self.world
        self.expert_WR = torch.full((self.world, self.per_rank), -1, dtype=torch.int64, device=device)
        self._placed: tuple[tuple[int, ...], ...] = ((),) * self.world
        self._side: torch.cuda.Stream | None = None  # Trans's stream (CUDA), made at the first one
        self._reads: tuple[tuple[int, int, int], ...] = ()  # this rank's (slot, owner, entry in the owner's box)

    @property
    def copied(self) -> list[int]:
        """The experts some slot holds (host view of the placement)."""
        return sorted({e for held in self._placed for e in held})

    def place(self, copies: Mapping[int, Collection[int]], in_place: bool = False) -> None:
        """Hold `copies` (expert -> the ranks that get a copy) from the next call on: each rank's
        copies in its slots by expert id, written to the device without a host wait. Each placement
        is a new device tensor, so that a CUDA graph captured earlier keeps replaying the placement
        it was captured with, to which its work is shaped (a rank whose slots held nothing captured
        no slot rows); `in_place`: written into the one tensor every call and graph reads (a graph
        whose work is shaped for any placement follows it). Not while a graph is captured."""
        held: list[list[int]] = [[] for _ in range(self.world)]
        for e in sorted(copies):
            owner = e // self.num_local
            for h in sorted(copies[e]):
                if h == owner or not 0 <= h < self.world:
                    raise ValueError(f"expert {e} (owned by rank {owner}) copied to rank {h}")
                held[h].append(e)
        if any(len(h) > self.per_rank for h in held):
            raise ValueError(f"more copies on one rank than its {self.per_rank} replica slots: {held}")
        sent = [sum(e // self.num_local == o for h in held for e in h) for o in range(self.world)]
        if max(sent) > self.per_rank:
            raise ValueError(f"more copies of one rank's experts ({sent}) than the {self.per_rank} entries of its box")
        placed = tuple(tuple(h) for h in held)
        if placed == self._placed:
            return
        if self.expert_WR.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a replica placement cannot change while a CUDA graph is captured")
        values = [e for h in held for e in h + [-1] * (self.per_rank - len(h))]
        self._reads = tuple(holder_entries(torch.tensor(values).view(self.world, self.per_rank), self.rank,
                                           self.num_local))
        written = device_tensor(values, self.expert_WR.device).view(self.world, self.per_rank)
        if in_place:
            self.expert_WR.copy_(written)
        else:
            self.expert_WR = written
        self._placed = placed

    def served_WE(self) -> torch.Tensor:
        """(W, E) bool: rank w computes its own rows of expert e (a slot of w holds e)."""
        experts = torch.arange(self.num_experts, device=self.expert_WR.device)
        return (self.expert_WR[:, :, None] == experts).any(1)

    @property
    def holds_here(self) -> bool:
        """Whether a slot of this rank holds a copy (host view of the placement): only then does it
        compute slot rows."""
        return bool(self._placed[self.rank])

    def slot_rows(self, counts_WE: torch.Tensor, bound: int) -> SlotRows:
        """Where this rank's slot rows are among its dispatched rows (sorted by expert, its row of
        `counts_WE`), at most `bound` of them (R * T for T tokens: a token picks an expert once),
        on the device, no host read (`weft.kernels.replica.slot_rows`)."""
        return SlotRows(*slot_rows(counts_WE[self.rank], self.expert_WR[self.rank], bound))

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> PeerBuffer:
        return self.peers.get(f"replica.{self.key}.{name}", (self.per_rank, *shape), dtype)

    def make_buffers(self, weights: tuple[torch.Tensor | None, ...], dtype: torch.dtype
                     ) -> list[tuple[PeerBuffer, PeerBuffer] | None]:
        """Each weight's (box, slots) peer buffers in `dtype`, made at the first call (collective,
        on every rank; not while a CUDA graph is captured, so a call that captures needs an
        earlier eager one)."""
        return [None if w is None else (self._buffer(f"b{i}", tuple(w.shape[1:]), dtype),
                                        self._buffer(f"w{i}", tuple(w.shape[1:]), dtype))
                for i, w in enumerate(weights)]

    def start_transfer(self, weights: tuple[torch.Tensor | None, ...], dtype: torch.dtype,
                       on_device: bool = False) -> PendingTransfer:
        """Trans: the slots' weights (R, K, N) in `dtype` on this rank. Each owner stages its
        copied experts of each weight (El, K, N) in its box, a barrier, each holder copies its
        slots' from the boxes (the copy engine), a barrier (the boxes are made here, on every rank:
        making a peer buffer is collective). The first barrier keeps the reads after the owners'
        staging, the second keeps this call's Agg, which reuses the boxes for gradients, and the
        next call's staging after these reads; a holder's slots are written after its own earlier
        reads of them (the last call's backward), being later on its stream.

        On CUDA it runs on a side stream of its own (its barriers on `TRANS_CHANNEL`), forked from
        the current stream now, so that it flies under the work launched until `wait()` joins it
        (the call's routing, dispatch and Comet's layer0; Alg. 2's Trans under the work before
        the copies are used); elsewhere at once. `on_device`: the holders' copies by the link
        kernel (`pull_copies`), which reads the placement on the device, instead of by the copy
        engine at addresses the host's view fixes (a graph that follows the placement)."""
        moves, held = [], []
        for w, buffers in zip(weights, self.make_buffers(weights, dtype)):
            if w is None:
                held.append(None)
                continue
            box, slots = buffers
            moves.append((w.detach(), w.detach().to(dtype), box, slots))  # cast here, on the current stream
            held.append(slots.local)
        streams = self._fork_side()
        with torch.cuda.stream(streams[1]) if streams is not None else contextlib.nullcontext():
            for weight, src, box, _ in moves:
                if streams is not None and src is not weight:
                    src.record_stream(streams[1])  # the cast: its memory not reused before the side stream is done
                stage_copies(src, box.local, self.expert_WR, self.rank)
            self.peers.barrier(TRANS_CHANNEL)
            for _, _, box, slots in moves:
                if on_device:
                    pull_copies(slots.local, box.table, box.peers, self.expert_WR, self.rank, self.num_local)
                else:  # the copy engine, across the link
                    copy_entries(slots.local, box.peers, self._reads, pull=True)
            self.peers.barrier(TRANS_CHANNEL)
        return PendingTransfer(tuple(held), streams)

    def _fork_side(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream] | None:
        """(the current stream, the side stream of Trans and the holders' Agg sends, made to wait
        for it), on CUDA; None elsewhere."""
        if not self.expert_WR.is_cuda:
            return None
        current = torch.cuda.current_stream(self.expert_WR.device)
        if self._side is None:
            self._side = torch.cuda.Stream(self.expert_WR.device)
        self._side.wait_stream(current)
        return current, self._side

    def send_grads_when_ready(self, params: tuple[torch.Tensor | None, ...], dtype: torch.dtype,
                              slot_weights: tuple[torch.Tensor | None, ...], on_device: bool = False) -> GradSends:
        """Agg, a holder's part, as early as it can run: as soon as the backward pass has
        accumulated a slot weight's gradient (the `.grad` of `slot_weights[i]`, the leaf its slot
        experts ran on; between Comet's layer1 and layer0 backward), its slots' gradients go to
        their owners' boxes, placed by this forward's placement, by the copy engine (or with
        `on_device` the link kernel `push_grads`), on the side stream on CUDA, so that they fly
        under the rest of the backward pass (Alg. 2's Agg under the backward computation). The
        final callback (`queue_aggregate`) joins them."""
        reads, expert_WR = self._reads, self.expert_WR

        def send(grads: torch.Tensor, box: PeerBuffer) -> None:
            if on_device:
                push_grads(grads, box.table, box.peers, expert_WR, self.rank, self.num_local)
            else:  # the copy engine, across the link
                copy_entries(grads, box.peers, reads, pull=False)

        sends = GradSends(send)
        for i, (param, held) in enumerate(zip(params, slot_weights)):
            if held is None or param is None or not param.requires_grad:
                continue
            box = self._buffer(f"b{i}", tuple(param.shape[1:]), dtype)

            def push(leaf: torch.Tensor, i: int = i, box: PeerBuffer = box) -> None:
                streams = self._fork_side()
                with torch.cuda.stream(streams[1]) if streams is not None else contextlib.nullcontext():
                    if streams is not None:
                        leaf.grad.record_stream(streams[1])  # not reused before the side stream is done
                    send(leaf.grad, box)
                sends.sent[i] = box
                sends.streams = streams or sends.streams

            held.register_post_accumulate_grad_hook(push)
            sends.expected[i] = box
        return sends

    def queue_aggregate(self, params: tuple[torch.Tensor | None, ...], dtype: torch.dtype,
                        expert_WR: torch.Tensor, sends: GradSends | None = None) -> None:
        """Agg at the end of this backward pass (autograd's final callback, after the owners' own
        weight gradients and the slots' are accumulated): a holder's slot gradients, sent early
        (`sends`, joined here; a slot weight no gradient reached sends zeros now), then a barrier,
        then each owner adds its box's gradients of its experts (placed by `expert_WR`, the
        forward's placement) into its `params[i].grad`, and a barrier (every rank queues it: they
        are collective). The boxes are Trans's, free again once the holders have read their
        weights; the second barrier keeps the next call's staging after these reads."""
        boxes = [(p, self._buffer(f"b{i}", tuple(p.shape[1:]), dtype)) for i, p in enumerate(params)
                 if p is not None and p.requires_grad]

        def add_copies() -> None:
            if sends is not None:
                sends.finish()
            self.peers.barrier()
            for param, box in boxes:
                if param.grad is None:  # the weight got no other gradient in this backward
                    param.grad = torch.zeros_like(param, memory_format=torch.contiguous_format)
                add_grads(param.grad, box.local, expert_WR, self.rank)
            self.peers.barrier()

        torch.autograd.Variable._execution_engine.queue_callback(add_copies)


@dataclass
class GradSends:
    """A holder's Agg sends of one backward pass: how a weight's slot gradients are sent (`send`),
    the boxes each slot weight's gradients go to (`expected`, by weight), those already sent
    (`sent`), and the streams to join."""

    send: Callable[[torch.Tensor, PeerBuffer], None]
    expected: dict[int, PeerBuffer] = field(default_factory=dict)
    sent: dict[int, PeerBuffer] = field(default_factory=dict)
    streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None

    def finish(self) -> None:
        """Send zeros for each weight whose slots got no gradient, then join the sends."""
        for i, box in self.expected.items():
            if i not in self.sent:
                self.send(torch.zeros_like(box.local), box)
        if self.streams is not None:
            current, side = self.streams
            current.wait_stream(side)


@dataclass
class PendingTransfer:
    """A Trans in flight: `wait()` joins its side stream into the stream it was forked from (once;
    every Trans must be joined, also by a rank that uses no copy, or a CUDA graph's capture fails)
    and returns the slots' weights."""

    held: tuple[torch.Tensor | None, ...]
    streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None

    def wait(self) -> tuple[torch.Tensor | None, ...]:
        if self.streams is not None:
            current, side = self.streams
            current.wait_stream(side)
            self.streams = None
        return self.held


class _Fork(torch.autograd.Function):
    """The dispatched rows (N, D) for Comet (the same tensor: Comet finds them in its buffer) and
    the slot rows gathered from them; backward, Comet's gradient (a tensor of its own, stale at the
    served rows, which its map skips) with the served rows' taken from the slots, in place."""

    @staticmethod
    def forward(ctx, rows_ND, rows: SlotRows):
        ctx.rows, ctx.rows_shape = rows, rows_ND.shape
        return rows_ND.view_as(rows_ND), _read_rows(rows_ND, rows)

    @staticmethod
    def backward(ctx, grad_ND, grad_MD):
        rows = ctx.rows
        if grad_MD is None:
            return grad_ND, None
        if grad_ND is None:
            grad_ND = grad_MD.new_zeros(ctx.rows_shape)
        elif grad_ND.stride(-1) != 1:  # written in place by rows (an expanded gradient has stride 0)
            grad_ND = grad_ND.contiguous()
        return _write_rows(grad_ND, grad_MD, rows), None


def _read_rows(from_ND: torch.Tensor, rows: SlotRows) -> torch.Tensor:
    """The slot rows (M, D) gathered from `from_ND`: by `read_rows` where Triton runs (the used rows
    only; padding undefined, as the grouped GEMM leaves its own); else `index_select` (padding:
    copies of row 0)."""
    if triton_usable(from_ND):
        return read_rows(from_ND, rows.idx_M, rows.ends_R)
    return from_ND.index_select(0, rows.idx_M)


def _write_rows(into_ND: torch.Tensor, rows_MD: torch.Tensor, rows: SlotRows) -> torch.Tensor:
    """`into_ND` with the slot rows' values (the used ones of `rows_MD`) written at their rows, in
    place: by `write_rows` where Triton runs (the used rows only); else in PyTorch ops over all
    rows, the padding rows writing their target's own value back."""
    if triton_usable(into_ND):
        write_rows(into_ND, rows_MD, rows.idx_M, rows.ends_R)
        return into_ND
    values = torch.where(rows.used_M[:, None], rows_MD.to(into_ND.dtype), into_ND.index_select(0, rows.write_M))
    return into_ND.index_copy_(0, rows.write_M, values)


class _Merge(torch.autograd.Function):
    """Comet's outputs (N, D, a tensor of its own) with the served rows written from the slots'
    (M, D), in place; backward, the gradient as it is to Comet (its map skips the served rows; it
    may be Comet's staged buffer) and gathered to the slot rows."""

    @staticmethod
    def forward(ctx, out_ND, y_MD, rows: SlotRows):
        ctx.rows = rows
        ctx.mark_dirty(out_ND)
        return _write_rows(out_ND, y_MD, rows)

    @staticmethod
    def backward(ctx, grad_ND):
        return grad_ND, _read_rows(grad_ND, ctx.rows), None


class _Aggregate(torch.autograd.Function):
    """The layer's output, unchanged; its backward queues Agg (`ReplicaSlots.queue_aggregate`) on
    every rank, holder or not. The owners' weights are inputs (not read), so that backward runs
    whenever they need a gradient."""

    @staticmethod
    def forward(ctx, out_ND, slots: ReplicaSlots, params: tuple, dtype: torch.dtype, slot_weights: tuple,
                on_device: bool, *owner_weights):
        ctx.slots, ctx.params, ctx.dtype, ctx.num_owner = slots, params, dtype, len(owner_weights)
        # the forward's placement: a later one is a new tensor, or (written in place, a graph that
        # follows the load) written after this backward, at the next call or replay
        ctx.expert_WR = slots.expert_WR
        ctx.sends = slots.send_grads_when_ready(params, dtype, slot_weights, on_device) if slot_weights else None
        return out_ND.view_as(out_ND)

    @staticmethod
    def backward(ctx, grad_ND):
        ctx.slots.queue_aggregate(ctx.params, ctx.dtype, ctx.expert_WR, ctx.sends)
        return grad_ND, None, None, None, None, None, *(None,) * ctx.num_owner


def fork(rows_ND: torch.Tensor, rows: SlotRows) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rows for Comet, the slot rows (M, D)): `_Fork`."""
    return _Fork.apply(rows_ND, rows)


def slot_experts(x_MD: torch.Tensor, rows: SlotRows, activation: str, held: tuple[torch.Tensor | None, ...]
                 ) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
    """The slot rows' outputs (M, D) with the held copies: the experts' grouped GEMMs and
    activation, through autograd, on leaves made of the slots' weights (returned: Agg reads their
    `.grad`). Rows past the slots' last end are padding (undefined on GPUs), as in the experts'
    grouped GEMM; the grouped GEMMs' weight gradients leave them out."""
    leaves = tuple(None if w is None else w.detach().requires_grad_() for w in held)
    w1, w2, w3 = leaves
    h3 = None if w3 is None else grouped_rows_mm(x_MD, w3, rows.ends_R)
    hidden = activate_rows(activation, grouped_rows_mm(x_MD, w1, rows.ends_R), h3, rows.ends_R)
    return grouped_rows_mm(hidden, w2, rows.ends_R), leaves


def merge(out_ND: torch.Tensor, y_MD: torch.Tensor, rows: SlotRows) -> torch.Tensor:
    """Comet's rows with the served ones from the slots (`_Merge`)."""
    return _Merge.apply(out_ND, y_MD, rows)


def aggregate(out_ND: torch.Tensor, slots: ReplicaSlots, params: tuple[torch.Tensor | None, ...],
              dtype: torch.dtype, slot_weights: tuple[torch.Tensor | None, ...] = (),
              on_device: bool = False) -> torch.Tensor:
    """`out_ND`, whose backward queues Agg of `params`' copies (slot gradients in `dtype`, from the
    `.grad` of this rank's `slot_weights`, if it computed slot rows; sent by the link kernel with
    `on_device`)."""
    return _Aggregate.apply(out_ND, slots, params, dtype, slot_weights, on_device,
                            *(p for p in params if p is not None))


@dataclass(frozen=True)
class ReplicaCall:
    """A dropless call's copies: the layer's slots, the most slot rows this rank can have, the
    call's Trans, in flight, and whether the call is shaped for any placement (`on_device`: every
    rank runs the slot path, the copies read the placement on the device; a CUDA graph of it
    follows the placements written in place between its replays)."""

    slots: ReplicaSlots
    most_rows: int
    transfer: PendingTransfer
    on_device: bool = False
