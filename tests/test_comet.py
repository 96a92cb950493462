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
from weft.comm.peers import held_peer_bytes, peer_buffers, peers_unavailable
from weft.testing import run_checks, run_distributed

COMET_BUFFERS = ["comet.pulled", "comet.pushed"]  # the forward's and the backward's roles share each


def rank_maps(K, world: int, local: int, cap: int, block_m: int, device, gen, on_device: bool = False) -> list:
    """Every rank's `RowMap` and every source's buffer rows: padded (cap > 0: C slots per expert
    from every source) or dropless (cap <= 0: each source's routed rows sorted by expert, random
    counts up to -cap, some zero; `on_device`: maps built from the counts on the device, sized for
    every source sending its most rows to one rank)."""
    experts = world * local
    if cap > 0:
        return [K.RowMap.padded(world, local, cap, r, block_m, device) for r in range(world)], experts * cap
    counts = torch.randint(0, -cap + 1, (world, experts), generator=gen)
    counts[0, 0] = 0  # an empty (source, expert) pair
    rows = int(counts.sum(1).max())
    if on_device:
        return [K.RowMap.on_device(counts.to(device), r, local, block_m, world * rows) for r in range(world)], rows
    offsets = torch.cumsum(counts, 1) - counts
    mine = [slice(r * local, (r + 1) * local) for r in range(world)]
    maps = [K.RowMap.build(counts[:, mine[r]].tolist(), offsets[:, mine[r]].tolist(), r, block_m, device)
            for r in range(world)]
    return maps, rows


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
        # the same map from the counts on the device, sized for more rows than arrive
        bound = rows.num_rows + 2 * block_m + 1
        device_rows = K.RowMap.on_device(counts, rank, local, block_m, bound)
        used = rows.num_rows
        assert device_rows.segments is None and device_rows.num_rows == bound, label
        assert device_rows.rank_R[:used].tolist() == rows.rank_R.tolist(), label
        assert device_rows.row_R[:used].tolist() == rows.row_R.tolist(), label
        assert set(device_rows.rank_R[used:].tolist()) == {-1}, f"{label}: rows past the last end"
        assert torch.equal(device_rows.ends_I, rows.ends_I), label
        for order, exact in ((device_rows.pull_tiles, rows.pull_tiles), (device_rows.push_tiles, rows.push_tiles)):
            assert len(order) == -(-bound // block_m) + local, label
            assert torch.equal(order[:len(exact)], exact), f"{label}: the same tiles in the same order first"
            assert not order[len(exact):].any(), f"{label}: then empty tiles only"
        for dim, hidden in ((8, 12), (5, 7)):
            x = torch.randn(rows.num_rows, dim, generator=gen)
            w = torch.randn(local, dim, hidden, generator=gen)
            dy = torch.randn(rows.num_rows, hidden, generator=gen)
            y_ref = torch.cat([part @ w[i] for i, part in enumerate(torch.split(x, segments))])
            dw_ref = torch.stack([a.T @ b for a, b in zip(torch.split(x, segments), torch.split(dy, segments))])
            torch.testing.assert_close(K.segment_mm(x, w, rows), y_ref, msg=label)
            torch.testing.assert_close(K.segment_wgrad(x, dy, rows), dw_ref, msg=label)
            # rows past the last end (anything there) change neither
            x_pad = torch.cat([x, torch.full((bound - used, dim), float("nan"))])
            dy_pad = torch.cat([dy, torch.full((bound - used, hidden), float("nan"))])
            torch.testing.assert_close(K.segment_mm(x_pad, w, device_rows)[:used], y_ref, msg=label)
            torch.testing.assert_close(K.segment_wgrad(x_pad, dy_pad, device_rows), dw_ref, msg=label)


def map_kernel_worker(device: str = "cpu") -> list[str]:
    """`RowMap`'s one-launch build (`_map_kernel`) against its PyTorch reference: exact maps and
    maps sized past their rows (more tiles than the rows take), W = 1, 2, 4, 8, experts without
    rows, every rank."""
    from weft.kernels import comet as K

    failures = []
    gen = torch.Generator().manual_seed(3)
    cases = [*itertools.product((1, 2, 4), (1, 3), (2, 16), (0, 5, 40), (0, 37)), (8, 3, 16, 40, 37), (2, 8, 2, 5, 0)]
    for world, local, block_m, most, spare in cases:
        counts = torch.randint(0, most + 1, (world, world * local), generator=gen)
        if most == 40:
            counts[:, 0] = 0
        offsets = torch.cumsum(counts, 1) - counts
        for rank in sorted({0, world - 1}):
            mine = slice(rank * local, (rank + 1) * local)
            count_IS = counts[:, mine].t().reshape(-1).to(device)  # a strided view where El = 1
            offset_IS = offsets[:, mine].t().reshape(-1).to(device)
            rows = int(count_IS.sum()) + spare
            n_tiles = sum(-(-int(c) // block_m) for c in counts[:, mine].sum(0)) + (-(-spare // block_m) + local
                                                                                   if spare else 0)
            got = K._row_map(count_IS, offset_IS, world, rank, block_m, rows, n_tiles)
            want = K._row_map_reference(count_IS, offset_IS, world, rank, block_m, rows, n_tiles)
            for name in ("rank_R", "row_R", "ends_I", "pull_tiles", "push_tiles"):
                a, b = getattr(got, name), getattr(want, name)
                if a.dtype != b.dtype or not torch.equal(a.cpu(), b.cpu()):
                    failures.append(f"W={world} El={local} block {block_m} counts<={most} spare {spare} rank {rank}: "
                                    f"{name} {a.tolist()} != {b.tolist()}")
    return failures


def test_the_map_kernel_matches_its_reference(triton_interpreter):
    failures = run_distributed(map_kernel_worker, 1, timeout=300)[0]
    assert not failures, "\n".join(failures[:5])


def kernels_worker(device: str = "cpu", tma: bool = True) -> list[str]:
    """`tma=False`: as with a Triton without host tensor descriptors, every operand by pointer."""
    from weft.kernels import comet as K
    from weft.kernels import tma as tma_module

    if not tma:
        tma_module.TensorDescriptor = None
    failures = []
    gen = torch.Generator().manual_seed(0)
    # Partial row, column and K tiles, and shapes the tiles divide (no masked loads): 16 on the
    # interpreter's tiles, 128 and 256 on the GPU's; capacity <= 0: dropless, up to -cap rows.
    # Widths that are multiples of 8 take the TMA descriptors, others (33) the pointer loads.
    shapes = [(1, 2, 5, 24, 40), (2, 2, 20, 40, 33), (4, 1, 7, 16, 48), (2, 2, 16, 32, 48), (2, 2, -12, 24, 40),
              (4, 2, -9, 16, 32), (2, 3, 6, 33, 24)]
    if device == "cuda":  # the last: 32 K steps, as the experts' real GEMMs run (a fault may show only over many)
        shapes += [(2, 2, 128, 256, 512), (2, 4, -300, 256, 512), (2, 2, 100, 256, 704), (2, 2, 128, 2048, 256)]
    if not tma:  # an operand whose width is not a multiple of 8 is read by pointer with descriptors on too
        shapes = [shape for shape in shapes if shape[3] % 8 == 0 and shape[4] % 8 == 0]
    cases = [(dtype, shape, transposed, on_device)
             for dtype, shape, transposed in itertools.product((torch.float32, torch.bfloat16), shapes, (False, True))
             for on_device in ((False, True) if shape[2] <= 0 else (False,))]
    by_engine = with_runs = 0
    for case, (dtype, (world, local, cap, dim, hidden), transposed, on_device) in enumerate(cases):
        activation = list(K.ACTIVATIONS)[case % len(K.ACTIVATIONS)]  # layer0's fused epilogue, in turn
        tiles = K.CometTiles.for_device(torch.device(device), dtype=dtype)
        maps, rows = rank_maps(K, world, local, cap, tiles.block_m, device, gen, on_device)
        if maps[0].runs is None:  # layer0 reads its own rows in place, or every row after its copy, in turn
            direct, engine = (case // 2) % 2 == 0, False
        else:  # a map the copy engine can serve: in place with the other ranks' rows by the copy engine,
            direct, engine = ((True, True), (True, False), (False, False))[with_runs % 3]  # in place, copied
            with_runs += 1
        tiles = dataclasses.replace(tiles, direct_local=direct, copy_engine=engine)
        by_engine += engine
        label = (f"{dtype} W={world} El={local} C={cap} dim={dim} hidden={hidden} w^T={transposed} "
                 f"map on the device {on_device} own rows in place {direct}{' by the copy engine' * engine}")
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
            gathered, out = K.pull_gemm(table, sends[rank], rank_map, b, tiles, sends)
            gathered_ref, out_ref = K.pull_gemm_reference(sends, rank_map, b)
            used = int(rank_map.ends_I[-1])  # a map built on the device: rows past it are anything
            gathered, out, gathered_ref, out_ref = gathered[:used], out[:used], gathered_ref[:used], out_ref[:used]
            if not torch.equal(gathered, gathered_ref):
                failures.append(f"{label} rank {rank}: pulled rows differ")
            err = float((out.float() - out_ref.float()).norm() / out_ref.float().norm().clamp_min(1e-12))
            if err > tol:
                failures.append(f"{label} rank {rank}: pull_gemm rel err {err:.2e}")
            failures += check_activation_epilogue(K, table, sends, rank_map, b, tiles, activation, used, tol,
                                                  f"{label} rank {rank}")
            w, w_second = weights(dim, hidden), (weights(dim, hidden) if case % 2 else None)
            a = torch.randn(rank_map.num_rows, dim * (1 if w_second is None else 2), generator=gen).to(device, dtype)
            K.gemm_push(a, w, out_table, outs[rank], rank_map, tiles, w_second)  # odd cases: a @ [w; w_second]
            K.gemm_push_reference(a, w, outs_ref, rank_map, w_second)
        for rank in range(world):  # every rank's rows, written by every rank
            err = float((outs[rank].float() - outs_ref[rank].float()).norm() / outs_ref[rank].float().norm())
            if err > tol:
                failures.append(f"{label}: gemm_push into rank {rank}'s buffer, rel err {err:.2e}")
    if not by_engine:
        failures.append("no case took the other ranks' rows by the copy engine")
    return failures


def check_activation_epilogue(K, table, sends, rank_map, b, tiles, activation, used, tol, label) -> list[str]:
    """Layer0 with `activation` in its epilogue, forward and backward (swiglu: the backward, from
    random kept h1 and h3), against its reference on the first `used` rows (the rest of a map
    built on the device is anything)."""
    failures = []
    if activation == "swiglu":  # the backward only: its forward's act(h) needs x @ w3 too
        act = act_ref = h = h_ref = None
        kept_ref = tuple(torch.randn(rank_map.num_rows, b.shape[2]).to(b) for _ in range(2))
    else:
        _, act, h = K.pull_gemm_activation(table, sends[0], rank_map, b, tiles, activation, sources=sends)
        _, act_ref, h_ref = K.pull_gemm_activation_reference(sends, rank_map, b, activation)
        kept_ref = (act_ref if h_ref is None else h_ref,)
    _, grad_h, act_again = K.pull_gemm_activation(table, sends[0], rank_map, b, tiles, activation,
                                                  tuple(t.contiguous() for t in kept_ref), sends)
    _, grad_h_ref, act_again_ref = K.pull_gemm_activation_reference(sends, rank_map, b, activation, kept_ref)
    pairs = {"act(h)": (act, act_ref), "h": (h, h_ref), "dh": (grad_h, grad_h_ref),
             "act(h) again": (act_again, act_again_ref)}
    for name, (got, want) in pairs.items():
        none_expected = ((activation == "relu" and name in ("h", "act(h) again"))  # relu's backward: act(h) alone
                         or (activation == "swiglu" and name in ("act(h)", "h")))
        if (got is None) != none_expected or (want is None) != none_expected:
            failures.append(f"{label} {activation}: {name} is {got is None and 'None' or 'a tensor'}, "
                            f"the reference's {want is None and 'None' or 'a tensor'}, expected None: {none_expected}")
        elif got is not None:
            got, want = got[:used].float(), want[:used].float()
            err = float((got - want).norm() / want.norm().clamp_min(1e-12))
            if err > tol:
                failures.append(f"{label} {activation}: layer0's epilogue {name} rel err {err:.2e}")
    return failures


@pytest.mark.parametrize("tma", [True, False])
def test_kernels_match_their_references(triton_interpreter, tma):
    failures = run_distributed(kernels_worker, 1, args=("cpu", tma), timeout=300)[0]
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


def staged_comet_worker(cases) -> list[str]:
    """`comet_worker`, counting where `CometPlan.share` found its rows: the row kernels' dispatch
    writes them into the "send" role's buffer and the combine's backward their gradient into "grad_send"
    (`Comet.staging`), so every share, forward and backward, finds them there and copies nothing."""
    from weft.moe.exchange import comet as exchange

    shares = {"staged": 0, "copied": 0}
    share = exchange.CometPlan.share

    def counting_share(plan, name, rows_ND):
        buffer = share(plan, name, rows_ND)
        shares["staged" if rows_ND.data_ptr() == buffer.local.data_ptr() else "copied"] += 1
        return buffer

    exchange.CometPlan.share = counting_share
    try:
        failures = comet_worker(cases)
    finally:
        exchange.CometPlan.share = share
    if shares["copied"] or not shares["staged"]:
        failures.append(f"rank {dist.get_rank()}: {shares['copied']} shares copied their rows, "
                        f"{shares['staged']} found them in the buffer (expected none copied)")
    return failures


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_comet_kernels_in_the_layer_match_dense_reference(world_size, triton_interpreter):
    """The same through the Triton kernels (interpreter): each rank's kernels read and write the
    other processes' buffers by address (one rank: plain tensors, as `test_kernels_match_their_references`),
    with the rows and their gradient dispatched straight into the buffers."""
    cases = (CASES[0], CASES[1], ("topk", -1.0, 4, "relu", torch.float32), ("topk", None, 2, "swiglu", torch.float32),
             ("topk", None, 2, "silu", torch.bfloat16))
    flat = run_checks(staged_comet_worker, world_size, args=(cases,), timeout=600)
    assert not flat, f"{len(flat)} mismatches, first ones:\n" + "\n".join(flat[:15])


def stacked_layers_worker(capacity) -> list[str]:
    """Two `kernels="comet"` layers one after the other, rows staged (Triton interpreter): the
    second layer's forward pushes into the buffer that holds the first's outputs before the
    first's backward, so the first's combine must keep its own copy of them (`Staging.transient_out`)
    and the backward's input gradients are read where they were pushed. Outputs and every
    gradient (the routers' read the kept outputs) against the same layers with `kernels="torch"`;
    two steps, so the second reads buffers the first left behind."""
    rank, world = dist.get_rank(), dist.get_world_size()
    failures = []
    models = []
    for kernels in ("comet", "torch"):
        torch.manual_seed(0)
        models.append(torch.nn.Sequential(*(MoE(16, 24, 2 * world, top_k=2, capacity_factor=capacity,
                                                kernels=kernels) for _ in range(2))))
    comet, plain = models
    gen = torch.Generator().manual_seed(rank)
    for step in range(2):
        x = torch.randn(20, 16, generator=gen)
        dy = torch.randn(20, 16, generator=gen)
        outputs = []
        for model in (comet, plain):
            model.zero_grad()
            xi = x.clone().requires_grad_()
            y = model(xi)
            (y * dy).sum().backward()
            outputs.append((y.detach(), xi.grad))
        (yc, gc), (yp, gp) = outputs
        label = f"rank {rank} cf {capacity} step {step}"
        if not torch.allclose(yc, yp, atol=1e-5):
            failures.append(f"{label}: outputs differ by {float((yc - yp).abs().max()):.2e}")
        if not torch.allclose(gc, gp, atol=1e-5):
            failures.append(f"{label}: input gradients differ by {float((gc - gp).abs().max()):.2e}")
        for (name, pc), pp in zip(comet.named_parameters(), plain.parameters()):
            if not torch.allclose(pc.grad, pp.grad, atol=1e-5):
                failures.append(f"{label}: {name}'s gradient differs by {float((pc.grad - pp.grad).abs().max()):.2e}")
    names = peer_buffers(dist.group.WORLD, torch.device("cpu")).names()
    if names != COMET_BUFFERS:
        failures.append(f"rank {rank}: peer buffers {names}, expected {COMET_BUFFERS}")
    return failures


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_stacked_comet_layers_keep_what_their_backward_reads(world_size, triton_interpreter):
    flat = []
    for capacity in (1.0, None):
        flat += run_checks(stacked_layers_worker, world_size, args=(capacity,), timeout=300)
    assert not flat, "\n".join(flat[:15])


def gradient_order_worker() -> list[str]:
    """Each expert weight's gradient is accumulated before the next one is made, as the plain
    layer's separate products give them (one weight gradient alive beyond the accumulated ones at
    the peak): `segment_wgrad` records which weights already have their `.grad` when it is asked
    for the next one. relu: dW2, then dW1; swiglu: dW2, dW3 (`CometW3Grad`), then dW1."""
    from weft.moe.exchange import comet as exchange

    world, failures = dist.get_world_size(), []
    real = exchange.segment_wgrad
    for activation, expected in (("relu", [[], ["w2"]]), ("swiglu", [[], ["w2"], ["w2", "w3"]])):
        torch.manual_seed(0)
        moe = MoE(16, 24, 2 * world, top_k=2, capacity_factor=1.0, activation=activation, kernels="comet")
        weights = {name: w for name, w in (("w1", moe.experts.w1), ("w2", moe.experts.w2), ("w3", moe.experts.w3))
                   if w is not None}
        seen = []

        def recording(x_RK, dy_RN, rows):
            seen.append(sorted(name for name, w in weights.items() if w.grad is not None))
            return real(x_RK, dy_RN, rows)

        exchange.segment_wgrad = recording
        try:
            moe(torch.randn(20, 16, requires_grad=True)).square().sum().backward()
        finally:
            exchange.segment_wgrad = real
        if seen != expected:
            failures.append(f"rank {dist.get_rank()} {activation}: weights already accumulated at each weight "
                            f"gradient {seen}, expected {expected}")
        if any(w.grad is None for w in weights.values()):
            failures.append(f"rank {dist.get_rank()} {activation}: a weight got no gradient")
    return failures


@pytest.mark.parametrize("world_size", [1, 2])
def test_each_weight_gradient_is_accumulated_before_the_next_is_made(world_size):
    flat = run_checks(gradient_order_worker, world_size, timeout=300)
    assert not flat, "\n".join(flat)


def test_dropless_calls_run_through_comet():
    """A dropless-only run allocates Comet's buffers: the calls above went through its exchange."""
    flat = run_checks(comet_worker, 2, args=((("topk", None, 2, "gelu", torch.float32),),), timeout=300)
    assert not flat, "\n".join(flat)


def counts_on_device_worker() -> list[str]:
    """A dropless `kernels="comet"` call (forward and backward) after the first reads nothing on
    the host: every rank's counts stay on the device and Comet's map is built there, which is what
    lets a CUDA graph hold the call. Its outputs and gradients are those of the plain layer, over
    several calls with changing counts; ranks routing different numbers of tokens are refused."""
    from test_moe_exchange import _count_reads

    rank, world = dist.get_rank(), dist.get_world_size()
    failures = []
    torch.manual_seed(0)
    comet = MoE(16, 24, 2 * world, top_k=2, capacity_factor=None, kernels="comet")
    torch.manual_seed(0)
    plain = MoE(16, 24, 2 * world, top_k=2, capacity_factor=None)
    gen = torch.Generator().manual_seed(rank)
    for step in range(4):
        x = torch.randn(20, 16, generator=gen)
        x[:, 0] += step  # the counts change from call to call
        xc, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
        yp = plain(xp)
        yp.square().sum().backward()

        def call():
            yc = comet(xc)
            yc.square().sum().backward()
            return yc

        reads = _count_reads(call) if step else []
        if step == 0:
            call()
        if reads:
            failures.append(f"rank {rank} step {step}: the dropless Comet call read the device {len(reads)} times "
                            f"({reads})")
        if not torch.allclose(xc.grad, xp.grad, atol=1e-5):
            failures.append(f"rank {rank} step {step}: input gradient differs from plain")
    for (name, pc), pp in zip(comet.named_parameters(), plain.parameters()):
        if not torch.allclose(pc.grad, pp.grad, atol=1e-4):
            failures.append(f"rank {rank}: {name} gradient differs from plain")
    uneven = MoE(16, 24, 2 * world, top_k=2, capacity_factor=None, kernels="comet")
    try:
        uneven(torch.randn(20 + rank, 16))
        failures.append(f"rank {rank}: ranks routing 20 and 21 tokens ran a dropless Comet call")
    except ValueError as e:
        if "tokens per rank" not in str(e):
            failures.append(f"rank {rank}: unexpected error {e}")
    return failures


@pytest.mark.parametrize("world_size", [2, 4])
def test_dropless_comet_reads_nothing_on_the_host(world_size):
    flat = run_checks(counts_on_device_worker, world_size, timeout=300)
    assert not flat, "\n".join(flat[:15])


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
    for capacity in (1.0, None, 1.0):  # the second padded call reuses the choice
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


def test_comet_times_its_copy_programs_once_per_shape(tmp_path, triton_interpreter):
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


def _held_bytes_worker() -> tuple[int, int, int]:
    device = torch.device("cpu")
    before = held_peer_bytes(device)
    peers = peer_buffers(dist.group.WORLD, device)
    peers.get("a", (3, 5), torch.float32)
    peers.get("b", (2, 4), torch.bfloat16)
    peers.get("a", (3, 5), torch.float32)  # the same buffer again: nothing new
    return before, peers.nbytes(), held_peer_bytes(device)


@pytest.mark.parametrize("world_size", [1, 2])
def test_peer_buffers_count_their_bytes(world_size):
    """What `weft bench layer` reports beside the peak (symmetric memory is outside torch's count)."""
    for before, own, held in run_distributed(_held_bytes_worker, world_size, timeout=120):
        assert own == 3 * 5 * 4 + 2 * 4 * 2 and held == before + own


def test_peers_unavailable_names_the_reason(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert peers_unavailable(None, torch.device("cpu")) is None  # one rank: nothing to share
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    results = run_distributed(_unavailable_worker, 2, timeout=120)
    assert results[0] == (None, "NCCL_P2P_DISABLE=1: the GPUs do not reach each other's memory")


def _unavailable_worker():
    return peers_unavailable(dist.group.WORLD, torch.device("cpu")), peers_unavailable(dist.group.WORLD,
                                                                                      torch.device("cuda"))


def auto_comet_worker() -> list[str]:
    """`kernels="auto"` with a tuned exchange: Comet's setting is one more candidate where "auto"
    means the Triton kernels (GPUs; here the rule is told the CPU counts, so the kernels'
    references run over shared-file peer buffers). Every candidate, Comet's included, computes
    the plain layer's outputs and gradients while the tuner times them, the ranks agree on the
    winner, and one rank (nothing to exchange) offers no Comet setting."""
    import weft.moe.layer as layer_module
    from weft.tune import TuningDictionary

    rule = layer_module.offers_comet
    layer_module.offers_comet = lambda call, on_gpu, ep, shards: rule(call, True, ep, shards)
    failures, world = [], dist.get_world_size()
    gen = torch.Generator().manual_seed(dist.get_rank())
    for capacity in (1.0, None):  # padded and dropless
        tuning = TuningDictionary(trials=1)
        torch.manual_seed(0)
        auto = MoE(16, 24, 8, top_k=2, capacity_factor=capacity, overlap_degree="auto", tuning=tuning)
        torch.manual_seed(0)
        plain = MoE(16, 24, 8, top_k=2, capacity_factor=capacity)
        names = [c.name for c in auto.candidates()]
        offered = "d1-linear-comet" in names
        if offered != (world > 1):
            failures.append(f"capacity {capacity}: candidates {names} on {world} ranks")
        for step in range(len(names) + 2):
            x = torch.randn(24, 16, generator=gen)
            xa, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
            ya, yp = auto(xa), plain(xp)
            ya.square().sum().backward()
            yp.square().sum().backward()
            if not (torch.allclose(ya, yp, atol=1e-5) and torch.allclose(xa.grad, xp.grad, atol=1e-5)):
                failures.append(f"capacity {capacity} step {step}: output or input gradient differs from plain")
        for (name, pa), pp in zip(auto.named_parameters(), plain.parameters()):
            if not torch.allclose(pa.grad, pp.grad, atol=1e-4):
                failures.append(f"capacity {capacity}: {name} gradient differs from plain")
        timed = {n for buckets in tuning.table.values() for e in buckets.values() for n in e["times_ms"]}
        if offered and "d1-linear-comet" not in timed:
            failures.append(f"capacity {capacity}: Comet's setting was never timed ({sorted(timed)})")
        chosen = [None] * world
        dist.all_gather_object(chosen, tuning.chosen())
        nothing_to_tune = world == 1 and capacity is None  # one rank, dropless: no exchange
        if len({tuple(c) for c in chosen}) != 1 or (not chosen[0] and not nothing_to_tune):
            failures.append(f"capacity {capacity}: the ranks chose {chosen}")
    buffers = peer_buffers(dist.group.WORLD, torch.device("cpu")).names()
    if (world > 1) != (buffers == COMET_BUFFERS):
        failures.append(f"peer buffers {buffers}: Comet's exchange {'did not run' if world > 1 else 'ran'}")
    return failures


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_auto_tunes_comet_as_a_candidate(world_size):
    flat = run_checks(auto_comet_worker, world_size, timeout=300)
    assert not flat, f"{len(flat)} failures, first ones:\n" + "\n".join(flat[:15])


def test_auto_offers_comet_only_where_it_can_run():
    """The rule (`offers_comet`) and the candidate lists: Comet's setting beside the plain one for
    "auto" on GPUs with an exchange among whole experts; `kernels="comet"` makes the plain setting
    Comet's; r = 0 or a fixed pipelining degree leaves no plain setting to pair it with."""
    from weft.moe.config import MoECall
    from weft.moe.exchange import candidates, offers_comet, tuning_key, untuned_setting
    from weft.tune import Setting

    auto = MoECall(top_k=2, capacity_factor=1.0, overlap_degree="auto", kernels="auto")
    assert offers_comet(auto, True, 2, 1)
    assert not offers_comet(auto, False, 2, 1)  # CPU: "auto" means torch ops
    assert not offers_comet(auto, True, 1, 1)  # one rank: nothing to exchange
    assert not offers_comet(auto, True, 4, 2)  # experts sliced over ranks
    assert not offers_comet(dataclasses.replace(auto, kernels="triton"), True, 2, 1)
    assert not offers_comet(dataclasses.replace(auto, communicate=False), True, 2, 1)
    names = [s.name for s in candidates(auto, "expert", 2, 1, 1, comet=True)]
    assert names == ["d1-linear", "d1-linear-comet", "d2-linear", "d4-linear", "d8-linear"]
    assert [s.name for s in candidates(auto, "expert", 2, 1, 1)] == ["d1-linear", "d2-linear", "d4-linear",
                                                                     "d8-linear"]
    assert Setting(1, "linear", 1, True) not in candidates(dataclasses.replace(auto, overlap_degree=2), "expert",
                                                           2, 1, 1, comet=True)
    comet = dataclasses.replace(auto, kernels="comet")
    assert [s.name for s in candidates(comet, "expert", 2, 1, 1)][:2] == ["d1-linear-comet", "d2-linear"]
    assert untuned_setting(comet) == Setting(1, "linear", 1, True)
    assert untuned_setting(auto) == Setting(1, "linear")
    assert tuning_key("s", auto, "expert", comet=True) == tuning_key("s", comet, "expert") != tuning_key("s", auto,
                                                                                                    "expert")
