"""Comet's fused kernels (weft.kernels.comet) and exchange (weft.moe.exchange.Comet).

- The two kernels against their PyTorch references in Triton's CPU interpreter, every rank's buffer
  in one process (W = 1, 2, 4; padded maps whose capacities do not fill a row tile and dropless
  maps with random counts; transposed weights).
- `weft.MoE(kernels="comet")` against the dense reference on 1, 2 and 4 gloo processes that share
  their buffers through files in shared memory, padded and dropless: outputs, losses, every
  gradient, counts and drops, through the kernels' PyTorch references and through the Triton
  kernels (interpreter).
- Where the ranks cannot address each other's memory, "comet" says so and runs the NCCL path.
"""
from __future__ import annotations

import dataclasses
import itertools
import warnings

import pytest
import torch
import torch.distributed as dist

from test_moe_equivalence import check_case
from weft import MoE
from weft.comm.peers import peer_buffers, peers_unavailable
from weft.testing import run_checks, run_distributed

COMET_BUFFERS = ["comet.grad_out", "comet.grad_send", "comet.out", "comet.send"]


def rank_maps(K, world: int, local: int, cap: int, block_m: int, device, gen) -> list:
    """Every rank's `RowMap` and every source's buffer rows: padded (cap > 0: C slots per expert
    from every source) or dropless (cap <= 0: each source's routed rows sorted by expert, random
    counts up to -cap, some zero)."""
    experts = world * local
    if cap > 0:
        return [K.RowMap.padded(world, local, cap, r, block_m, device) for r in range(world)], experts * cap
    counts = torch.randint(0, -cap + 1, (world, experts), generator=gen)
    counts[0, 0] = 0  # an empty (source, expert) pair
    offsets = torch.cumsum(counts, 1) - counts
    mine = [slice(r * local, (r + 1) * local) for r in range(world)]
    maps = [K.RowMap.build(counts[:, mine[r]].tolist(), offsets[:, mine[r]].tolist(), r, block_m, device)
            for r in range(world)]
    return maps, int(counts.sum(1).max())


def test_row_map_and_segment_gemms_match_loops_over_experts():
    """`RowMap.build` (vectorised) against its definition written as loops, and the per-expert
    GEMMs (`segment_mm`, `segment_wgrad`: bmm, grouped GEMM or a loop, by shape) against one matmul
    per expert; experts without rows, equal and unequal segments, aligned and unaligned widths."""
    from weft.kernels import comet as K

    gen = torch.Generator().manual_seed(0)
    for world, local, block_m, most in itertools.product((1, 2, 4), (1, 3), (2, 16), (0, 5, 19)):
        counts = torch.randint(0, most + 1, (world, world * local), generator=gen)
        if most == 19:
            counts[:, 0] = 0  # an expert no source sends rows to
        rank = world - 1
        mine = slice(rank * local, (rank + 1) * local)
        offsets = torch.cumsum(counts, 1) - counts
        rows = K.RowMap.build(counts[:, mine].tolist(), offsets[:, mine].tolist(), rank, block_m, torch.device("cpu"))
        where, tiles, start = [], [], 0
        for i in range(local):
            for s in range(world):
                c, o = int(counts[s, rank * local + i]), int(offsets[s, rank * local + i])
                where += [(s, o + j) for j in range(c)]
            size = int(counts[:, rank * local + i].sum())
            tiles += [(i, f, min(f + block_m, start + size)) for f in range(start, start + size, block_m)]
            start += size
        label = f"W={world} El={local} block {block_m} counts<={most}"
        assert list(zip(rows.rank_R.tolist(), rows.row_R.tolist())) == where, label
        segments = [int(counts[:, rank * local + i].sum()) for i in range(local)]
        assert rows.segments == tuple(segments) and rows.ends_I.tolist() == list(itertools.accumulate(segments))
        for order in (rows.pull_tiles, rows.push_tiles):
            assert order.dtype == torch.int32 and sorted(map(tuple, order.tolist())) == tiles, label
        first_rank = [(rows.rank_R[t[1]].item() - rank) % world for t in rows.pull_tiles.tolist()]
        assert first_rank == sorted(first_rank), f"{label}: layer0 takes tiles starting on this rank first"
        for dim, hidden in ((8, 12), (5, 7)):
            x = torch.randn(rows.num_rows, dim, generator=gen)
            w = torch.randn(local, dim, hidden, generator=gen)
            dy = torch.randn(rows.num_rows, hidden, generator=gen)
            y_ref = torch.cat([part @ w[i] for i, part in enumerate(torch.split(x, segments))])
            dw_ref = torch.stack([a.T @ b for a, b in zip(torch.split(x, segments), torch.split(dy, segments))])
            torch.testing.assert_close(K.segment_mm(x, w, rows), y_ref, msg=label)
            torch.testing.assert_close(K.segment_wgrad(x, dy, rows), dw_ref, msg=label)


