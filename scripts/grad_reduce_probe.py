"""How long `weft train`'s data-parallel gradient reduction takes on this machine: one flat float32
all-reduce of each preset's replicated (non-expert) parameters, as `weft.moe.grads.reduce_gradients`
runs it after backward, and the same bytes in buckets of several sizes (ms, algorithm GB/s).
Run under torchrun, one process per GPU:
    torchrun --standalone --nproc_per_node=2 scripts/grad_reduce_probe.py [--presets gpt2-s-moe ...]"""
import argparse
import os

import torch
import torch.distributed as dist

from weft.models import GPT
from weft.models.presets import get_preset
from weft.moe.grads import expert_parameters
from weft.profiling import seconds_per_call


def dense_numel(preset: str) -> int:
    with torch.device("meta"):
        model = GPT(get_preset(preset))
    experts = {id(p) for p in expert_parameters(model)}
    return sum(p.numel() for p in model.parameters() if id(p) not in experts)


def ms_per_call(fn) -> float:
    return seconds_per_call(fn, torch.device("cuda"), calls=10) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["gpt2-s-moe", "gpt2-l-moe", "qwen2-moe-2l"])
    parser.add_argument("--buckets-mb", nargs="+", type=float, default=[25.0, 100.0])
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    for preset in args.presets:
        n = dense_numel(preset)
        flat = torch.ones(n, device="cuda")
        ms = ms_per_call(lambda: dist.all_reduce(flat))
        if rank == 0:
            print(f"{preset:14s} {n / 1e6:7.1f}M float32 ({n * 4 / 1e6:6.0f} MB): one all-reduce {ms:7.2f} ms "
                  f"({n * 4 / ms / 1e6:6.1f} GB/s)", flush=True)
        for mb in args.buckets_mb:
            parts = list(flat.split(int(mb * 1e6 / 4)))
            ms = ms_per_call(lambda parts=parts: [dist.all_reduce(p) for p in parts])
            if rank == 0:
                print(f"{'':14s} in {len(parts)} buckets of {mb:g} MB: {ms:7.2f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
