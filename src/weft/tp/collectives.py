"""The two collectives of Megatron-style tensor parallelism as autograd functions (Megatron-LM,
sec. 3: `f` and `g`), over the tensor-parallel group:

- `copy_to_tp` (f): identity forward; the input gradient, a partial sum on each rank after a
  column-parallel linear, is all-reduced in backward.
- `reduce_from_tp` (g): the partial outputs of a row-parallel linear all-reduced in forward;
  identity backward.

And the pair that hands a token-wise sub-layer (an MoE layer) a different share of the tokens on
each rank of the group (Megatron-Core's sequence-parallel split around its MoE layer):

- `split_to_tp`: the rows of a tensor that is the same on every rank, this rank's 1 / tp of them
  in forward; the rows' gradients all-gathered in backward (each rank computed its own rows'
  gradient, every rank needs them all);
- `gather_from_tp`: every rank's rows all-gathered in forward; this rank's rows of the gradient
  in backward (the gradient of the gathered tensor is the same on every rank).

A group of size 1 (or None with no process group) makes both the identity.

`copy_all_reduce_` is the in-place sum of `all_reduce_` done through peer memory instead of the
group's collective: Domino's asynchronous all-reduces (`weft.tp.schedule.Domino`, reduce="copy")
run beside the GEMMs they hide behind, and NCCL's kernels there share the GEMMs' SMs: on 2 H100s
with NVLink the GEMMs of Domino's graphed step took 6.9 ms of kernel time against 5.4 with the
all-reduces left out (docs/benchmarks.md, "Why Domino's graphed step loses with NVLink"). A copy
into the peer's memory is a memcpy over NVLink; what is left on the SMs is the add of this
rank's chunk and two barriers. It runs as a reduce-scatter and an all-gather of copies, so each
rank sends what a ring all-reduce sends ((world - 1) / world of the tensor per phase) and adds
only its 1 / world of the sum.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from weft.comm.all_to_all import ALL_GATHER
from weft.comm.peers import PeerBuffers, peer_buffers, peers_unavailable
from weft.distributed import group_rank, group_size

# the peers' barrier channel of the copy all-reduce (Comet's kernels keep channel 0 of a group)
COPY_REDUCE_CHANNEL = 1


def all_reduce_(x: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False):
    """Sum `x` in place over `group`; the work handle when `async_op` (None for one rank)."""
    if group_size(group) == 1:
        return None
    return dist.all_reduce(x.detach(), group=group, async_op=async_op)  # detached: weft.comm.all_to_all


class CopyReduced:
    """The handle of a `copy_all_reduce_` with async_op: `wait()` makes the current stream wait for
    the sum (the work itself runs on the copy all-reduce's side stream; on the CPU it is done)."""

    def __init__(self, done: torch.cuda.Event | None):
        self.done = done

    def wait(self) -> None:
        if self.done is not None:
            torch.cuda.current_stream().wait_event(self.done)


class PeerCopyAllReduce:
    """In-place sums over the ranks of `peers`' group by copies into peer memory
    (`weft.comm.peers`: symmetric memory on GPUs that reach each other's, shared files on the CPU),
    as a reduce-scatter then an all-gather, both done by copies.

    For a tensor of n elements cut into `world` contiguous chunks, every rank keeps a buffer of
    (world, n) that every rank can write; rank r writes row r of every peer's buffer only, each
    chunk at its own offset. Reduce-scatter: rank r copies chunk q of its tensor into rank q's
    buffer (q != r); a barrier; rank r sums chunk r over the ranks in rank order (its own from the
    tensor, the others from its buffer). All-gather: rank r copies its summed chunk r into every
    peer's buffer; a barrier; rank r copies the other chunks from its buffer into the tensor. Each
    chunk is summed by one rank and copied as is, so every rank ends with the same bits, the
    rank-order sum (with two ranks the one add NCCL's sum does). Each rank sends (world - 1) / world
    of the tensor per phase, as a ring all-reduce does, and adds only its own chunk. The two
    barriers keep every buffer region from being written again before its reader is done: the
    reduce-scatter's regions are read before the second barrier, the all-gather's before the
    next call's first. On CUDA this runs on one side stream, like a collective's own stream: the
    caller's stream waits for it through the handle. One buffer per size and dtype, allocated at
    its first call (a collective: warm up before capturing a CUDA graph)."""

    def __init__(self, peers: PeerBuffers):
        self.peers = peers
        self.side = torch.cuda.Stream(peers.device) if peers.device.type == "cuda" else None

    def __call__(self, x: torch.Tensor, async_op: bool = False) -> CopyReduced | None:
        if not x.is_contiguous():
            raise ValueError("copy_all_reduce_ sums a contiguous tensor in place")
        flat = x.view(-1)
        buffer = self.peers.get("tp_copy_all_reduce", (self.peers.world, flat.numel()), flat.dtype)
        if self.side is None:
            self._reduce(flat, buffer)
            return CopyReduced(None) if async_op else None
        self.side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(self.side):
            self._reduce(flat, buffer)
        x.record_stream(self.side)
        done = torch.cuda.Event()
        done.record(self.side)
        handle = CopyReduced(done)
        if async_op:
            return handle
        handle.wait()
        return None

    def _reduce(self, flat: torch.Tensor, buffer) -> None:
        rank, world = self.peers.rank, self.peers.world
        bounds = [flat.numel() * q // world for q in range(world + 1)]
        chunk = [slice(a, b) for a, b in zip(bounds, bounds[1:])]
        others = [q for q in range(world) if q != rank and bounds[q] < bounds[q + 1]]
        for q in others:  # reduce-scatter: chunk q to rank q
            buffer.peers[q][rank][chunk[q]].copy_(flat[chunk[q]])
        self.peers.barrier(COPY_REDUCE_CHANNEL)
        mine = chunk[rank]
        parts = [flat[mine] if q == rank else buffer.local[q][mine] for q in range(world)]
        if world == 2:
            torch.add(parts[0], parts[1], out=flat[mine])
        else:
            total = parts[0] + parts[1]
            for part in parts[2:]:
                total += part
            flat[mine].copy_(total)
        if bounds[rank] < bounds[rank + 1]:
            for q in range(world):  # all-gather: the summed chunk to every peer
                if q != rank:
                    buffer.peers[q][rank][mine].copy_(flat[mine])
        self.peers.barrier(COPY_REDUCE_CHANNEL)
        for q in others:
            flat[chunk[q]].copy_(buffer.local[q][chunk[q]])


def copy_all_reduce_(x: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False):
    """`all_reduce_` through peer memory (`PeerCopyAllReduce`, one per group and device); the
    handle when `async_op` (None for one rank). The ranks must reach each other's memory
    (`weft.comm.peers.peers_unavailable`)."""
    if group_size(group) == 1:
        return None
    peers = peer_buffers(group, x.device)
    return peers.memo(("tp_copy_all_reduce",), lambda: _copy_all_reduce(peers))(x, async_op)


def _copy_all_reduce(peers: PeerBuffers) -> PeerCopyAllReduce:
    """The group's copy all-reduce, built once (the check with it: not on every call)."""
    why = peers_unavailable(peers.group, peers.device)
    if why is not None:
        raise ValueError(f"the copy all-reduce needs ranks that reach each other's memory: {why}")
    return PeerCopyAllReduce(peers)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()  # the incoming gradient may be shared (a residual's)
        all_reduce_(grad, ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        out = x.contiguous().clone()
        all_reduce_(out, group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """f: identity forward, gradient all-reduced over `group` in backward."""
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """g: `x` summed over `group` in forward, identity backward."""
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def _gather_rows(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((group_size(group) * x.shape[0],) + tuple(x.shape[1:]))
    ALL_GATHER(out, x, group=group)
    return out


def _own_rows(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x.chunk(group_size(group))[group_rank(group)].contiguous()


class _Rows(torch.autograd.Function):
    """This rank's rows (`gather` False) or every rank's (`gather` True) in forward; the other
    one of the two in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None, gather: bool) -> torch.Tensor:
        ctx.group, ctx.gather = group, gather
        return _gather_rows(x, group) if gather else _own_rows(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (_own_rows(grad, ctx.group) if ctx.gather else _gather_rows(grad, ctx.group)), None, None


def split_to_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's 1 / tp of the rows (dim 0) of `x`, the same tensor on every rank of `group`;
    backward all-gathers the rows' gradients. The rows must divide evenly."""
    world = group_size(group)
    if x.shape[0] % world:
        raise ValueError(f"{x.shape[0]} rows cannot be split evenly over {world} tensor-parallel ranks")
    return x if world == 1 else _Rows.apply(x, group, False)


def gather_from_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's rows (dim 0) of `x` in rank order; backward keeps this rank's rows of the
    gradient (which must be the same on every rank)."""
    return x if group_size(group) == 1 else _Rows.apply(x, group, True)