def kernels_worker(device: str = "cpu") -> list[str]:
    from weft.kernels import comet as K

    failures = []
    gen = torch.Generator().manual_seed(0)
    # Partial row, column and K tiles, and shapes the tiles divide (no masked loads): 16 on the
    # interpreter's tiles, 128 and 256 on the GPU's; capacity <= 0: dropless, up to -cap rows.
    # Widths that are multiples of 8 take the TMA descriptors, others (33) the pointer loads.
    shapes = [(1, 2, 5, 24, 40), (2, 2, 20, 40, 33), (4, 1, 7, 16, 48), (2, 2, 16, 32, 48), (2, 2, -12, 24, 40),
              (4, 2, -9, 16, 32), (2, 3, 6, 33, 24)]
    if device == "cuda":
        shapes += [(2, 2, 128, 256, 512), (2, 4, -300, 256, 512), (2, 2, 100, 256, 704)]
    cases = itertools.product((torch.float32, torch.bfloat16), shapes, (False, True))
    for dtype, (world, local, cap, dim, hidden), transposed in cases:
        label = f"{dtype} W={world} El={local} C={cap} dim={dim} hidden={hidden} w^T={transposed}"
        tiles = K.CometTiles.for_device(torch.device(device), dtype=dtype)
        maps, rows = rank_maps(K, world, local, cap, tiles.block_m, device, gen)
        sends = [torch.randn(rows, dim, generator=gen).to(device, dtype) for _ in range(world)]
        table = torch.tensor([s.data_ptr() for s in sends], dtype=torch.int64, device=device)
        outs = [torch.zeros(rows, hidden, dtype=dtype, device=device) for _ in range(world)]
        outs_ref = [torch.zeros(rows, hidden, dtype=dtype, device=device) for _ in range(world)]
        out_table = torch.tensor([o.data_ptr() for o in outs], dtype=torch.int64, device=device)
        tol = 1e-5 if dtype == torch.float32 else 2e-2

        def weights(k: int, n: int) -> torch.Tensor:  # (El, k, n), or (El, n, k) viewed transposed: the backward's w^T
            if transposed:
                return torch.randn(local, n, k, generator=gen).to(device, dtype).transpose(1, 2)
            return torch.randn(local, k, n, generator=gen).to(device, dtype)

        for rank, rank_map in enumerate(maps):
            b = weights(dim, hidden)
            gathered, out = K.pull_gemm(table, sends[rank], rank_map, b, tiles)
            gathered_ref, out_ref = K.pull_gemm_reference(sends, rank_map, b)
            if not torch.equal(gathered, gathered_ref):
                failures.append(f"{label} rank {rank}: pulled rows differ")
            err = float((out.float() - out_ref.float()).norm() / out_ref.float().norm().clamp_min(1e-12))
            if err > tol:
                failures.append(f"{label} rank {rank}: pull_gemm rel err {err:.2e}")
            a = torch.randn(rank_map.num_rows, dim, generator=gen).to(device, dtype)
            w = weights(dim, hidden)
            K.gemm_push(a, w, out_table, outs[rank], rank_map, tiles)
            K.gemm_push_reference(a, w, outs_ref, rank_map)
        for rank in range(world):  # every rank's rows, written by every rank
            err = float((outs[rank].float() - outs_ref[rank].float()).norm() / outs_ref[rank].float().norm())
            if err > tol:
                failures.append(f"{label}: gemm_push into rank {rank}'s buffer, rel err {err:.2e}")
    return failures


