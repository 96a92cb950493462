"""Comet's two kernels on one GPU against torch.bmm on the same shapes (2-rank buffers held by this
GPU, so the "remote" rows are local memory: this times the kernels' compute path and its tile
scheduling, not NVLink). Prints a table and writes JSON to $OUT/comet_kernels.json.

    PYTHONPATH=src python3 scripts/comet_kernels.py [--configs qwen2 phi35 mixtral] [--n-comm 4 8 16]
        [--tiles 128x256x64w8s4 128x128x64w8s5] [--copy-engine]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch

from weft.bench.layer import CONFIGS
from weft.kernels import comet as K
from weft.profiling import seconds_per_call


def timed(fn, calls: int = 20, rounds: int = 5) -> float:
    """ms per call of `calls` back-to-back calls (`weft.profiling.seconds_per_call`: the host's launch
    work hides behind the queued kernels, as in a CUDA graph), the best of `rounds`, after 3 warm-ups."""
    for _ in range(3):
        fn()
    return min(seconds_per_call(fn, torch.device("cuda"), calls) for _ in range(rounds)) * 1e3


def parse_tiles(spec: str) -> K.CometTiles:
    sizes, rest = spec.split("w")
    warps, stages = rest.split("s")
    bm, bn, bk = (int(v) for v in sizes.split("x"))
    return K.CometTiles(bm, bn, bk, num_warps=int(warps), num_stages=int(stages))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", nargs="+", default=["qwen2", "phi35", "mixtral"])
    parser.add_argument("--n-comm", nargs="+", type=int, default=[16, 32, 64])
    parser.add_argument("--block-copy", nargs="+", type=int, default=[128], help="columns a copy program moves at once")
    parser.add_argument("--world", type=int, default=2, help="ranks whose buffers the GPU holds")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--tiles", nargs="+", default=["128x256x64w8s4"],
                        help="GEMM tiles to time, BMxBNxBK w<warps> s<stages> (the first runs the n_comm sweep)")
    parser.add_argument("--copy-engine", action="store_true",
                        help="also time layer0 with the other ranks' rows moved by the copy engine (for two GPUs: "
                             "with every buffer on one GPU the call did not return in 120 s, fifty-fourth session)")
    args = parser.parse_args()
    rows, dev, dtype = [], torch.device("cuda"), torch.bfloat16
    for name in args.configs:
        cfg = CONFIGS[name]
        world, local = args.world, cfg.num_experts // args.world
        cap = args.tokens * cfg.top_k // cfg.num_experts
        sends = [torch.randn(cfg.num_experts * cap, cfg.dim, device=dev, dtype=dtype) for _ in range(world)]
        table = torch.tensor([s.data_ptr() for s in sends], dtype=torch.int64, device=dev)
        w1 = torch.randn(local, cfg.dim, cfg.hidden_dim, device=dev, dtype=dtype) / cfg.dim ** 0.5
        w2 = torch.randn(local, cfg.hidden_dim, cfg.dim, device=dev, dtype=dtype) / cfg.hidden_dim ** 0.5
        outs = [torch.empty(cfg.num_experts * cap, cfg.dim, device=dev, dtype=dtype) for _ in range(world)]
        out_table = torch.tensor([o.data_ptr() for o in outs], dtype=torch.int64, device=dev)
        rows_map = K.RowMap.padded(world, local, cap, 0, parse_tiles(args.tiles[0]).block_m, dev)
        gathered, h = K.pull_gemm_reference(sends, rows_map, w1)
        flops0 = 2 * local * world * cap * cfg.dim * cfg.hidden_dim
        gathered_3d, h_3d = gathered.view(local, world * cap, -1), h.view(local, world * cap, -1)
        bmm0 = timed(lambda: torch.bmm(gathered_3d, w1))
        bmm1 = timed(lambda: torch.bmm(h_3d, w2))
        err = float((K.pull_gemm(table, sends[0], rows_map, w1, parse_tiles(args.tiles[0]))[1].float()
                     - h.float()).norm() / h.float().norm())
        row = {"config": name, "experts_here": local, "rows_per_expert": world * cap, "bmm_layer0_ms": bmm0,
               "bmm_layer1_ms": bmm1, "pull_rel_err": err}
        shapes = [parse_tiles(t) for t in args.tiles]
        for n_comm in args.n_comm:
            for block_copy in args.block_copy:
                tiles = dataclasses.replace(shapes[0], n_comm=n_comm, block_copy=block_copy)
                row[f"pull_gemm_ms_c{n_comm}_b{block_copy}"] = timed(
                    lambda: K.pull_gemm(table, sends[0], rows_map, w1, tiles))
            row[f"pull_gemm_ms_c{n_comm}"] = min(row[f"pull_gemm_ms_c{n_comm}_b{b}"] for b in args.block_copy)
        best_comm = min(args.n_comm, key=lambda c: row[f"pull_gemm_ms_c{c}"])
        for spec, tiles in zip(args.tiles, shapes):
            tiles = dataclasses.replace(tiles, n_comm=best_comm)
            tile_map = K.RowMap.padded(world, local, cap, 0, tiles.block_m, dev)
            row[f"tiles {spec}"] = (timed(lambda: K.pull_gemm(table, sends[0], tile_map, w1, tiles)),
                                    timed(lambda: K.gemm_push(h, w2, out_table, outs[0], tile_map, tiles)),
                                    timed(lambda: K.gemm_push(h, w1.transpose(1, 2), out_table, outs[0], tile_map,
                                                              tiles)))
            print(f"{name} tiles {spec} n_comm {best_comm}: pull {row[f'tiles {spec}'][0]:.3f} ms, "
                  f"push {row[f'tiles {spec}'][1]:.3f} ms, push by w1^T {row[f'tiles {spec}'][2]:.3f} ms",
                  flush=True)
        for direct in (True, False):  # layer0 reading its own rows in place, or every row after its copy
            tiles = dataclasses.replace(shapes[0], n_comm=best_comm, direct_local=direct)
            row[f"pull direct {direct}"] = timed(lambda: K.pull_gemm(table, sends[0], rows_map, w1, tiles))
        print(f"{name} pull, own rows read in place {row['pull direct True']:.3f} ms, every row copied first "
              f"{row['pull direct False']:.3f} ms", flush=True)
        # the other ranks' rows by the copy engine
        engine = dataclasses.replace(shapes[0], n_comm=best_comm, copy_engine=True)
        if args.copy_engine and rows_map.runs is not None and K.copy_engine_available(dev):
            got_g, got_h = K.pull_gemm(table, sends[0], rows_map, w1, engine, sends)
            row["engine_gathered_equal"] = bool(torch.equal(got_g, gathered))
            row["engine_rel_err"] = float((got_h.float() - h.float()).norm() / h.float().norm())
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                K.pull_gemm(table, sends[0], rows_map, w1, engine, sends)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                graph_g, graph_h = K.pull_gemm(table, sends[0], rows_map, w1, engine, sends)
            graph.replay()
            torch.cuda.synchronize()
            row["engine_graph_gathered_equal"] = bool(torch.equal(graph_g, gathered))
            row["engine_graph_rel_err"] = float((graph_h.float() - h.float()).norm() / h.float().norm())
            row["pull engine"] = timed(lambda: K.pull_gemm(table, sends[0], rows_map, w1, engine, sends))
            row["pull engine graphed"] = timed(graph.replay)
            print(f"{name} pull by the copy engine {row['pull engine']:.3f} ms "
                  f"(graphed {row['pull engine graphed']:.3f}); "
                  f"gathered equal {row['engine_gathered_equal']} / graphed {row['engine_graph_gathered_equal']}, "
                  f"rel err {row['engine_rel_err']:.1e} / {row['engine_graph_rel_err']:.1e}", flush=True)
        row["gemm_push_ms"] = min(v[1] for k, v in row.items() if k.startswith("tiles "))
        row["tflops_bmm_layer0"] = flops0 / bmm0 / 1e9
        row["tflops_pull_best"] = flops0 / min(v[0] for k, v in row.items() if k.startswith("tiles ")) / 1e9
        row["tflops_push"] = flops0 / row["gemm_push_ms"] / 1e9
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'config':<9} {'bmm0 ms':>8} {'pull best':>9} {'bmm1 ms':>8} {'push ms':>8} {'TF bmm':>7} "
          f"{'TF pull':>7} {'TF push':>7}  pull ms by n_comm")
    for r in rows:
        best = min(v[0] for k, v in r.items() if k.startswith("tiles "))
        sweep = " ".join(f"{c}:{r[f'pull_gemm_ms_c{c}']:.3f}" for c in args.n_comm)
        print(f"{r['config']:<9} {r['bmm_layer0_ms']:>8.3f} {best:>9.3f} {r['bmm_layer1_ms']:>8.3f} "
              f"{r['gemm_push_ms']:>8.3f} {r['tflops_bmm_layer0']:>7.0f} {r['tflops_pull_best']:>7.0f} "
              f"{r['tflops_push']:>7.0f}  {sweep}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "comet_kernels.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
