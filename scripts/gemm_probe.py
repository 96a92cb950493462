"""Where Comet's Triton GEMMs lose to cuBLAS on the experts' shapes (one GPU): torch.bmm, the two
Comet kernels on this GPU's own buffer (W = 1), and bare Triton batched GEMMs of the same tiles
(one program per tile, and persistent), each timed as the mean of back-to-back launches between
two events; and what Triton compiled (registers, spills, wgmma and TMA instructions in the PTX).
Prints a table and writes JSON to $OUT/gemm_probe.json.

    PYTHONPATH=src python3 scripts/gemm_probe.py [--configs qwen2 mixtral] [--tiles 128x256x64w8s4 ...]
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl
from comet_kernels import parse_tiles, timed  # this script's folder is on sys.path
from triton.tools.tensor_descriptor import TensorDescriptor

from weft.bench.layer import CONFIGS
from weft.kernels import comet as K
from weft.kernels.comet import _work_item


@triton.jit
def _tile_of(q, E, n_mt, n_nt, GROUP: tl.constexpr):
    """Work item q -> (expert, row tile, column tile): the experts one after another, each expert's
    tiles in Comet's grouped order (`_work_item`)."""
    per_e = n_mt * n_nt
    mt, nt = _work_item(q % per_e, n_mt, n_nt, GROUP)
    return q // per_e, mt, nt


@triton.jit
def _bare_kernel(a, a_desc, b_desc, c_desc, c, E, M, N, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, GROUP: tl.constexpr, C_TMA: tl.constexpr, A_PTR: tl.constexpr = False):
    """C[e] = A[e] @ B[e], one program per output tile, A/B by TMA (A_PTR: A by masked pointer
    loads through L2 only, as Comet's layer0 reads its gathered rows), C by TMA or by pointers."""
    n_mt, n_nt = tl.cdiv(M, BM), tl.cdiv(N, BN)
    e, mt, nt = _tile_of(tl.program_id(0), E, n_mt, n_nt, GROUP)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    rows = e * M + mt * BM + tl.arange(0, BM)
    for k0 in range(0, K, BK):
        if A_PTR:
            k = k0 + tl.arange(0, BK)
            a_tile = tl.load(a + rows[:, None].to(tl.int64) * K + k[None, :], mask=(rows < (e + 1) * M)[:, None],
                        other=0.0, cache_modifier=".cg")
        else:
            a_tile = a_desc.load([e * M + mt * BM, k0])
        b = b_desc.load([e * K + k0, nt * BN])
        acc = tl.dot(a_tile, b, acc)
    if C_TMA:
        c_desc.store([e * M + mt * BM, nt * BN], acc.to(tl.bfloat16))
    else:
        m = e * M + mt * BM + tl.arange(0, BM)
        n = nt * BN + tl.arange(0, BN)
        tl.store(c + m[:, None].to(tl.int64) * N + n[None, :], acc.to(tl.bfloat16), mask=(n < N)[None, :])


