"""Where a dropless Comet step's expert GEMMs lose against cf 1.0's, on one GPU: Comet's two
kernels and the weight gradient on a config's per-rank shapes (2-rank buffers held by this GPU, as
`scripts/comet_kernels.py`), with three maps of the same 4,096 x k rows a rank: the padded one (cf
1.0: every expert the same rows), the dropless one built from counts the host holds (its tiles
exact), and the dropless one built on the device (`RowMap.on_device`, as a graphed dropless step
builds it: arrays and grid sized for the most rows the rank can receive, the empty tiles last).
The counts: a uniform random top-k routing of every rank's tokens (seeded). GPU ms a call
(`weft.profiling.seconds_per_call`), every case in turn within each round; the median and the
fastest of the rounds. Prints a table and writes JSON to
$OUT/dropless_kernels.json.

    PYTHONPATH=src python3 scripts/dropless_kernels.py [--configs qwen2 phi35 mixtral]
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch

from weft.bench.layer import CONFIGS
from weft.jsonfile import write_json
from weft.kernels import comet as K
from weft.profiling import seconds_per_call


def interleaved(cases: dict, rounds: int, calls: int = 20) -> dict[str, list[float]]:
    """ms a call of each case, round after round, the cases in turn within a round (so that the
    GPU's clock, which falls as it warms, weighs on each case alike)."""
    for fn in cases.values():
        for _ in range(3):
            fn()
    times = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            times[name].append(seconds_per_call(fn, torch.device("cuda"), calls) * 1e3)
    return times


def routed_counts(world: int, tokens: int, experts: int, k: int, seed: int = 0) -> torch.Tensor:
    """(world, experts) int64: each rank's tokens' k distinct experts, uniform at random."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(world, experts, dtype=torch.int64)
    for s in range(world):
        chosen = torch.rand(tokens, experts, generator=gen).topk(k, dim=1).indices
        counts[s] = torch.bincount(chosen.reshape(-1), minlength=experts)
    return counts


def maps(cfg, world: int, tokens: int, block_m: int, dev: torch.device) -> dict[str, K.RowMap]:
    local = cfg.num_experts // world
    cap = tokens * cfg.top_k // cfg.num_experts
    counts_WE = routed_counts(world, tokens, cfg.num_experts, cfg.top_k)
    offsets_WE = torch.cumsum(counts_WE, 1) - counts_WE
    host = K.RowMap.build(counts_WE[:, :local].tolist(), offsets_WE[:, :local].tolist(), 0, block_m, dev)
    max_rows = world * min(tokens * cfg.top_k, tokens * local)
    device = K.RowMap.on_device(counts_WE.to(dev), 0, local, block_m, max_rows)
    return {"padded": K.RowMap.padded(world, local, cap, 0, block_m, dev), "dropless, host map": host,
            "dropless, device map": device}


def rank_buffers(cfg, world: int, rows_per_rank: int, dev: torch.device, dtype: torch.dtype):
    """Every rank's send and output buffers on this GPU, their address tables, and one rank's
    expert weights w1 (El, D, H) and w2 (El, H, D), random: (sends, outs, table, out_table, w1, w2)."""
    local = cfg.num_experts // world
    sends = [torch.randn(rows_per_rank, cfg.dim, device=dev, dtype=dtype) for _ in range(world)]
    outs = [torch.empty(rows_per_rank, cfg.dim, device=dev, dtype=dtype) for _ in range(world)]
    table = torch.tensor([s.data_ptr() for s in sends], dtype=torch.int64, device=dev)
    out_table = torch.tensor([o.data_ptr() for o in outs], dtype=torch.int64, device=dev)
    w1 = torch.randn(local, cfg.dim, cfg.hidden_dim, device=dev, dtype=dtype) / cfg.dim ** 0.5
    w2 = torch.randn(local, cfg.hidden_dim, cfg.dim, device=dev, dtype=dtype) / cfg.hidden_dim ** 0.5
    return sends, outs, table, out_table, w1, w2


def probe(name: str, world: int, tokens: int, rounds: int) -> list[dict]:
    cfg, dev, dtype = CONFIGS[name], torch.device("cuda"), torch.bfloat16
    tiles = K.CometTiles.for_device(dev)
    sends, outs, table, out_table, w1, w2 = rank_buffers(cfg, world, tokens * cfg.top_k, dev, dtype)
    cases, info = {}, {}
    for label, rows in maps(cfg, world, tokens, tiles.block_m, dev).items():
        gathered, h = K.pull_gemm(table, sends[0], rows, w1, tiles)
        dh = torch.randn_like(h)
        info[label] = {"rows": int(rows.ends_I[-1]), "rows_allocated": rows.num_rows,
                       "tiles": int((rows.pull_tiles[:, 2] > rows.pull_tiles[:, 1]).sum()),
                       "tiles_launched": rows.pull_tiles.shape[0]}
        cases[(label, "wgrad")] = lambda g=gathered, d=dh, r=rows: K.segment_wgrad(g, d, r)
        cases[(label, "pull")] = lambda r=rows: K.pull_gemm(table, sends[0], r, w1, tiles)
        cases[(label, "push")] = lambda r=rows, h=h: K.gemm_push(h, w2, out_table, outs[0], r, tiles)
    times = interleaved(cases, rounds)
    results = []
    for (label, kernel), ms in times.items():
        row = {"config": name, "map": label, "kernel": kernel, **info[label], "median_ms": statistics.median(ms),
               "min_ms": min(ms), "rounds_ms": ms}
        print(f"{name:8s} {label:22s} {kernel:6s} rows {row['rows']:6d}/{row['rows_allocated']:6d} tiles "
              f"{row['tiles']:4d}/{row['tiles_launched']:4d}  median {row['median_ms']:.3f}  "
              f"min {row['min_ms']:.3f} ms",
              flush=True)
        results.append(row)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["qwen2", "phi35", "mixtral"])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    rows = [r for name in args.configs for r in probe(name, args.world, args.tokens, args.rounds)]
    write_json(os.path.join(os.environ.get("OUT", "."), "dropless_kernels.json"), {"rows": rows})


if __name__ == "__main__":
    main()
