"""The tensor memory accelerator's host descriptors (Triton >= 3.4), and which operands it reads.
Older Tritons (the ones older torch releases bring) have no host descriptors: `TensorDescriptor`
is None there and the kernels read every operand by pointer."""
from __future__ import annotations

import torch

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None


def takes(m: torch.Tensor) -> bool:
    """A 2-D operand the tensor memory accelerator can read: row-major, 16-byte aligned base and
    row stride, on an sm90+ GPU (or the CPU interpreter, which runs descriptors as loads), with a
    Triton that has host tensor descriptors."""
    if TensorDescriptor is None or (m.is_cuda and torch.cuda.get_device_capability(m.device)[0] < 9):
        return False
    return m.stride(1) == 1 and m.data_ptr() % 16 == 0 and m.stride(0) * m.element_size() % 16 == 0
