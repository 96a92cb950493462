"""Pro-Prophet's Trans and Agg through peer memory (sec. IV-A, fig. 6): the owners' parts as
Triton kernels, each beside its PyTorch reference, placed by a small tensor on the device, so
nothing is read on the host and a CUDA graph holds them.

The placement is `expert_WR` (int64, (W, R), the same on every rank): rank h's replica slot j
holds expert `expert_WR[h, j]`, or nothing (-1). Expert e is owned by rank e // El (El experts a
rank). Slot f = h * R + j is its owner's entry number k(f): how many slots before f (in (h, j)
order) hold an expert of the same owner. An owner has at most R entries (`ReplicaSlots.place`
checks it), so every rank's box of R entries (a peer buffer of (R, P) values, P an expert
weight's elements, one per weight) holds them.

The owners' parts, here, touch only their own memory; the holders move the bytes across the link
(`weft.moe.exchange.replica_slots`, by the copy engine, at the entries `entries` gives):

- Trans: `stage_copies` (the owner copies each of its copied experts into its box), a barrier,
  then the holders read their slots' experts from the boxes.
- Agg: the holders write their slots' gradients into their owners' boxes, a barrier, then
  `add_grads` (each owner adds its box's gradients of each expert into its own gradient rows, in
  slot order, accumulated in float32, one program per element range of an expert (the first slot
  holding it sums for all): no atomics, deterministic).
- `write_rows`: a holder's slot rows written among its dispatched rows (the used ones only).

The Triton kernels run on CUDA tensors, and on CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1), where the references are their oracle.
"""
from __future__ import annotations

import torch

from weft.kernels.rows import triton, triton_usable

if triton is not None:
    import triton.language as tl

BLOCK = 4096  # elements a program moves
ROW_BLOCK = 512  # columns a program of `write_rows` moves


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


def _grid(slots: int, elements: int) -> tuple[int, int]:
    return slots, triton.cdiv(elements, BLOCK)


def stage_copies(w_EKN: torch.Tensor, box: torch.Tensor, expert_WR: torch.Tensor, rank: int) -> None:
    """Trans, the owner's part for one weight: each slot holding one of this rank's experts gets
    that expert's `w` (El, K, N), cast to the box's dtype (as `Tensor.to` rounds), at its entry of
    this rank's box (R, K, N). Local memory only."""
    src = _flat(w_EKN.to(box.dtype))
    world, per_rank = expert_WR.shape
    if triton_usable(src):
        _stage_copies_kernel[_grid(world * per_rank, src.shape[1])](
            src, box, expert_WR, rank, src.shape[1], LOCAL=src.shape[0], SLOTS=world * per_rank,
            BLOCK_S=triton.next_power_of_2(world * per_rank), BLOCK=BLOCK)
        return
    stage_copies_reference(w_EKN, box, expert_WR, rank)


def stage_copies_reference(w_EKN: torch.Tensor, box: torch.Tensor, expert_WR: torch.Tensor, rank: int) -> None:
    """`stage_copies` in PyTorch ops (reads the placement on the host)."""
    local = w_EKN.shape[0]
    for e, k in zip(expert_WR.flatten().tolist(), entries(expert_WR, local)):
        if e >= 0 and e // local == rank:
            box[k].copy_(w_EKN[e - rank * local])


def add_grads(grad_EKN: torch.Tensor, box: torch.Tensor, expert_WR: torch.Tensor, rank: int) -> None:
    """Agg, the owner's part for one weight: for each of this rank's experts e held in slots,
    grad[e] += its box's gradients of e (in slot order), summed in float32 with grad's value first
    and stored in grad's dtype, in place (rounded to nearest even on GPUs; Triton's CPU
    interpreter truncates a float32 sum stored as bfloat16). Local memory only."""
    dst = _flat(grad_EKN)
    world, per_rank = expert_WR.shape
    if triton_usable(dst):
        _add_grads_kernel[_grid(world * per_rank, dst.shape[1])](
            dst, box, expert_WR, rank, dst.shape[1], LOCAL=dst.shape[0], SLOTS=world * per_rank,
            BLOCK_S=triton.next_power_of_2(world * per_rank), BLOCK=BLOCK)
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


