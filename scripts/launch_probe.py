"""Host microseconds per call: a trivial Triton kernel (12 arguments) by `kernel[grid](...)`,
a small torch op, an allocation, and weft's one-pass routing (qwen2's shape) forward and forward
plus backward, each called back to back without synchronising (the GPU work is smaller than the
host's, so the wall time per call is the host's); `--profile`: cProfile of the routing's calls.
One GPU.
    PYTHONPATH=src python3 scripts/launch_probe.py [--profile]"""
import sys
import time

import torch
import triton
import triton.language as tl

from weft.kernels.token_choice import route_topk


@triton.jit
def _touch(a, b, c, d, e, f, n0, n1, n2, n3, FLAG: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(a + i, tl.load(b + i, mask=i < n0, other=0), mask=i < n0)


PROFILE = "--profile" in sys.argv


def host_us(fn, calls=2000):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def main():
    dev = torch.device("cuda")
    bufs = [torch.zeros(1024, device=dev) for _ in range(6)]
    args = (*bufs, 1024, 7, 4096, 64)
    print(f"triton kernel[grid](...)       {host_us(lambda: _touch[(1,)](*args, FLAG=True, BLOCK=1024)):7.1f} us")
    x = torch.zeros(1024, device=dev)
    print(f"torch x.add_(1)                {host_us(lambda: x.add_(1)):7.1f} us")
    print(f"torch.empty(1024)              {host_us(lambda: torch.empty(1024, device=dev)):7.1f} us")
    logits = torch.randn(4096, 64, device=dev)
    for cap in (256, None):
        print(f"route_topk fwd qwen2 cap {cap!s:5s} {host_us(lambda: route_topk(logits, 4, True, cap), 500):7.1f} us")
    lg = logits.clone().requires_grad_()

    def fwd_bwd():
        r = route_topk(lg, 4, True, 256)
        torch.autograd.backward([r.gates_TK, r.aux_loss], [torch.ones_like(r.gates_TK), torch.ones_like(r.aux_loss)])
    print(f"route_topk fwd+bwd             {host_us(fwd_bwd, 500):7.1f} us")
    if PROFILE:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            fwd_bwd()
        torch.cuda.synchronize()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
