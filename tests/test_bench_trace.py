"""The time-decomposition arithmetic on synthetic kernel intervals."""
from __future__ import annotations

import pytest
import torch

from weft.bench.trace import (
    CommExposed,
    CommIdle,
    Launch,
    comm_exposed,
    comm_idle,
    decompose,
    is_comm_kernel,
    kernel_intervals,
    launches,
    merge,
    overlap_length,
    profile_trace,
    stream_timeline,
)


def test_merge_and_overlap():
    assert merge([(5, 7), (0, 2), (1, 3), (7, 8), (9, 9)]) == [(0, 3), (5, 8)]
    assert overlap_length([(0, 3), (5, 8)], [(2, 6), (7, 10)]) == 1 + 1 + 1


def test_fully_exposed_communication():
    d = decompose(comm=[(0, 1000)], compute=[(1000, 3000)], steps=1)
    assert (d.comm_ms, d.compute_ms, d.overlap_ms) == (1.0, 2.0, 0.0)
    assert d.comm_only_ms == 1.0 and d.compute_only_ms == 2.0 and d.hidden_share == 0.0


def test_partly_hidden_communication_over_two_steps():
    # Per step: comm 0-400 us, compute 100-1100 us -> 300 us of comm hidden, 100 us exposed.
    comm = [(0, 400), (2000, 2400)]
    compute = [(100, 600), (600, 1100), (2100, 3100)]
    d = decompose(comm, compute, steps=2)
    assert d.comm_ms == pytest.approx(0.4) and d.compute_ms == pytest.approx(1.0)
    assert d.overlap_ms == pytest.approx(0.3) and d.comm_only_ms == pytest.approx(0.1)
    assert d.compute_only_ms == pytest.approx(0.7) and d.hidden_share == pytest.approx(0.75)


def test_no_communication_has_no_hidden_share():
    assert decompose([], [(0, 10)]).hidden_share is None


def test_kernel_classification_from_a_chrome_trace():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv", "ts": 0, "dur": 50},
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 10, "dur": 100},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 200, "dur": 5},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},
    ]}
    comm, compute = kernel_intervals(trace)
    assert comm == [(0.0, 50.0)] and compute == [(10.0, 110.0), (200.0, 205.0)]
    assert is_comm_kernel("ncclKernel_AllToAll_RING") and not is_comm_kernel("vectorized_elementwise_kernel")
    # the copy all-reduce's parts (names as torch.profiler shows them on 2 H100s)
    assert is_comm_kernel("Memcpy PtoP (Device -> Device)") and not is_comm_kernel("Memcpy DtoD (Device -> Device)")
    assert is_comm_kernel("c10d::symmetric_memory::barrier_kernel(unsigned int**, int, int, int)")


def test_stream_timeline_merges_each_streams_back_to_back_kernels_and_keeps_nccl_apart():
    """`stream_timeline`: kernels on one stream closer than the gap form one run (busy time, count,
    the longest kernel's name); an NCCL kernel on that stream starts a run of its own; a gap
    starts a new run; runs come in start order with the NCCL kernel's grid."""
    def kernel(name, ts, dur, stream, grid=None):
        args = {"stream": stream} if grid is None else {"stream": stream, "grid": grid}
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": args}

    trace = {"traceEvents": [
        kernel("gemm_a", 0, 100, 7), kernel("gemm_b", 110, 300, 7),  # one run: 10 us apart
        kernel("ncclDevKernel_SendRecv", 50, 500, 9, [4, 1, 1]),
        kernel("ncclDevKernel_SendRecv", 600, 20, 7, [4, 1, 1]),  # NCCL on stream 7: its own run
        kernel("gemm_c", 700, 50, 7),  # 290 us after gemm_b: a new run
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000},  # not a kernel
    ]}
    runs = stream_timeline(trace)
    got = [(r.stream, r.comm, r.start, r.end, r.busy, r.count, r.name, r.grid) for r in runs]
    assert got == [(7, False, 0, 410, 400, 2, "gemm_b", None),
                   (9, True, 50, 550, 500, 1, "ncclDevKernel_SendRecv", [4, 1, 1]),
                   (7, True, 600, 620, 20, 1, "ncclDevKernel_SendRecv", [4, 1, 1]),
                   (7, False, 700, 750, 50, 1, "gemm_c", None)]
    assert stream_timeline({"traceEvents": []}) == []


