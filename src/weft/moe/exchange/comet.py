"""Comet's exchange (MLSys 2025): the experts' two GEMMs communicate inside their kernels, tile by tile.

Where the plain exchange runs all-to-all -> experts -> all-to-all, here nothing is cut into
chunks: layer0 (`weft.kernels.comet.pull_gemm`) reads each expert's rows from the source ranks'
buffers while it computes x @ w1, local rows first; layer1 (`gemm_push`) computes h @ w2 and
stores each finished tile into the buffer of the rank the rows came from, where the layer's
combine then does the top-k sum. The buffers are peer memory (`weft.comm.peers`): symmetric memory
on GPUs, shared files across CPU processes; the layer's Triton dispatch writes the rows straight
into this rank's buffer and the combine's backward their gradient (`Comet.staging`). The backward
runs the same two patterns: the output gradient's rows are pulled by the experts' ranks under
dY @ w2^T (Comet's layer1 in reverse), and the input gradient dH @ w1^T is pushed home tile by
tile; the weight gradients are GEMMs over rows that are then local, each accumulated as soon as
it is made (layer0 and layer1 are two autograd functions).

Both layouts: padded (every rank's buffer holds E * C rows; the map from gathered rows to buffer
rows is fixed and kept with the group's buffers) and dropless (each rank's routed rows sorted by
expert; the ranks all-gather their per-expert counts, one small collective). A dropless call
builds its map from those counts on the device (`grouped_on_device`: sized for the most rows a
rank can receive, nothing read on the host, so a CUDA graph holds the call, as DeepEP's
low-latency kernels size their buffers), or, where the host has read the counts anyway (a tuned
call's bucket), from the host's copy (`grouped`). Same function as `AllToAll`: outputs, gradients
and dropped slots; the rows each rank reads and writes are the all-to-all's.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd.graph import increment_version

from weft.comm.peers import PeerBuffer, PeerBuffers
from weft.kernels import comet as kernels
from weft.kernels.comet import RowMap, segment_mm, segment_wgrad
from weft.kernels.rows import triton_usable
from weft.moe.backward_sgd import BackwardSGD
from weft.moe.exchange.base import Exchange, ExchangeContext, Grouped, GroupedOnDevice, Layout, Staging
from weft.moe.exchange.replica_slots import ReplicaCall, aggregate, fork, merge, slot_experts
from weft.moe.experts import activate
from weft.profiling import stage
from weft.tune.dictionary import TuningDictionary

# Each role's buffer: what layer0 pulls ("send": the dispatched rows in the forward; "grad_send":
# their output gradient in the backward) and what layer1 pushes home ("out", "grad_out").
BUFFER_OF_ROLE = {"send": "pulled", "grad_send": "pulled", "out": "pushed", "grad_out": "pushed"}


def comet_buffer(peers: PeerBuffers, role: str, rows: int, dim: int, dtype: torch.dtype) -> PeerBuffer:
    """The group's buffer of (rows, dim) for `role` (`BUFFER_OF_ROLE`). The forward's and the
    backward's roles share one buffer, two in all instead of four, because every rank's calls run
    the same sequence of barriers (B1 after "send" is written, B2 after "out" is pushed, B3 after
    "grad_send", B4 after "grad_out") and each content is read before the next barrier on every
    reader: the other ranks pull "send" between B1 and B2, and the backward writes "grad_send"
    after B2; each rank reads its "out" (the combine's kept copy, `CometPlan.push`) before its
    next barrier, and the backward pushes "grad_out" after B3; the next call writes after B4
    (B2 without a backward). This holds while a group's Comet calls run one after another on
    one stream, as they must anyway (the roles' names are the same for every call)."""
    return peers.get(f"comet.{BUFFER_OF_ROLE[role]}", (rows, dim), dtype)


def in_own_buffer(rows_ND: torch.Tensor, buffer: PeerBuffer) -> bool:
    """Whether `rows_ND` were made in this rank's part of `buffer` (staged: `Comet.staging`)."""
    return rows_ND.data_ptr() == buffer.local.data_ptr()


@dataclass(frozen=True)
class CometPlan:
    """One call's constants: the group's peer buffers and their rows per rank (`buffer_rows`, the
    same on every rank), where this rank's experts' rows are (`rows`), the tiles, whether the
    Triton kernels run (else their PyTorch references over the same buffers), and the tuning
    dictionary that keeps layer0's copy programs per shape (None: the tiles' default), the
    call's `weft.BackwardSGD` (None: every weight gets its gradient), and whether the caller's
    combine keeps its own copy of the forward's outputs (`outputs_kept`: the rows were staged,
    `Comet.staging`), so that layer1 returns its buffer's rows without copying them."""

    peers: PeerBuffers
    buffer_rows: int
    rows: RowMap
    activation: str
    tiles: kernels.CometTiles
    use_kernels: bool
    tuning: TuningDictionary | None = None
    expert_step: BackwardSGD | None = None
    outputs_kept: bool = False

    def weight_grad(self, x_RK: torch.Tensor, dy_RN: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """`weight`'s gradient x^T dy per expert, or None where the call's `BackwardSGD` stepped the
        weight in that GEMM's epilogue instead (`kernels.segment_wgrad_into`; the weight must be the
        optimizer's own tensor, not a cast, and no later op of the backward may read it)."""
        if self.expert_step is not None and self.expert_step.fuse(
                weight, lambda alpha, beta: kernels.segment_wgrad_into(weight, x_RK, dy_RN, self.rows, alpha, beta)):
            return None
        return segment_wgrad(x_RK, dy_RN, self.rows)

    def buffer(self, role: str, like: torch.Tensor) -> PeerBuffer:
        return comet_buffer(self.peers, role, self.buffer_rows, like.shape[1], like.dtype)

    def share(self, role: str, rows_ND: torch.Tensor) -> PeerBuffer:
        """Write this rank's rows into its buffer for `role` (nothing to copy where they were made
        there: `Comet.staging`), then wait until every rank has."""
        buffer = self.buffer(role, rows_ND)
        if not in_own_buffer(rows_ND, buffer):
            buffer.local[: rows_ND.shape[0]].copy_(rows_ND)
        self.peers.barrier()
        return buffer

    def pull(self, source: PeerBuffer, b_EKN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer0: (this rank's experts' rows gathered from every source, their product with b)."""
        if self.use_kernels:
            def launch(tiles: kernels.CometTiles):
                return kernels.pull_gemm(source.table, source.local, self.rows, b_EKN, tiles, source.peers)
            return launch(self.pull_tiles(source, b_EKN, launch))
        return kernels.pull_gemm_reference(source.peers, self.rows, b_EKN)

    def pull_activation(self, source: PeerBuffer, b_EKN: torch.Tensor, saved: tuple[torch.Tensor, ...] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Layer0 with the activation in its epilogue: forward (not swiglu) (gathered, act(h), h or
        None for relu); backward, with what the forward kept, (gathered dY, dh ([dh1 | dh3] for
        swiglu), act(h) or None for relu) (`kernels.activation_epilogue_reference`)."""
        if self.use_kernels:
            def launch(tiles: kernels.CometTiles):
                return kernels.pull_gemm_activation(source.table, source.local, self.rows, b_EKN, tiles,
                                                    self.activation, saved, source.peers)
            return launch(self.pull_tiles(source, b_EKN, launch))
        return kernels.pull_gemm_activation_reference(source.peers, self.rows, b_EKN, self.activation, saved)

    def pull_tiles(self, source: PeerBuffer, b_EKN: torch.Tensor, launch) -> kernels.CometTiles:
        """Comet's adaptive workload assignment (3.2.2): layer0's tiles with the number of copy
        programs that ran this shape fastest on this rank, timed the first time the shape is seen
        (a rerun of layer0 reads the same rows and writes only local tensors, so timing it changes
        nothing; `launch(tiles)` runs the call's own layer0). A call captured into a CUDA graph
        times nothing: it takes an earlier choice, or the default."""
        tiles = self.tiles
        if self.tuning is None or len(tiles.n_comm_choices) == 1:
            return tiles
        num_local, K, N = b_EKN.shape
        rows = 1 << max(0, (self.rows.num_rows - 1).bit_length())  # dropless: a power-of-two bucket
        dtype = str(b_EKN.dtype).removeprefix("torch.")
        key = (f"comet.pull-W{self.peers.world}-El{num_local}-R{rows}-K{K}-N{N}-{dtype}"
               f"-{tiles.block_m}x{tiles.block_n}x{tiles.block_k}")
        if source.local.is_cuda and torch.cuda.is_current_stream_capturing():
            n_comm = self.tuning.picked(key)
        else:
            n_comm = self.tuning.pick(key, tiles.n_comm_choices, lambda n: launch(dataclasses.replace(tiles, n_comm=n)),
                                      source.local.device, self.peers.group)
        return tiles if n_comm is None else dataclasses.replace(tiles, n_comm=n_comm)

    def push(self, a_RK: torch.Tensor, b_EKN: torch.Tensor, role: str, like: torch.Tensor,
             b2_EKN: torch.Tensor | None = None) -> torch.Tensor:
        """Layer1: a @ b's rows (with b2: a @ [b; b2], joined along K) into the ranks they came
        from, in `role`'s buffer; returns this rank's rows. The buffer's next role overwrites
        them (`comet_buffer`), so they are the buffer's own rows only where their one reader runs
        before that: the backward's "grad_out" (the dispatch's backward reads them next, before
        any other Comet call of the group can start: every later node of the backward waits for
        the input gradient they make) and the forward's "out" where the combine keeps its own
        copy (`outputs_kept`); elsewhere a copy. The buffer's version counter is bumped on every
        push, so a forward output saved by an autograd node that kept no copy fails in the
        backward instead of reading another call's rows."""
        dest = self.buffer(role, like)
        if self.use_kernels:
            kernels.gemm_push(a_RK.contiguous(), b_EKN, dest.table, dest.local, self.rows, self.tiles, b2_EKN)
        else:
            kernels.gemm_push_reference(a_RK, b_EKN, dest.peers, self.rows, b2_EKN)
        self.peers.barrier()
        increment_version(dest.local)
        rows_ND = dest.local[: like.shape[0]]
        return rows_ND if role == "grad_out" or self.outputs_kept else rows_ND.clone()


class CometLayer0(torch.autograd.Function):
    """Layer0 (Comet 3.1, fig. 4): rows (N, dim) dispatched by this rank -> their experts' act(h),
    pulled from the source ranks under x @ w1 with the activation in the epilogue.

    Returns (link, gathered, act, *saved). `act` and `saved` go to `CometLayer1` as plain tensors:
    `saved` is what act'(h) needs besides act(h) (nothing for relu, h for gelu / silu, (h1, h3)
    for swiglu). `link`, a broadcast zero of h's shape (no memory), is what carries the gradient
    back: layer1's backward runs the backward's layer0, whose epilogue already multiplies by
    act'(h), so the gradient it returns for `link` is dh, and this function's backward takes it as
    such. Two functions, not one, so that each weight's gradient leaves autograd (and is
    accumulated) as soon as it is made: one function returning both held both at once, one weight
    gradient more than the plain layer at its peak. For the same reason swiglu's w3 gets its
    gradient from `CometW3Grad` between the two (from `gathered`, not differentiable), and this
    function's backward makes only dW1 and the rows' gradient."""

    @staticmethod
    def forward(ctx, rows_ND, w1, w3, plan: CometPlan):
        source = plan.share("send", rows_ND)
        if w3 is None:  # act = act(x @ w1) from layer0's epilogue; layer1 keeps act(h) (relu) or h
            gathered, act, h1 = plan.pull_activation(source, w1)
            saved = () if h1 is None else (h1,)
            hidden = w1.shape[2]
        else:  # swiglu: silu(x @ w1) * (x @ w3), the second product a grouped GEMM of its own
            gathered, h1 = plan.pull(source, w1)  # (R, dim), (R, hidden): this rank's experts' rows
            h3 = segment_mm(gathered, w3, plan.rows)
            act, saved = activate(plan.activation, h1, h3), (h1, h3)
            hidden = 2 * w1.shape[2]
        link = act.new_zeros(()).expand(act.shape[0], hidden)
        ctx.plan, ctx.rows_like = plan, torch.empty_like(rows_ND, device="meta")
        ctx.save_for_backward(gathered, w1, w3)
        ctx.mark_non_differentiable(gathered, act, *saved)
        ctx.set_materialize_grads(False)  # gathered, act and saved get no gradient: no zeros made for them
        return link, gathered, act, *saved

    @staticmethod
    def backward(ctx, grad_h, *_):
        plan = ctx.plan
        gathered, w1, w3 = ctx.saved_tensors
        hidden = w1.shape[2]  # swiglu: grad_h is [dh1 | dh3]; dW3 was made by `CometW3Grad`
        # swiglu: dX = dh1 @ w1^T + dh3 @ w3^T, one GEMM over the joined hidden dimension; before
        # dW1, which may step w1 in place (`CometPlan.weight_grad`)
        grad_rows = plan.push(grad_h, w1.transpose(1, 2), "grad_out", ctx.rows_like,
                              None if w3 is None else w3.transpose(1, 2))
        grad_w1 = plan.weight_grad(gathered, grad_h if w3 is None else grad_h[:, :hidden], w1) \
            if ctx.needs_input_grad[1] else None
        return grad_rows, grad_w1, None, None


class CometW3Grad(torch.autograd.Function):
    """swiglu's dW3 = gathered^T @ dh3 on a node of its own, between `CometLayer1` and
    `CometLayer0` in the backward: the link's gradient [dh1 | dh3] passes through unchanged, and
    dW3 is accumulated (and freed) before layer0's backward makes dW1, as the plain layer's
    separate x @ w1 and x @ w3 give them one at a time. Never stepped in the backward
    (`BackwardSGD`): layer0's input gradient reads w3 after this."""

    @staticmethod
    def forward(ctx, link, gathered, w3, rows: RowMap):
        ctx.rows = rows
        ctx.save_for_backward(gathered)
        ctx.set_materialize_grads(False)
        return link.new_zeros(()).expand(link.shape)

    @staticmethod
    def backward(ctx, grad_h):
        if grad_h is None:
            return None, None, None, None
        (gathered,) = ctx.saved_tensors
        hidden = grad_h.shape[1] // 2
        grad_w3 = segment_wgrad(gathered, grad_h[:, hidden:], ctx.rows) if ctx.needs_input_grad[2] else None
        return grad_h, None, grad_w3, None


class CometLayer1(torch.autograd.Function):
    """Layer1 (Comet 3.1, fig. 4): act(h) @ w2, each finished tile stored into the buffer of the
    rank its rows came from; returns this rank's rows (N, dim). Its backward pulls the output
    gradient's rows under dY @ w2^T with act'(h) in the epilogue (layer0's pattern), makes dW2 and
    returns dh for `CometLayer0`'s link."""

    @staticmethod
    def forward(ctx, link, act, w2, plan: CometPlan, rows_like, *saved):
        out_ND = plan.push(act, w2, "out", rows_like)
        ctx.plan, ctx.num_saved = plan, len(saved)
        ctx.save_for_backward(w2, *(saved or (act,)))
        return out_ND

    @staticmethod
    def backward(ctx, grad_ND):
        plan = ctx.plan
        w2, *kept = ctx.saved_tensors
        grad_ND = grad_ND.to(w2.dtype).contiguous()
        source = plan.share("grad_send", grad_ND)
        # dY rows here; dh = (dY @ w2^T) * act'(h) from layer0's epilogue, act(h) beside it for dW2
        grad_out, grad_h, act = plan.pull_activation(source, w2.transpose(1, 2), tuple(kept))
        # relu kept act(h); w2 is read no more: its step may run in the GEMM (`CometPlan.weight_grad`)
        grad_w2 = plan.weight_grad(kept[0] if act is None else act, grad_out, w2) if ctx.needs_input_grad[2] else None
        return grad_h, None, grad_w2, None, None, *(None,) * ctx.num_saved


class Comet(Exchange):
    """Both layouts through Comet's fused kernels on the group's peer buffers."""

    def __init__(self, ctx: ExchangeContext, peers: PeerBuffers):
        super().__init__(ctx)
        self.peers = peers

    def staging(self, layout: Layout, num_rows: int, like: torch.Tensor) -> Staging | None:
        """This rank's rows of the "send" and "grad_send" roles' buffer (one buffer,
        `BUFFER_OF_ROLE`): the dispatch writes its rows where the other ranks read them, the
        combine's backward its gradient, and `share` copies nothing (two copies of the rows fewer
        a call, forward and backward). Rows of another dtype than the experts compute in are cast
        on the way in, so they are not staged."""
        dtype, dim = like.dtype, like.shape[1]
        if self.ctx.experts.compute_dtype(like) != dtype:
            return None
        buffer_rows = self._buffer_rows(layout, num_rows)
        send, grad_send = (comet_buffer(self.peers, role, buffer_rows, dim, dtype).local[:num_rows]
                           for role in ("send", "grad_send"))
        return Staging(send, grad_send, transient_out=True)

    @staticmethod
    def _buffer_rows(layout: Layout, rows: int) -> int:
        """The rows of every rank's buffers, the same on every rank: the padded rows; a dropless
        call's most rows any rank dispatches, to a power of two (few sizes, few allocations), or
        on the device, the rows every rank dispatches."""
        if isinstance(layout, Grouped):
            return 1 << max(0, (layout.most_slots() - 1).bit_length())
        if isinstance(layout, GroupedOnDevice):
            return layout.rows
        return rows

    def padded(self, rows_RD: torch.Tensor, capacity: int) -> torch.Tensor:
        tiles = kernels.CometTiles.for_device(rows_RD.device, dtype=self.ctx.experts.compute_dtype(rows_RD))
        key = ("comet.padded", self.ctx.placement.num_local, capacity, tiles.block_m)
        world, local = self.peers.world, self.ctx.placement.num_local
        rows = self.peers.memo(key, lambda: RowMap.padded(world, local, capacity, self.peers.rank, tiles.block_m,
                                                          rows_RD.device))
        return self._run(rows_RD, rows_RD.shape[0], rows, tiles)

    def grouped(self, rows_ND: torch.Tensor, layout: Grouped) -> torch.Tensor:
        tiles = kernels.CometTiles.for_device(rows_ND.device, dtype=self.ctx.experts.compute_dtype(rows_ND))
        rank, local = self.peers.rank, self.ctx.placement.num_local
        counts_WE = layout.counts_WE  # every rank's rows per expert, on the host
        if len(counts_WE) != self.peers.world:
            raise ValueError(f"Comet's dropless exchange needs the counts of all {self.peers.world} ranks, "
                             f"got {len(counts_WE)}")
        offsets_WE = [[0, *itertools.accumulate(row[:-1])] for row in counts_WE]
        mine = slice(rank * local, (rank + 1) * local)
        rows = RowMap.build([row[mine] for row in counts_WE], [row[mine] for row in offsets_WE], rank, tiles.block_m,
                            rows_ND.device)
        return self._run(rows_ND, self._buffer_rows(layout, rows_ND.shape[0]), rows, tiles)

    def grouped_on_device(self, rows_ND: torch.Tensor, layout: GroupedOnDevice) -> torch.Tensor:
        """The dropless layout with the counts left on the device: the map is built there, sized for
        the most rows this rank can receive, and the buffers hold the `layout.rows` rows every rank
        dispatches. Nothing is read on the host (a CUDA graph holds the call); the kernels skip the
        map's empty tiles, and the rows past the last one are computed by no GEMM."""
        tiles = kernels.CometTiles.for_device(rows_ND.device, dtype=self.ctx.experts.compute_dtype(rows_ND))
        if rows_ND.shape[0] != layout.rows:
            raise ValueError(f"Comet's exchange got {rows_ND.shape[0]} rows, the layout says {layout.rows}")
        # a call shaped for any placement (`on_device`) takes the slot path even when nothing is
        # copied now: a graph captured so replays the placements written after it
        replicas = layout.replicas
        if replicas is not None and not (replicas.slots.copied or replicas.on_device):
            replicas = None
        served = None if replicas is None else replicas.slots.served_WE()
        rows = RowMap.on_device(layout.counts_WE, self.peers.rank, self.ctx.placement.num_local, tiles.block_m,
                                layout.most_received, served)
        buffer_rows = self._buffer_rows(layout, rows_ND.shape[0])
        if replicas is None:
            return self._run(rows_ND, buffer_rows, rows, tiles)
        return self._run_replicated(rows_ND, buffer_rows, rows, tiles, replicas, layout.counts_WE)

    def _run_replicated(self, rows_ND: torch.Tensor, buffer_rows: int, rows: RowMap, tiles: kernels.CometTiles,
                        replicas: ReplicaCall, counts_WE: torch.Tensor) -> torch.Tensor:
        """Pro-Prophet's copies (`weft.moe.exchange.replica_slots`): Comet on the rows the map
        keeps, with this rank's served rows (if its slots hold copies, or on every rank for a call
        shaped for any placement) computed by its slots between layer0 and layer1, once the call's
        Trans (`replicas.transfer`, launched by the layer before the dispatch) is joined; Agg
        queued by the output's backward."""
        experts, slots = self.ctx.experts, replicas.slots
        dtype = experts.compute_dtype(rows_ND)
        params = experts.weights()
        transfer = replicas.transfer  # Trans, launched by the layer before the dispatch (on CUDA, in flight)
        if not (slots.holds_here or replicas.on_device):
            out_ND = self._run(rows_ND, buffer_rows, rows, tiles)
            transfer.wait()
            return aggregate(out_ND, slots, params, dtype)
        with torch.autocast(rows_ND.device.type, enabled=False):
            slot_rows = slots.slot_rows(counts_WE, replicas.most_rows)
            rows_ND, x_MD = fork(rows_ND.to(dtype).contiguous(), slot_rows)
        outputs = []

        def between() -> None:
            outputs.append(slot_experts(x_MD, slot_rows, experts.activation, transfer.wait()))

        out_ND = self._run(rows_ND, buffer_rows, rows, tiles, between, written=True)
        (y_MD, slot_weights), = outputs
        with torch.autocast(out_ND.device.type, enabled=False):
            out_ND = merge(out_ND, y_MD, slot_rows)
        return aggregate(out_ND, slots, params, dtype, slot_weights, replicas.on_device)

    def _run(self, rows_ND: torch.Tensor, buffer_rows: int, rows: RowMap, tiles: kernels.CometTiles,
             between: Callable[[], None] | None = None, written: bool = False) -> torch.Tensor:
        """Layer0 and layer1 through autograd (`between`: run between the two, in forward and,
        being created there, in backward). The outputs are the pushed buffer's rows where the
        caller staged the rows (its combine keeps its own copy: `Staging.transient_out`), unless
        they are `written` in place next (Pro-Prophet's `merge`): then a tensor of their own."""
        experts = self.ctx.experts
        dtype = experts.compute_dtype(rows_ND)
        w1, w2, w3 = experts.weights()
        with stage("experts"), torch.autocast(rows_ND.device.type, enabled=False):
            rows_ND = rows_ND.to(dtype).contiguous()
            # rows the caller staged (`staging`, where `share` finds them): its combine keeps the outputs
            staged = in_own_buffer(rows_ND, comet_buffer(self.peers, "send", buffer_rows, rows_ND.shape[1], dtype))
            plan = CometPlan(self.peers, buffer_rows, rows, experts.activation, tiles, triton_usable(rows_ND),
                             self.ctx.tuning, self.ctx.expert_step, staged and not written)
            w3 = None if w3 is None else w3.to(dtype)
            # swiglu: layer0 reads w3's values only (its gradient comes from `CometW3Grad`, and an
            # edge to w3 would hold w3's accumulation until layer0's backward has made dW1 too)
            link, gathered, act, *saved = CometLayer0.apply(rows_ND, w1.to(dtype), None if w3 is None else w3.detach(),
                                                            plan)
            if w3 is not None:  # swiglu: dW3 leaves autograd before layer0's backward makes dW1
                link = CometW3Grad.apply(link, gathered, w3, plan.rows)
            if between is not None:
                between()
            # w2 cast after layer0: a cast's backward then runs before layer0's, and dW2 leaves first
            return CometLayer1.apply(link, act, w2.to(dtype), plan, rows_ND.detach(), *saved)
