"""Comet's two fused MoE kernels (Comet, MLSys 2025, sections 3.1-3.2), each beside its PyTorch reference.

Every rank's dispatched rows sit in a buffer every rank of the group can address
(`weft.comm.peers`). On rank r, the rows of r's El local experts are "gathered" rows, R of them,
grouped by expert (`segments[i]` rows for local expert i) and within an expert by source rank. A
`RowMap` says where each gathered row g lives: rank `rank_R[g]`'s buffer, row `row_R[g]`. It
covers both of weft's layouts: padded (C slots per expert per source, Tutel's Flexible order) and
dropless (each source's routed rows sorted by expert, counts varying per call). Its tiles cut each
expert's rows into runs of at most `block_m` rows (a GEMM's rows are independent, so the shared
tensor is split along M, 3.1.1).

- `pull_gemm` (Comet's layer0, fig. 4 left and fig. 5): out = gathered @ b per expert, where the
  gathered rows are read from the source ranks' buffers. The first `n_comm` programs only copy:
  each takes whole tiles, copies their rows into the local `gathered` (R, K) and raises the tile's
  flag; every other program computes one output tile once its tile's flag is up (thread-block
  specialisation, 3.2.1). Tiles whose rows start on this rank come first (3.1.2: what the
  consumer can use at once), so the GEMM starts before any byte crosses the link.
- `gemm_push` (layer1, fig. 4 right and fig. 7): y = a @ b per expert (a (R, K) local), each
  finished tile stored straight into the buffer of the rank its rows came from, at the rows that
  rank dispatched them from; the top-k reduction then runs there (the layer's combine). Remote
  tiles first, this rank's own last. The stores sit in the GEMM's epilogue (Comet's "vertical
  fusion", 3.2.1): each output element crosses the link once, and stores do not stall a program
  the way layer0's loads would, so no copy programs are needed here. Comet reduces the top-k
  partially before sending (fewer bytes when several of a token's experts share a rank); weft
  sends every expert's row and reduces at home.

Both GEMMs read the weights (and layer1 its local rows) through the tensor memory accelerator
where it takes them, take row tiles in groups for L2 reuse, and store through row addresses
declared 16-byte aligned (docs/comet.md, "How the GEMM tiles run").

Both kernels accumulate in float32 (fp32 inputs with IEEE products, not TF32) and write every
output element from exactly one program: deterministic. Spin-waits on the flags need every copy
program to be resident before the compute programs that wait for it: they have the lowest
program ids, which CUDA schedules first. The kernels run on CUDA tensors, and on CPU tensors
under Triton's interpreter (TRITON_INTERPRET=1), where the programs run one after another in id
order (copy programs first), which is how the CPU suite tests them with every rank's buffer in
one process (`tests/test_comet.py`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from weft.kernels import tma
from weft.kernels.activation import ELEMENTWISE
from weft.kernels.grouped_mm import batched_wgrad_into, grouped_mm_takes, grouped_rows_mm, grouped_weights_mm
from weft.kernels.grouped_wgrad import grouped_wgrad_into
from weft.kernels.rows import triton, triton_usable

if triton is not None:
    import triton.language as tl
try:  # the copy engine's flags (layer0 with `CometTiles.copy_engine`): torch's symmetric-memory ops
    from torch._C._distributed_c10d import _SymmetricMemory
except ImportError:
    _SymmetricMemory = None


@dataclass(frozen=True)
class CometTiles:
    """Tile sizes and Comet's split of programs (3.2.2): `n_comm` copy programs in layer0, chosen
    per shape among `n_comm_choices` where a tuning dictionary times them (Comet's adaptive
    workload assignment; `weft.moe.exchange.comet`), else the default. `group`: row tiles taken
    together across every column tile (L2 reuse). `direct_local`: layer0's tiles whose rows are all
    in this rank's own buffer are read from there without waiting for a copy, and the copy
    programs move the other ranks' rows first (`_pull_gemm_kernel`). `copy_engine` (needs
    `direct_local` and a map with `runs`): the other ranks' rows cross by the GPU's copy engine
    instead, the copy programs moving this rank's own rows alone (`_copy_runs`); off by default
    (docs/comet.md says what it measured). The 16-bit GPU tiles (128 x 256 x 64, 8 warps, 4
    stages) are those docs/benchmarks.md ("Comet, step 2") found fastest for qwen2's, phi35's and
    mixtral's expert GEMMs; float32 GEMMs (IEEE products) take tiles whose stages fit in shared
    memory."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    block_copy: int = 128
    n_comm: int = 32
    num_warps: int = 8
    num_stages: int = 4
    n_comm_choices: tuple[int, ...] = (16, 32, 64, 128)
    group: int = 8
    direct_local: bool = True
    copy_engine: bool = False

    @staticmethod
    def for_device(device: torch.device, n_comm: int | None = None, dtype: torch.dtype = torch.bfloat16) -> CometTiles:
        """GPU tiles (wgmma-sized; smaller for float32) on CUDA; small ones for the CPU interpreter,
        where there is nothing to tune (its programs run one after another)."""
        if device.type != "cuda":
            tiles = CometTiles(16, 16, 16, 32, 2, 1, 1, (2,), group=2)
        elif dtype == torch.float32:
            tiles = CometTiles(128, 128, 32, num_stages=3)
        else:
            tiles = CometTiles()
        return tiles if n_comm is None else dataclasses.replace(tiles, n_comm=n_comm, n_comm_choices=(n_comm,))


