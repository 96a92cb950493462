"""One AdamW update of a tensor whose float32 master copy is updated from a low-precision
gradient, in one pass over memory: `adamw_step` (one tensor), `adamw_steps` (many, one launch).

For each element, with g = grad * grad_scale in float32 (the scale is gradient clipping's
coefficient, 1 without clipping; a number, or a one-element float32 tensor the kernel reads from
memory, so the host need not wait for the norm it comes from):

    master <- master * (1 - lr * weight_decay)                     (decoupled weight decay)
    exp_avg <- beta1 * exp_avg + (1 - beta1) * g
    exp_avg_sq <- beta2 * exp_avg_sq + (1 - beta2) * g * g
    master <- master - lr / (1 - beta1^t) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2^t) + eps)
    copy <- master rounded to copy's dtype                          (when a copy is given)

the update of `torch.optim.AdamW` (Loshchilov & Hutter), in the order of torch's fused CUDA
kernel, so the two agree to float32 rounding. `master`, `exp_avg` and `exp_avg_sq` are float32;
`grad` float32 or bfloat16 / float16 (read as stored: no float32 copy of it is made); `copy` the
model's low-precision parameter, written from the new master in the same pass. Memory traffic per
element with a bf16 gradient and copy: 14 bytes read, 14 written, against 28 + 6 (the gradient's
cast to float32) + 8 (clipping's separate scaling) + 6 (autocast's cast of the weight in the next
forward) for torch's fused AdamW on float32 parameters. `skip` (a one-element bool tensor, e.g.
"the gradient norm is not finite"): where true nothing is written, decided on the device (the
PyTorch reference reads it on the host).

`adamw_steps` updates many tensors with one launch per kind of tensor (their addresses and
hyperparameters in a table): on a GPU the same bits as `adamw_step` on each (Triton's CPU
interpreter passes `adamw_step`'s hyperparameters in float64 and rounds a fused multiply-add
twice, so there the two agree to float32 rounding).

The Triton kernels run on CUDA tensors (and on CPU tensors under TRITON_INTERPRET=1, which is how
the CPU suite tests it); `adamw_step_reference` is the same update in PyTorch ops, the CPU path
and the test oracle.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from weft.kernels import multi_tensor
from weft.kernels.multi_tensor import aligned, block_table, kernel_takes, on_device, on_gpu_of

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch reference remains
    triton = None

BLOCK = 1024


@dataclass(frozen=True)
class AdamWHyper:
    """One parameter group's hyperparameters at one step (`step` counts from 1)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int

    @property
    def bias_correction1(self) -> float:
        return 1 - self.beta1 ** self.step

    @property
    def bias_correction2_sqrt(self) -> float:
        return math.sqrt(1 - self.beta2 ** self.step)


def _check(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
           copy: torch.Tensor | None) -> None:
    for name, t in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32:
            raise TypeError(f"adamw_step: {name} must be float32, got {t.dtype}")
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("copy", copy)):
        if t is not None and t.shape != master.shape:
            raise ValueError(f"adamw_step: {name} has shape {tuple(t.shape)}, the master {tuple(master.shape)}")


Scale = float | torch.Tensor  # a number, or a one-element float32 tensor on the update's device


def adamw_step_reference(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                         hyper: AdamWHyper, grad_scale: Scale = 1.0, copy: torch.Tensor | None = None,
                         skip: torch.Tensor | None = None) -> None:
    """The update in PyTorch ops, in place (see the module docstring)."""
    _check(master, grad, exp_avg, exp_avg_sq, copy)
    _update(master, grad, exp_avg, exp_avg_sq, hyper, grad_scale, copy, skip)


def _update(master, grad, exp_avg, exp_avg_sq, hyper: AdamWHyper, grad_scale: Scale, copy, skip) -> None:
    if skip is not None and bool(skip):
        return
    g = grad.float() * grad_scale
    master.mul_(1 - hyper.lr * hyper.weight_decay)
    exp_avg.mul_(hyper.beta1).add_(g, alpha=1 - hyper.beta1)
    exp_avg_sq.mul_(hyper.beta2).addcmul_(g, g, value=1 - hyper.beta2)
    denom = exp_avg_sq.sqrt().div_(hyper.bias_correction2_sqrt).add_(hyper.eps)
    master.addcdiv_(exp_avg, denom, value=-hyper.lr / hyper.bias_correction1)
    if copy is not None:
        copy.copy_(master)


@dataclass(frozen=True, eq=False)
class AdamWUpdate:
    """One tensor's update in `adamw_steps`: `adamw_step`'s arguments but the scale and skip."""

    master: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    hyper: AdamWHyper
    copy: torch.Tensor | None = None


