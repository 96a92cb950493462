"""Pro-Prophet's Trans and Agg through peer memory (sec. IV-A, fig. 6), each kernel beside its
PyTorch reference: the copies of heavy experts move between ranks by address, placed by a small
tensor on the device, so nothing is read on the host and a CUDA graph holds them.

The placement is `expert_WR` (int64, (W, R), the same on every rank): rank h's replica slot j
holds expert `expert_WR[h, j]`, or nothing (-1). Expert e is owned by rank e // El (El experts a
rank). Every rank's slots are a peer buffer (`weft.comm.peers`) of (R, P) values, P an expert
weight's elements, one buffer per weight.

- `push_copies` (Trans): each owner writes each of its experts that a slot holds into that slot,
  on the holder, by address; the owners' weights are read where they are (no staging copy).
- `pull_add_grads` (Agg): each owner adds every slot's gradient of each of its experts into its
  own gradient rows, the slots in (h, j) order, accumulated in float32, one program per element
  range of an expert (the first slot holding it sums for all): no atomics, deterministic.

Both run between peer-buffer barriers (the caller's): write, barrier, read. The Triton kernels
run on CUDA tensors, and on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1), where
the references are their oracle.
"""
from __future__ import annotations

import torch

from weft.kernels.rows import triton, triton_usable

if triton is not None:
    import triton.language as tl

BLOCK = 4096  # elements a program moves


def _flat(w: torch.Tensor) -> torch.Tensor:
    """(El, P) view of an expert weight (El, K, N), which must be contiguous."""
    if not w.is_contiguous():
        raise ValueError(f"replica copies need contiguous expert weights, got strides {w.stride()}")
    return w.view(w.shape[0], -1)


def push_copies(w_EKN: torch.Tensor, slots: list[torch.Tensor], table: torch.Tensor, expert_WR: torch.Tensor,
                rank: int) -> None:
    """Trans for one weight: every slot (h, j) holding one of this rank's experts gets that
    expert's `w` (El, K, N), cast to the slots' dtype, in rank h's buffer (`slots[h]` (R, K, N) as
    this process addresses it, `table` their addresses). Slots holding other ranks' experts are
    left to their owners. A weight of another dtype is cast first (as `Tensor.to` rounds)."""
    src = _flat(w_EKN.to(slots[rank].dtype))
    world, per_rank = expert_WR.shape
    if triton_usable(src):
        like = slots[rank]
        grid = (world * per_rank, triton.cdiv(src.shape[1], BLOCK))
        _push_copies_kernel[grid](src, table, like, expert_WR, rank, src.shape[1], LOCAL=src.shape[0], R=per_rank,
                                  BLOCK=BLOCK)
        return
    push_copies_reference(w_EKN, slots, expert_WR, rank)


def push_copies_reference(w_EKN: torch.Tensor, slots: list[torch.Tensor], expert_WR: torch.Tensor, rank: int) -> None:
    """`push_copies` in PyTorch ops (reads the placement on the host)."""
    local, per_rank = w_EKN.shape[0], expert_WR.shape[1]
    for slot, e in enumerate(expert_WR.flatten().tolist()):
        if e >= 0 and e // local == rank:
            slots[slot // per_rank][slot % per_rank].copy_(w_EKN[e - rank * local])


def pull_add_grads(grad_EKN: torch.Tensor, slots: list[torch.Tensor], table: torch.Tensor, expert_WR: torch.Tensor,
                   rank: int) -> None:
    """Agg for one weight: for each of this rank's experts e held in slots, grad[e] += the slots'
    gradients of e (rank h's slot j as `slots[h][j]`, (h, j) in order), summed in float32 with
    grad's value first and stored in grad's dtype, in place (rounded to nearest even on GPUs;
    Triton's CPU interpreter truncates a float32 sum stored as bfloat16)."""
    dst = _flat(grad_EKN)
    world, per_rank = expert_WR.shape
    if triton_usable(dst):
        like = slots[rank]
        grid = (world * per_rank, triton.cdiv(dst.shape[1], BLOCK))
        _pull_add_kernel[grid](dst, table, like, expert_WR, rank, dst.shape[1], LOCAL=dst.shape[0], R=per_rank,
                               SLOTS=world * per_rank, BLOCK_S=triton.next_power_of_2(world * per_rank), BLOCK=BLOCK)
        return
    pull_add_grads_reference(grad_EKN, slots, expert_WR, rank)


def pull_add_grads_reference(grad_EKN: torch.Tensor, slots: list[torch.Tensor], expert_WR: torch.Tensor,
                             rank: int) -> None:
    """`pull_add_grads` in PyTorch ops (reads the placement on the host)."""
    local, per_rank = grad_EKN.shape[0], expert_WR.shape[1]
    held: dict[int, list[int]] = {}
    for slot, e in enumerate(expert_WR.flatten().tolist()):
        if e >= 0 and e // local == rank:
            held.setdefault(e - rank * local, []).append(slot)
    for i, where in held.items():
        total = grad_EKN[i].float()
        for slot in where:
            total = total + slots[slot // per_rank][slot % per_rank].float()
        grad_EKN[i].copy_(total)


if triton is not None:

    @triton.jit
    def _base(addr, like):
        """A peer buffer's address (int64) as a pointer to `like`'s dtype, 16-byte aligned."""
        return tl.multiple_of(addr.to(tl.pointer_type(like.dtype.element_ty)), 16)

    @triton.jit
    def _push_copies_kernel(src, table, like, expert_WR, rank, P, LOCAL: tl.constexpr, R: tl.constexpr,
                            BLOCK: tl.constexpr):
        """Program (slot, chunk): if slot (h, j) holds an expert of this rank, copy chunk of its
        weight into rank h's buffer at slot j. Reference: `push_copies_reference`."""
        slot = tl.program_id(0)
        e = tl.load(expert_WR + slot)
        if (e >= 0) & (e // LOCAL == rank):
            offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < P
            values = tl.load(src + (e - rank * LOCAL) * P + offs, mask=mask)
            dst = _base(tl.load(table + slot // R), like) + (slot % R).to(tl.int64) * P
            tl.store(dst + offs, values.to(like.dtype.element_ty), mask=mask)

    @triton.jit
    def _pull_add_kernel(grad, table, like, expert_WR, rank, P, LOCAL: tl.constexpr, R: tl.constexpr,
                         SLOTS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr):
        """Program (slot, chunk): the first slot holding an expert of this rank adds chunk of every
        slot's gradient of that expert into grad, in slot order, in float32. Reference:
        `pull_add_grads_reference`."""
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
                    src = _base(tl.load(table + other // R), like) + P.to(tl.int64) * (other % R)
                    total += tl.load(src + offs, mask=mask).to(tl.float32)
            tl.store(row, total.to(grad.dtype.element_ty), mask=mask)
