"""Triton kernels for the tests of `weft.testing`'s interpreter patches (imported by a rank with
TRITON_INTERPRET=1 set): one calls a `@triton.jit` device function twice per program
(`patch_interpreter_once`), one does int32 arithmetic that overflows
(`skip_discarded_overflow_checks`)."""
import triton
import triton.language as tl


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def four_x_plus_one_kernel(src, out, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + i, _twice(_twice(tl.load(src + i))) + 1)


@triton.jit
def wrapping_int32_kernel(src, out, BLOCK: tl.constexpr):
    """`src * 65536 + index` in int32: past 2**31 it wraps (the overflow check's verdict is dropped)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + i, tl.load(src + i) * 65536 + i)