def test_kernels_match_their_references(monkeypatch):
    pytest.importorskip("triton", reason="Triton is in the test extra; CPU-only installs run the torch path")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    failures = run_distributed(kernels_worker, 1, timeout=300)[0]
    assert not failures, "\n".join(failures)


CASES = (("topk", 1.0, 2, "gelu", torch.float32), ("topk", 0, 1, "swiglu", torch.bfloat16),
         ("bpr", -1.0, 4, "relu", torch.float32), ("cosine", 1.0, 2, "silu", torch.bfloat16),
         ("random", 1.0, 1, "swiglu", torch.float32), ("expert_choice", 1.25, 2, "gelu", torch.float32),
         ("topk", None, 2, "swiglu", torch.float32), ("bpr", None, 4, "gelu", torch.bfloat16))


def comet_worker(cases=CASES) -> list[str]:
    failures = []
    for gate, cap, k, activation, dtype in cases:
        failures += check_case(gate, cap, k, activation, dtype, kernels="comet")
    names = peer_buffers(dist.group.WORLD, torch.device("cpu")).names()
    if names != COMET_BUFFERS:  # the calls went through Comet's exchange, forward and backward
        failures.append(f"rank {dist.get_rank()}: peer buffers {names}, expected {COMET_BUFFERS}")
    return failures


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_comet_layer_matches_dense_reference(world_size):
    """The kernels' PyTorch references over shared-file peer buffers: the exchange's protocol
    (buffers, barriers, row placement, the backward's pull and push) on real processes."""
    flat = run_checks(comet_worker, world_size, timeout=300)
    assert not flat, f"{len(flat)} mismatches, first ones:\n" + "\n".join(flat[:15])


@pytest.mark.parametrize("world_size", [2, 4])
def test_comet_kernels_in_the_layer_match_dense_reference(world_size, monkeypatch):
    """The same through the Triton kernels (interpreter): each rank's kernels read and write the
    other processes' buffers by address (one rank: `test_kernels_match_their_references`)."""
    pytest.importorskip("triton", reason="Triton is in the test extra; CPU-only installs run the torch path")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cases = (CASES[0], CASES[1], ("topk", -1.0, 4, "relu", torch.float32), ("topk", None, 2, "swiglu", torch.float32))
    flat = run_checks(comet_worker, world_size, args=(cases,), timeout=600)
    assert not flat, f"{len(flat)} mismatches, first ones:\n" + "\n".join(flat[:15])


def test_dropless_calls_run_through_comet():
    """A dropless-only run allocates Comet's buffers: the calls above went through its exchange."""
    flat = run_checks(comet_worker, 2, args=((("topk", None, 2, "gelu", torch.float32),),), timeout=300)
    assert not flat, "\n".join(flat)


