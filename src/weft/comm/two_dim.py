"""Two-dimensional hierarchical (2DH) all-to-all (Tutel appendix A, Alg. 2).

A linear all-to-all over W ranks sends W small chunks per rank, many of them across the slow
inter-node links. 2DH first exchanges inside each node, so that each rank then holds, for every
remote node, one chunk aggregated from all its local peers, and sends that in a single
inter-node message (`local_size` times larger, `local_size` times fewer).

Layout, with W = num_nodes * L, group rank r = node * L + local, `c` rows per chunk: the input
is W chunks, chunk d for group rank d, read as an (N, L, c, ...) array `x[n][l]`. The result
equals the linear fixed-size all-to-all: output chunk s came from group rank s.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from weft.distributed import HierarchicalGroups


class _AllToAll2DH(torch.autograd.Function):
    # An equal-split all-to-all is a permutation of chunks that is its own inverse (chunk j of
    # rank i <-> chunk i of rank j), so its adjoint is the same all-to-all.
    @staticmethod
    def forward(ctx, x: torch.Tensor, groups: HierarchicalGroups) -> torch.Tensor:
        ctx.groups = groups
        return _exchange_2dh(x, groups)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange_2dh(grad, ctx.groups), None


def _exchange(x: torch.Tensor, group: dist.ProcessGroup | None, peers: int) -> torch.Tensor:
    """Equal-split all_to_all_single along dim 0 (identity for a one-rank level)."""
    if peers == 1:
        return x
    out = torch.empty_like(x)
    dist.all_to_all_single(out.detach(), x.detach(), group=group)  # detached: weft.comm.all_to_all
    return out


def _exchange_2dh(x: torch.Tensor, groups: HierarchicalGroups) -> torch.Tensor:
    nodes, local = groups.num_nodes, groups.local_size
    rest = tuple(x.shape[1:])
    chunk = x.shape[0] // (nodes * local)
    # Phase 1 (strideMemcpy): buf[l][n] = x[n][l], so the N chunks bound for local index l
    # (one per node) are contiguous and go to intra peer l as one block.
    buf = x.reshape(nodes, local, chunk, *rest).transpose(0, 1).contiguous()
    # Phase 2 (intra-node): afterwards buf[l'][n] = the chunk that rank (my node, l') holds
    # for rank (n, my local index).
    buf = _exchange(buf, groups.intra, local)
    # Phase 3 (strideMemcpy): buf[n][l'] groups the L chunks bound for node n, so one message
    # per node carries what all local peers send to that node's rank with my local index.
    buf = buf.transpose(0, 1).contiguous()
    # Phase 4 (inter-node): the block from node n' holds, at l', the chunk of rank (n', l')
    # for me, i.e. out[n'][l'] is output chunk s = n' * L + l', as in the linear algorithm.
    buf = _exchange(buf, groups.inter, nodes)
    return buf.reshape(x.shape)


def all_to_all_2dh(x: torch.Tensor, groups: HierarchicalGroups) -> torch.Tensor:
    """Fixed-size all-to-all along dim 0 over the group `groups` was built from, via 2DH.

    Dim 0 is cut into W = `groups.size` equal chunks; chunk j goes to group rank j and output
    chunk j comes from group rank j, exactly as the linear all-to-all. Differentiable; any
    trailing shape. Build `groups` with `weft.distributed.hierarchical_groups` (a collective).
    """
    world = groups.size
    if x.dim() == 0 or x.shape[0] % world != 0:
        raise ValueError(
            f"dim 0 of x (shape {tuple(x.shape)}) must be divisible by the all-to-all group size ({world})"
        )
    if world == 1:
        return x
    return _AllToAll2DH.apply(x, groups)


class StreamWork:
    """Handle of work queued on a side CUDA stream: `wait()` makes the current stream wait for it
    without blocking the CPU, like the handle of an async NCCL collective."""

    def __init__(self, done: torch.cuda.Event):
        self.done = done

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.done)


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def start_exchange_2dh(x: torch.Tensor, groups: HierarchicalGroups) -> tuple[torch.Tensor, StreamWork | None]:
    """Start the 2DH exchange of x (not differentiable); returns (output, handle or None).

    On CUDA every phase (stride copies and both all-to-alls) is queued on one side stream that
    first waits for the current stream; NCCL calls without async_op only make that side stream
    wait for them, so the CPU and the compute stream run on until `handle.wait()`. Chunks share
    the side stream, so every rank issues its intra/inter collectives in the same order. On the
    CPU (gloo) the exchange runs now and the handle is None.
    """
    if groups.size == 1:
        return x, None
    if not x.is_cuda:
        return _exchange_2dh(x, groups), None
    current = torch.cuda.current_stream(x.device)
    side = _SIDE_STREAMS.get(x.device)
    if side is None:
        side = _SIDE_STREAMS[x.device] = torch.cuda.Stream(x.device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        out = _exchange_2dh(x, groups)
        done = torch.cuda.Event()
        done.record(side)
    # Caching allocator: x comes from the current stream and is read on the side stream, out the
    # other way round, and callers drop them before those streams catch up. record_stream keeps
    # each block from being reused until the other stream is done with it (cheaper than holding
    # every chunk until a final synchronize). Phase temporaries live and die on the side stream,
    # whose own order protects them.
    x.record_stream(side)
    out.record_stream(current)
    return out, StreamWork(done)