def adamw_step(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               hyper: AdamWHyper, grad_scale: Scale = 1.0, copy: torch.Tensor | None = None,
               skip: torch.Tensor | None = None) -> None:
    """The update in place: the Triton kernel where it can run (contiguous tensors on CUDA, or the
    CPU under TRITON_INTERPRET=1), the reference otherwise. One tensor, its hyperparameters passed
    as the kernel's arguments (`adamw_steps` reads them from a table it copies to the device)."""
    _check(master, grad, exp_avg, exp_avg_sq, copy)
    tensors = [t for t in (master, grad, exp_avg, exp_avg_sq, copy) if t is not None]
    if not kernel_takes(tensors) or master.numel() == 0:
        _update(master, grad, exp_avg, exp_avg_sq, hyper, grad_scale, copy, skip)
        return
    scale_in_memory = isinstance(grad_scale, torch.Tensor)
    _adamw_kernel[(triton.cdiv(master.numel(), BLOCK),)](
        master, grad, exp_avg, exp_avg_sq, copy if copy is not None else master, master.numel(),
        hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay,
        hyper.lr / hyper.bias_correction1, hyper.bias_correction2_sqrt,
        grad_scale if scale_in_memory else master, 1.0 if scale_in_memory else float(grad_scale),
        skip if skip is not None else master,
        HAS_COPY=copy is not None, SCALE_IN_MEMORY=scale_in_memory, HAS_SKIP=skip is not None, BLOCK=BLOCK)


def adamw_steps(updates: list[AdamWUpdate], grad_scale: Scale = 1.0, skip: torch.Tensor | None = None) -> None:
    """`adamw_step` of every update, with one `grad_scale` and `skip`: one Triton launch for all
    the tensors of one kind (device, gradient and copy dtypes, 16-byte alignment), whose programs
    find their tensor in a table of addresses and per-tensor hyperparameters (the multi-tensor
    form of torch's fused optimizers): a launch per tensor leaves the GPU a gap between each two
    kernels (docs/benchmarks.md, forty-eighth session). The same arithmetic per element as
    `adamw_step`, with the same float32 hyperparameters: on a GPU bitwise the same results. The host
    builds the table before the first launch, so from an idle GPU the pass starts later; a
    training step launches it while its backward runs. Tensors the kernel cannot take
    (non-contiguous, or on the CPU without the interpreter) run the reference."""
    kinds: dict[tuple, list[AdamWUpdate]] = {}
    for u in updates:
        _check(u.master, u.grad, u.exp_avg, u.exp_avg_sq, u.copy)
        tensors = _tensors(u)
        if not kernel_takes(tensors):
            _update(u.master, u.grad, u.exp_avg, u.exp_avg_sq, u.hyper, grad_scale, u.copy, skip)
        elif u.master.numel():
            kind = (u.master.device, u.grad.dtype, None if u.copy is None else u.copy.dtype, aligned(tensors))
            kinds.setdefault(kind, []).append(u)
    for (device, _, _, is_aligned), group in kinds.items():
        _launch_many(group, device, is_aligned, grad_scale, skip)


def _tensors(u: AdamWUpdate) -> list[torch.Tensor]:
    return [u.master, u.grad, u.exp_avg, u.exp_avg_sq] + ([u.copy] if u.copy is not None else [])


def _launch_many(group: list[AdamWUpdate], device: torch.device, is_aligned: bool, grad_scale: Scale,
                 skip: torch.Tensor | None) -> None:
    """One launch over `group`'s tensors (`weft.kernels.multi_tensor`'s table: per tensor the
    addresses of master, grad, exp_avg, exp_avg_sq and copy, the master's where there is none)."""
    table, blocks = block_table([u.master.numel() for u in group],
                                [[t.data_ptr() for t in _tensors(u)] + ([] if u.copy is not None else
                                                                         [u.master.data_ptr()]) for u in group], BLOCK)
    hyper = [v for u in group for v in (u.hyper.lr, u.hyper.beta1, u.hyper.beta2, u.hyper.eps, u.hyper.weight_decay,
                                        u.hyper.lr / u.hyper.bias_correction1, u.hyper.bias_correction2_sqrt)]
    first = group[0]
    scale_in_memory = isinstance(grad_scale, torch.Tensor)
    with on_gpu_of(device):  # the copies and the launch on the tensors' GPU, its current stream
        table_t, hyper_t = on_device(table, torch.int64, device), on_device(hyper, torch.float32, device)
        _adamw_many_kernel[(blocks,)](
            table_t, hyper_t, len(group), first.master, first.grad, first.master if first.copy is None else first.copy,
            grad_scale if scale_in_memory else first.master, 1.0 if scale_in_memory else float(grad_scale),
            skip if skip is not None else first.master,
            HAS_COPY=first.copy is not None, SCALE_IN_MEMORY=scale_in_memory, HAS_SKIP=skip is not None,
            ALIGNED=is_aligned, BLOCK=BLOCK)