@triton.jit
def _persistent_kernel(a_desc, b_desc, c_desc, E, M, N, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, GROUP: tl.constexpr, PROGRAMS: tl.constexpr, SUBTILE: tl.constexpr):
    """The same GEMM with PROGRAMS programs, each looping over tiles pid, pid + PROGRAMS, ... (the
    tile loop and K loop flattened into one pipelined loop, Triton's persistent-matmul tutorial's
    structure), C stored by TMA in two halves (SUBTILE) or whole."""
    n_mt, n_nt = tl.cdiv(M, BM), tl.cdiv(N, BN)
    total = E * n_mt * n_nt
    k_tiles = K // BK
    for q in tl.range(tl.program_id(0), total, PROGRAMS, flatten=True):
        e, mt, nt = _tile_of(q, E, n_mt, n_nt, GROUP)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kk in range(k_tiles):
            a = a_desc.load([e * M + mt * BM, kk * BK])
            b = b_desc.load([e * K + kk * BK, nt * BN])
            acc = tl.dot(a, b, acc)
        if SUBTILE:
            halves = tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1))
            left, right = tl.split(halves)
            c_desc.store([e * M + mt * BM, nt * BN], left.to(tl.bfloat16))
            c_desc.store([e * M + mt * BM, nt * BN + BN // 2], right.to(tl.bfloat16))
        else:
            c_desc.store([e * M + mt * BM, nt * BN], acc.to(tl.bfloat16))


def compiled_info(handle) -> dict:
    """Registers, spills, shared memory and the PTX's wgmma / TMA / cp.async counts of a compiled kernel."""
    ptx = handle.asm.get("ptx", "")
    try:
        handle._init_handles()
    except Exception as exc:  # a variant that never ran (too much shared memory)
        return {"error": f"{type(exc).__name__}"}
    return {"regs": handle.n_regs, "spills": handle.n_spills, "shared": handle.metadata.shared,
            "wgmma": ptx.count("wgmma.mma_async"), "wgmma_wait": ptx.count("wgmma.wait_group"),
            "tma_load": ptx.count("cp.async.bulk.tensor"), "cp_async": ptx.count("cp.async.cg") +
            ptx.count("cp.async.ca"), "mma_sync": ptx.count("mma.sync")}


def jit_handles(fn) -> list:
    """Every compiled kernel of a JIT function (Triton's per-device caches)."""
    found = []
    for entry in fn.device_caches.values():
        for part in entry if isinstance(entry, tuple) else (entry,):
            if isinstance(part, dict):
                found.extend(v for v in part.values() if hasattr(v, "asm"))
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", nargs="+", default=["qwen2", "mixtral"])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank (2 ranks' rows, padded cf 1.0)")
    parser.add_argument("--tiles", nargs="+", default=["128x256x64w8s4", "128x256x64w8s3", "128x128x64w4s4",
                                                        "128x128x64w8s4", "128x192x64w8s4"])
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    results = []
    for name in args.configs:
        cfg = CONFIGS[name]
        world, local = 2, cfg.num_experts // 2
        rows_e = world * args.tokens * cfg.top_k // cfg.num_experts
        for layer, (k_dim, n_dim) in (("layer0", (cfg.dim, cfg.hidden_dim)), ("layer1", (cfg.hidden_dim, cfg.dim))):
            a = torch.randn(local * rows_e, k_dim, device=dev, dtype=dtype)
            b = torch.randn(local, k_dim, n_dim, device=dev, dtype=dtype) / k_dim ** 0.5
            c = torch.empty(local * rows_e, n_dim, device=dev, dtype=dtype)
            flops = 2 * local * rows_e * k_dim * n_dim
            ref = torch.bmm(a.view(local, rows_e, k_dim), b).view(-1, n_dim)
            row = {"config": name, "layer": layer, "E": local, "M": rows_e, "K": k_dim, "N": n_dim,
                   "bmm": timed(lambda: torch.bmm(a.view(local, rows_e, k_dim), b), args.calls)}
            table = torch.tensor([a.data_ptr()], dtype=torch.int64, device=dev)
            for spec in args.tiles:
                tiles = parse_tiles(spec)
                rows = K.RowMap.padded(1, local, rows_e, 0, tiles.block_m, dev)
                if layer == "layer0":
                    row[f"comet {spec}"] = timed(lambda: K.pull_gemm(table, a, rows, b, tiles), args.calls)
                else:
                    out_table = torch.tensor([c.data_ptr()], dtype=torch.int64, device=dev)
                    row[f"comet {spec}"] = timed(lambda: K.gemm_push(a, b, out_table, c, rows, tiles), args.calls)
                a_desc = TensorDescriptor.from_tensor(a, [tiles.block_m, tiles.block_k])
                b_desc = TensorDescriptor.from_tensor(b.view(-1, n_dim), [tiles.block_k, tiles.block_n])
                c_desc = TensorDescriptor.from_tensor(c, [tiles.block_m, tiles.block_n])
                c_half = TensorDescriptor.from_tensor(c, [tiles.block_m, tiles.block_n // 2])
                n_tiles = local * triton.cdiv(rows_e, tiles.block_m) * triton.cdiv(n_dim, tiles.block_n)
                launch = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
                for c_tma, a_ptr in ((False, False), (True, False), (False, True)):
                    def bare(c_tma=c_tma, a_ptr=a_ptr):
                        _bare_kernel[(n_tiles,)](a, a_desc, b_desc, c_desc, c, local, rows_e, n_dim, k_dim,
                                                 tiles.block_m, tiles.block_n, tiles.block_k, 8, c_tma, a_ptr,
                                                 **launch)
                    bare()
                    err = float((c.float() - ref.float()).abs().max())
                    label = f"bare{'-tma' if c_tma else ''}{'-ptrA' if a_ptr else ''} {spec}"
                    row[label] = timed(bare, args.calls)
                    row[f"{label} err"] = err
                for subtile in (False, True):
                    def persistent(subtile=subtile):
                        _persistent_kernel[(min(sms, n_tiles),)](
                            a_desc, b_desc, c_half if subtile else c_desc, local, rows_e, n_dim, k_dim,
                            tiles.block_m, tiles.block_n, tiles.block_k, 8, min(sms, n_tiles), subtile, **launch)
                    try:
                        persistent()
                        row[f"persistent{'-sub' if subtile else ''} {spec}"] = timed(persistent, args.calls)
                        row[f"persistent{'-sub' if subtile else ''} {spec} err"] = float(
                            (c.float() - ref.float()).abs().max())
                    except Exception as exc:  # a tile whose stages do not fit: reported, the sweep goes on
                        row[f"persistent{'-sub' if subtile else ''} {spec}"] = f"{type(exc).__name__}: {exc}"[:200]
            row["tflops_bmm"] = flops / row["bmm"] / 1e9
            results.append(row)
            best = {k: v for k, v in row.items() if isinstance(v, float) and not k.endswith("err")
                    and k not in ("bmm", "tflops_bmm")}
            print(f"{name} {layer} E{local} M{rows_e} K{k_dim} N{n_dim}: bmm {row['bmm']:.3f} ms "
                  f"({row['tflops_bmm']:.0f} TF/s)", flush=True)
            for key, ms in sorted(best.items(), key=lambda kv: kv[1]):
                print(f"  {key:<36} {ms:.3f} ms  {flops / ms / 1e9:5.0f} TF/s  {row['bmm'] / ms:.2f}x bmm", flush=True)
    info = {}
    for fn in (K._pull_gemm_kernel, K._gemm_push_kernel, _bare_kernel, _persistent_kernel):
        info[fn.fn.__name__] = [compiled_info(h) for h in jit_handles(fn)]
        print(fn.fn.__name__, info[fn.fn.__name__], flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gemm_probe.json"), "w") as f:
            json.dump({"results": results, "compiled": info}, f, indent=1)


if __name__ == "__main__":
    main()
