"""The energy of the experts' GEMMs, per call, on one GPU: cuBLAS's batched products, Comet's
layer0 and layer1 at several tiles, and the weight gradient into the weight (SGD's step in the
epilogue: cuBLAS's `baddbmm_`, Triton's grouped kernel), on a config's per-rank shapes on W ranks
(the ranks' buffers held by this GPU, as `scripts/comet_kernels.py`; cf 1.0, every expert the
same rows). Each case runs back to back in blocks of about --block-s seconds, the cases' blocks
interleaved over --rounds rounds, NVML's energy counter read around each block between two
synchronisations (`weft.bench.timing.energy_counter`). A large layer's steps hold an H200 at its
700 W limit (docs/benchmarks.md), where a GEMM's time follows its energy: the table gives both,
and TFLOP a joule.
    PYTHONPATH=src python3 scripts/energy_probe.py [--configs mixtral phi35] [--world 2]"""
from __future__ import annotations

import argparse
import dataclasses
import os

import torch
from dropless_kernels import rank_buffers  # this script's folder is on sys.path

from weft.bench.layer import CONFIGS
from weft.bench.timing import Run, energy_counter, energy_per_step
from weft.jsonfile import write_json
from weft.kernels import comet as K
from weft.kernels.grouped_wgrad import grouped_wgrad
from weft.profiling import seconds_per_call

# Comet's tiles tried beside the default (block_m stays the map's 128 rows)
TILES = {"128x256x64 w8 s4": {}, "128x256x64 w8 s3": {"num_stages": 3},
         "128x128x64 w4 s4": {"block_n": 128, "num_warps": 4}, "128x256x32 w8 s5": {"block_k": 32, "num_stages": 5}}


def blocks(cases: dict, seconds: float, rounds: int, read_mj) -> dict[str, dict]:
    """Per case: ms a call and joules a call over `rounds` blocks of about `seconds` each, the
    cases' blocks interleaved (`weft.bench.timing.energy_per_step`, each case a run whose step is
    one call, its blocks sized by a first timing of 10 calls)."""
    dev = torch.device("cuda")
    runs = [Run(lambda: None, lambda s, fn=fn: fn()) for fn in cases.values()]
    call_ms = [seconds_per_call(fn, dev, calls=10) * 1e3 for fn in cases.values()]
    energies = energy_per_step(runs, call_ms, seconds * rounds * len(runs), dev, read_mj, rounds)
    return {name: {"ms": e["ms_per_step"], "joules": e["joules_per_step"], "watts": e["watts"]}
            for name, e in zip(cases, energies)}


def probe(name: str, world: int, seconds: float, rounds: int, read_mj) -> list[dict]:
    cfg, dev, dtype = CONFIGS[name], torch.device("cuda"), torch.bfloat16
    local = cfg.num_experts // world
    rows_per_rank = cfg.tokens_per_rank * cfg.top_k
    cap = rows_per_rank // cfg.num_experts
    base = K.CometTiles.for_device(dev)
    sends, outs, table, out_table, w1, w2 = rank_buffers(cfg, world, rows_per_rank, dev, dtype)
    rows = K.RowMap.padded(world, local, cap, 0, base.block_m, dev)
    gathered, h = K.pull_gemm(table, sends[0], rows, w1, base)
    C = gathered.shape[0] // local
    offs = rows.ends_I
    cases = {"bmm x @ w1": lambda: torch.bmm(gathered.view(local, C, -1), w1),
             "bmm h @ w2": lambda: torch.bmm(h.view(local, C, -1), w2)}
    for label, change in TILES.items():
        tiles = dataclasses.replace(base, **change)
        cases[f"pull {label}"] = lambda t=tiles: K.pull_gemm(table, sends[0], rows, w1, t)
        cases[f"push {label}"] = lambda t=tiles: K.gemm_push(h, w2, out_table, outs[0], rows, t)
    cases["baddbmm_ into w1"] = lambda: w1.baddbmm_(gathered.view(local, C, -1).transpose(1, 2), h.view(local, C, -1),
                                                    alpha=-1e-30)
    cases["grouped into w1"] = lambda: grouped_wgrad(gathered, h, offs, into=w1, alpha=-1e-30)
    flops = 2 * gathered.shape[0] * cfg.dim * cfg.hidden_dim
    out = []
    for case, m in blocks(cases, seconds, rounds, read_mj).items():
        row = {"config": name, "world": world, "case": case, **m, "tflop_per_joule": flops / 1e12 / m["joules"]}
        print(f"{name:8s} {case:26s} {m['ms']:7.3f} ms {m['joules'] * 1e3:8.1f} mJ {m['watts']:5.0f} W "
              f"{row['tflop_per_joule']:6.3f} TFLOP/J", flush=True)
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["mixtral", "phi35"])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--block-s", type=float, default=0.5, help="seconds a block")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    read_mj = energy_counter(torch.device("cuda"))
    if read_mj is None:
        raise SystemExit("energy_probe: no NVML energy counter here (a CUDA GPU and nvidia-ml-py are needed)")
    rows = [r for name in args.configs for r in probe(name, args.world, args.block_s, args.rounds, read_mj)]
    write_json(os.path.join(os.environ.get("OUT", "."), "energy_probe.json"), {"rows": rows})


if __name__ == "__main__":
    main()