def test_comm_idle_lists_the_stretches_without_communication_and_the_compute_in_them():
    """`comm_idle`: between the step's first and last kernel, every stretch of at least `min_us`
    with no communication kernel (overlapping NCCL kernels merged), in time order, with the
    computation kernels' time inside it; shorter gaps are left out; no communication, none."""
    def kernel(name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": 7}}

    trace = {"traceEvents": [
        kernel("routing", 0, 80), kernel("ncclDevKernel_SendRecv", 100, 400),  # head: 100 us, 80 busy
        kernel("ncclDevKernel_SendRecv", 450, 100),  # overlaps the first: one busy stretch to 550
        kernel("gemm", 300, 500),  # 550-800 without communication, all of it compute
        kernel("ncclDevKernel_SendRecv", 800, 200), kernel("ncclDevKernel_SendRecv", 1030, 100),  # 30 us gap
        kernel("sgd", 1200, 60),  # tail 1130-1260, 60 us busy
    ]}
    assert comm_idle(trace) == [CommIdle(0, 100, 80), CommIdle(550, 800, 250), CommIdle(1130, 1260, 60)]
    assert comm_idle(trace, min_us=200) == [CommIdle(550, 800, 250)]
    assert comm_idle({"traceEvents": [kernel("gemm", 0, 10)]}) == []


def test_comm_exposed_lists_communication_alone_with_the_kernels_around_it():
    """`comm_exposed`: every stretch where a communication kernel runs and no computation kernel
    does (overlapping NCCL kernels merged, a computation kernel inside one cuts it in two), of at
    least `min_us`, with the last computation kernel ended before it and the first started after
    it; their sum is `decompose`'s comm_only."""
    def kernel(name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": 7}}

    trace = {"traceEvents": [
        kernel("router", 0, 80), kernel("ncclDevKernel_SendRecv", 100, 400),  # alone 100-300
        kernel("ncclDevKernel_SendRecv", 450, 100),  # merged with the first, to 550
        kernel("gemm", 300, 100), kernel("relu", 420, 20),  # 400-420 and 440-550 alone
        kernel("ncclDevKernel_SendRecv", 800, 203), kernel("combine", 1000, 10),  # 800-1000 alone, 1003 inside
        kernel("ncclDevKernel_SendRecv", 1100, 3),  # 3 us: under min_us
    ]}
    assert comm_exposed(trace) == [CommExposed(100, 300, "router", "gemm"), CommExposed(400, 420, "gemm", "relu"),
                                   CommExposed(440, 550, "relu", "combine"), CommExposed(800, 1000, "relu", "combine")]
    assert sum(s.end - s.start for s in comm_exposed(trace, min_us=0)) == pytest.approx(
        decompose(*kernel_intervals(trace)).comm_only_ms * 1e3)
    assert comm_exposed({"traceEvents": [kernel("gemm", 0, 10)]}) == []


def test_the_profile_records_the_steps_after_an_unrecorded_warm_up():
    """`profile_trace` runs one step before the recorded ones (then the ranks meet, GPUs idle), so
    the trace holds exactly the `steps` steps after it."""
    calls = []

    def step():
        with torch.profiler.record_function(f"step{len(calls)}"):
            calls.append(torch.ones(4) + 1)

    trace = profile_trace(step, steps=2)
    names = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("step")}
    assert len(calls) == 3 and names == {"step1", "step2"}


def test_the_replica_slots_trans_and_agg_are_their_peer_copies():
    """On Comet's path (`transfer_intervals(..., peer_copies=True)`) Trans and Agg are the copies
    between GPUs, the copy engine's or the link kernels': a peer copy under a GEMM counts as
    hidden, one alone as exposed; the barrier and the collective kernels are not theirs (in neither
    list), the local copy is computation."""
    from weft.bench.breakdown import transfer_intervals

    trace = {"traceEvents": [
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy PtoP (Device -> Device)", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "_pull_gemm_kernel", "ts": 0, "dur": 300},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy PtoP (Device -> Device)", "ts": 400, "dur": 50},
        {"ph": "X", "cat": "kernel", "name": "c10d::symmetric_memory::barrier_kernel(unsigned int**)",
         "ts": 500, "dur": 40},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL", "ts": 600, "dur": 20},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 700, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "_link_kernel", "ts": 800, "dur": 30},
        {"ph": "X", "cat": "kernel", "name": "_grouped_mm_kernel", "ts": 790, "dur": 60},
        {"ph": "X", "cat": "kernel", "name": "_link_kernel", "ts": 900, "dur": 20},
    ]}
    moved, compute = transfer_intervals(trace, peer_copies=True)
    assert moved == [(0.0, 100.0), (400.0, 450.0), (800.0, 830.0), (900.0, 920.0)]
    assert compute == [(0.0, 300.0), (700.0, 710.0), (790.0, 850.0)]
    d = decompose(moved, compute)
    assert d.hidden_share == pytest.approx((100 + 30) / (150 + 50))
    assert transfer_intervals(trace)[0] == []  # by their launching stage: none here


def test_each_kernel_is_attributed_to_the_op_stage_and_autograd_node_that_launched_it():
    """`launches`: the innermost host range open at a kernel's launch call on its thread, the
    innermost `weft.*` stage and autograd node around it; ranges of other threads, or closed by
    then, do not count."""
    def op(name, ts, dur, tid=1, cat="cpu_op"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}

    def launch(ts, correlation, tid=1):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "tid": tid,
                "args": {"correlation": correlation}}

    trace = {"traceEvents": [
        op("weft.attention", 0, 100, cat="user_annotation"), op("aten::linear", 10, 30), op("aten::mm", 12, 20),
        launch(15, 1),  # the forward's matmul, inside the attention stage
        op("autograd::engine::evaluate_function: UnbindBackward0", 200, 50), op("UnbindBackward0", 205, 40),
        op("aten::cat", 210, 20), launch(215, 2),  # the backward's stack
        op("aten::add_", 246, 3), launch(247, 3),  # after UnbindBackward0 closed, in evaluate_function
        op("aten::copy_", 300, 10, tid=2), launch(305, 4),  # thread 1 has nothing open at 305
        launch(500, 5, tid=3),  # a thread without ranges
    ]}
    found = launches(trace)
    assert found[1] == Launch("aten::mm", "weft.attention", "-")
    assert found[2] == Launch("aten::cat", "-", "UnbindBackward0")
    assert found[3] == Launch("aten::add_", "-", "autograd::engine::evaluate_function: UnbindBackward0")
    assert 4 not in found and 5 not in found
