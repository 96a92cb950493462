"""Pro-Prophet's Trans and Agg through peer memory (sec. IV-A, fig. 6): the owners' parts as
Triton kernels, each beside its PyTorch reference, placed by a small tensor on the device, so
nothing is read on the host and a CUDA graph holds them.

The placement is `expert_WR` (int64, (W, R), the same on every rank): rank h's replica slot j
holds expert `expert_WR[h, j]`, or nothing (-1). Expert e is owned by rank e // El (El experts a
rank). Slot f = h * R + j is its owner's entry number k(f): how many slots before f (in (h, j)
order) hold an expert of the same owner. An owner has at most R entries (`ReplicaSlots.place`
checks it), so every rank's box of R entries (a peer buffer of (R, P) values, P an expert
weight's elements, one per weight) holds them.

The owners' parts touch only their own memory; the holders move the bytes across the link, by
the copy engine at the entries `entries` gives where the host's view of the placement may fix
the copies' addresses (`weft.moe.exchange.replica_slots`), else by the link kernels here, which
read the placement on the device (a CUDA graph that follows the placement):

- Trans: `stage_copies` (the owner copies each of its copied experts into its box), a barrier,
  then the holders read their slots' experts from the boxes (`pull_copies`).
- Agg: the holders write their slots' gradients into their owners' boxes (`push_grads`), a
  barrier, then `add_grads` (each owner adds its box's gradients of each expert into its own
  gradient rows, in slot order, accumulated in float32, one program per element range of an
  expert (the first slot holding it sums for all): no atomics, deterministic).
- `write_rows` / `read_rows`: a holder's slot rows written among its dispatched rows, and
  gathered from them, the used ones only (the rows below the slots' last end, read on the device:
  a call shaped for any placement bounds its slot rows by the most there can be, and where
  nothing is copied nothing moves); `activate_rows`: the slot experts' activation, forward and
  backward, on those rows only.

The link kernels run on few programs (`LINK_PROGRAMS`), each taking the used slots' chunks in
turn, `LINK_BLOCK` elements at a time, so that they leave most SMs to the GEMMs they fly beside
(on 2 x H200 they reached ~200-370 GB/s; the copy engine, which takes no SMs, is faster where it
can be used: docs/balance.md).

The Triton kernels run on CUDA tensors, and on CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1), where the references are their oracle.
"""
from __future__ import annotations

import torch

from weft.kernels import comet as comet_kernels
from weft.kernels.activation import activate
from weft.kernels.rows import triton, triton_usable

if triton is not None:
    import triton.language as tl

    # Comet's layer0 epilogue's activation helpers, as globals the kernels below call
    act_value, act_grad = comet_kernels.act_value, comet_kernels.act_grad

BLOCK = 4096  # elements an owner's program moves at a time
OWNER_PROGRAMS = 2048  # programs a slot of an owner's kernel, each taking every OWNER_PROGRAMS-th chunk
ROW_BLOCK = 512  # columns a program of `write_rows` / `read_rows` moves
ROW_PROGRAMS = 1024  # programs down the rows of `write_rows` / `read_rows`, each taking every ROW_PROGRAMS-th row
LINK_PROGRAMS = 32  # programs of a link kernel
LINK_BLOCK = 16384  # elements a link program moves at a time
LINK_WARPS = 8


def _flat(w: torch.Tensor) -> torch.Tensor:
    """(G, P) view of an expert weight or a box (G, K, N), which must be contiguous."""
    if not w.is_contiguous():
        raise ValueError(f"replica copies need contiguous expert weights, got strides {w.stride()}")
    return w.view(w.shape[0], -1)