@dataclass(frozen=True)
class RowMap:
    """Where rank `rank`'s gathered rows live, and their tiles.

    `rank_R` (int32) and `row_R` (int64): gathered row g is row `row_R[g]` of rank `rank_R[g]`'s
    buffer. `ends_I` (int32, on the device): the running sum of local expert i's rows (consecutive),
    the offsets `torch._grouped_mm` takes. `pull_tiles` / `push_tiles` (int32 (T, 3): expert,
    first row, end row): the same tiles in layer0's order (rows starting on this rank first) and
    layer1's (remote first, this rank's own last). `segments[i]`: local expert i's rows, where the
    host knows them (`build`); None for a map built from counts on the device (`on_device`), whose
    arrays are sized for the most rows the rank can receive: rows past the last end have rank -1,
    tiles past the last one are empty (first = end = 0) and come last in both orders.
    `runs` (a padded map whose capacity the tiles divide, else None): every (expert, source) run
    as (source, first row in its buffer, first gathered row, rows), the other ranks' runs first
    (nearest first, experts in order: the order layer0's GEMM takes them) and this rank's last;
    each run is whole tiles, so a tile's rows arrive with one run (layer0's copies by the copy
    engine, `CometTiles.copy_engine`)."""

    rank_R: torch.Tensor
    row_R: torch.Tensor
    segments: tuple[int, ...] | None
    ends_I: torch.Tensor
    pull_tiles: torch.Tensor
    push_tiles: torch.Tensor
    runs: tuple[tuple[int, int, int, int], ...] | None = None

    @property
    def num_rows(self) -> int:
        """The gathered rows (`on_device`: the most there can be, the buffers' size)."""
        return sum(self.segments) if self.segments is not None else self.rank_R.shape[0]

    @staticmethod
    def build(counts_SI: list[list[int]], offsets_SI: list[list[int]], rank: int, block_m: int,
              device: torch.device) -> RowMap:
        """Local expert i's rows from source s are `counts_SI[s][i]` rows of s's buffer from row
        `offsets_SI[s][i]` on; gathered by expert, then by source. The counts and offsets (El * W
        numbers the caller holds on the host) go to `device` in one copy, and the per-row and
        per-tile arrays are computed there, every size known on the host: no synchronisation, and
        no host work that grows with the rows (a dropless call builds its map every call)."""
        world, num_local = len(counts_SI), len(counts_SI[0])
        count_IS_host = [counts_SI[s][i] for i in range(num_local) for s in range(world)]  # expert-major
        offset_IS_host = [offsets_SI[s][i] for i in range(num_local) for s in range(world)]
        segments = tuple(sum(count_IS_host[i * world:(i + 1) * world]) for i in range(num_local))
        count_IS, offset_IS = torch.tensor([count_IS_host, offset_IS_host], dtype=torch.int64).to(device)
        return _row_map(count_IS, offset_IS, world, rank, block_m, sum(segments),
                        sum(-(-c // block_m) for c in segments), segments)

    @staticmethod
    def on_device(counts_WE: torch.Tensor, rank: int, num_local: int, block_m: int, max_rows: int,
                  served_WE: torch.Tensor | None = None) -> RowMap:
        """The dropless map from every rank's counts left on the device (`counts_WE[s][e]`: the rows
        source s dispatched to expert e, each source's rows sorted by expert from row 0 of its
        buffer): nothing is read on the host, so a CUDA graph can hold the call. Its arrays are
        sized for `max_rows`, the most rows this rank's experts can receive (W * min(T * k, T * El)
        for T tokens a rank), and the tiles for the most such rows can take (max_rows / block_m + El);
        the kernels skip the empty tiles and the rows past the last end. `served_WE` (bool, on the
        device): source s's rows of expert e are left out of the map where it is True (Pro-Prophet:
        s computes them itself, with a copy of e), their buffer rows skipped."""
        world = counts_WE.shape[0]
        counts_WE = counts_WE.to(torch.int64)
        mine = slice(rank * num_local, (rank + 1) * num_local)
        offset_IS = (torch.cumsum(counts_WE, 1) - counts_WE)[:, mine].t().reshape(-1)
        if served_WE is not None:
            counts_WE = counts_WE.masked_fill(served_WE, 0)
        count_IS = counts_WE[:, mine].t().reshape(-1)  # expert-major, then source
        return _row_map(count_IS, offset_IS, world, rank, block_m, max_rows, -(-max_rows // block_m) + num_local)

    @staticmethod
    def padded(world: int, num_local: int, capacity: int, rank: int, block_m: int, device: torch.device) -> RowMap:
        """The padded layout: C slots of each expert from each source, rank r's expert i's slots at
        rows (r * El + i) * C of every source's buffer."""
        counts = [[capacity] * num_local for _ in range(world)]
        offsets = [[(rank * num_local + i) * capacity for i in range(num_local)] for _ in range(world)]
        rows = RowMap.build(counts, offsets, rank, block_m, device)
        if capacity == 0 or capacity % block_m:
            return rows
        order = [(rank + d) % world for d in range(1, world)] + [rank]
        runs = tuple((s, (rank * num_local + i) * capacity, (i * world + s) * capacity, capacity)
                     for s in order for i in range(num_local))
        return dataclasses.replace(rows, runs=runs)


def _row_map(count_IS: torch.Tensor, offset_IS: torch.Tensor, world: int, rank: int, block_m: int, rows: int,
             n_tiles: int, segments: tuple[int, ...] | None = None) -> RowMap:
    """`RowMap` from the (expert, source) runs' counts and source offsets on the device, with
    `rows` gathered rows and `n_tiles` tiles (exact, or bounds: the rows and tiles past the runs'
    are marked empty, as `RowMap` says): one Triton kernel where it runs (`_map_kernel`), else
    `_row_map_reference` (its PyTorch reference: some sixty small ops, ~1.3 ms of host time per
    map on a GPU host)."""
    if not triton_usable(count_IS):
        return _row_map_reference(count_IS, offset_IS, world, rank, block_m, rows, n_tiles, segments)
    runs = count_IS.numel()
    num_local = runs // world
    device = count_IS.device
    rank_R = torch.empty(rows, dtype=torch.int32, device=device)
    row_R = torch.empty(rows, dtype=torch.int64, device=device)
    ends_I = torch.empty(num_local, dtype=torch.int32, device=device)
    pull = torch.empty(n_tiles, 3, dtype=torch.int32, device=device)
    push = torch.empty(n_tiles, 3, dtype=torch.int32, device=device)
    block_r = 128
    _map_kernel[(triton.cdiv(rows, block_r) + 1,)](
        count_IS.contiguous(), offset_IS.contiguous(), rank_R, row_R, ends_I, pull, push, rows, n_tiles, rank,
        WORLD=world, RUNS=runs, LOCAL=num_local, BM=block_m, BLOCK_R=block_r, BLOCK_S=triton.next_power_of_2(runs),
        BLOCK_I=triton.next_power_of_2(num_local), BLOCK_Q=64, BLOCK_K=triton.next_power_of_2(2 * world + 2))
    return RowMap(rank_R, row_R, segments, ends_I, pull, push)


def _row_map_reference(count_IS: torch.Tensor, offset_IS: torch.Tensor, world: int, rank: int, block_m: int,
                       rows: int, n_tiles: int, segments: tuple[int, ...] | None = None) -> RowMap:
    """`_row_map` in PyTorch ops (the CPU path and `_map_kernel`'s test oracle)."""
    device = count_IS.device
    num_local = count_IS.numel() // world
    end_IS = torch.cumsum(count_IS, 0)
    run_R = torch.searchsorted(end_IS, torch.arange(rows, device=device), right=True)  # each row's run
    used_R = run_R < count_IS.numel()
    run_R = run_R.clamp(max=count_IS.numel() - 1)
    rank_R = torch.where(used_R, run_R % world, -1)
    row_R = torch.where(used_R, offset_IS[run_R] + torch.arange(rows, device=device) - (end_IS - count_IS)[run_R], 0)
    count_I = count_IS.view(num_local, world).sum(1)
    end_I = torch.cumsum(count_I, 0)
    tiles_T3 = _tiles(count_I, end_I - count_I, block_m, n_tiles)
    used_T = tiles_T3[:, 2] > tiles_T3[:, 1]
    distance_T = (rank_R[tiles_T3[:, 1].clamp(max=max(rows - 1, 0))] - rank) % world if rows else tiles_T3[:, 0]
    pull = torch.sort(torch.where(used_T, distance_T, world), stable=True).indices
    push = torch.sort(torch.where(used_T, (distance_T - 1) % world, world), stable=True).indices
    return RowMap(rank_R.to(torch.int32), row_R, segments, end_I.to(torch.int32),
                  tiles_T3[pull].to(torch.int32), tiles_T3[push].to(torch.int32))


def _tiles(count_I: torch.Tensor, start_I: torch.Tensor, block_m: int, n_tiles: int) -> torch.Tensor:
    """(n_tiles, 3) int64: each expert's rows [start, start + count) cut into runs of at most
    `block_m` (expert, first, end), in expert order; experts without rows have no tile. `n_tiles`:
    at least their number; the rest are empty, (0, 0, 0)."""
    tiles_I = (count_I + block_m - 1) // block_m
    ends_I = torch.cumsum(tiles_I, 0)
    expert_T = torch.searchsorted(ends_I, torch.arange(n_tiles, device=count_I.device), right=True)
    used_T = expert_T < len(count_I)
    expert_T = expert_T.clamp(max=len(count_I) - 1)
    tile_T = torch.arange(n_tiles, device=count_I.device)
    first_T = start_I[expert_T] + (tile_T - (ends_I - tiles_I)[expert_T]) * block_m
    end_T = torch.minimum(first_T + block_m, (start_I + count_I)[expert_T])
    return torch.where(used_T[:, None], torch.stack([expert_T, first_T, end_T], 1), 0)


def segment_mm(x_RK: torch.Tensor, w_EKN: torch.Tensor, rows: RowMap) -> torch.Tensor:
    """x's rows of expert i (consecutive, up to `rows.ends_I[i]`) @ w[i]: one batched matmul when
    the host knows every expert has the same rows, else one grouped GEMM where `torch._grouped_mm`
    takes the operands, else one matmul per expert (a map built on the device: its ends read on
    the host, `grouped_rows_mm`). Rows past the last end: anything."""
    segments, w_EKN = rows.segments, w_EKN.to(x_RK.dtype)
    if segments is not None and len(set(segments)) == 1:
        num_local, count = len(segments), segments[0]
        return torch.bmm(x_RK.view(num_local, count, x_RK.shape[1]), w_EKN).view(num_local * count, w_EKN.shape[2])
    if grouped_mm_takes(x_RK, w_EKN):
        return torch._grouped_mm(x_RK, w_EKN, offs=rows.ends_I)
    if segments is None:
        return grouped_rows_mm(x_RK, w_EKN, rows.ends_I)
    outs = [part @ w_EKN[i] for i, part in enumerate(torch.split(x_RK, list(segments)))]
    return torch.cat(outs) if outs else x_RK.new_zeros(0, w_EKN.shape[2])


def segment_wgrad(x_RK: torch.Tensor, dy_RN: torch.Tensor, rows: RowMap) -> torch.Tensor:
    """The weight gradient of `segment_mm`: (El, K, N), x's rows of expert i transposed @ dy's (the
    grouped GEMM's 2-D x 2-D form: groups along the contracted rows; an expert without rows gets
    zeros; rows past the last end left out)."""
    segments = rows.segments
    if segments is not None and len(set(segments)) == 1:
        num_local, count = len(segments), segments[0]
        x_IRK, dy_IRN = x_RK.view(num_local, count, x_RK.shape[1]), dy_RN.view(num_local, count, dy_RN.shape[1])
        return torch.bmm(x_IRK.transpose(1, 2), dy_IRN)
    if segments is None or grouped_mm_takes(x_RK.T, dy_RN):
        return grouped_weights_mm(x_RK, dy_RN, rows.ends_I)
    return torch.stack([a.T @ b for a, b in zip(torch.split(x_RK, list(segments)), torch.split(dy_RN, list(segments)))])


def segment_wgrad_into(into_EKN: torch.Tensor, x_RK: torch.Tensor, dy_RN: torch.Tensor, rows: RowMap, alpha: float,
                       beta: float) -> bool:
    """into = beta * into + alpha * `segment_wgrad`(x, dy, rows) with the scaling and the add in the
    GEMM's epilogue, in float32, rounded once (with `into` an expert weight, alpha = -lr and beta =
    1 - lr * weight_decay: SGD's update without the gradient ever written): cuBLAS's `baddbmm_`
    where the host knows every expert has the same rows, `weft.kernels.grouped_wgrad` where its
    Triton kernel runs. False, `into` untouched, elsewhere (the caller then makes the gradient)."""
    segments = rows.segments
    if segments is not None and len(set(segments)) == 1:
        num_local, count = len(segments), segments[0]
        x_IRK, dy_IRN = x_RK.view(num_local, count, x_RK.shape[1]), dy_RN.view(num_local, count, dy_RN.shape[1])
        return batched_wgrad_into(into_EKN, x_IRK, dy_IRN, alpha, beta)
    return grouped_wgrad_into(into_EKN, x_RK, dy_RN, rows.ends_I, alpha, beta)


# -- references (the CPU path and the test oracle) -------------------------------------------------
def pull_rows_reference(sources: list[torch.Tensor], rows: RowMap) -> torch.Tensor:
    """The gathered rows (R, K), row g = sources[rank_R[g]][row_R[g]] (zeros where rank_R is -1)."""
    gathered = sources[0].new_zeros(rows.num_rows, sources[0].shape[1])
    for s, source in enumerate(sources):
        here = (rows.rank_R == s).nonzero().flatten()
        gathered[here] = source.index_select(0, rows.row_R[here])
    return gathered


def pull_gemm_reference(sources: list[torch.Tensor], rows: RowMap,
                        b_EKN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gathered, gathered @ b per expert) with gathered = `pull_rows_reference`."""
    gathered = pull_rows_reference(sources, rows)
    return gathered, segment_mm(gathered, b_EKN, rows)


ACTIVATIONS = {"relu": 1, "gelu": 2, "silu": 3, "swiglu": 4}  # layer0's epilogues (Triton codes)


def activation_epilogue_reference(activation: str, y_RN: torch.Tensor, saved: tuple[torch.Tensor, ...] | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What layer0's activation epilogue makes of its product y, as the unfused layer computes it.

    Forward (`saved` None; y = h = x @ w1; not swiglu, whose act(h) needs x @ w3 too): (act(h),
    h to keep for the backward, or None for relu, whose backward needs only act(h) > 0).
    Backward (y = dA = dY @ w2^T; `saved` what the forward kept: (act(h),) for relu, (h,) for gelu
    and silu, (h1, h3) for swiglu): (dh, act(h) recomputed for w2's gradient, or None for relu,
    whose forward kept it), dh = dA * act'(h), for swiglu [dh1 | dh3] side by side (R, 2N), the
    operand of the input gradient's one GEMM against [w1 | w3]^T. The same ops autograd runs
    for the unfused activation (`threshold_backward` on the result, `gelu_backward` /
    `silu_backward` on the input, swiglu's products), so the PyTorch path computes the unfused
    layer's values bitwise."""
    relu = activation == "relu"
    if saved is None:
        if activation == "swiglu":
            raise ValueError("layer0 fuses swiglu's backward only: its forward needs x @ w3 beside x @ w1")
        return ELEMENTWISE[activation](y_RN), None if relu else y_RN
    if activation == "swiglu":  # act = silu(h1) * h3
        h1, h3 = saved
        silu = torch.nn.functional.silu(h1)
        return torch.cat([torch.ops.aten.silu_backward(y_RN * h3, h1), y_RN * silu], 1), silu * h3
    (kept,) = saved
    if relu:
        return torch.ops.aten.threshold_backward(y_RN, kept, 0), None
    grad = torch.ops.aten.gelu_backward(y_RN, kept) if activation == "gelu" else \
        torch.ops.aten.silu_backward(y_RN, kept)
    return grad, ELEMENTWISE[activation](kept)


def pull_gemm_activation_reference(sources: list[torch.Tensor], rows: RowMap, b_EKN: torch.Tensor, activation: str,
                                   saved: tuple[torch.Tensor, ...] | None = None
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(gathered, *`activation_epilogue_reference`(activation, gathered @ b, saved))."""
    gathered, y = pull_gemm_reference(sources, rows, b_EKN)
    return gathered, *activation_epilogue_reference(activation, y, saved)


def gemm_push_reference(a_RK: torch.Tensor, b_EKN: torch.Tensor, dests: list[torch.Tensor], rows: RowMap,
                        b2_EKN: torch.Tensor | None = None) -> None:
    """y = a @ b per expert (with b2: a @ [b; b2], joined along K); y[g] into dests[rank_R[g]] row
    row_R[g]."""
    y = segment_mm(a_RK, b_EKN if b2_EKN is None else torch.cat([b_EKN, b2_EKN], 1), rows)
    for s, dest in enumerate(dests):
        here = (rows.rank_R == s).nonzero().flatten()
        dest.index_copy_(0, rows.row_R[here], y[here].to(dest.dtype))


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
    def _work_item(q, n_tiles, n_nt, GROUP: tl.constexpr):
        """Work item q -> (row tile, column tile), GROUP row tiles at a time across every column
        tile: the programs running together share B's column tiles and A's row tiles in L2."""
        width = GROUP * n_nt
        first_t = (q // width) * GROUP
        size = tl.minimum(n_tiles - first_t, GROUP)
        return first_t + (q % width) % size, (q % width) // size

    @triton.jit
    def _tile_product(acc, a_rows, a_desc, a_k0, b, b_desc, i, first, m_ok, n0, K: tl.constexpr,
                      N, sb_k, sb_n, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
                      EVEN: tl.constexpr, A_TMA: tl.constexpr, A_CG: tl.constexpr, B_TMA: tl.constexpr,
                      B_T: tl.constexpr):
        """acc + A[:, a_k0:a_k0 + K] @ b_i[:, n0:n0 + BN] in float32 for the tile's BM rows of A,
        rows with m_ok (others: anything; the caller masks them). A's rows, contiguous, read by the
        tensor memory accelerator (A_TMA: `a_desc`, a block at [first, a_k0 + k]; rows past the
        tile belong to other tiles or are zeros) or by pointers from `a_rows` (each row's first
        element; A_CG: through L2 only, for rows another program wrote). b_i = expert i's weight:
        by TMA (`b_desc` over (El * K, N), or with B_T over the (El * N, K) storage of b
        transposed, whose rows past N are discarded columns), else by pointers with strides sb_k,
        sb_n. EVEN: the tiles divide N and K (no masks on pointer loads)."""
        n = n0 + tl.arange(0, BN)
        a_ptr = a_rows[:, None] + a_k0
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            if A_TMA:
                a_tile = a_desc.load([first, a_k0 + k0])
            else:
                a_mask = m_ok[:, None] if EVEN else m_ok[:, None] & (k[None, :] < K)
                if A_CG:
                    a_tile = tl.load(a_ptr + k[None, :], mask=a_mask, other=0.0, cache_modifier=".cg")
                else:
                    a_tile = tl.load(a_ptr + k[None, :], mask=a_mask, other=0.0)
            if B_TMA:
                if B_T:
                    b_tile = b_desc.load([i * N + n0, k0]).T
                else:
                    b_tile = b_desc.load([i * K + k0, n0])
            else:
                b_ptr = b + k[:, None] * sb_k + n[None, :] * sb_n
                if EVEN:
                    b_tile = tl.load(b_ptr)
                else:
                    b_tile = tl.load(b_ptr, mask=(k[:, None] < K) & (n[None, :] < N), other=0.0)
            acc = _dot(a_tile, b_tile, acc, IEEE)
        return acc

    @triton.jit
    def _store_tile(row_ptr, valid, n0, acc, N, BN: tl.constexpr):
        """acc's rows (valid ones) into row_ptr[r] + n0.., in two column halves: the epilogue holds
        half the tile's addresses at a time (fewer registers than the full tile's)."""
        halves = tl.permute(tl.reshape(acc, (acc.shape[0], 2, BN // 2)), (0, 2, 1))
        left, right = tl.split(halves)
        n = n0 + tl.arange(0, BN // 2)
        dtype = row_ptr.dtype.element_ty
        tl.store(row_ptr[:, None] + n[None, :], left.to(dtype), mask=valid[:, None] & (n < N)[None, :])
        n = n + BN // 2
        tl.store(row_ptr[:, None] + n[None, :], right.to(dtype), mask=valid[:, None] & (n < N)[None, :])

    @triton.jit
    def act_value(h, ACT: tl.constexpr):
        """relu / gelu (erf) / silu of float32 h, as PyTorch's kernels compute them."""
        if ACT == 1:
            return tl.maximum(h, 0.0)
        elif ACT == 2:
            return h * 0.5 * (1.0 + tl.math.erf(h * 0.7071067811865476))
        else:
            return h / (1.0 + tl.exp(-h))

    @triton.jit
    def act_grad(g, s, ACT: tl.constexpr):
        """dA * act'(h) in float32 from s (relu: act(h), whose sign is h's; else h), as PyTorch's
        threshold_backward / gelu_backward / silu_backward compute it."""
        if ACT == 1:
            return tl.where(s > 0.0, g, 0.0)
        elif ACT == 2:
            cdf = 0.5 * (1.0 + tl.math.erf(s * 0.7071067811865476))
            pdf = tl.exp(-0.5 * s * s) * 0.3989422804014327
            return g * (cdf + s * pdf)
        else:
            sig = 1.0 / (1.0 + tl.exp(-s))
            return g * sig * (1.0 + s * (1.0 - sig))

    @triton.jit
    def _store_activation_half(out, extra, saved, saved3, m, valid, n, y, N, ACT: tl.constexpr, GRAD: tl.constexpr):
        """One column half of layer0's activation epilogue (`activation_epilogue_reference`): y is
        first rounded to the output's dtype, as the unfused path stores it before the activation,
        and so is every product the unfused path stores (swiglu's silu(h1), dA * h3)."""
        mask = valid[:, None] & (n < N)[None, :]
        offs = m.to(tl.int64)[:, None] * N + n[None, :]
        dtype = out.dtype.element_ty
        y = y.to(dtype).to(tl.float32)
        if GRAD:
            s = tl.load(saved + offs, mask=mask, other=0.0).to(tl.float32)
            if ACT == 4:  # swiglu: [dh1 | dh3] into out's rows of 2N, act(h) = silu(h1) * h3 again
                h3 = tl.load(saved3 + offs, mask=mask, other=0.0).to(tl.float32)
                silu = act_value(s, 3).to(dtype).to(tl.float32)
                joint = m.to(tl.int64)[:, None] * (2 * N) + n[None, :]
                tl.store(out + joint, act_grad((y * h3).to(dtype).to(tl.float32), s, 3).to(dtype), mask=mask)
                tl.store(out + joint + N, (y * silu).to(dtype), mask=mask)
                tl.store(extra + offs, (silu * h3).to(dtype), mask=mask)
            else:
                tl.store(out + offs, act_grad(y, s, ACT).to(dtype), mask=mask)
                if ACT != 1:
                    tl.store(extra + offs, act_value(s, ACT).to(dtype), mask=mask)
        else:
            tl.store(out + offs, act_value(y, ACT).to(dtype), mask=mask)
            if ACT != 1:
                tl.store(extra + offs, y.to(dtype), mask=mask)

    @triton.jit
    def _store_activation_tile(out, extra, saved, saved3, m, valid, n0, acc, N, BN: tl.constexpr,
                               ACT: tl.constexpr, GRAD: tl.constexpr):
        """Layer0's epilogue with the experts' activation fused, in two column halves as `_store_tile`."""
        halves = tl.permute(tl.reshape(acc, (acc.shape[0], 2, BN // 2)), (0, 2, 1))
        left, right = tl.split(halves)
        n = n0 + tl.arange(0, BN // 2)
        _store_activation_half(out, extra, saved, saved3, m, valid, n, left, N, ACT, GRAD)
        _store_activation_half(out, extra, saved, saved3, m, valid, n + BN // 2, right, N, ACT, GRAD)

    @triton.jit
    def _row_bases(table, rank, valid, like):
        """Each row's buffer: the address `table` holds for its rank (`_as_base`)."""
        return _as_base(tl.load(table + rank, mask=valid, other=0), like)

    @triton.jit
    def _as_base(addr, like):
        """Buffer addresses (int64) as pointers to `like`'s dtype, declared 16-byte aligned (buffers
        start on allocation boundaries), so that a row's consecutive elements move in 16-byte
        accesses rather than one element at a time."""
        return tl.multiple_of(addr.to(tl.pointer_type(like.dtype.element_ty)), 16)

    @triton.jit
    def _pick(values, index, positions):
        """values[index] for each element of `index` (values small: a sum over a one-hot row)."""
        return tl.sum(tl.where(positions[None, :] == index[:, None], values[None, :], 0), axis=1)

    @triton.jit(do_not_specialize=["rows", "n_tiles", "rank"])  # a size of 1 would become a constant
    def _map_kernel(count_IS, offset_IS, rank_R, row_R, ends_I, pull, push, rows, n_tiles, rank,
                    WORLD: tl.constexpr, RUNS: tl.constexpr, LOCAL: tl.constexpr, BM: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_Q: tl.constexpr,
                    BLOCK_K: tl.constexpr):
        """`RowMap` in one launch from the RUNS = El * W (expert, source) runs' counts and source
        offsets (expert-major): programs below the last fill BLOCK_R gathered rows each
        (`_map_rows`); the last one cuts every expert's rows into tiles (`_map_tiles`). Sizes in
        int32 (rows and tiles below 2^31), the small per-run and per-expert vectors recomputed by
        every program. Reference: `_row_map_reference`."""
        pid = tl.program_id(0)
        s = tl.arange(0, BLOCK_S)
        count_S = tl.load(count_IS + s, mask=s < RUNS, other=0).to(tl.int32)
        end_S = tl.where(s < RUNS, tl.cumsum(count_S, 0), 2147483647)  # padding runs end after every row
        if pid < tl.num_programs(0) - 1:
            _map_rows(offset_IS, rank_R, row_R, rows, pid, s, count_S, end_S, WORLD, RUNS, BLOCK_R)
        else:
            _map_tiles(ends_I, pull, push, n_tiles, rank, s, count_S, end_S, WORLD, RUNS, LOCAL, BM, BLOCK_I,
                       BLOCK_Q, BLOCK_K)

    @triton.jit
    def _map_rows(offset_IS, rank_R, row_R, rows, pid, s, count_S, end_S, WORLD: tl.constexpr, RUNS: tl.constexpr,
                  BLOCK_R: tl.constexpr):
        """Gathered rows [pid * BLOCK_R, ...): each row's run is the number of runs ending at or
        before it; its rank the run's source, its row the run's offset plus its place in the run
        (rank -1 past the last run)."""
        r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        run = tl.sum((end_S[None, :] <= r[:, None]).to(tl.int32), axis=1)
        used = run < RUNS
        offset_S = tl.load(offset_IS + s, mask=s < RUNS, other=0).to(tl.int32)
        row = _pick(offset_S - (end_S - count_S), run, s) + r
        tl.store(rank_R + r, tl.where(used, run % WORLD, -1), mask=r < rows)
        tl.store(row_R + r, tl.where(used, row, 0).to(tl.int64), mask=r < rows)

    @triton.jit
    def _tile_chunk(q0, n_tiles, rank, s, end_S, i, count_I, end_I, tiles_I, tile_end_I, WORLD: tl.constexpr,
                    LOCAL: tl.constexpr, BM: tl.constexpr, BLOCK_Q: tl.constexpr):
        """Tiles [q0, q0 + BLOCK_Q) in expert order: (expert, first, end, distance of the first
        row's source from this rank, used)."""
        q = q0 + tl.arange(0, BLOCK_Q)
        expert = tl.sum((tile_end_I[None, :] <= q[:, None]).to(tl.int32), axis=1)
        used = (expert < LOCAL) & (q < n_tiles)
        first = _pick(end_I - count_I, expert, i) + (q - _pick(tile_end_I - tiles_I, expert, i)) * BM
        end = tl.minimum(first + BM, _pick(end_I, expert, i))
        source = tl.sum((end_S[None, :] <= first[:, None]).to(tl.int32), axis=1) % WORLD
        distance = (source - rank + WORLD) % WORLD
        return tl.where(used, expert, 0), tl.where(used, first, 0), tl.where(used, end, 0), distance, used, q

    @triton.jit
    def _map_tiles(ends_I, pull, push, n_tiles, rank, s, count_S, end_S, WORLD: tl.constexpr, RUNS: tl.constexpr,
                   LOCAL: tl.constexpr, BM: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_Q: tl.constexpr,
                   BLOCK_K: tl.constexpr):
        """The experts' ends, and every expert's rows cut into tiles of BM in both orders, each a
        stable counting sort by a key (pull: the distance from this rank of the tile's first row's
        source, 0 first; push: 1 first, this rank's own last; the empty tiles, key WORLD, last in
        both), over chunks of BLOCK_Q tiles: one pass counts each key, the second places every
        tile after the smaller keys' and its own key's earlier tiles."""
        i = tl.arange(0, BLOCK_I)
        in_expert = (s[None, :] // WORLD == i[:, None]) & (s[None, :] < RUNS)
        count_I = tl.sum(tl.where(in_expert, count_S[None, :], 0), axis=1)
        end_I = tl.cumsum(count_I, 0)
        tl.store(ends_I + i, end_I, mask=i < LOCAL)
        tiles_I = tl.where(i < LOCAL, (count_I + BM - 1) // BM, 0)
        tile_end_I = tl.where(i < LOCAL, tl.cumsum(tiles_I, 0), 2147483647)
        k = tl.arange(0, BLOCK_K)  # pull's keys 0..WORLD, then push's (WORLD + 1..2 * WORLD + 1)
        total_K = tl.zeros((BLOCK_K,), dtype=tl.int32)
        q0 = n_tiles * 0  # an int32 scalar carried by the loop
        while q0 < n_tiles:  # (a while loop: Triton's interpreter takes no runtime range bound)
            expert, first, end, distance, used, q = _tile_chunk(q0, n_tiles, rank, s, end_S, i, count_I, end_I,
                                                                tiles_I, tile_end_I, WORLD, LOCAL, BM, BLOCK_Q)
            pull_key = tl.where(used, distance, WORLD)
            push_key = tl.where(used, (distance - 1 + WORLD) % WORLD, WORLD) + WORLD + 1
            stored = q < n_tiles
            total_K += tl.sum(((pull_key[:, None] == k[None, :]) & stored[:, None]).to(tl.int32), axis=0)
            total_K += tl.sum(((push_key[:, None] == k[None, :]) & stored[:, None]).to(tl.int32), axis=0)
            q0 += BLOCK_Q
        # where each key's tiles start in its order: the totals of the smaller keys of that order
        base_K = tl.cumsum(total_K, 0) - total_K - tl.where(k > WORLD, n_tiles, 0)
        q0 = n_tiles * 0
        while q0 < n_tiles:
            expert, first, end, distance, used, q = _tile_chunk(q0, n_tiles, rank, s, end_S, i, count_I, end_I,
                                                                tiles_I, tile_end_I, WORLD, LOCAL, BM, BLOCK_Q)
            stored = q < n_tiles
            pull_key = tl.where(used, distance, WORLD)
            push_key = tl.where(used, (distance - 1 + WORLD) % WORLD, WORLD) + WORLD + 1
            base_K = _place_tiles(pull, pull_key, stored, k, base_K, expert, first, end)
            base_K = _place_tiles(push, push_key, stored, k, base_K, expert, first, end)
            q0 += BLOCK_Q

    @triton.jit
    def _place_tiles(dest, key, stored, k, base_K, expert, first, end):
        """A chunk's tiles into `dest`, each after the tiles already placed with its key
        (`base_K[key]`) and its key's earlier tiles in the chunk; returns the keys' new bases."""
        hit_QK = ((key[:, None] == k[None, :]) & stored[:, None]).to(tl.int32)
        before_QK = tl.cumsum(hit_QK, 0) - hit_QK + base_K[None, :]
        position = tl.sum(tl.where(hit_QK > 0, before_QK, 0), axis=1)
        tl.store(dest + position * 3, expert, mask=stored)
        tl.store(dest + position * 3 + 1, first, mask=stored)
        tl.store(dest + position * 3 + 2, end, mask=stored)
        return base_K + tl.sum(hit_QK, axis=0)

    @triton.jit
    def _source_rows(table, rank_R, row_R, m, valid, like, own_addr, K: tl.constexpr):
        """The tile's rows in their source ranks' buffers (each row's first element, as a pointer to
        `like`'s dtype) and whether every valid row is in this rank's own buffer (the address
        `own_addr`)."""
        src = tl.load(rank_R + m, mask=valid, other=0)
        src_row = tl.load(row_R + m, mask=valid, other=0)
        addr = tl.load(table + src, mask=valid, other=own_addr)
        own = tl.sum((addr != own_addr).to(tl.int32), axis=0) == 0
        return _as_base(addr, like) + src_row * K, own

    @triton.jit
    def _copy_tile(table, gathered, flags, rank_R, row_R, tiles, t, own_addr, PASS: tl.constexpr, K: tl.constexpr,
                   BM: tl.constexpr, BC: tl.constexpr):
        """Tile t's rows from their ranks' buffers into `gathered`, then the tile's flag. PASS 0: every
        tile; 1: only tiles with a row in another rank's buffer; 2: only tiles wholly in this rank's
        (whose flag no GEMM program waits for: it reads them in place)."""
        first = tl.load(tiles + t * 3 + 1)
        end = tl.load(tiles + t * 3 + 2)
        m = first + tl.arange(0, BM)
        valid = m < end
        src_ptr, own = _source_rows(table, rank_R, row_R, m, valid, gathered, own_addr, K)
        if PASS == 0:
            wanted = first < end  # a map built on the device ends in empty tiles
        else:
            wanted = (first < end) & (own == (PASS == 2))
        if wanted:
            for k0 in range(0, K, BC):
                k = k0 + tl.arange(0, BC)
                mask = valid[:, None] & (k[None, :] < K)
                values = tl.load(src_ptr[:, None] + k[None, :], mask=mask)
                tl.store(gathered + m[:, None].to(tl.int64) * K + k[None, :], values, mask=mask)
            if PASS != 2:
                tl.debug_barrier()
                tl.atomic_xchg(flags + t, 1, sem="release", scope="gpu")

    @triton.jit
    def _pull_gemm_kernel(table, gathered, own_addr, b, b_desc, out, extra, saved, saved3, flags, rank_R, row_R, tiles,
                          n_tiles, K: tl.constexpr, N, sb_e, sb_k, sb_n, BM: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr, BC: tl.constexpr, N_COMM: tl.constexpr, GROUP: tl.constexpr,
                          IEEE: tl.constexpr, EVEN: tl.constexpr, B_TMA: tl.constexpr, B_T: tl.constexpr,
                          ACT: tl.constexpr, GRAD: tl.constexpr, DIRECT: tl.constexpr, ENGINE: tl.constexpr):
        """Comet's layer0 (fig. 4 left, fig. 5): programs below N_COMM are the communication
        blocks (copy whole row tiles from the source ranks' buffers, raise each tile's flag); the
        others are the GEMM blocks (one output tile each, in the tiles' order: local rows first,
        3.1.2), each waiting for its rows' flag. DIRECT: a tile whose rows are all in this rank's
        own buffer (at `own_addr`) is read from there at once, without waiting, and the copy
        programs move the other tiles first and such tiles last (into `gathered`, for the
        backward): the link is busy from the start, not after the local copies. ENGINE (with
        DIRECT): the copy engine moves the other ranks' rows (`_copy_runs`) and raises the flag of
        gathered row g's tile at g // BM (waited for with a system-scope acquire: another agent
        writes it); the copy programs move this rank's own tiles alone. ACT > 0: the
        experts' activation in the epilogue (`_store_activation_tile`; GRAD: its backward, reading
        `saved` (and swiglu's `saved3`); `extra` the second output).
        Reference: `pull_gemm_reference`, `pull_gemm_activation_reference`."""
        pid = tl.program_id(0)
        if pid < N_COMM:  # a copy program: tiles pid, pid + N_COMM, ... in order (DIRECT: remote ones first)
            if not ENGINE:  # (ENGINE: the copy engine moves the other ranks' rows)
                t = pid
                while t < n_tiles:
                    _copy_tile(table, gathered, flags, rank_R, row_R, tiles, t, own_addr, 1 if DIRECT else 0, K, BM,
                               BC)
                    t += N_COMM
            if DIRECT:
                t = pid
                while t < n_tiles:
                    _copy_tile(table, gathered, flags, rank_R, row_R, tiles, t, own_addr, 2, K, BM, BC)
                    t += N_COMM
        else:  # a GEMM program: one output tile, once its rows are here
            t, nt = _work_item(pid - N_COMM, n_tiles, tl.cdiv(N, BN), GROUP)
            i = tl.load(tiles + t * 3)
            first = tl.load(tiles + t * 3 + 1)
            end = tl.load(tiles + t * 3 + 2)
            if first < end:  # not one of the empty tiles a map built on the device ends in
                m = first + tl.arange(0, BM)
                valid = m < end
                a_rows = gathered + m.to(tl.int64) * K
                if DIRECT:
                    src_ptr, own = _source_rows(table, rank_R, row_R, m, valid, gathered, own_addr, K)
                    a_rows = tl.where(own, src_ptr, a_rows)
                else:
                    own = first < 0  # False
                if not own:
                    if ENGINE:
                        while tl.atomic_add(flags + first // BM, 0, sem="acquire", scope="sys") == 0:
                            pass
                    else:
                        while tl.atomic_add(flags + t, 0, sem="acquire", scope="gpu") == 0:
                            pass
                acc = _tile_product(tl.zeros((BM, BN), dtype=tl.float32), a_rows, None, 0, b + i * sb_e, b_desc,
                                    i, first, valid, nt * BN, K, N, sb_k, sb_n, BM, BN, BK, IEEE, EVEN, False,
                                    True, B_TMA, B_T)
                if ACT == 0:
                    _store_tile(out + m.to(tl.int64) * N, valid, nt * BN, acc, N, BN)
                else:
                    _store_activation_tile(out, extra, saved, saved3, m, valid, nt * BN, acc, N, BN, ACT, GRAD)

    @triton.jit
    def _gemm_push_kernel(a, a_desc, b, b_desc, b2, b2_desc, table, like, rank_R, row_R, tiles, n_tiles,
                          K: tl.constexpr, N, sb_e, sb_k, sb_n, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                          GROUP: tl.constexpr, IEEE: tl.constexpr, EVEN: tl.constexpr, A_TMA: tl.constexpr,
                          B_TMA: tl.constexpr, B_T: tl.constexpr, TWO: tl.constexpr):
        """Comet's layer1 (fig. 4 right, fig. 7): one output tile per program, remote rows' tiles
        first; the epilogue stores each row straight into the buffer of the rank it came from
        (the "vertical fusion" of 3.2.1: no separate communication blocks). TWO: a's rows hold 2K
        columns and the product is a[:, :K] @ b + a[:, K:] @ b2 (b2 strided and read as b is):
        swiglu's input gradient [dh1 | dh3] @ [w1 | w3]^T without joining the weights.
        Reference: `gemm_push_reference`."""
        t, nt = _work_item(tl.program_id(0), n_tiles, tl.cdiv(N, BN), GROUP)
        i = tl.load(tiles + t * 3)
        first = tl.load(tiles + t * 3 + 1)
        end = tl.load(tiles + t * 3 + 2)
        if first < end:  # not one of the empty tiles a map built on the device ends in
            m = first + tl.arange(0, BM)
            valid = m < end
            # where the rows go, loaded before the product so that these loads' latency hides under it
            dest_row = tl.load(row_R + m, mask=valid, other=0)
            row_ptr = _row_bases(table, tl.load(rank_R + m, mask=valid, other=0), valid, like) + dest_row * N
            a_rows = a + m.to(tl.int64) * ((1 + TWO) * K)
            acc = _tile_product(tl.zeros((BM, BN), dtype=tl.float32), a_rows, a_desc, 0, b + i * sb_e, b_desc, i,
                                first, valid, nt * BN, K, N, sb_k, sb_n, BM, BN, BK, IEEE, EVEN, A_TMA, False, B_TMA,
                                B_T)
            if TWO:
                acc = _tile_product(acc, a_rows, a_desc, K, b2 + i * sb_e, b2_desc, i, first, valid, nt * BN, K,
                                    N, sb_k, sb_n, BM, BN, BK, IEEE, EVEN, A_TMA, False, B_TMA, B_T)
            _store_tile(row_ptr, valid, nt * BN, acc, N, BN)


def pull_gemm(table: torch.Tensor, like: torch.Tensor, rows: RowMap, b_EKN: torch.Tensor,
              tiles: CometTiles, sources: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer0: (gathered, gathered @ b per expert), gathered (R, K) read from the buffers whose
    addresses are in `table` (int64, one per rank, on the kernel's device; `like`: this rank's own
    buffer, for dtype and device). Equal to `pull_gemm_reference` up to float32 summation order.
    `tiles.block_m` must be the one `rows` was built with. `tiles.copy_engine`: the other ranks'
    rows are copied by the copy engine instead of copy programs (`sources`: every rank's buffer as
    this process addresses it; a map with `runs`)."""
    gathered, out, _ = _pull(table, like, rows, b_EKN, tiles, "", None, sources)
    return gathered, out


def pull_gemm_activation(table: torch.Tensor, like: torch.Tensor, rows: RowMap, b_EKN: torch.Tensor,
                         tiles: CometTiles, activation: str, saved: tuple[torch.Tensor, ...] | None = None,
                         sources: list[torch.Tensor] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Layer0 with the experts' activation in its epilogue: (gathered, out, extra) as
    `pull_gemm_activation_reference` says (forward, relu / gelu / silu: act(h) and h; backward with
    `saved`, every activation: dh, [dh1 | dh3] for swiglu, and act(h)), each tile's values
    computed while the tile is in registers, so no pass over the rows follows the GEMM and rows no
    tile covers are never touched. Equal to the reference up to float32 summation order and the
    float32 activation's last bit."""
    if activation not in ACTIVATIONS or (activation == "swiglu" and saved is None):
        raise ValueError(f"layer0's epilogue fuses relu, gelu and silu, and the backward of swiglu, not "
                         f"{activation!r}{'' if saved else ' forward'}")
    return _pull(table, like, rows, b_EKN, tiles, activation, saved, sources)


def _pull(table, like, rows, b_EKN, tiles, activation, saved, sources=None):
    """`pull_gemm` (activation "") and `pull_gemm_activation`: one launch of `_pull_gemm_kernel`
    (with `tiles.copy_engine`, beside the copy engine's copies: `_copy_runs`)."""
    num_local, K, N = b_EKN.shape
    gathered = like.new_empty(rows.num_rows, K)
    out = like.new_empty(rows.num_rows, 2 * N if activation == "swiglu" else N)
    extra = like.new_empty(rows.num_rows, N) if activation not in ("", "relu") else None
    for kept in saved or ():
        if kept.shape != (rows.num_rows, N) or not kept.is_contiguous():
            raise ValueError(f"layer0's saved activation inputs must be contiguous {(rows.num_rows, N)}, "
                             f"got {tuple(kept.shape)}")
    grad, saved = saved is not None, saved or (out,)  # no saved tensors: their pointers unused
    n_tiles = rows.pull_tiles.shape[0]
    engine = tiles.copy_engine
    if engine:
        flags, joined = _copy_runs(sources, like, gathered, rows, tiles)
    else:
        flags = torch.zeros(max(n_tiles, 1), dtype=torch.int32, device=like.device)
    b, b_desc, b_t = _weights(b_EKN, tiles)
    _pull_gemm_kernel[(tiles.n_comm + n_tiles * triton.cdiv(N, tiles.block_n),)](
        table, gathered, like.data_ptr(), b, b_desc, out, out if extra is None else extra, saved[0], saved[-1],
        flags, rows.rank_R, rows.row_R, rows.pull_tiles, n_tiles, K, N,
        *b.stride(), BM=tiles.block_m, BN=tiles.block_n, BK=tiles.block_k, BC=tiles.block_copy,
        N_COMM=tiles.n_comm, GROUP=tiles.group, B_TMA=b_desc is not None, B_T=b_t,
        ACT=ACTIVATIONS.get(activation, 0), GRAD=grad, DIRECT=tiles.direct_local, ENGINE=engine,
        **_launch(like, tiles, N, K))
    if engine:
        joined()
    return gathered, out, extra


def copy_engine_available(device: torch.device) -> bool:
    """Whether layer0 can take its rows by the copy engine here: CUDA with the stream-ordered
    32-bit writes of PyTorch's symmetric memory (the flags), or the CPU."""
    return torch.device(device).type == "cpu" or _SymmetricMemory is not None


def _copy_runs(sources, like, gathered, rows, tiles):
    """The other ranks' runs of `rows.runs` copied into `gathered` by the copy engine
    (`CometTiles.copy_engine`), on a side stream, nearest rank first, each followed by a 32-bit
    write raising the flags of its tiles (flag g // block_m for gathered row g; a run is whole
    tiles), as torch's own fused all-gather matmul raises its signals. The copies take no SM; the
    kernel, launched between this fork and the join it returns, moves this rank's own rows with
    its copy programs (the copy engine moves device-local rows at a fraction of what SMs do). On
    the CPU the copies run first and every flag is up."""
    if rows.runs is None or sources is None or not tiles.direct_local:
        raise ValueError("layer0 by the copy engine needs a padded map whose capacity its tiles divide, every rank's "
                         "buffer, and its own rows read in place (direct_local)")
    if not copy_engine_available(like.device):
        raise ValueError("layer0 by the copy engine needs torch's symmetric-memory ops (memset32) on CUDA")
    blocks = max(1, rows.num_rows // tiles.block_m)
    remote = [run for run in rows.runs if sources[run[0]].data_ptr() != like.data_ptr()]
    if not like.is_cuda:
        for s, src, dst, count in remote:
            gathered[dst:dst + count] = sources[s][src:src + count]
        return torch.ones(blocks, dtype=torch.int32), lambda: None
    flags = torch.zeros(blocks, dtype=torch.uint32, device=like.device)
    current = torch.cuda.current_stream(like.device)
    side = torch.cuda.Stream(like.device)
    side.wait_stream(current)
    capturing = torch.cuda.is_current_stream_capturing()
    with torch.cuda.stream(side):
        for s, src, dst, count in remote:
            gathered[dst:dst + count].copy_(sources[s][src:src + count])
            if capturing:
                _SymmetricMemory.memset32(flags, dst // tiles.block_m, 1, count // tiles.block_m)
            else:  # (a write that fences the copy before it)
                for block in range(dst // tiles.block_m, (dst + count) // tiles.block_m):
                    _SymmetricMemory.stream_write_value32(flags, block, 1)
    return flags, lambda: current.wait_stream(side)


def gemm_push(a_RK: torch.Tensor, b_EKN: torch.Tensor, table: torch.Tensor, like: torch.Tensor, rows: RowMap,
              tiles: CometTiles, b2_EKN: torch.Tensor | None = None) -> None:
    """Layer1: a @ b per expert, row g stored into rank rank_R[g]'s buffer (address in `table`) at
    row row_R[g]. `like`: this rank's own buffer (dtype). With `b2` (b's shape): a holds 2K
    columns and the product is a @ [b; b2] (b and b2 joined along K, never in memory). Equal to
    `gemm_push_reference` up to float32 summation order."""
    K, N = b_EKN.shape[1], b_EKN.shape[2]
    if a_RK.shape[1] != K * (1 if b2_EKN is None else 2) or (b2_EKN is not None and b2_EKN.shape != b_EKN.shape):
        raise ValueError(f"layer1 got rows of {a_RK.shape[1]} for weights {tuple(b_EKN.shape)}"
                         f"{'' if b2_EKN is None else f' and {tuple(b2_EKN.shape)}'}")
    n_tiles = rows.push_tiles.shape[0]
    if n_tiles == 0:
        return
    b, b_desc, b_t = _weights(b_EKN, tiles)
    b2, b2_desc, b2_t = (b, b_desc, b_t) if b2_EKN is None else _weights(b2_EKN, tiles)
    if b2.stride() != b.stride() or (b2_desc is None) != (b_desc is None) or b2_t != b_t:
        # the kernel reads both alike: here by pointer, from row-major copies
        b, b2, b_desc, b2_desc, b_t = b_EKN.contiguous(), b2_EKN.contiguous(), None, None, False
    a_desc = tma.TensorDescriptor.from_tensor(a_RK, [tiles.block_m, tiles.block_k]) if tma.takes(a_RK) else None
    _gemm_push_kernel[(n_tiles * triton.cdiv(N, tiles.block_n),)](
        a_RK, a_desc, b, b_desc, b2, b2_desc, table, like, rows.rank_R, rows.row_R, rows.push_tiles, n_tiles, K, N,
        *b.stride(), BM=tiles.block_m, BN=tiles.block_n, BK=tiles.block_k, GROUP=tiles.group,
        A_TMA=a_desc is not None, B_TMA=b_desc is not None, B_T=b_t, TWO=b2_EKN is not None,
        **_launch(like, tiles, N, K))


def _weights(b_EKN: torch.Tensor, tiles: CometTiles) -> tuple[torch.Tensor, object, bool]:
    """(b, its TMA descriptor or None, whether it is read transposed). b (El, K, N) as it is when
    row-major per expert or the transpose of a row-major (El, N, K) (the backward's w^T), else a
    row-major copy. The descriptor covers (El * K, N) blocks [BK, BN] (only where BK divides K:
    a block must not reach the next expert's rows, which would meet A's columns past K), or the
    transposed storage (El * N, K) blocks [BN, BK] (rows past an expert's N are columns the
    epilogue discards)."""
    num_local, K, N = b_EKN.shape
    transposed = b_EKN.stride(1) == 1 and b_EKN.stride(2) == K and b_EKN.stride(0) == K * N and N > 1
    if not transposed and b_EKN.stride() != (K * N, N, 1):
        b_EKN = b_EKN.contiguous()
    storage = b_EKN.transpose(1, 2).reshape(num_local * N, K) if transposed else b_EKN.view(num_local * K, N)
    if not tma.takes(storage) or (not transposed and K % tiles.block_k):
        return b_EKN, None, False
    block = [tiles.block_n, tiles.block_k] if transposed else [tiles.block_k, tiles.block_n]
    return b_EKN, tma.TensorDescriptor.from_tensor(storage, block), transposed


def _launch(x: torch.Tensor, tiles: CometTiles, N: int, K: int) -> dict:
    """Launch options: float32 GEMMs in IEEE precision (and every GEMM under the interpreter); no
    masks along N and K where the tiles divide them."""
    even = N % tiles.block_n == 0 and K % tiles.block_k == 0
    ieee = {"IEEE": x.dtype == torch.float32 or not x.is_cuda, "EVEN": even}
    return {**ieee, "num_warps": tiles.num_warps, "num_stages": tiles.num_stages} if x.is_cuda else ieee
