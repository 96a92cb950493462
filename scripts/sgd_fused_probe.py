"""Does the SGD update cost less inside the weight-gradient GEMM? One GPU, a config's per-rank
expert shapes on 2 ranks (E/2 local experts, 4,096 tokens x k rows): both expert weights' gradients
and their SGD updates, (a) as today, each gradient by cuBLAS `bmm` (padded) or CUTLASS
`torch._grouped_mm` (dropless counts) and then `w.add_(g, alpha=-lr)`, (b) fused: the update as
the GEMM's epilogue, `w.baddbmm_(x^T, dy, alpha=-lr)` (cuBLAS's beta = 1) for padded rows and
`weft.kernels.grouped_wgrad(..., into=w, alpha=-lr)` for dropless counts. Each case one CUDA graph,
GPU ms a replay (20 replays between events), cases interleaved round by round. Prints a table and
writes JSON to $OUT/sgd_fused_probe.json.

    PYTHONPATH=src python3 scripts/sgd_fused_probe.py [--configs phi35 mixtral qwen2]
"""
from __future__ import annotations

import sgd_overlap_probe  # this folder: the configs' per-rank shapes, a case's row, the command line
import torch
from sgd_overlap_probe import report, shapes

from weft.graphs import GraphedStep
from weft.kernels.grouped_wgrad import grouped_wgrad
from weft.profiling import seconds_per_call

LR = 1e-30  # nonzero (so no library may skip the product), too small to change a bf16 weight


def routed_ends(local: int, rows: int, seed: int = 0) -> torch.Tensor:
    """int32 ends of `local` groups of a random routing's counts, local * rows rows in all."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.bincount(torch.randint(0, local, (local * rows,), generator=gen), minlength=local)
    return counts.cumsum(0).to(torch.int32).cuda()


def probe(config: str, rounds: int) -> list[dict]:
    e, r, d, h = shapes(config)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, dh, act, dy = (torch.randn(e, r, n, **bf) for n in (d, h, h, d))
    w1, w2 = torch.randn(e, d, h, **bf) * 0.02, torch.randn(e, h, d, **bf) * 0.02
    ends = routed_ends(e, r)
    x2, dh2, act2, dy2 = (t.view(e * r, -1) for t in (x, dh, act, dy))

    def padded_then_add():
        w1.add_(torch.bmm(x.transpose(1, 2), dh), alpha=-LR)
        w2.add_(torch.bmm(act.transpose(1, 2), dy), alpha=-LR)

    def padded_fused():
        w1.baddbmm_(x.transpose(1, 2), dh, alpha=-LR)
        w2.baddbmm_(act.transpose(1, 2), dy, alpha=-LR)

    def padded_triton_fused():
        grouped_wgrad(x2, dh2, (torch.arange(1, e + 1, device="cuda") * r).to(torch.int32), into=w1, alpha=-LR)
        grouped_wgrad(act2, dy2, (torch.arange(1, e + 1, device="cuda") * r).to(torch.int32), into=w2, alpha=-LR)

    def dropless_then_add():
        w1.add_(torch._grouped_mm(x2.T, dh2, offs=ends), alpha=-LR)
        w2.add_(torch._grouped_mm(act2.T, dy2, offs=ends), alpha=-LR)

    def dropless_triton_then_add():
        w1.add_(grouped_wgrad(x2, dh2, ends), alpha=-LR)
        w2.add_(grouped_wgrad(act2, dy2, ends), alpha=-LR)

    def dropless_fused():
        grouped_wgrad(x2, dh2, ends, into=w1, alpha=-LR)
        grouped_wgrad(act2, dy2, ends, into=w2, alpha=-LR)

    def padded_grads_alone():
        torch.bmm(x.transpose(1, 2), dh)
        torch.bmm(act.transpose(1, 2), dy)

    cases = {"padded: bmm, then add": padded_then_add, "padded: baddbmm_ (fused)": padded_fused,
             "padded: Triton into w (fused)": padded_triton_fused, "padded: bmm alone": padded_grads_alone,
             "dropless: _grouped_mm, then add": dropless_then_add,
             "dropless: Triton, then add": dropless_triton_then_add,
             "dropless: Triton into w (fused)": dropless_fused, "padded: bmm, then add (again)": padded_then_add}
    steps = {name: GraphedStep(lambda _, fn=fn: fn(), [torch.zeros(1, device="cuda")]) for name, fn in cases.items()}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name].append(seconds_per_call(step.graph.replay, torch.device("cuda"), 20) * 1e3)
    return [report(config, name, ms) for name, ms in times.items()]


if __name__ == "__main__":
    sgd_overlap_probe.main(probe, 7, "sgd_fused_probe.json", __doc__)