def entries(expert_WR: torch.Tensor, local: int) -> list[int]:
    """Each slot's entry in its owner's box, (h, j) order (-1 for an empty slot), on the host."""
    seen: dict[int, int] = {}
    out = []
    for e in expert_WR.flatten().tolist():
        if e < 0:
            out.append(-1)
            continue
        out.append(seen.get(e // local, 0))
        seen[e // local] = out[-1] + 1
    return out


def _owner_launch(kernel, weights: torch.Tensor, box: torch.Tensor, expert_WR: torch.Tensor, rank: int) -> None:
    """An owner's kernel (`_stage_copies_kernel`, `_add_grads_kernel`) over its experts' flat
    weights or gradients (El, P): up to `OWNER_PROGRAMS` programs a slot, each taking every
    OWNER_PROGRAMS-th chunk of `BLOCK` elements (`ITERS` turns). A slot with nothing for this rank
    exits at once; the programs a slot are enough loads in flight for an owner's real copies
    (a program per chunk and fewer programs both measured slower: docs/balance.md)."""
    world, per_rank = expert_WR.shape
    chunks = triton.cdiv(weights.shape[1], BLOCK)
    programs = min(chunks, OWNER_PROGRAMS)
    kernel[(world * per_rank, programs)](weights, box, expert_WR, rank, weights.shape[1], LOCAL=weights.shape[0],
                                         SLOTS=world * per_rank, BLOCK_S=triton.next_power_of_2(world * per_rank),
                                         BLOCK=BLOCK, PROGRAMS=programs, ITERS=triton.cdiv(chunks, programs))


def _link_launch(elements: int) -> dict:
    """A link kernel's grid and loop: `LINK_PROGRAMS` programs (fewer where a slot has fewer
    chunks), each taking every PROGRAMS-th chunk (`CHUNKS` a slot, `ITERS` turns) of each slot
    that holds an expert, slot after slot, so that those slots get every program, wherever they
    are, and an empty slot costs one load."""
    chunks = triton.cdiv(elements, LINK_BLOCK)
    programs = max(1, min(LINK_PROGRAMS, chunks))
    return dict(grid=(programs,), PROGRAMS=programs, CHUNKS=chunks, ITERS=triton.cdiv(chunks, programs),
                BLOCK=LINK_BLOCK, num_warps=LINK_WARPS)


def stage_copies(w_EKN: torch.Tensor, box: torch.Tensor, expert_WR: torch.Tensor, rank: int) -> None:
    """Trans, the owner's part for one weight: each slot holding one of this rank's experts gets
    that expert's `w` (El, K, N), cast to the box's dtype (as `Tensor.to` rounds), at its entry of
    this rank's box (R, K, N). Local memory only."""
    src = _flat(w_EKN.to(box.dtype))
    if triton_usable(src):
        _owner_launch(_stage_copies_kernel, src, box, expert_WR, rank)
        return
    stage_copies_reference(w_EKN, box, expert_WR, rank)


def stage_copies_reference(w_EKN: torch.Tensor, box: torch.Tensor, expert_WR: torch.Tensor, rank: int) -> None:
    """`stage_copies` in PyTorch ops (reads the placement on the host)."""
    local = w_EKN.shape[0]
    for e, k in zip(expert_WR.flatten().tolist(), entries(expert_WR, local)):
        if e >= 0 and e // local == rank:
            box[k].copy_(w_EKN[e - rank * local])


def pull_copies(slots: torch.Tensor, table: torch.Tensor, boxes: list[torch.Tensor], expert_WR: torch.Tensor,
                rank: int, local: int) -> None:
    """Trans, a holder's part for one weight, placed on the device: this rank's slots (R, K, N)
    read their experts from their owners' boxes (`boxes[o]` as this process addresses rank o's,
    `table` their addresses), `local` experts a rank. Empty slots keep their values."""
    _link(slots, table, boxes, expert_WR, rank, local, pull=True)


def push_grads(grads: torch.Tensor, table: torch.Tensor, boxes: list[torch.Tensor], expert_WR: torch.Tensor,
               rank: int, local: int) -> None:
    """Agg, a holder's part for one weight, placed on the device: the gradient of each of this
    rank's slots (`grads`, (R, K, N)) goes to its entry of its owner's box, cast to the boxes'
    dtype. Empty slots send nothing."""
    _link(grads.contiguous(), table, boxes, expert_WR, rank, local, pull=False)


def _link(mine: torch.Tensor, table: torch.Tensor, boxes: list[torch.Tensor], expert_WR: torch.Tensor, rank: int,
          local: int, pull: bool) -> None:
    """This rank's slots' values (`mine`, (R, ...)) from (`pull`) or to their entries of the
    owners' boxes: `_link_kernel`, or the reference."""
    world, per_rank = expert_WR.shape
    flat = _flat(mine)
    if triton_usable(flat):
        launch = _link_launch(flat.shape[1])
        _link_kernel[launch.pop("grid")](flat, table, boxes[rank], expert_WR, rank, flat.shape[1], LOCAL=local,
                                         R=per_rank, SLOTS=world * per_rank,
                                         BLOCK_S=triton.next_power_of_2(world * per_rank), PULL=pull, **launch)
        return
    link_reference(mine, boxes, expert_WR, rank, local, pull)


def link_reference(mine: torch.Tensor, boxes: list[torch.Tensor], expert_WR: torch.Tensor, rank: int, local: int,
                   pull: bool) -> None:
    """`pull_copies` (`pull`) or `push_grads` in PyTorch ops (reads the placement on the host)."""
    copy_entries(mine, boxes, holder_entries(expert_WR, rank, local), pull)


def holder_entries(expert_WR: torch.Tensor, rank: int, local: int) -> list[tuple[int, int, int]]:
    """This rank's slots that hold an expert, as (slot j, its owner, its entry in the owner's
    box), on the host."""
    per_rank = expert_WR.shape[1]
    entry = entries(expert_WR, local)
    return [(j, e // local, entry[rank * per_rank + j]) for j, e in enumerate(expert_WR[rank].tolist()) if e >= 0]


def copy_entries(mine: torch.Tensor, boxes: list[torch.Tensor], held: list[tuple[int, int, int]] | tuple,
                 pull: bool) -> None:
    """Slot j of `mine` (R, ...) from (`pull`) or to its entry k of owner o's box, for each
    (j, o, k) of `held` (`holder_entries`): tensor copies, which on CUDA between peer buffers run
    on the GPU's copy engine, at addresses the host fixes."""
    for j, owner, k in held:
        if pull:
            mine[j].copy_(boxes[owner][k])
        else:
            boxes[owner][k].copy_(mine[j])


def add_grads(grad_EKN: torch.Tensor, box: torch.Tensor, expert_WR: torch.Tensor, rank: int) -> None:
    """Agg, the owner's part for one weight: for each of this rank's experts e held in slots,
    grad[e] += its box's gradients of e (in slot order), summed in float32 with grad's value first
    and stored in grad's dtype, in place (rounded to nearest even on GPUs; Triton's CPU
    interpreter truncates a float32 sum stored as bfloat16). Local memory only."""
    dst = _flat(grad_EKN)
    if triton_usable(dst):
        _owner_launch(_add_grads_kernel, dst, box, expert_WR, rank)
        return
    add_grads_reference(grad_EKN, box, expert_WR, rank)


def add_grads_reference(grad_EKN: torch.Tensor, box: torch.Tensor, expert_WR: torch.Tensor, rank: int) -> None:
    """`add_grads` in PyTorch ops (reads the placement on the host)."""
    local = grad_EKN.shape[0]
    held: dict[int, list[int]] = {}
    for e, k in zip(expert_WR.flatten().tolist(), entries(expert_WR, local)):
        if e >= 0 and e // local == rank:
            held.setdefault(e - rank * local, []).append(k)
    for i, where in held.items():
        total = grad_EKN[i].float()
        for k in where:
            total = total + box[k].float()
        grad_EKN[i].copy_(total)


SLOT_ROWS_BLOCK = 1024  # slot rows a program of `_slot_rows_kernel` places


def slot_rows(counts_E: torch.Tensor, expert_R: torch.Tensor, bound: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where a rank's slot rows are among its dispatched rows (sorted by expert; `counts_E` its
    rows per expert, `expert_R` the expert in each of its slots or -1), at most `bound` of them,
    on the device: (idx_M int64, ends_R int32, used_M bool, write_M int64). Slot row m is
    dispatched row idx_M[m]; slot j's rows end at ends_R[j]; used_M: m is below the last end (the
    rest are padding, idx 0); write_M: idx_M[m], or for padding the first row of an expert with
    rows that no slot holds (0 where there is none). One Triton kernel where Triton runs (it
    replaces ~25 small kernels of the reference); else `slot_rows_reference`."""
    if not triton_usable(counts_E):
        return slot_rows_reference(counts_E, expert_R, bound)
    device = counts_E.device
    idx_M = torch.empty(bound, dtype=torch.int64, device=device)
    write_M = torch.empty(bound, dtype=torch.int64, device=device)
    used_M = torch.empty(bound, dtype=torch.bool, device=device)
    ends_R = torch.empty(expert_R.shape[0], dtype=torch.int32, device=device)
    experts, slots = counts_E.shape[0], expert_R.shape[0]
    _slot_rows_kernel[(max(1, triton.cdiv(bound, SLOT_ROWS_BLOCK)),)](
        counts_E.contiguous(), expert_R.contiguous(), idx_M, ends_R, used_M, write_M, bound, experts, slots,
        BLOCK_E=triton.next_power_of_2(experts), BLOCK_R=triton.next_power_of_2(slots), BLOCK_M=SLOT_ROWS_BLOCK)
    return idx_M, ends_R, used_M, write_M


def slot_rows_reference(counts_E: torch.Tensor, expert_R: torch.Tensor, bound: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`slot_rows` in PyTorch ops (small ops over the experts, slots and `bound` rows:
    deterministic, no host read)."""
    device, experts, slots = counts_E.device, counts_E.shape[0], expert_R.shape[0]
    counts_E = counts_E.to(torch.int64)
    firsts_E = torch.cumsum(counts_E, 0) - counts_E
    held_E = (torch.arange(experts, device=device)[:, None] == expert_R[None, :]).any(1)
    count_R = torch.where(expert_R >= 0, counts_E[expert_R.clamp(min=0)], 0)
    ends_R = torch.cumsum(count_R, 0)
    m = torch.arange(bound, device=device)
    j_M = torch.searchsorted(ends_R, m, right=True).clamp(max=slots - 1)
    used_M = m < ends_R[-1]
    idx_M = torch.where(used_M, firsts_E[expert_R.clamp(min=0)][j_M] + m - (ends_R - count_R)[j_M], 0)
    # padding writes to the first row of an expert no slot holds (there is one wherever there is padding)
    free = firsts_E.index_select(0, ((counts_E > 0) & ~held_E).to(torch.int32).argmax().view(1))
    return idx_M, ends_R.to(torch.int32), used_M, torch.where(used_M, idx_M, free)


def write_rows(into_ND: torch.Tensor, rows_MD: torch.Tensor, index_M: torch.Tensor, ends_R: torch.Tensor) -> None:
    """into[index[m]] = rows[m] (cast to into's dtype) for the m below the slots' last end
    (`ends_R[-1]`, on the device): the holder's slot rows written among its dispatched rows, in
    place; the rows past the end (padding) and the rows no slot computes are not touched. A
    Triton kernel (CUDA, or the CPU interpreter); callers elsewhere write with PyTorch ops."""
    if rows_MD.shape[0] == 0:
        return
    if into_ND.stride(1) != 1:
        raise ValueError(f"write_rows writes rows of unit column stride, got strides {into_ND.stride()}")
    _rows_launch(rows_MD.contiguous(), into_ND, index_M, ends_R, write=True)


def read_rows(from_ND: torch.Tensor, index_M: torch.Tensor, ends_R: torch.Tensor) -> torch.Tensor:
    """(M, D): row m = from[index[m]] for the m below the slots' last end (`ends_R[-1]`, on the
    device), the rows past it (padding) left undefined, as the grouped GEMM leaves its own: the
    holder's slot rows gathered from its dispatched rows without moving the padding. A Triton
    kernel (CUDA, or the CPU interpreter); its reference is `from.index_select(0, index)` on the
    rows below the end."""
    out_MD = from_ND.new_empty(index_M.shape[0], from_ND.shape[1])
    if index_M.shape[0] == 0:
        return out_MD
    if from_ND.stride(1) != 1:  # the kernel walks a row's columns one element apart
        from_ND = from_ND.contiguous()
    _rows_launch(out_MD, from_ND, index_M, ends_R, write=False)
    return out_MD


def _rows_launch(dense_MD: torch.Tensor, sparse_ND: torch.Tensor, index_M: torch.Tensor, ends_R: torch.Tensor,
                 write: bool) -> None:
    """`_rows_kernel` over the M rows of `dense_MD` (`_row_launch`)."""
    launch = _row_launch(dense_MD.shape[0], sparse_ND.shape[1])
    _rows_kernel[launch.pop("grid")](dense_MD, sparse_ND, index_M, ends_R, dense_MD.shape[0], sparse_ND.shape[1],
                                     sparse_ND.stride(0), R=ends_R.shape[0], WRITE=write, **launch)


def _row_launch(rows: int, columns: int) -> dict:
    """A row kernel's grid (`_rows_kernel`, `_activation_rows_kernel`): up to `ROW_PROGRAMS`
    programs down the rows, each taking every ROW_PROGRAMS-th row below the slots' end, read on
    the device (past it, nothing moves: a call whose slots hold nothing costs a load a program),
    one program per `ROW_BLOCK` columns across."""
    programs = min(rows, ROW_PROGRAMS)
    return dict(grid=(programs, triton.cdiv(columns, ROW_BLOCK)), BLOCK=ROW_BLOCK, PROGRAMS=programs)


def activate_rows(activation: str, h1_MH: torch.Tensor, h3_MH: torch.Tensor | None,
                  ends_R: torch.Tensor) -> torch.Tensor:
    """`activate(activation, h1, h3)` (weft.kernels.activation) of the slot rows below the slots'
    last end (`ends_R[-1]`, on the device), through autograd, each value rounded as PyTorch's ops
    round it; the rows past the end (padding) are left undefined, in the output and in the
    gradients, as the grouped GEMMs around it leave theirs. A Triton kernel where Triton runs
    (CUDA, or the CPU interpreter); else `activate` on every row, its reference."""
    if not triton_usable(h1_MH):
        return activate(activation, h1_MH, h3_MH)
    return _ActivateRows.apply(h1_MH.contiguous(), None if h3_MH is None else h3_MH.contiguous(), ends_R,
                               activation)


class _ActivateRows(torch.autograd.Function):
    """`activate_rows` on Triton: forward act(h1) (swiglu: silu(h1) * h3); backward dh1 (and
    dh3) from the saved h1 (and h3), as PyTorch's autograd of `activate` computes them."""

    @staticmethod
    def forward(ctx, h1_MH, h3_MH, ends_R, activation):
        ctx.activation = activation
        ctx.save_for_backward(h1_MH, h3_MH, ends_R)
        out_MH = h1_MH.new_empty(h1_MH.shape)
        _activation_launch(activation, h1_MH, h3_MH, ends_R, out_MH)
        return out_MH

    @staticmethod
    def backward(ctx, grad_MH):
        h1_MH, h3_MH, ends_R = ctx.saved_tensors
        dh1_MH = h1_MH.new_empty(h1_MH.shape)
        dh3_MH = None if h3_MH is None else h3_MH.new_empty(h3_MH.shape)
        _activation_launch(ctx.activation, h1_MH, h3_MH, ends_R, dh1_MH, grad_MH.contiguous(), dh3_MH)
        return dh1_MH, dh3_MH, None, None


def _activation_launch(activation: str, h1_MH: torch.Tensor, h3_MH: torch.Tensor | None, ends_R: torch.Tensor,
                       out_MH: torch.Tensor, grad_MH: torch.Tensor | None = None,
                       out3_MH: torch.Tensor | None = None) -> None:
    """`_activation_rows_kernel` over the rows (`_row_launch`): the forward into `out_MH`, or with
    `grad_MH` the backward into `out_MH` (dh1) and `out3_MH` (dh3)."""
    rows, hidden = h1_MH.shape
    if rows == 0:
        return
    launch = _row_launch(rows, hidden)
    _activation_rows_kernel[launch.pop("grid")](
        h1_MH, h1_MH if h3_MH is None else h3_MH, h1_MH if grad_MH is None else grad_MH, out_MH,
        out_MH if out3_MH is None else out3_MH, ends_R, rows, hidden, R=ends_R.shape[0],
        ACT=comet_kernels.ACTIVATIONS[activation], GRAD=grad_MH is not None, **launch)

if triton is not None:

    @triton.jit
    def _base(addr, like):
        """A peer buffer's address (int64) as a pointer to `like`'s dtype, 16-byte aligned."""
        return tl.multiple_of(addr.to(tl.pointer_type(like.dtype.element_ty)), 16)

    @triton.jit
    def _link_kernel(mine, table, like, expert_WR, rank, P, LOCAL: tl.constexpr, R: tl.constexpr,
                     SLOTS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr,
                     CHUNKS: tl.constexpr, ITERS: tl.constexpr, PULL: tl.constexpr):
        """For each of this rank's slots j that holds an expert, program i takes its chunks i,
        i + PROGRAMS, ...: read from the slot's entry of the owner's box into `mine` (PULL) or
        written there from `mine`. Reference: `link_reference`."""
        for j in tl.static_range(R):
            slot = rank * R + j
            e = tl.load(expert_WR + slot)
            if e >= 0:
                k = _entry(expert_WR, slot, LOCAL, SLOTS, BLOCK_S)
                box_j = _base(tl.load(table + e // LOCAL), like) + k.to(tl.int64) * P
                mine_j = mine + j * P.to(tl.int64)
                for it in range(ITERS):
                    chunk = it * PROGRAMS + tl.program_id(0)
                    offs = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
                    mask = (offs < P) & (chunk < CHUNKS)
                    if PULL:
                        tl.store(mine_j + offs, tl.load(box_j + offs, mask=mask).to(mine.dtype.element_ty),
                                 mask=mask)
                    else:
                        tl.store(box_j + offs, tl.load(mine_j + offs, mask=mask).to(like.dtype.element_ty),
                                 mask=mask)

    @triton.jit
    def _entry(expert_WR, slot, LOCAL: tl.constexpr, SLOTS: tl.constexpr, BLOCK_S: tl.constexpr):
        """Slot `slot`'s entry in its owner's box (`entries`); the slot holds an expert."""
        s = tl.arange(0, BLOCK_S)
        e_s = tl.load(expert_WR + s, mask=s < SLOTS, other=-1)
        owner = tl.load(expert_WR + slot) // LOCAL
        return tl.sum(((e_s >= 0) & (e_s // LOCAL == owner) & (s < slot)).to(tl.int32))

    @triton.jit
    def _stage_copies_kernel(src, box, expert_WR, rank, P, LOCAL: tl.constexpr, SLOTS: tl.constexpr,
                             BLOCK_S: tl.constexpr, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr,
                             ITERS: tl.constexpr):
        """Program (slot, i): if the slot holds an expert of this rank, copy chunks i,
        i + PROGRAMS, ... of its weight into this rank's box at the slot's entry. Reference:
        `stage_copies_reference`."""
        slot = tl.program_id(0)
        e = tl.load(expert_WR + slot)
        if (e >= 0) & (e // LOCAL == rank):
            k = _entry(expert_WR, slot, LOCAL, SLOTS, BLOCK_S)
            for it in range(ITERS):
                offs = (it * PROGRAMS + tl.program_id(1)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
                mask = offs < P
                values = tl.load(src + (e - rank * LOCAL) * P + offs, mask=mask)
                tl.store(box + k.to(tl.int64) * P + offs, values.to(box.dtype.element_ty), mask=mask)

    @triton.jit
    def _add_grads_kernel(grad, box, expert_WR, rank, P, LOCAL: tl.constexpr, SLOTS: tl.constexpr,
                          BLOCK_S: tl.constexpr, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr,
                          ITERS: tl.constexpr):
        """Program (slot, i): the first slot holding an expert of this rank adds chunks i,
        i + PROGRAMS, ... of every entry of that expert in this rank's box into grad, in slot
        order, in float32. Reference: `add_grads_reference`."""
        slot = tl.program_id(0)
        e = tl.load(expert_WR + slot)
        s = tl.arange(0, BLOCK_S)
        earlier = tl.sum(((tl.load(expert_WR + s, mask=s < SLOTS, other=-1) == e) & (s < slot)).to(tl.int32))
        if (e >= 0) & (e // LOCAL == rank) & (earlier == 0):
            for it in range(ITERS):
                offs = (it * PROGRAMS + tl.program_id(1)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
                mask = offs < P
                row = grad + (e - rank * LOCAL) * P + offs
                total = tl.load(row, mask=mask).to(tl.float32)
                for other in tl.static_range(SLOTS):
                    if tl.load(expert_WR + other) == e:
                        k = _entry(expert_WR, other, LOCAL, SLOTS, BLOCK_S)
                        total += tl.load(box + k.to(tl.int64) * P + offs, mask=mask).to(tl.float32)
                tl.store(row, total.to(grad.dtype.element_ty), mask=mask)

    @triton.jit
    def _rows_kernel(dense, sparse, index, ends, M, D, stride_sparse, R: tl.constexpr, BLOCK: tl.constexpr,
                     PROGRAMS: tl.constexpr, WRITE: tl.constexpr):
        """Program (i, column block): rows m = i, i + PROGRAMS, ... below the last end (and the
        M rows): `dense` row m into `sparse` row index[m] (WRITE, cast to its dtype), or from it.
        The loop's bound is read on the device, so a launch with no slot row costs one load a
        program. References: `write_rows`' PyTorch path and `index_select`."""
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < D
        end = tl.minimum(tl.load(ends + R - 1), M)
        m = tl.program_id(0)
        while m < end:  # (a while loop: Triton's interpreter takes no range with a bound read on the device)
            near = dense + m.to(tl.int64) * D + cols
            far = sparse + tl.load(index + m).to(tl.int64) * stride_sparse + cols
            if WRITE:
                tl.store(far, tl.load(near, mask=inside).to(sparse.dtype.element_ty), mask=inside)
            else:
                tl.store(near, tl.load(far, mask=inside), mask=inside)
            m += PROGRAMS

    @triton.jit
    def _activation_rows_kernel(h1, h3, grad, out, out3, ends, M, H, R: tl.constexpr, BLOCK: tl.constexpr,
                                PROGRAMS: tl.constexpr, ACT: tl.constexpr, GRAD: tl.constexpr):
        """Program (i, column block): rows m = i, i + PROGRAMS, ... below the last end (and the
        M rows; the loop's bound read on the device, as `_rows_kernel`'s): out = act(h1) (swiglu:
        silu(h1), rounded, times h3), or with GRAD out = dh1 and out3 = dh3 from grad, each
        product rounded to the dtype as PyTorch's autograd stores it (Comet's layer0 epilogue
        does the same: `_store_activation_half`)."""
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < H
        end = tl.minimum(tl.load(ends + R - 1), M)
        dtype = out.dtype.element_ty
        m = tl.program_id(0)
        while m < end:
            offs = m.to(tl.int64) * H + cols
            s = tl.load(h1 + offs, mask=inside).to(tl.float32)
            if ACT == 4:
                v3 = tl.load(h3 + offs, mask=inside).to(tl.float32)
                silu = act_value(s, 3).to(dtype).to(tl.float32)
                if GRAD:
                    g = tl.load(grad + offs, mask=inside).to(tl.float32)
                    tl.store(out + offs, act_grad((g * v3).to(dtype).to(tl.float32), s, 3).to(dtype),
                             mask=inside)
                    tl.store(out3 + offs, (g * silu).to(dtype), mask=inside)
                else:
                    tl.store(out + offs, (silu * v3).to(dtype), mask=inside)
            elif GRAD:
                g = tl.load(grad + offs, mask=inside).to(tl.float32)
                tl.store(out + offs, act_grad(g, s, ACT).to(dtype), mask=inside)
            else:
                tl.store(out + offs, act_value(s, ACT).to(dtype), mask=inside)
            m += PROGRAMS

    @triton.jit
    def _slot_rows_kernel(counts, expert_R, idx, ends_out, used, write, bound, E, R, BLOCK_E: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr):
        """Program i places slot rows i * BLOCK_M ... (each program recomputes the experts' and
        slots' few numbers; program 0 stores the slots' ends). Reference: `slot_rows_reference`."""
        e = tl.arange(0, BLOCK_E)
        r = tl.arange(0, BLOCK_R)
        counts_E = tl.load(counts + e, mask=e < E, other=0).to(tl.int64)
        expert = tl.load(expert_R + r, mask=r < R, other=-1).to(tl.int64)
        hit_RE = expert[:, None] == e[None, :]
        count_R = tl.sum(tl.where(hit_RE, counts_E[None, :], 0), axis=1)
        first_R = tl.sum(tl.where(e[None, :] < expert[:, None], counts_E[None, :], 0), axis=1)
        ends = tl.cumsum(count_R, axis=0)
        last = tl.sum(count_R, axis=0)
        if tl.program_id(0) == 0:
            tl.store(ends_out + r, ends.to(tl.int32), mask=r < R)
        held_E = tl.sum(hit_RE.to(tl.int32), axis=0) > 0
        free_e = tl.min(tl.where((counts_E > 0) & (held_E == 0) & (e < E), e, BLOCK_E), axis=0)
        free_e = tl.where(free_e == BLOCK_E, 0, free_e)
        free_row = tl.sum(tl.where(e < free_e, counts_E, 0), axis=0)
        m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        j = tl.minimum(tl.sum(((ends[None, :] <= m[:, None]) & (r[None, :] < R)).to(tl.int32), axis=1), R - 1)
        pick = r[None, :] == j[:, None]
        start_j = tl.sum(tl.where(pick, (ends - count_R)[None, :], 0), axis=1)
        first_j = tl.sum(tl.where(pick, first_R[None, :], 0), axis=1)
        inside = m < last
        row = tl.where(inside, first_j + m - start_j, 0)
        keep = m < bound
        tl.store(idx + m, row, mask=keep)
        tl.store(used + m, inside, mask=keep)
        tl.store(write + m, tl.where(inside, row, free_row), mask=keep)
