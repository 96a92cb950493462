"""The routing stage, forward and backward, by the one-pass kernels (weft.kernels.token_choice)
against the composition they replace (PyTorch ops around the top-k/position kernels of
weft.kernels.routing), in one process, interleaved: per call, eagerly (back-to-back calls: the
host's launch time where it is the slower side) and as a CUDA graph replay (the GPU's time
alone), for the layer configs' routing shapes (4096 tokens), padded cf 1.0 and dropless, and for
each token-block height of the one-pass kernels given. Prints a table.
    python3 scripts/routing_one_pass.py [--block-t 16 32 64] [--rounds 3]
Run it where weft is importable (PYTHONPATH=src)."""
from __future__ import annotations

import argparse

import torch

import weft.kernels.token_choice as token_choice
import weft.moe.routing as routing
from weft.graphs import GraphedStep
from weft.profiling import seconds_per_call, wall_seconds

SHAPES = {"qwen2": (4096, 64, 4), "phi35": (4096, 16, 2), "mixtral": (4096, 8, 2), "deepseek-like": (4096, 256, 8)}


def step_of(router, k: int, cf: float | None):
    def step(logits):
        r = router.route(logits, k, cf, fused=True)
        (r.gates_S.sum() + 0.01 * r.summary.aux_loss + 0.001 * r.summary.z_loss).backward()
        return r

    return step


def eager_ms(step, logits, calls: int) -> float:
    """Back-to-back eager calls, wall ms a call (the host's time where it is the slower side)."""
    run = lambda: [step(logits.detach().requires_grad_()) for _ in range(calls)]  # noqa: E731
    return wall_seconds(run, logits.device) * 1e3 / calls


def graph_ms(step, logits, calls: int) -> float:
    """ms a replay of the step captured as a CUDA graph (the GPU's time alone)."""
    graph = GraphedStep(step, [logits.detach().requires_grad_()], accumulate=False)
    captured = graph.inputs[0]  # replayed on its own input: no copy into it
    return seconds_per_call(lambda: graph(captured), logits.device, calls) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-t", type=int, nargs="+", default=[None])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    tiles = token_choice._tiles
    one_pass_gates = routing.ONE_PASS_GATES

    def variant(block_t):
        """Set the module state for one variant: None = the composition, else the one pass."""
        routing.ONE_PASS_GATES = () if block_t == "composition" else one_pass_gates
        token_choice._tiles = tiles if block_t in (None, "composition") else (
            lambda T, E, k, b=block_t: {**tiles(T, E, k), "BLOCK_T": b})

    variants = ["composition", *args.block_t]
    print("| shape (T, E, k) | capacity | variant | eager ms (rounds) | graph ms (rounds) |")
    print("|---|---|---|---|---|")
    for name, (T, E, k) in SHAPES.items():
        for cf in (1.0, None):
            logits = torch.randn(T, E, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
            router = routing.Router("topk", E, False, None)
            results = {v: ([], []) for v in variants}
            reference = None
            for _ in range(args.rounds):
                for v in variants:
                    variant(v)
                    step = step_of(router, k, cf)
                    r = step(logits.detach().requires_grad_())
                    if reference is None:
                        reference = r
                    elif not (torch.equal(r.experts_S, reference.experts_S)
                              and torch.equal(r.positions_S, reference.positions_S)):
                        raise SystemExit(f"{name} cf={cf} {v}: the slots differ from the composition's")
                    results[v][0].append(eager_ms(step, logits, args.calls))
                    results[v][1].append(graph_ms(step, logits, args.calls))
            for v in variants:
                eager, graph = results[v]
                label = v if v == "composition" else f"one pass, BLOCK_T {v or 'default'}"
                print(f"| {name} ({T}, {E}, {k}) | {'dropless' if cf is None else cf} | {label} | "
                      f"{' / '.join(f'{x:.3f}' for x in eager)} | {' / '.join(f'{x:.4f}' for x in graph)} |")
    variant(None)


if __name__ == "__main__":
    main()
