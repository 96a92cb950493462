"""The `weft` command: one entry point, one subcommand per job.

Without torchrun, a command that needs a world spawns it locally: one process per GPU (NCCL)
when CUDA is available, else `--nproc` CPU processes with gloo. Under torchrun it uses the
world torchrun made (any number of nodes).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

import torch


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _capacity_list(text: str) -> tuple[float | None, ...]:
    out = []
    for item in text.split(","):
        item = item.strip()
        try:
            out.append(None if item in ("none", "dropless") else float(item))
        except ValueError:
            raise argparse.ArgumentTypeError(f"capacity factors are numbers or 'dropless', got {item!r}") from None
    return tuple(out)


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def launch(fn: Callable[..., Any], args: tuple, nproc: int, device: str | None = None) -> Any:
    """Run `fn(*args)` in the current torchrun world, or spawn a local one."""
    if "WORLD_SIZE" in os.environ:
        return fn(*args)
    use_cuda = torch.cuda.is_available() and device != "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("weft: --device cuda but no CUDA GPU is visible")
    from weft.launch import run_distributed

    world = torch.cuda.device_count() if use_cuda else nproc
    return run_distributed(fn, world, args=args, timeout=None, backend="nccl" if use_cuda else "gloo")[0]


def _bench_layer(ns: argparse.Namespace) -> None:
    from weft.bench import layer

    if ns.config not in layer.CONFIGS:
        raise SystemExit(f"weft bench layer: unknown --config {ns.config!r}; choose from {', '.join(layer.CONFIGS)}")
    args = (ns.config, ns.tokens_per_rank, ns.capacity, ns.activation, DTYPES[ns.dtype], ns.steps, ns.warmup, ns.json)
    launch(layer.run, args, ns.nproc, ns.device)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weft", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    lay = bench.add_parser("layer", help="time forward+backward of one MoE layer")
    lay.add_argument("--config", default="tiny", help="mixtral, qwen2, phi35, deepseek or tiny")
    lay.add_argument("--tokens-per-rank", type=_positive_int, default=4096)
    lay.add_argument("--capacity", type=_capacity_list, default=(1.0, None),
                     help="comma-separated capacity factors, 'dropless' for None (default 1.0,dropless)")
    lay.add_argument("--activation", default="relu", choices=["relu", "gelu", "silu", "swiglu"])
    lay.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    lay.add_argument("--steps", type=_positive_int, default=20)
    lay.add_argument("--warmup", type=_positive_int, default=5)
    lay.add_argument("--json", default=None, help="write the results to this JSON file")
    lay.add_argument("--nproc", type=_positive_int, default=2, help="CPU processes when not under torchrun")
    lay.add_argument("--device", choices=["cpu", "cuda"], default=None)
    lay.set_defaults(run=_bench_layer)
    return parser


def main(argv: list[str] | None = None) -> None:
    ns = build_parser().parse_args(argv)
    ns.run(ns)


if __name__ == "__main__":
    main(sys.argv[1:])
