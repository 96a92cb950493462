"""torch.optim.SGD's three implementations on qwen2's expert weights (one GPU): foreach (torch's
default on CUDA), fused, and single-tensor (foreach=False: one elementwise kernel per parameter),
with a 512 MiB device copy as the bandwidth yardstick; prints GPU ms, TB/s and the host's us per
step for each round, and whether the steps give bitwise equal weights.
    python3 scripts/sgd_probe.py
(docs/benchmarks.md, twenty-fifth and twenty-seventh sessions.)"""
import time

import torch

torch.manual_seed(0)
E, D, H = 64, 2048, 1408
ps = [torch.nn.Parameter(torch.randn(E, D, H, device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(2)]
ps.append(torch.nn.Parameter(torch.randn(D, E, device="cuda")))
for p in ps:
    p.grad = torch.randn_like(p) * 1e-3
nbytes = sum(p.numel() * p.element_size() * 3 for p in ps)
KINDS = {"foreach": dict(foreach=True), "fused": dict(fused=True), "single": dict(foreach=False)}
opts = {kind: torch.optim.SGD(ps, lr=1e-9, **flags) for kind, flags in KINDS.items()}
x = torch.empty(2**28, device="cuda", dtype=torch.bfloat16)
y = torch.empty_like(x)
for rnd in range(3):
    for kind, opt in opts.items():
        for _ in range(5):
            opt.step()
        st, en = torch.cuda.Event(True), torch.cuda.Event(True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        st.record()
        for _ in range(40):
            opt.step()
        en.record()
        host_us = (time.perf_counter() - t0) / 40 * 1e6
        torch.cuda.synchronize()
        ms = st.elapsed_time(en) / 40
        print(f"round {rnd} {kind:8s} {ms:.3f} ms  {nbytes/ms/1e9:.2f} TB/s  host {host_us:.0f} us")
    st.record()
    for _ in range(20):
        y.copy_(x)
    en.record()
    torch.cuda.synchronize()
    ms = st.elapsed_time(en) / 20
    print(f"round {rnd} copy 512MiB {ms:.3f} ms {2*x.numel()*2/ms/1e9:.2f} TB/s")
results = {}
for kind, flags in KINDS.items():
    copies = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    for c, p in zip(copies, ps):
        c.grad = p.grad.clone()
    torch.optim.SGD(copies, lr=1e-2, **flags).step()
    results[kind] = copies
for kind in ("fused", "single"):
    print(f"{kind} == foreach bitwise:", all(torch.equal(p, q) for p, q in zip(results[kind], results["foreach"])))
