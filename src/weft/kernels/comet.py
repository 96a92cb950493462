"""Comet's two fused MoE kernels (Comet, MLSys 2025, sections 3.1-3.2), each beside its PyTorch reference.

The padded expert-parallel layout of weft (docs/moe.md): W ranks, El experts per rank, C slots per
expert per source rank, E = W * El. A rank's dispatched rows (E * C, D) sit in a buffer every rank
of the group can address (`weft.comm.peers`): row (r * El + i) * C + c is slot c of rank r's local
expert i. On rank r, local expert i's rows in Flexible order (Tutel) are m = s * C + c for source
rank s and slot c; there are M = W * C of them per expert.

- `pull_gemm` (Comet's layer0, fig. 4 left and fig. 5): out[i] = rows[i] @ b[i], where rows[i]
  (M, K) are read from the source ranks' buffers. The shared tensor is split along M (tokens are
  independent in a GEMM, 3.1.1) into tiles of `block_m` rows. `n_comm` programs only copy: each
  takes whole row tiles, copies them into the local `gathered` (El, M, K) and raises the tile's
  flag; every other program computes one output tile once its rows' flag is up (thread-block
  specialisation, 3.2.1). Tiles start with this rank's own rows (local first, 3.1.2), so the GEMM
  starts before any byte crosses the link. Returns both `gathered` (the backward needs it) and out.
- `gemm_push` (layer1, fig. 4 right and fig. 7): y[i] = a[i] @ b[i] (a (El, M, K) local), each
  finished tile stored straight into the buffer of the rank its rows came from, at the rows that
  rank dispatched them from; the top-k reduction then runs there (the layer's combine). Tiles go
  remote first, this rank's own last. The stores sit in the GEMM's epilogue (Comet's "vertical
  fusion", 3.2.1): each output element crosses the link once, and stores do not stall the
  program the way the layer0 loads would, so no copy programs are needed here. Comet reduces the
  top-k partially before sending (fewer bytes when several of a token's experts share a rank);
  weft sends every expert's row and reduces at home.

Both kernels accumulate in float32 (fp32 inputs with IEEE products, not TF32) and write every
output element from exactly one program: deterministic. Spin-waits on the flags need every copy
program to be resident before the compute programs that wait for it: they have the lowest
program ids, which CUDA schedules first. The kernels run on CUDA tensors, and on CPU tensors
under Triton's interpreter (TRITON_INTERPRET=1), where the programs run one after another in id
order (copy programs first), which is how the CPU suite tests them with every rank's buffer in
one process (`tests/test_comet_kernels.py`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from weft.kernels.rows import triton

if triton is not None:
    import triton.language as tl


@dataclass(frozen=True)
class CometTiles:
    """Tile sizes and Comet's split of programs (3.2.2): `n_comm` copy programs in layer0. The GPU
    default, 256 x 128 x 64 with 8 warps and 3 stages and 64 copy programs, was the fastest of the
    shapes timed on one H200 for qwen2's, phi35's and mixtral's expert GEMMs (docs/benchmarks.md)."""

    block_m: int = 256
    block_n: int = 128
    block_k: int = 64
    block_copy: int = 128
    n_comm: int = 64
    num_warps: int = 8
    num_stages: int = 3

    @staticmethod
    def for_device(device: torch.device, n_comm: int | None = None) -> CometTiles:
        """GPU tiles (wgmma-sized) on CUDA; small ones for the CPU interpreter."""
        tiles = CometTiles() if device.type == "cuda" else CometTiles(16, 16, 16, 32, 2, 1, 1)
        return tiles if n_comm is None else dataclasses.replace(tiles, n_comm=n_comm)


# -- references (the CPU path and the test oracle) -------------------------------------------------
def pull_rows_reference(sources: list[torch.Tensor], rank: int, num_local: int, capacity: int) -> torch.Tensor:
    """Local expert i's rows from every source buffer (E * C, K) -> gathered (El, W * C, K)."""
    per_source = [src.view(len(sources), num_local, capacity, -1)[rank] for src in sources]  # (El, C, K) each
    return torch.stack(per_source, 1).flatten(1, 2)


