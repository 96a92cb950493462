"""One AdamW update of a tensor whose float32 master copy is updated from a low-precision
gradient, in one pass over memory: `adamw_step`.

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

The Triton kernel runs on CUDA tensors (and on CPU tensors under TRITON_INTERPRET=1, which is how
the CPU suite tests it); `adamw_step_reference` is the same update in PyTorch ops, the CPU path
and the test oracle.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from weft.kernels.rows import triton_usable

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


def adamw_step(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               hyper: AdamWHyper, grad_scale: Scale = 1.0, copy: torch.Tensor | None = None,
               skip: torch.Tensor | None = None) -> None:
    """The update in place: the Triton kernel where it can run (contiguous tensors on CUDA, or the
    CPU under TRITON_INTERPRET=1), the reference otherwise."""
    _check(master, grad, exp_avg, exp_avg_sq, copy)
    tensors = [master, grad, exp_avg, exp_avg_sq] + ([copy] if copy is not None else [])
    if not triton_usable(master) or not all(t.is_contiguous() for t in tensors) or master.numel() == 0:
        _update(master, grad, exp_avg, exp_avg_sq, hyper, grad_scale, copy, skip)
        return
    n = master.numel()
    scale_in_memory = isinstance(grad_scale, torch.Tensor)
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](
        master, grad, exp_avg, exp_avg_sq, copy if copy is not None else master, n,
        hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay,
        hyper.lr / hyper.bias_correction1, hyper.bias_correction2_sqrt,
        grad_scale if scale_in_memory else master, 1.0 if scale_in_memory else float(grad_scale),
        skip if skip is not None else master,
        HAS_COPY=copy is not None, SCALE_IN_MEMORY=scale_in_memory, HAS_SKIP=skip is not None, BLOCK=BLOCK)


if triton is not None:
    @triton.jit
    def _adamw_kernel(master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, copy_ptr, n,
                      lr, beta1, beta2, eps, weight_decay, step_size, bias_correction2_sqrt, scale_ptr, grad_scale,
                      skip_ptr, HAS_COPY: tl.constexpr, SCALE_IN_MEMORY: tl.constexpr, HAS_SKIP: tl.constexpr,
                      BLOCK: tl.constexpr):
        """One block of BLOCK elements; each element read and written once (none where `skip`)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        if HAS_SKIP:
            mask = mask & (tl.load(skip_ptr).to(tl.int32) == 0)
        if SCALE_IN_MEMORY:
            grad_scale = tl.load(scale_ptr)
        p = tl.load(master_ptr + offs, mask=mask, other=0.0)
        g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32) * grad_scale
        m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
        v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0)
        p = p * (1 - lr * weight_decay)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        denom = tl.sqrt(v) / bias_correction2_sqrt + eps
        p = p - step_size * (m / denom)
        tl.store(master_ptr + offs, p, mask=mask)
        tl.store(exp_avg_ptr + offs, m, mask=mask)
        tl.store(exp_avg_sq_ptr + offs, v, mask=mask)
        if HAS_COPY:
            tl.store(copy_ptr + offs, p.to(copy_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
