"""The experts' grouped weight gradient (x^T @ dy, groups along the rows) on one GPU: Triton's
`weft.kernels.grouped_wgrad` at several tiles against `torch._grouped_mm` (CUTLASS) and, with
equal groups, cuBLAS's batched matmul; ms and TFLOP/s of each, for the layer configs' shapes on
W ranks (E / W local experts, T * k rows), equal groups and the counts of a random top-k routing;
every method once a round, --rounds rounds interleaved, the median.
    PYTHONPATH=src python3 scripts/wgrad_probe.py [--configs qwen2 phi35 mixtral] [--ranks 2]"""
import argparse
import statistics

import torch

from weft.bench.layer import CONFIGS
from weft.kernels.grouped_wgrad import WGradTiles, grouped_wgrad
from weft.profiling import seconds_per_call

TILES = {
    "128x256x32 w8 s5": WGradTiles(128, 256, 32, 8, 5, per_sm=1),  # the default until the fiftieth session
    "128x256x32 w8 s4": WGradTiles(128, 256, 32, 8, 4, per_sm=1),
    "128x256x64 w8 s3": WGradTiles(128, 256, 64, 8, 3, per_sm=1),
    "256x128x32 w8 s4": WGradTiles(256, 128, 32, 8, 4, per_sm=1),
    # two persistent programs an SM: one's epilogue beside the other's loads
    "128x128x64 w4 s3 x2": WGradTiles(128, 128, 64, 4, 3, per_sm=2),
    "128x128x64 w8 s3 x2": WGradTiles(128, 128, 64, 8, 3, per_sm=2),
    "128x128x32 w4 s5 x2": WGradTiles(),  # the default
    "128x256x32 w8 s3 x2": WGradTiles(128, 256, 32, 8, 3, per_sm=2),
    "128x128x32 w4 s4 x2": WGradTiles(128, 128, 32, 4, 4, per_sm=2),
    "128x128x32 w4 s6 x2": WGradTiles(128, 128, 32, 4, 6, per_sm=2),
    "128x128x32 w8 s5 x2": WGradTiles(128, 128, 32, 8, 5, per_sm=2),
    "128x128x32 w4 s5 g4 x2": WGradTiles(128, 128, 32, 4, 5, group=4, per_sm=2),
}


def routed_counts(rows: int, experts: int, local: int, top_k: int, gen: torch.Generator) -> list[int]:
    """The rows each of the first `local` experts gets from rows / top_k tokens routed top-k over
    softmax-free random logits (every rank alike), scaled so they sum to `rows`."""
    tokens = rows // top_k
    picks = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices.flatten()
    counts = torch.bincount(picks, minlength=experts)[:local].double()
    counts = (counts / counts.sum() * rows).floor().long()
    counts[-1] += rows - int(counts.sum())
    return counts.tolist()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["qwen2", "phi35", "mixtral"])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds, the median reported")
    parser.add_argument("--into-tiles", nargs="*", default=[], choices=list(TILES),
                        help="also time the product added into a weight at -1e-30 (SGD's update) at these tiles")
    parser.add_argument("--tiles", nargs="*", default=list(TILES), choices=list(TILES), help="tiles timed alone")
    args = parser.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    print(f"{'config':8s} {'counts':7s} {'product':9s} {'method':18s} {'ms':>7s} {'TF/s':>6s} {'max err':>8s}")
    for name in args.configs:
        cfg = CONFIGS[name]
        El, D, H = cfg.num_experts // args.ranks, cfg.dim, cfg.hidden_dim
        rows = cfg.tokens_per_rank * cfg.top_k
        for kind in ("equal", "routed"):
            counts = [rows // El] * El if kind == "equal" else routed_counts(rows, cfg.num_experts, El, cfg.top_k, gen)
            offs = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
            for product, (K, N) in (("x^T dh", (D, H)), ("h^T dy", (H, D))):
                x = torch.randn(rows, K, device=dev, dtype=torch.bfloat16)
                dy = torch.randn(rows, N, device=dev, dtype=torch.bfloat16)
                flops = 2 * rows * K * N
                ref = torch._grouped_mm(x.t(), dy, offs=offs)
                methods = {"_grouped_mm": lambda: torch._grouped_mm(x.t(), dy, offs=offs)}
                if kind == "equal":
                    C = rows // El
                    methods["bmm"] = lambda: torch.bmm(x.view(El, C, K).transpose(1, 2), dy.view(El, C, N))
                for label in args.tiles:
                    methods[label] = (lambda t=TILES[label]: grouped_wgrad(x, dy, offs, tiles=t))
                # the own-apart tap: the product added to a share computed earlier
                share = torch.randn(El, K, N, device=dev, dtype=torch.bfloat16)
                methods["_grouped_mm + add"] = lambda: torch._grouped_mm(x.t(), dy, offs=offs).add_(share)
                methods["triton into"] = lambda: grouped_wgrad(x, dy, offs, into=share.clone())
                for label in args.into_tiles:  # SGD's update in the epilogue (alpha -lr): into the weight
                    methods[f"into w, {label}"] = (lambda t=TILES[label]: grouped_wgrad(x, dy, offs, into=share,
                                                                                         tiles=t, alpha=-1e-30))
                methods["share.clone()"] = lambda: share.clone()
                errors = {}
                for label, fn in methods.items():
                    try:
                        with_share = label in ("_grouped_mm + add", "triton into", "share.clone()")
                        out = fn()
                        errors[label] = 0.0 if label == "share.clone()" or label.startswith("into w") else (
                            out.float() - ref.float() - (share.float() if with_share else 0)).abs().max().item()
                    except Exception as e:  # a tile that does not fit: say so, go on
                        print(f"{name:8s} {kind:7s} {product:9s} {label:20s} failed: {str(e).splitlines()[0][:80]}")
                times = {label: [] for label in errors}
                for _ in range(args.rounds):  # interleaved: the GPU's clock drifts as it warms
                    for label in errors:
                        times[label].append(seconds_per_call(methods[label], dev, calls=20))
                for label, err in errors.items():
                    s = statistics.median(times[label])
                    print(f"{name:8s} {kind:7s} {product:9s} {label:20s} {s * 1e3:7.3f} {flops / s / 1e12:6.0f} "
                          f"{err:8.3g}", flush=True)


if __name__ == "__main__":
    main()