def write_rows(into_ND: torch.Tensor, rows_MD: torch.Tensor, index_M: torch.Tensor, ends_R: torch.Tensor) -> None:
    """into[index[m]] = rows[m] (cast to into's dtype) for the m below the slots' last end
    (`ends_R[-1]`, on the device): the holder's slot rows written among its dispatched rows, in
    place; the rows past the end (padding) and the rows no slot computes are not touched. A
    Triton kernel (CUDA, or the CPU interpreter); callers elsewhere write with PyTorch ops."""
    if rows_MD.shape[0] == 0:
        return
    grid = (rows_MD.shape[0], triton.cdiv(into_ND.shape[1], ROW_BLOCK))
    _write_rows_kernel[grid](into_ND, rows_MD.contiguous(), index_M, ends_R, into_ND.shape[1], into_ND.stride(0),
                             R=ends_R.shape[0], BLOCK=ROW_BLOCK)


if triton is not None:

    @triton.jit
    def _entry(expert_WR, slot, LOCAL: tl.constexpr, SLOTS: tl.constexpr, BLOCK_S: tl.constexpr):
        """Slot `slot`'s entry in its owner's box (`entries`); the slot holds an expert."""
        s = tl.arange(0, BLOCK_S)
        e_s = tl.load(expert_WR + s, mask=s < SLOTS, other=-1)
        owner = tl.load(expert_WR + slot) // LOCAL
        return tl.sum(((e_s >= 0) & (e_s // LOCAL == owner) & (s < slot)).to(tl.int32))

    @triton.jit
    def _stage_copies_kernel(src, box, expert_WR, rank, P, LOCAL: tl.constexpr, SLOTS: tl.constexpr,
                             BLOCK_S: tl.constexpr, BLOCK: tl.constexpr):
        """Program (slot, chunk): if the slot holds an expert of this rank, copy chunk of its
        weight into this rank's box at the slot's entry. Reference: `stage_copies_reference`."""
        slot = tl.program_id(0)
        e = tl.load(expert_WR + slot)
        if (e >= 0) & (e // LOCAL == rank):
            k = _entry(expert_WR, slot, LOCAL, SLOTS, BLOCK_S)
            offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < P
            values = tl.load(src + (e - rank * LOCAL) * P + offs, mask=mask)
            tl.store(box + k.to(tl.int64) * P + offs, values.to(box.dtype.element_ty), mask=mask)

    @triton.jit
    def _add_grads_kernel(grad, box, expert_WR, rank, P, LOCAL: tl.constexpr, SLOTS: tl.constexpr,
                          BLOCK_S: tl.constexpr, BLOCK: tl.constexpr):
        """Program (slot, chunk): the first slot holding an expert of this rank adds chunk of
        every entry of that expert in this rank's box into grad, in slot order, in float32.
        Reference: `add_grads_reference`."""
        slot = tl.program_id(0)
        e = tl.load(expert_WR + slot)
        s = tl.arange(0, BLOCK_S)
        earlier = tl.sum(((tl.load(expert_WR + s, mask=s < SLOTS, other=-1) == e) & (s < slot)).to(tl.int32))
        if (e >= 0) & (e // LOCAL == rank) & (earlier == 0):
            offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < P
            row = grad + (e - rank * LOCAL) * P + offs
            total = tl.load(row, mask=mask).to(tl.float32)
            for other in tl.static_range(SLOTS):
                if tl.load(expert_WR + other) == e:
                    k = _entry(expert_WR, other, LOCAL, SLOTS, BLOCK_S)
                    total += tl.load(box + k.to(tl.int64) * P + offs, mask=mask).to(tl.float32)
            tl.store(row, total.to(grad.dtype.element_ty), mask=mask)

    @triton.jit
    def _write_rows_kernel(into, rows, index, ends, D, stride_into, R: tl.constexpr, BLOCK: tl.constexpr):
        """Program (m, column block): row m, if below the last end, into its index's row."""
        m = tl.program_id(0)
        if m < tl.load(ends + R - 1):
            cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            inside = cols < D
            values = tl.load(rows + m.to(tl.int64) * D + cols, mask=inside)
            target = tl.load(index + m).to(tl.int64)
            tl.store(into + target * stride_into + cols, values.to(into.dtype.element_ty), mask=inside)
