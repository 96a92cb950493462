"""Comet's exchange (MLSys 2025): the experts' two GEMMs communicate inside their kernels, tile by tile.

Where the plain exchange runs all-to-all -> experts -> all-to-all, here nothing is cut into
chunks: layer0 (`weft.kernels.comet.pull_gemm`) reads each expert's rows from the source ranks'
buffers while it computes x @ w1, local rows first; layer1 (`gemm_push`) computes h @ w2 and
stores each finished tile into the buffer of the rank the rows came from, where the layer's
combine then does the top-k sum. The buffers are peer memory (`weft.comm.peers`): symmetric memory
on GPUs, shared files across CPU processes. The backward runs the same two patterns: the output
gradient's rows are pulled by the experts' ranks under dY @ w2^T (Comet's layer1 in reverse), and
the input gradient dH @ w1^T is pushed home tile by tile; the weight gradients stay batched GEMMs
over rows that are then local.

Same function as `AllToAll` on padded layouts (outputs, gradients, dropped slots): the rows each
rank sends and receives are the all-to-all's, in Tutel's Flexible order. Dropless calls (whose
per-expert row counts vary) run the plain exchange: fused dropless kernels are not built yet.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from weft.comm.peers import PeerBuffer, PeerBuffers
from weft.kernels import comet as kernels
from weft.kernels.rows import triton_usable
from weft.moe.exchange.all_to_all import AllToAll
from weft.moe.exchange.base import Exchange, ExchangeContext
from weft.moe.experts import activate
from weft.profiling import stage


@dataclass(frozen=True)
class CometPlan:
    """One call's constants: the group's peer buffers, the padded capacity, the tiles, and whether
    the Triton kernels run (else their PyTorch references over the same buffers)."""

    peers: PeerBuffers
    num_local: int
    capacity: int
    activation: str
    tiles: kernels.CometTiles
    use_kernels: bool

    def buffer(self, name: str, rows_RD: torch.Tensor) -> PeerBuffer:
        return self.peers.get(f"comet.{name}", tuple(rows_RD.shape), rows_RD.dtype)

    def share(self, name: str, rows_RD: torch.Tensor) -> PeerBuffer:
        """Write this rank's rows into its buffer `name`, then wait until every rank has."""
        buffer = self.buffer(name, rows_RD)
        buffer.local.copy_(rows_RD)
        self.peers.barrier()
        return buffer

    def pull(self, source: PeerBuffer, b_EKN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer0: (this rank's experts' rows gathered from every source, their product with b)."""
        if self.use_kernels:
            return kernels.pull_gemm(source.table, source.local, self.peers.rank, self.capacity, b_EKN, self.tiles)
        return kernels.pull_gemm_reference(source.peers, self.peers.rank, self.capacity, b_EKN)

    def push(self, a_EMK: torch.Tensor, b_EKN: torch.Tensor, name: str, like: torch.Tensor) -> torch.Tensor:
        """Layer1: a @ b's rows into the ranks they came from; returns this rank's rows (a copy)."""
        dest = self.buffer(name, like)
        if self.use_kernels:
            kernels.gemm_push(a_EMK.contiguous(), b_EKN, dest.table, dest.local, self.peers.rank, self.capacity,
                              self.tiles)
        else:
            kernels.gemm_push_reference(a_EMK, b_EKN, dest.peers, self.peers.rank, self.capacity)
        self.peers.barrier()
        return dest.local.clone()


class CometExperts(torch.autograd.Function):
    """rows (E * C, dim) dispatched by this rank -> their experts' outputs, same rows (padded layout)."""

    @staticmethod
    def forward(ctx, rows_RD, w1, w2, w3, plan: CometPlan):
        source = plan.share("send", rows_RD)
        gathered, h1 = plan.pull(source, w1)  # (El, W * C, dim), (El, W * C, hidden)
        h3 = torch.bmm(gathered, w3) if w3 is not None else None
        out_RD = plan.push(activate(plan.activation, h1, h3), w2, "out", rows_RD)
        ctx.plan = plan
        ctx.save_for_backward(gathered, h1, h3, w1, w2, w3)
        return out_RD

    @staticmethod
    def backward(ctx, grad_RD):
        plan = ctx.plan
        gathered, h1, h3, w1, w2, w3 = ctx.saved_tensors
        source = plan.share("grad_send", grad_RD.to(gathered.dtype).contiguous())
        grad_out, grad_act = plan.pull(source, w2.transpose(1, 2))  # dY rows here; dY @ w2^T
        with torch.enable_grad():  # the activation again, for its gradient and dW2
            inputs = [h.detach().requires_grad_() for h in (h1, h3) if h is not None]
            act = activate(plan.activation, *inputs)
        grad_w2 = torch.bmm(act.detach().transpose(1, 2), grad_out)
        grads_h = torch.autograd.grad(act, inputs, grad_act)
        grad_w1 = torch.bmm(gathered.transpose(1, 2), grads_h[0])
        grad_w3 = torch.bmm(gathered.transpose(1, 2), grads_h[1]) if w3 is not None else None
        if w3 is None:
            a, b = grads_h[0], w1.transpose(1, 2)
        else:  # dX = dh1 @ w1^T + dh3 @ w3^T as one GEMM over the joined hidden dimension
            a, b = torch.cat(grads_h, 2), torch.cat([w1, w3], 2).transpose(1, 2)
        grad_rows = plan.push(a, b, "grad_out", grad_RD.to(gathered.dtype))
        return grad_rows, grad_w1, grad_w2, grad_w3, None


class Comet(Exchange):
    """Padded layouts through Comet's fused kernels on the group's peer buffers; dropless through
    the plain exchange (see the module docstring)."""

    def __init__(self, ctx: ExchangeContext, peers: PeerBuffers, tiles: kernels.CometTiles | None = None):
        super().__init__(ctx)
        self.peers, self.tiles = peers, tiles

    def padded(self, rows_RD: torch.Tensor, capacity: int) -> torch.Tensor:
        experts = self.ctx.experts
        dtype = experts.compute_dtype(rows_RD)
        w1, w2, w3 = (None if w is None else w.to(dtype) for w in experts.weights())
        tiles = self.tiles or kernels.CometTiles.for_device(rows_RD.device)
        plan = CometPlan(self.peers, experts.num_local, capacity, experts.activation, tiles,
                         kernels.triton is not None and triton_usable(rows_RD))
        with stage("experts"), torch.autocast(rows_RD.device.type, enabled=False):
            return CometExperts.apply(rows_RD.to(dtype).contiguous(), w1, w2, w3, plan)

    def grouped(self, rows_ND: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        return AllToAll(self.ctx).grouped(rows_ND, counts_E)