def pull_gemm_reference(sources: list[torch.Tensor], rank: int, capacity: int,
                        b_EKN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gathered, gathered @ b) with gathered = `pull_rows_reference`."""
    gathered = pull_rows_reference(sources, rank, b_EKN.shape[0], capacity)
    return gathered, torch.bmm(gathered, b_EKN.to(gathered.dtype))


def gemm_push_reference(a_EMK: torch.Tensor, b_EKN: torch.Tensor, dests: list[torch.Tensor], rank: int,
                        capacity: int) -> None:
    """y = a @ b; rows s * C + c of expert i into dests[s] row (rank * El + i) * C + c."""
    num_local, world = a_EMK.shape[0], len(dests)
    y = torch.bmm(a_EMK, b_EKN.to(a_EMK.dtype)).view(num_local, world, capacity, -1)
    for s, dest in enumerate(dests):
        dest.view(world, num_local, capacity, -1)[rank].copy_(y[:, s])


# -- Triton kernels ----------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _dot(a, b, acc, IEEE: tl.constexpr):
        """acc + a @ b in float32: IEEE products for fp32 inputs (not TF32); 16-bit inputs in float32 under
        the interpreter, whose dot of bfloat16 tiles is wrong (Triton 3.6)."""
        if IEEE:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def _tile_product(a, b, m, n, M, K: tl.constexpr, N, sb_k, sb_n, BM: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr, IEEE: tl.constexpr, EVEN: tl.constexpr, A_CG: tl.constexpr):
        """a[m, :] @ b[:, n] in float32 (a: rows of K, contiguous; b: strides sb_k, sb_n). EVEN: the tiles
        divide M, N and K, so no load is masked. A_CG: read a through L2 only (rows another program wrote)."""
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        a_ptr = a + m[:, None].to(tl.int64) * K
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            if EVEN:
                if A_CG:
                    a_tile = tl.load(a_ptr + k[None, :], cache_modifier=".cg")
                else:
                    a_tile = tl.load(a_ptr + k[None, :])
                b_tile = tl.load(b + k[:, None] * sb_k + n[None, :] * sb_n)
            else:
                a_mask = (m[:, None] < M) & (k[None, :] < K)
                if A_CG:
                    a_tile = tl.load(a_ptr + k[None, :], mask=a_mask, other=0.0, cache_modifier=".cg")
                else:
                    a_tile = tl.load(a_ptr + k[None, :], mask=a_mask, other=0.0)
                b_tile = tl.load(b + k[:, None] * sb_k + n[None, :] * sb_n,
                                 mask=(k[:, None] < K) & (n[None, :] < N), other=0.0)
            acc = _dot(a_tile, b_tile, acc, IEEE)
        return acc

    @triton.jit
    def _copy_tile(table, gathered, flags, i, j, rank, num_local, capacity, M, K: tl.constexpr, n_mt,
                   BM: tl.constexpr, BC: tl.constexpr):
        """Row tile j of local expert i from its source ranks' buffers into `gathered`, then its flag."""
        m = j * BM + tl.arange(0, BM)
        valid = m < M
        src = m // capacity
        src_row = ((rank * num_local + i) * capacity + m % capacity).to(tl.int64)
        base = tl.load(table + src, mask=valid, other=0).to(tl.pointer_type(gathered.dtype.element_ty))
        for k0 in range(0, K, BC):
            k = k0 + tl.arange(0, BC)
            mask = valid[:, None] & (k[None, :] < K)
            rows = tl.load(base[:, None] + src_row[:, None] * K + k[None, :], mask=mask)
            tl.store(gathered + (i.to(tl.int64) * M + m[:, None]) * K + k[None, :], rows, mask=mask)
        tl.debug_barrier()
        tl.atomic_xchg(flags + i * n_mt + j, 1, sem="release", scope="gpu")

    @triton.jit
    def _pull_gemm_kernel(table, gathered, b, out, flags, rank, num_local, capacity, M, K: tl.constexpr, N,
                          sb_e, sb_k, sb_n, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                          BC: tl.constexpr, N_COMM: tl.constexpr, IEEE: tl.constexpr, EVEN: tl.constexpr):
        pid = tl.program_id(0)
        n_mt = tl.cdiv(M, BM)
        first = (rank * capacity) // BM  # the tile holding this rank's own first row: start there
        if pid < N_COMM:
            # A copy program: whole row tiles (expert-major within a tile round), then the flag.
            task = pid
            while task < num_local * n_mt:
                _copy_tile(table, gathered, flags, task % num_local, (task // num_local + first) % n_mt,
                           rank, num_local, capacity, M, K, n_mt, BM, BC)
                task += N_COMM
        else:
            q = pid - N_COMM
            n_nt = tl.cdiv(N, BN)
            j = (q // (num_local * n_nt) + first) % n_mt
            i = (q // n_nt) % num_local
            n0 = (q % n_nt) * BN
            while tl.atomic_add(flags + i * n_mt + j, 0, sem="acquire", scope="gpu") == 0:
                pass
            m = j * BM + tl.arange(0, BM)
            n = n0 + tl.arange(0, BN)
            acc = _tile_product(gathered + i.to(tl.int64) * M * K, b + i * sb_e, m, n, M, K, N, sb_k, sb_n,
                                BM, BN, BK, IEEE, EVEN, True)
            tl.store(out + (i.to(tl.int64) * M + m[:, None]) * N + n[None, :], acc.to(out.dtype.element_ty),
                     mask=(m[:, None] < M) & (n[None, :] < N))

    @triton.jit
    def _gemm_push_kernel(a, b, table, like, rank, num_local, capacity, M, K: tl.constexpr, N, world,
                          sb_e, sb_k, sb_n, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                          IEEE: tl.constexpr, EVEN: tl.constexpr):
        pid = tl.program_id(0)
        n_mt = tl.cdiv(M, BM)
        n_nt = tl.cdiv(N, BN)
        first = (((rank + 1) % world) * capacity) // BM  # remote rows first, this rank's own last
        j = (pid // (num_local * n_nt) + first) % n_mt
        i = (pid // n_nt) % num_local
        n = (pid % n_nt) * BN + tl.arange(0, BN)
        m = j * BM + tl.arange(0, BM)
        acc = _tile_product(a + i.to(tl.int64) * M * K, b + i * sb_e, m, n, M, K, N, sb_k, sb_n, BM, BN, BK, IEEE,
                            EVEN, False)
        valid = m < M
        dest = m // capacity
        dest_row = ((rank * num_local + i) * capacity + m % capacity).to(tl.int64)
        base = tl.load(table + dest, mask=valid, other=0).to(tl.pointer_type(like.dtype.element_ty))
        tl.store(base[:, None] + dest_row[:, None] * N + n[None, :], acc.to(like.dtype.element_ty),
                 mask=valid[:, None] & (n[None, :] < N))


def pull_gemm(table: torch.Tensor, like: torch.Tensor, rank: int, capacity: int, b_EKN: torch.Tensor,
              tiles: CometTiles) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer0: (gathered, gathered @ b), gathered (El, W * C, K) read from the W source buffers
    whose addresses are in `table` (int64, one per rank, on the kernel's device; `like` this
    rank's own buffer, for dtype and device). Equal to `pull_gemm_reference` up to the float32
    accumulation order."""
    world, (num_local, K, N) = table.numel(), b_EKN.shape
    M = world * capacity
    gathered = like.new_empty(num_local, M, K)
    out = like.new_empty(num_local, M, N)
    flags = torch.zeros(num_local * triton.cdiv(M, tiles.block_m), dtype=torch.int32, device=like.device)
    grid = tiles.n_comm + num_local * triton.cdiv(M, tiles.block_m) * triton.cdiv(N, tiles.block_n)
    _pull_gemm_kernel[(grid,)](table, gathered, b_EKN, out, flags, rank, num_local, capacity, M, K, N,
                               *b_EKN.stride(), BM=tiles.block_m, BN=tiles.block_n, BK=tiles.block_k,
                               BC=tiles.block_copy, N_COMM=tiles.n_comm, **_launch(like, tiles, M, N, K))
    return gathered, out


def gemm_push(a_EMK: torch.Tensor, b_EKN: torch.Tensor, table: torch.Tensor, like: torch.Tensor, rank: int,
              capacity: int, tiles: CometTiles) -> None:
    """Layer1: a @ b, rows s * C + c of expert i stored into rank s's buffer (address in `table`)
    at row (rank * El + i) * C + c. `like`: this rank's own buffer (dtype). Equal to
    `gemm_push_reference` up to the float32 accumulation order."""
    world, (num_local, M, K), N = table.numel(), a_EMK.shape, b_EKN.shape[2]
    grid = num_local * triton.cdiv(M, tiles.block_m) * triton.cdiv(N, tiles.block_n)
    _gemm_push_kernel[(grid,)](a_EMK, b_EKN, table, like, rank, num_local, capacity, M, K, N, world,
                               *b_EKN.stride(), BM=tiles.block_m, BN=tiles.block_n, BK=tiles.block_k,
                               **_launch(like, tiles, M, N, K))


def _launch(x: torch.Tensor, tiles: CometTiles, M: int, N: int, K: int) -> dict:
    """Launch options: float32 GEMMs in IEEE precision (and every GEMM under the interpreter); no
    masked loads where the tiles divide the GEMM."""
    even = M % tiles.block_m == 0 and N % tiles.block_n == 0 and K % tiles.block_k == 0
    ieee = {"IEEE": x.dtype == torch.float32 or not x.is_cuda, "EVEN": even}
    return {**ieee, "num_warps": tiles.num_warps, "num_stages": tiles.num_stages} if x.is_cuda else ieee
