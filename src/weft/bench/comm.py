"""`weft bench comm`: time all-to-all and all-reduce over the world, size by size; fit a cost model.

Sizes are the bytes each rank contributes: for all-to-all the whole send buffer (split equally
among the ranks, itself included), for all-reduce the tensor reduced. Every timed call follows a
barrier, so the ranks start together; it is timed with CUDA events on GPUs (perf_counter on the
CPU) after warm-up, and the median over `steps` of the slowest rank is reported. Bandwidths follow
nccl-tests: algbw = bytes / time, busbw = algbw * (W-1)/W for all-to-all and 2 (W-1)/W for
all-reduce, which compares with the link speed whatever the world size. 1 GB/s = 1e9 bytes/s.

The medians are fitted into a `CommCostModel` (Lancet section 3), which planners query.
"""
from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from weft.cliargs import DTYPES, arg, byte_sizes, names, non_negative_int, positive_int
from weft.comm.cost_model import CommCostModel
from weft.distributed import init_distributed
from weft.jsonfile import write_json

KiB, MiB = 1 << 10, 1 << 20
# 1 KiB, 4 KiB, ..., 256 MiB: powers of 4 cover latency- and bandwidth-bound sizes in 10 steps.
DEFAULT_SIZES = [KiB * 4**i for i in range(10)]
# gloo moves 256 MiB in seconds per call; beyond 16 MiB a CPU run takes minutes and adds nothing.
CPU_MAX_BYTES = 16 * MiB
COLLECTIVES = ("all_to_all", "all_reduce")
# Bus-bandwidth factor per collective, as a function of the world size W (nccl-tests' definition).
_BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_to_all": lambda w: (w - 1) / w,
    "all_reduce": lambda w: 2 * (w - 1) / w,
}


@dataclass
class CommResult:
    collective: str
    size: int  # bytes per rank asked for
    bytes: int  # bytes per rank moved: all-to-all rounds down to a multiple of W elements
    world_size: int
    median_ms: float  # the slowest rank's median
    algbw_gbps: float
    busbw_gbps: float


def format_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n} B"


def _timer(device: torch.device) -> tuple[Callable[[], None], Callable[[], float]]:
    """(begin, stop) where stop() returns milliseconds since begin(), the device's work included."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def stop_cuda() -> float:
            end.record()
            end.synchronize()
            return start.elapsed_time(end)

        return start.record, stop_cuda
    t0 = [0.0]

    def begin_cpu() -> None:
        t0[0] = time.perf_counter()

    def stop_cpu() -> float:
        return (time.perf_counter() - t0[0]) * 1e3

    return begin_cpu, stop_cpu


def _barrier(device: torch.device) -> None:
    # NCCL's barrier must know the device, or it guesses one and may hang on a multi-GPU host.
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def time_collective(collective: str, nbytes: int, device: torch.device, dtype: torch.dtype,
                    steps: int, warmup: int) -> tuple[int, float]:
    """(bytes actually moved per rank, this rank's median ms) of one collective at one size."""
    world = dist.get_world_size()
    elem = torch.tensor([], dtype=dtype).element_size()
    numel = nbytes // elem
    if collective == "all_to_all":
        numel -= numel % world  # all_to_all_single without splits needs W equal chunks
    if numel < 1:
        raise ValueError(f"{collective} of {nbytes} bytes is less than one {dtype} element per rank "
                         f"(world size {world}); use sizes >= {elem * world} bytes")
    # Random data in two buffers used in turn: never time zeros, and the same buffer twice in a row.
    gen = torch.Generator(device=device).manual_seed(dist.get_rank())
    inputs = [torch.randn(numel, device=device, dtype=dtype, generator=gen) for _ in range(2)]
    out = torch.empty_like(inputs[0])
    begin, stop = _timer(device)
    times = []
    for i in range(warmup + steps):
        src = inputs[i % 2]
        if collective == "all_reduce":
            # In place: refill outside the timed region, or repeated sums grow to inf.
            out.copy_(src)
        _barrier(device)
        begin()
        if collective == "all_to_all":
            dist.all_to_all_single(out, src)
        else:
            dist.all_reduce(out)
        elapsed = stop()
        if i >= warmup:
            times.append(elapsed)
    return numel * elem, statistics.median(times)


@dataclass
class CommBenchConfig:
    """`weft bench comm`: collectives at a range of sizes; fits the communication cost model."""

    sizes: list[int] | None = arg(None, "bytes per rank, comma-separated (default 1K..256M in powers of 4; CPU up "
                                  "to 16M)", parse=byte_sizes)
    collectives: tuple[str, ...] = arg(COLLECTIVES, "comma-separated: all_to_all, all_reduce", parse=names)
    steps: int = arg(20, "timed steps per size (median reported)", parse=positive_int)
    warmup: int = arg(5, "untimed steps first", parse=non_negative_int)
    json: str | None = arg(None, "write the measurements here (and the fitted model as <stem>.model.json beside it)")
    model: str | None = arg(None, "where to write the fitted piecewise-linear cost model")
    dtype: str | None = arg(None, "element type (default bf16 on GPUs, fp32 on the CPU)", choices=tuple(DTYPES))

    def validate(self) -> None:
        unknown = [c for c in self.collectives if c not in _BUS_FACTOR]
        if not self.collectives or unknown:
            raise ValueError(f"--collectives: unknown collective(s) {unknown}; choose from {', '.join(COLLECTIVES)}")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"need --steps >= 1 and --warmup >= 0, got {self.steps} and {self.warmup}")
        if self.sizes is not None and (not self.sizes or min(self.sizes) < 1):
            raise ValueError(f"--sizes must be positive byte counts, got {self.sizes}")