def tuned_worker(path: str) -> list[str]:
    """Comet's adaptive assignment in the layer: with two copy-program choices, the first call of
    each shape times both (layer0's forward and backward GEMMs have the same shape: one key; the
    padded calls' rows and the dropless call's fall in other buckets), keeps the fastest in the
    layer's tuning dictionary (rank 0 saves it), and computes what the plain exchange does."""
    from weft.kernels import comet as K
    from weft.tune import TuningDictionary

    def choices(device, n_comm=None, dtype=None):  # the interpreter's tiles, with something to choose
        return dataclasses.replace(K.CometTiles(16, 16, 16, 32, 2, 1, 1), n_comm_choices=(1, 2))

    K.CometTiles.for_device = staticmethod(choices)
    failures = []
    tuning = TuningDictionary(path, trials=1)
    torch.manual_seed(0)
    moe = MoE(16, 24, 8, top_k=2, capacity_factor=1.0, kernels="comet", tuning=tuning)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for capacity in (2.0, None, 2.0):  # the second padded call reuses the choice
        x = torch.randn(20, 16, generator=gen)
        outs = []
        for kernels in ("comet", "auto"):
            xi = x.clone().requires_grad_()
            y = moe(xi, kernels=kernels, capacity_factor=capacity)
            y.square().sum().backward()
            outs.append((y.detach(), xi.grad, moe.experts.w1.grad.clone()))
            moe.zero_grad()
        for what, a, b in zip(("output", "input grad", "w1 grad"), *outs):
            if not torch.allclose(a, b, atol=1e-5):
                failures.append(f"capacity {capacity}: {what} differs from the plain exchange")
    pulls = {k: e for k, e in tuning.kernels.items() if k.startswith("comet.pull")}
    if len(pulls) != 2 or any(sorted(e["times_ms"]) != ["1", "2"] or e["best"] not in (1, 2) for e in pulls.values()):
        failures.append(f"expected layer0 tuned for both layouts' row buckets: {pulls}")
    if tuning.measurements != 2 * len(pulls):
        failures.append(f"{tuning.measurements} timed runs for {len(pulls)} shapes: some were timed twice")
    dist.barrier()
    if dist.get_rank() == 0 and TuningDictionary(path).kernels.keys() != pulls.keys():
        failures.append("rank 0 did not save its choices")
    return failures


def test_comet_times_its_copy_programs_once_per_shape(tmp_path, monkeypatch):
    pytest.importorskip("triton", reason="Triton is in the test extra; CPU-only installs run the torch path")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    flat = run_checks(tuned_worker, 2, args=(str(tmp_path / "tuning.json"),), timeout=300)
    assert not flat, "\n".join(flat)


def fallback_worker() -> list[str]:
    """Ranks that cannot share memory run the NCCL path, the same function, and are told why."""
    failures = []
    moe = MoE(16, 24, 8, top_k=2, capacity_factor=1.0, kernels="comet")
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    with warnings.catch_warnings(record=True) as caught, pytest.MonkeyPatch.context() as env:
        warnings.simplefilter("always")
        env.setenv("LOCAL_WORLD_SIZE", "1")  # as if every rank were on a node of its own
        y_fallback = moe(x)
    said = [str(w.message) for w in caught if "kernels='comet'" in str(w.message)]
    if not said or "span several nodes" not in said[0]:
        failures.append(f"no warning naming why comet cannot run: {said}")
    if peer_buffers(dist.group.WORLD, torch.device("cpu")).names():
        failures.append("the fallback call allocated Comet's buffers")
    if not torch.allclose(y_fallback, moe(x, kernels="auto"), atol=1e-6):
        failures.append("the fallback computes another function")
    return failures


def test_comet_falls_back_to_the_nccl_path():
    flat = run_checks(fallback_worker, 2, timeout=300)
    assert not flat, "\n".join(flat)


def test_peers_unavailable_names_the_reason(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert peers_unavailable(None, torch.device("cpu")) is None  # one rank: nothing to share
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    results = run_distributed(_unavailable_worker, 2, timeout=120)
    assert results[0] == (None, "NCCL_P2P_DISABLE=1: the GPUs do not reach each other's memory")


def _unavailable_worker():
    return peers_unavailable(dist.group.WORLD, torch.device("cpu")), peers_unavailable(dist.group.WORLD,
                                                                                      torch.device("cuda"))
