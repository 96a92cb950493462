"""Comet's two kernels across NVLink (2+ GPUs, `torchrun --nproc_per_node=2`): layer0 (`pull_gemm`)
and layer1 (`gemm_push`) over symmetric-memory buffers, against the same kernels with every rank's
table pointing at its own buffer (no NVLink: what the kernels cost without the exchange), torch.bmm
on the same rows, and a plain copy of the rows this rank pulls (the copy engine's NVLink rate).
Padded layout, cf 1.0, 4096 tokens per rank. Every rank runs the same loop at once, as in the layer.
Prints a table (rank 0) and writes JSON to $OUT/comet_nvlink.json.

    torchrun --nproc_per_node=2 scripts/comet_nvlink.py [--configs qwen2 mixtral] [--n-comm 16 32 64 128]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch
import torch.distributed as dist
from comet_kernels import parse_tiles
from comet_kernels import timed as timed_alone  # this script's folder is on sys.path

from weft.bench.layer import CONFIGS
from weft.comm.peers import peer_buffers
from weft.kernels import comet as K


def timed(fn) -> float:
    """`comet_kernels.timed` (back-to-back calls, the best round) with every rank starting together."""
    dist.barrier()
    torch.cuda.synchronize()
    return timed_alone(fn)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", nargs="+", default=["qwen2", "phi35", "mixtral"])
    parser.add_argument("--n-comm", nargs="+", type=int, default=[16, 32, 64, 128])
    parser.add_argument("--block-copy", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument("--tiles", nargs="+", default=[],
                        help="GEMM tiles to time beside the default, BMxBNxBK w<warps> s<stages> (c32 b128)")
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(dev)
    peers = peer_buffers(dist.group.WORLD, dev)
    dtype, results = torch.bfloat16, []
    for name in args.configs:
        cfg = CONFIGS[name]
        local = cfg.num_experts // world
        cap = args.tokens * cfg.top_k // cfg.num_experts
        send = peers.get(f"send.{name}", (cfg.num_experts * cap, cfg.dim), dtype)
        send.local.copy_(torch.randn_like(send.local))
        out = peers.get(f"out.{name}", (cfg.num_experts * cap, cfg.dim), dtype)
        peers.barrier()
        own_table = torch.full_like(send.table, send.local.data_ptr())
        own_out = torch.full_like(out.table, out.local.data_ptr())
        gen = torch.Generator(device=dev).manual_seed(0)
        w1 = torch.randn(local, cfg.dim, cfg.hidden_dim, device=dev, dtype=dtype, generator=gen) / cfg.dim ** 0.5
        w2 = torch.randn(local, cfg.hidden_dim, cfg.dim, device=dev, dtype=dtype, generator=gen) / cfg.hidden_dim ** 0.5
        base = K.CometTiles.for_device(dev)
        rows = K.RowMap.padded(world, local, cap, rank, base.block_m, dev)
        gathered, h = K.pull_gemm(send.table, send.local, rows, w1, base)
        ref_g, ref_h = K.pull_gemm_reference(send.peers, rows, w1)
        assert torch.equal(gathered, ref_g), "pull_gemm gathered other rows than its reference"
        flops = 2 * rows.num_rows * cfg.dim * cfg.hidden_dim
        g3, h3 = gathered.view(local, world * cap, -1), h.view(local, world * cap, -1)
        mine = slice(rank * local * cap, (rank + 1) * local * cap)
        pulled = torch.empty((world - 1) * local * cap, cfg.dim, device=dev, dtype=dtype)

        def copy_rows():
            at = 0
            for r in range(world):
                if r != rank:
                    pulled[at:at + local * cap].copy_(send.peers[r][mine])
                    at += local * cap

        row = {"config": name, "rows": rows.num_rows, "gflop": flops / 1e9,
               "remote_mib": pulled.numel() * 2 / 2**20,
               "bmm0_ms": timed(lambda: torch.bmm(g3, w1)), "bmm1_ms": timed(lambda: torch.bmm(h3, w2)),
               "copy_ms": timed(copy_rows)}
        for bc in args.block_copy:
            for n_comm in args.n_comm:
                tiles = dataclasses.replace(base, n_comm=n_comm, block_copy=bc)
                row[f"pull c{n_comm} b{bc}"] = timed(lambda: K.pull_gemm(send.table, send.local, rows, w1, tiles))
                row[f"own c{n_comm} b{bc}"] = timed(lambda: K.pull_gemm(own_table, send.local, rows, w1, tiles))
        for spec in args.tiles:
            tiles = parse_tiles(spec)
            tile_rows = K.RowMap.padded(world, local, cap, rank, tiles.block_m, dev)
            row[f"tiles {spec}"] = (timed(lambda: K.pull_gemm(send.table, send.local, tile_rows, w1, tiles)),
                                    timed(lambda: K.gemm_push(h, w2, out.table, out.local, tile_rows, tiles)),
                                    timed(lambda: K.gemm_push(h, w1.transpose(1, 2), out.table, out.local,
                                                              tile_rows, tiles)))
        for direct in (True, False):  # layer0 reading its own rows in place, or every row after its copy
            tiles = dataclasses.replace(base, direct_local=direct)
            row[f"pull direct {direct}"] = timed(lambda: K.pull_gemm(send.table, send.local, rows, w1, tiles))
        if rows.runs is not None and K.copy_engine_available(dev):  # the other ranks' rows by the copy engine
            engine = dataclasses.replace(base, copy_engine=True)
            got_g, got_h = K.pull_gemm(send.table, send.local, rows, w1, engine, send.peers)
            row["engine_exact"] = bool(torch.equal(got_g, ref_g)) and bool(torch.equal(got_h, h))
            row["pull engine"] = timed(lambda: K.pull_gemm(send.table, send.local, rows, w1, engine, send.peers))
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                K.pull_gemm(send.table, send.local, rows, w1, engine, send.peers)
                K.pull_gemm(send.table, send.local, rows, w1, base)
            torch.cuda.current_stream().wait_stream(side)
            graphs = {name: torch.cuda.CUDAGraph() for name in ("engine", "programs")}
            for name, graph in graphs.items():
                with torch.cuda.graph(graph):
                    if name == "engine":
                        K.pull_gemm(send.table, send.local, rows, w1, engine, send.peers)
                    else:
                        K.pull_gemm(send.table, send.local, rows, w1, base)
            row["pull engine graphed"] = timed(graphs["engine"].replay)
            row["pull graphed"] = timed(graphs["programs"].replay)
        row["push"] = timed(lambda: K.gemm_push(h, w2, out.table, out.local, rows, base))
        row["push own"] = timed(lambda: K.gemm_push(h, w2, own_out, out.local, rows, base))
        results.append(row)
        if rank == 0:
            print(f"\n{name}: {rows.num_rows} rows, {row['gflop']:.1f} GFLOP a GEMM, "
                  f"{row['remote_mib']:.1f} MiB pulled; "
                  f"bmm0 {row['bmm0_ms']:.3f} ms ({flops / row['bmm0_ms'] / 1e9:.0f} TF/s), bmm1 {row['bmm1_ms']:.3f}, "
                  f"copy of the pulled rows {row['copy_ms']:.3f} ms "
                  f"({pulled.numel() * 2 / row['copy_ms'] / 1e6:.0f} GB/s)", flush=True)
            print(f"  pull {row['pull direct True']:.3f} ms with its own rows read in place, "
                  f"{row['pull direct False']:.3f} with every row copied first (default tiles)")
            if "pull engine" in row:
                print(f"  pull with the other ranks' rows by the copy engine {row['pull engine']:.3f} ms (graphed "
                      f"{row['pull engine graphed']:.3f}, copy programs graphed {row['pull graphed']:.3f}); "
                      f"same rows and products as the copy programs': {row['engine_exact']}")
            print(f"  push {row['push']:.3f} ms, push to its own buffer {row['push own']:.3f}")
            for spec in args.tiles:
                pull, push, push_t = row[f"tiles {spec}"]
                print(f"  tiles {spec}: pull {pull:.3f} ms, push {push:.3f}, push by w1^T {push_t:.3f}")
            print(f"  {'block_copy':>10} " + " ".join(f"{'c' + str(c):>15}" for c in args.n_comm)
                  + "   (pull / own, ms)")
            for bc in args.block_copy:
                print(f"  {bc:>10} " + " ".join(f"{row[f'pull c{c} b{bc}']:>7.3f}/{row[f'own c{c} b{bc}']:<7.3f}"
                                              for c in args.n_comm))
    if rank == 0 and os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "comet_nvlink.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
