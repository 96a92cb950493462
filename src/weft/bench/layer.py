"""`weft bench layer`: forward+backward time of one MoE layer, every capacity mode side by side.

Timed with CUDA events on GPUs (perf_counter on the CPU), after warm-up, as the median over
many steps with inputs rotated; the slowest rank's median is reported.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from weft.distributed import init_distributed
from weft.moe import MoE


@dataclass(frozen=True)
class LayerConfig:
    dim: int
    hidden_dim: int
    num_experts: int
    top_k: int


CONFIGS = {
    "mixtral": LayerConfig(4096, 14336, 8, 2),
    "qwen2": LayerConfig(2048, 1408, 64, 4),
    "phi35": LayerConfig(4096, 6400, 16, 2),
    "deepseek": LayerConfig(7168, 2048, 256, 8),
    "tiny": LayerConfig(64, 128, 8, 2),
}


@dataclass
class LayerResult:
    config: str
    capacity_factor: float | None
    activation: str
    tokens_per_rank: int
    world_size: int
    median_ms: float
    tflops_per_rank: float
    dropped_share: float


def expert_flops(cfg: LayerConfig, tokens: int, activation: str) -> float:
    """Forward+backward FLOPs of the routed expert matmuls (3x forward), per rank."""
    mats = 3 if activation == "swiglu" else 2
    return 3 * 2 * tokens * cfg.top_k * cfg.dim * cfg.hidden_dim * mats


def _timer(device: torch.device):
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def begin():
            start.record()

        def stop() -> float:
            end.record()
            end.synchronize()
            return start.elapsed_time(end)

        return begin, stop
    t0 = [0.0]

    def begin_cpu():
        t0[0] = time.perf_counter()

    def stop_cpu() -> float:
        return (time.perf_counter() - t0[0]) * 1e3

    return begin_cpu, stop_cpu


def time_layer(moe: MoE, inputs: list[torch.Tensor], steps: int, warmup: int) -> float:
    """Median milliseconds of forward+backward over `steps`, inputs rotated."""
    begin, stop = _timer(inputs[0].device)
    times = []
    for i in range(warmup + steps):
        x = inputs[i % len(inputs)]
        if dist.is_initialized():
            dist.barrier()
        begin()
        moe(x).backward(x)
        elapsed = stop()
        if i >= warmup:
            times.append(elapsed)
        moe.zero_grad(set_to_none=True)
        x.grad = None
    return statistics.median(times)


def run(
    config: str,
    tokens_per_rank: int = 4096,
    capacity_factors: tuple[float | None, ...] = (1.0, None),
    activation: str = "relu",
    dtype: torch.dtype = torch.bfloat16,
    steps: int = 20,
    warmup: int = 5,
    json_path: str | None = None,
) -> list[LayerResult]:
    ctx = init_distributed()
    cfg = CONFIGS[config]
    if ctx.device.type == "cpu" and dtype == torch.bfloat16:
        dtype = torch.float32
    results = []
    for cf in capacity_factors:
        torch.manual_seed(0)
        moe = MoE(cfg.dim, cfg.hidden_dim, cfg.num_experts, cfg.top_k, capacity_factor=cf,
                  activation=activation, device=ctx.device, dtype=dtype)
        gen = torch.Generator(device=ctx.device).manual_seed(ctx.rank)
        inputs = [torch.randn(tokens_per_rank, cfg.dim, device=ctx.device, dtype=dtype, generator=gen)
                  .requires_grad_() for _ in range(4)]
        ms = torch.tensor([time_layer(moe, inputs, steps, warmup)], device=ctx.device)
        dropped = moe.stats.dropped.float().reshape(1) / (tokens_per_rank * cfg.top_k)
        if dist.is_initialized():
            dist.all_reduce(ms, op=dist.ReduceOp.MAX)
            dist.all_reduce(dropped)
            dropped /= ctx.world_size
        median = float(ms)
        tflops = expert_flops(cfg, tokens_per_rank, activation) / (median * 1e-3) / 1e12
        results.append(LayerResult(config, cf, activation, tokens_per_rank, ctx.world_size, median, tflops,
                                   float(dropped)))
        del moe, inputs
    if ctx.rank == 0:
        print_table(results, ctx.device, dtype)
        if json_path:
            Path(json_path).parent.mkdir(parents=True, exist_ok=True)
            Path(json_path).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return results


def print_table(results: list[LayerResult], device: torch.device, dtype: torch.dtype) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    base = results[0].median_ms
    print(f"\nweft bench layer: {results[0].config}, {results[0].world_size} x {name}, {dtype}, "
          f"{results[0].tokens_per_rank} tokens/rank, {results[0].activation} experts, fwd+bwd")
    print(f"{'capacity':>10} {'median ms':>10} {'vs first':>9} {'TFLOP/s/rank':>13} {'dropped':>8}")
    for r in results:
        cap = "dropless" if r.capacity_factor is None else f"{r.capacity_factor:g}"
        print(f"{cap:>10} {r.median_ms:>10.3f} {r.median_ms / base:>8.2f}x {r.tflops_per_rank:>13.1f} "
              f"{r.dropped_share:>8.1%}")
