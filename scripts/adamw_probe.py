"""`weft train`'s AdamW pass over a preset's parameters on one GPU, and the gradient norm before
it. The pass: one launch per tensor
(`adamw_step`, as `MasterAdamW` ran it before the forty-eighth session) against one launch per kind
of tensor (`adamw_steps`), interleaved, each round after a sleep kernel (~10-20 ms) so that the host
queues every launch before the GPU reaches them (GPU ms: the kernels and the gaps between them),
and from an idle GPU (wall ms: the host's launches included). The parameters as `weft train
--master-weights` holds them on one rank: bf16 gradients and copies for the matrices, float32
for the rest. The norm's sum of squares over those gradients: `torch._foreach_norm` over the
mixed list (PyTorch runs it a kernel per tensor), over each dtype's list, and
`weft.kernels.sumsq.sum_of_squares` (one pass), GPU ms as above. Prints a table (TB/s: the bytes
each must move) and writes JSON to $OUT/adamw_probe.json.

    PYTHONPATH=src python3 scripts/adamw_probe.py [--presets gpt2-s-moe qwen2-moe-2l gpt2-l-moe] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from weft.jsonfile import write_json
from weft.kernels.adamw import AdamWHyper, AdamWUpdate, adamw_step, adamw_steps
from weft.kernels.sumsq import sum_of_squares, sum_of_squares_reference
from weft.models import GPT, get_preset


def updates_of(preset: str, device: torch.device) -> tuple[list[AdamWUpdate], int]:
    """One update per parameter of the preset's model (shapes from a meta-device model) and the
    bytes the pass moves."""
    with torch.device("meta"):
        shapes = [(tuple(p.shape), p.dim() >= 2) for p in GPT(get_preset(preset)).parameters()]
    updates, nbytes = [], 0
    gen = torch.Generator(device=device).manual_seed(0)
    for shape, matrix in shapes:
        master = torch.randn(shape, device=device, generator=gen) * 0.02
        grad = (torch.randn(shape, device=device, generator=gen) * 1e-3).to(torch.bfloat16 if matrix else torch.float32)
        copy = master.bfloat16() if matrix else None
        updates.append(AdamWUpdate(master, grad, torch.zeros_like(master), torch.zeros_like(master),
                                   AdamWHyper(1e-9, 0.9, 0.95, 1e-8, 0.1 if matrix else 0.0, 10), copy))
        nbytes += master.numel() * (4 * 6 + grad.element_size() + (copy.element_size() if matrix else 0))
    return updates, nbytes


def per_tensor(updates: list[AdamWUpdate], scale: torch.Tensor) -> None:
    for u in updates:
        adamw_step(u.master, u.grad, u.exp_avg, u.exp_avg_sq, u.hyper, scale, u.copy)


def together(updates: list[AdamWUpdate], scale: torch.Tensor) -> None:
    adamw_steps(updates, scale)


def gpu_ms(fn, calls: int = 5) -> float:
    """ms per call with the host ahead: a sleep kernel first, then `calls` calls between events."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(20_000_000)  # ~10-20 ms of one SM spinning: the launches queue behind it
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def wall_ms(fn) -> float:
    torch.cuda.synchronize()
    begin = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - begin) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", nargs="+", default=["gpt2-s-moe", "qwen2-moe-2l", "gpt2-l-moe"])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda")
    scale = torch.tensor(0.5, device=device)
    rows = []
    for preset in args.presets:
        updates, nbytes = updates_of(preset, device)
        times = {name: {"gpu": [], "wall": []} for name in ("per tensor", "together")}
        for _ in range(args.rounds):
            for name, fn in (("per tensor", per_tensor), ("together", together)):
                times[name]["gpu"].append(gpu_ms(lambda fn=fn: fn(updates, scale)))
                times[name]["wall"].append(statistics.median(wall_ms(lambda fn=fn: fn(updates, scale))
                                                             for _ in range(5)))
        grads = [u.grad for u in updates]
        dtypes = {g.dtype for g in grads}
        norms = {"norm, one list": lambda: sum_of_squares_reference(grads),
                 "norm, by dtype": lambda: sum(sum_of_squares_reference([g for g in grads if g.dtype == d])
                                               for d in dtypes),
                 "norm, one pass": lambda: sum_of_squares(grads)}
        for name, fn in norms.items():
            times[name] = {"gpu": [gpu_ms(fn) for _ in range(args.rounds)], "wall": []}
        values = {name: float(fn()) for name, fn in norms.items()}
        grad_bytes = sum(g.numel() * g.element_size() for g in grads)
        row = {"preset": preset, "tensors": len(updates), "bytes": nbytes, "grad_bytes": grad_bytes, "times_ms": times,
               "sums_of_squares": values}
        rows.append(row)
        print(f"{preset}: {len(updates)} tensors, {nbytes / 1e9:.2f} GB a pass", flush=True)
        for name, t in times.items():
            moved = grad_bytes if name.startswith("norm") else nbytes
            print(f"  {name:16s} GPU ms {' / '.join(f'{v:.3f}' for v in t['gpu'])} "
                  f"({moved / min(t['gpu']) / 1e9:.2f} TB/s)   wall ms {' / '.join(f'{v:.3f}' for v in t['wall'])}",
                  flush=True)
        print("  sums of squares: " + ", ".join(f"{name[6:]} {v:.9g}" for name, v in values.items()), flush=True)
        updates = grads = norms = None  # freed before the next preset
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        write_json(os.path.join(os.environ["OUT"], "adamw_probe.json"), rows)


if __name__ == "__main__":
    main()
