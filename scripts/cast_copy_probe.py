"""What copying bf16 gradients into float32 buckets costs (`weft.moe.grads.OverlappedReduce`'s
copies; it takes the per-bucket `_foreach_copy_`, docs/benchmarks.md, forty-fifth session): each
way of casting a preset's gradients (all of them, as with `--ep-size 1`, or the replicated ones)
into ~25 MB float32 buckets, timed on one GPU (ms per step's worth, GB/s of bytes read and
written).
    PYTHONPATH=src python3 scripts/cast_copy_probe.py [--presets gpt2-s-moe ...]"""
import argparse

import torch
import triton
import triton.language as tl

from weft.models import GPT
from weft.models.presets import get_preset
from weft.moe.grads import expert_parameters
from weft.profiling import seconds_per_call


@triton.jit
def _cast_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=mask).to(tl.float32), mask=mask)


def triton_cast(dst: torch.Tensor, src: torch.Tensor) -> None:
    n = src.numel()
    _cast_kernel[(triton.cdiv(n, 4096),)](src, dst, n, BLOCK=4096)


def buckets_of(shapes, bucket_numel):
    out, chunk, numel = [], [], 0
    for s in shapes:
        chunk.append(s)
        numel += torch.Size(s).numel()
        if numel >= bucket_numel:
            out.append(chunk)
            chunk, numel = [], 0
    return out + ([chunk] if chunk else [])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["gpt2-s-moe"])
    ns = parser.parse_args()
    for preset in ns.presets:
        with torch.device("meta"):
            model = GPT(get_preset(preset))
        experts = {id(p) for p in expert_parameters(model)}
        for which in ("replicated", "all"):
            shapes = [tuple(p.shape) for p in model.parameters() if which == "all" or id(p) not in experts]
            grads, flats, slots = [], [], []
            for bucket in buckets_of(shapes, 25 * 2**20 // 4):
                gs = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in bucket]
                flat = torch.empty(sum(g.numel() for g in gs), device="cuda")
                grads.append(gs)
                flats.append(flat)
                slots.append(list(flat.split([g.numel() for g in gs])))
            numel = sum(f.numel() for f in flats)

            def per_param():
                for gs, ss in zip(grads, slots):
                    for g, s in zip(gs, ss):
                        s.copy_(g.reshape(-1))

            def foreach():
                for gs, ss in zip(grads, slots):
                    torch._foreach_copy_(ss, [g.reshape(-1) for g in gs])

            def cat():
                for gs, flat in zip(grads, flats):
                    torch.cat([g.reshape(-1) for g in gs], out=flat)

            def per_param_triton():
                for gs, ss in zip(grads, slots):
                    for g, s in zip(gs, ss):
                        triton_cast(s, g)

            ways = {"per-parameter copy_": per_param, "per-bucket _foreach_copy_": foreach,
                    "per-bucket cat(out=)": cat, "per-parameter Triton cast": per_param_triton}
            want = None
            for name, fn in ways.items():
                for f in flats:
                    f.zero_()
                fn()
                got = torch.cat(flats)
                want = got if want is None else want
                ms = seconds_per_call(fn, torch.device("cuda"), calls=10) * 1e3
                print(f"{preset:12s} {which:10s} {numel / 1e6:7.1f}M  {name:28s} {ms:8.3f} ms  "
                      f"{numel * 6 / ms / 1e6:7.0f} GB/s  equal {torch.equal(got, want)}", flush=True)


if __name__ == "__main__":
    main()
