"""Does an SGD update run beside the expert GEMMs for free? One GPU, a config's per-rank expert
shapes on 2 ranks (E/2 local experts, 4,096 tokens x k rows): the backward's last two GEMMs of the
first expert weight (dx = dh w1^T, dw1 = x^T dh, cuBLAS bmm) and the SGD update of the second
weight (w2 += -lr g2), captured as one CUDA graph either one after another or with the update on a
side stream beside the GEMMs; the update by torch's add or by a Triton grid-stride kernel on a few
programs (so that the GEMMs keep most SMs). GPU ms a replay (CUDA events over 20 replays, median of
rounds). Prints a table and writes JSON to $OUT/sgd_overlap_probe.json.

    PYTHONPATH=src python3 scripts/sgd_overlap_probe.py [--configs phi35 mixtral qwen2]
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch
import triton
import triton.language as tl

from weft.bench.layer import CONFIGS
from weft.graphs import GraphedStep
from weft.jsonfile import write_json
from weft.profiling import seconds_per_call


@triton.jit
def _sgd_kernel(w_ptr, g_ptr, n, lr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        w = tl.load(w_ptr + offs, mask=mask).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
        tl.store(w_ptr + offs, (w - lr * g).to(w_ptr.dtype.element_ty), mask=mask)


def sgd_triton(w: torch.Tensor, g: torch.Tensor, programs: int) -> None:
    _sgd_kernel[(programs,)](w, g, w.numel(), 1e-9, BLOCK=4096, num_warps=4)


def shapes(config: str) -> tuple[int, int, int, int]:
    cfg = CONFIGS[config]
    local = cfg.num_experts // 2
    rows = 4096 * cfg.top_k * 2 // cfg.num_experts
    return local, rows, cfg.dim, cfg.hidden_dim


def graph_ms(fn, rounds: int) -> list[float]:
    """ms a replay of `fn` captured as one CUDA graph (`weft.graphs.GraphedStep`), 20 replays between
    events (`weft.profiling.seconds_per_call`), once per round."""
    step = GraphedStep(lambda _: fn(), [torch.zeros(1, device="cuda")])
    return [seconds_per_call(step.graph.replay, torch.device("cuda"), 20) * 1e3 for _ in range(rounds)]


def probe(config: str, rounds: int) -> list[dict]:
    e, r, d, h = shapes(config)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, dh = torch.randn(e, r, d, **bf), torch.randn(e, r, h, **bf)
    w1 = torch.randn(e, d, h, **bf)
    w2, g2 = torch.randn(e, h, d, **bf), torch.randn(e, h, d, **bf) * 1e-3
    dx, dw1 = torch.empty(e, r, d, **bf), torch.empty(e, d, h, **bf)

    def gemms():
        torch.bmm(dh, w1.transpose(1, 2), out=dx)
        torch.bmm(x.transpose(1, 2), dh, out=dw1)

    def update(kind: str):
        if kind == "torch add":
            w2.add_(g2, alpha=-1e-9)
        else:
            sgd_triton(w2, g2, int(kind.split()[1]))

    def serial(kind):
        def fn():
            gemms()
            update(kind)
        return fn

    def beside(kind):
        side = torch.cuda.Stream()

        def fn():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                update(kind)
            gemms()
            torch.cuda.current_stream().wait_stream(side)
        return fn

    rows = []
    kinds = ["torch add", "triton 132", "triton 66", "triton 33", "triton 16", "triton 8"]
    cases = [("gemms alone", gemms), ("update alone (torch add)", lambda: update("torch add"))]
    for kind in kinds:
        cases += [(f"serial, {kind}", serial(kind)), (f"beside, {kind}", beside(kind))]
    cases.append(("gemms alone (again)", gemms))
    for name, fn in cases:
        rows.append(report(config, name, graph_ms(fn, rounds)))
    return rows


def report(config: str, case: str, ms: list[float]) -> dict:
    """A case's row (median of its rounds), printed."""
    print(f"{config:8s} {case:34s} {statistics.median(ms):7.3f} ms  ({', '.join(f'{t:.3f}' for t in ms)})",
          flush=True)
    return {"config": config, "case": case, "ms": statistics.median(ms), "rounds_ms": ms}


def main(probe_fn=probe, rounds: int = 5, json_name: str = "sgd_overlap_probe.json", doc: str = __doc__) -> None:
    """`probe_fn(config, rounds)` for every --configs, rows to $OUT/`json_name`."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["phi35", "mixtral", "qwen2"])
    parser.add_argument("--rounds", type=int, default=rounds)
    args = parser.parse_args()
    rows = [row for config in args.configs for row in probe_fn(config, args.rounds)]
    write_json(os.path.join(os.environ.get("OUT", "."), json_name), {"rows": rows})


if __name__ == "__main__":
    main()
