"""A Triton kernel that calls a `@triton.jit` device function twice per program, for the test of
`weft.testing.patch_interpreter_once` (imported by a rank with TRITON_INTERPRET=1 set)."""
import triton
import triton.language as tl


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def four_x_plus_one_kernel(src, out, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + i, _twice(_twice(tl.load(src + i))) + 1)
