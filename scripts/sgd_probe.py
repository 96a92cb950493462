"""torch.optim.SGD's foreach against its fused step on qwen2's expert weights (one GPU), with a
512 MiB device copy as the bandwidth yardstick; prints ms and TB/s per round and whether the two
steps give bitwise equal weights.
    python3 scripts/sgd_probe.py
(docs/benchmarks.md, twenty-fifth session: the throwaway probe this keeps, as it ran.)"""
import torch

torch.manual_seed(0)
E, D, H = 64, 2048, 1408
ps = [torch.nn.Parameter(torch.randn(E, D, H, device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(2)]
ps.append(torch.nn.Parameter(torch.randn(D, E, device="cuda")))
for p in ps:
    p.grad = torch.randn_like(p) * 1e-3
nbytes = sum(p.numel() * p.element_size() * 3 for p in ps)
opts = {k: torch.optim.SGD(ps, lr=1e-9, **{k: True}) for k in ("foreach", "fused")}
x = torch.empty(2**28, device="cuda", dtype=torch.bfloat16)
y = torch.empty_like(x)
for rnd in range(3):
    for kind, opt in opts.items():
        for _ in range(5):
            opt.step()
        st, en = torch.cuda.Event(True), torch.cuda.Event(True)
        torch.cuda.synchronize()
        st.record()
        for _ in range(40):
            opt.step()
        en.record()
        torch.cuda.synchronize()
        ms = st.elapsed_time(en) / 40
        print(f"round {rnd} {kind:8s} {ms:.3f} ms  {nbytes/ms/1e9:.2f} TB/s")
    st.record()
    for _ in range(20):
        y.copy_(x)
    en.record()
    torch.cuda.synchronize()
    ms = st.elapsed_time(en) / 20
    print(f"round {rnd} copy 512MiB {ms:.3f} ms {2*x.numel()*2/ms/1e9:.2f} TB/s")
a = [torch.nn.Parameter(p.detach().clone()) for p in ps]
b = [torch.nn.Parameter(p.detach().clone()) for p in ps]
for p, q, r in zip(a, b, ps):
    p.grad = r.grad.clone()
    q.grad = r.grad.clone()
torch.optim.SGD(a, lr=1e-2, foreach=True).step()
torch.optim.SGD(b, lr=1e-2, fused=True).step()
print("fused == foreach bitwise:", all(torch.equal(p, q) for p, q in zip(a, b)))