def run(bench: CommBenchConfig) -> list[CommResult]:
    """Benchmark the collectives at `sizes` bytes per rank on every rank; rank 0 prints and writes.

    Call on every rank of an initialised world (torchrun, or `weft.launch.run_distributed`).
    `sizes` defaults to 1 KiB..256 MiB in powers of 4 (to 16 MiB on the CPU); `dtype` to bf16
    on GPUs and fp32 on the CPU. `json` receives the table, `model` the fitted `CommCostModel`
    (default: `<json stem>.model.json` beside `json`; neither given: not written).
    """
    bench.validate()
    sizes, collectives, steps, warmup = bench.sizes, bench.collectives, bench.steps, bench.warmup
    json_path, model_path = bench.json, bench.model
    dtype = None if bench.dtype is None else DTYPES[bench.dtype]
    ctx = init_distributed()
    if not dist.is_initialized():
        raise RuntimeError("weft bench comm needs a distributed world: run it under torchrun or "
                           "through `weft bench comm --nproc N`")
    # gloo communicates host memory: a CUDA tensor would add copies to every timing.
    device = ctx.device if ctx.backend == "nccl" else torch.device("cpu")
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if sizes is None:
        sizes = [s for s in DEFAULT_SIZES if device.type == "cuda" or s <= CPU_MAX_BYTES]
    sizes = sorted(set(sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"sizes must be a non-empty list of positive byte counts, got {sizes}")
    world = ctx.world_size
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if ctx.rank == 0:
        print(f"weft bench comm: {world} x {device_name}, {ctx.backend}, {dtype}, {len(sizes)} sizes "
              f"{format_bytes(sizes[0])}..{format_bytes(sizes[-1])}, {steps} steps", flush=True)

    results = []
    for k, nbytes in enumerate(sizes):
        measured = [time_collective(c, nbytes, device, dtype, steps, warmup) for c in collectives]
        medians = torch.tensor([ms for _, ms in measured], dtype=torch.float64, device=device)
        dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # the collective is as slow as its slowest rank
        for c, (moved, _), ms in zip(collectives, measured, medians.tolist()):
            algbw = moved / (ms * 1e-3) / 1e9
            results.append(CommResult(c, nbytes, moved, world, ms, algbw, algbw * _BUS_FACTOR[c](world)))
        if ctx.rank == 0:
            line = ", ".join(f"{r.collective} {r.median_ms:.3f} ms" for r in results[-len(collectives):])
            print(f"  [{k + 1}/{len(sizes)}] {format_bytes(nbytes)}: {line}", flush=True)

    if ctx.rank == 0:
        print_table(results)
        meta = {"benchmark": "comm", "world_size": world, "backend": ctx.backend, "device_name": device_name,
                "dtype": str(dtype).removeprefix("torch."), "steps": steps, "warmup": warmup,
                "torch_version": torch.__version__,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        if json_path:
            path = write_json(json_path, {"meta": meta, "results": [asdict(r) for r in results]})
            print(f"wrote {path}")
        if model_path is None and json_path:
            model_path = str(Path(json_path).with_suffix(".model.json"))
        if model_path:
            print(f"wrote {fit_cost_model(results, ctx.backend, device_name).to_json(model_path)}")
    return results


def fit_cost_model(results: list[CommResult], backend: str, device_name: str) -> CommCostModel:
    """The `CommCostModel` through the measured medians (bytes, seconds) of each collective."""
    measurements: dict[str, list[tuple[int, float]]] = {}
    for r in results:
        measurements.setdefault(r.collective, []).append((r.bytes, r.median_ms * 1e-3))
    return CommCostModel.fit(measurements, results[0].world_size, backend, device_name)


def print_table(results: list[CommResult]) -> None:
    print(f"\n{'size':>10} {'collective':>11} {'ms':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}")
    for r in results:
        # .3g: gloo's small messages move well under 0.01 GB/s, which .2f would print as 0.
        print(f"{format_bytes(r.size):>10} {r.collective:>11} {r.median_ms:>10.3f} "
              f"{r.algbw_gbps:>11.3g} {r.busbw_gbps:>11.3g}")