if triton is not None:
    row_address, tensor_of_block = multi_tensor.row_address, multi_tensor.tensor_of_block  # jit helpers

    @triton.jit
    def _adamw_block(master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, copy_ptr, offs, mask,
                     lr, beta1, beta2, eps, weight_decay, step_size, bias_correction2_sqrt, grad_scale,
                     HAS_COPY: tl.constexpr):
        """One block of elements `offs` (where `mask`), each read and written once. Every product
        that meets a sum is an explicit fused multiply-add: which of two products the compiler
        would fuse on its own may differ between kernels (vectorised or not), and then so would
        the last bit; so both kernels give the same bits."""
        p = tl.load(master_ptr + offs, mask=mask, other=0.0)
        g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32) * grad_scale
        m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
        v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0)
        p = p * tl.fma(-lr, weight_decay, 1.0)
        m = tl.fma(beta1, m, (1 - beta1) * g)
        v = tl.fma(beta2, v, (1 - beta2) * g * g)
        denom = tl.sqrt(v) / bias_correction2_sqrt + eps
        p = tl.fma(-step_size, m / denom, p)
        tl.store(master_ptr + offs, p, mask=mask)
        tl.store(exp_avg_ptr + offs, m, mask=mask)
        tl.store(exp_avg_sq_ptr + offs, v, mask=mask)
        if HAS_COPY:
            tl.store(copy_ptr + offs, p.to(copy_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)

    @triton.jit
    def _adamw_kernel(master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, copy_ptr, n,
                      lr, beta1, beta2, eps, weight_decay, step_size, bias_correction2_sqrt, scale_ptr, grad_scale,
                      skip_ptr, HAS_COPY: tl.constexpr, SCALE_IN_MEMORY: tl.constexpr, HAS_SKIP: tl.constexpr,
                      BLOCK: tl.constexpr):
        """One tensor: program b updates its block b (none where `skip`)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        if HAS_SKIP:
            mask = mask & (tl.load(skip_ptr).to(tl.int32) == 0)
        if SCALE_IN_MEMORY:
            grad_scale = tl.load(scale_ptr)
        _adamw_block(master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, copy_ptr, offs, mask, lr, beta1, beta2, eps,
                     weight_decay, step_size, bias_correction2_sqrt, grad_scale, HAS_COPY)

    @triton.jit
    def _adamw_many_kernel(table, hyper, n_tensors, master_like, grad_like, copy_like, scale_ptr, grad_scale,
                           skip_ptr, HAS_COPY: tl.constexpr, SCALE_IN_MEMORY: tl.constexpr,
                           HAS_SKIP: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
        """Block b of the launch: its tensor t (`tensor_of_block`), then t's numel and five
        addresses (`table[n_tensors + 1 + 6t :]`) and seven hyperparameters (`hyper[7t :]`: lr,
        beta1, beta2, eps, weight decay, step size, sqrt of the second bias correction)."""
        b = tl.program_id(0)
        lo = tensor_of_block(table, n_tensors, b)
        row = table + n_tensors + 1 + 6 * lo
        n = tl.load(row)
        start = (b - tl.load(table + lo)) * BLOCK
        offs = start + tl.arange(0, BLOCK)
        # a whole block's mask is one value for all its elements, so aligned loads and stores move
        # 16 bytes at a time (the mask `offs < n` of an n not known to divide by 4 would not let them)
        mask = tl.full((BLOCK,), 1, tl.int1)
        if HAS_SKIP:
            mask = mask & (tl.load(skip_ptr).to(tl.int32) == 0)
        if SCALE_IN_MEMORY:
            grad_scale = tl.load(scale_ptr)
        h = hyper + 7 * lo
        master, grad = row_address(row, 1, master_like, ALIGNED), row_address(row, 2, grad_like, ALIGNED)
        exp_avg, exp_avg_sq = row_address(row, 3, master_like, ALIGNED), row_address(row, 4, master_like, ALIGNED)
        copy = row_address(row, 5, copy_like, ALIGNED)
        lr, beta1, beta2, eps = tl.load(h), tl.load(h + 1), tl.load(h + 2), tl.load(h + 3)
        weight_decay, step_size, bias_correction2_sqrt = tl.load(h + 4), tl.load(h + 5), tl.load(h + 6)
        if start + BLOCK <= n:
            _adamw_block(master, grad, exp_avg, exp_avg_sq, copy, offs, mask, lr, beta1, beta2, eps, weight_decay,
                         step_size, bias_correction2_sqrt, grad_scale, HAS_COPY)
        else:  # the tensor's last, partial block
            _adamw_block(master, grad, exp_avg, exp_avg_sq, copy, offs, mask & (offs < n), lr, beta1, beta2, eps,
                         weight_decay, step_size, bias_correction2_sqrt, grad_scale, HAS_COPY)
