"""`weft.bench.breakdown`: GPU kernels attributed to the stage that launched them, forward and
backward (a backward op inherits its forward op's stage), from real CPU profiles of the layer and
from a trace with GPU kernels written out here."""
from __future__ import annotations

import pytest
import torch

from weft import MoE
from weft.bench.breakdown import Breakdown, _op_contexts, breakdown, format_breakdown, kernel_label, print_breakdowns
from weft.bench.trace import profile_trace
from weft.profiling import stage


def _op(name, ts, dur, tid, ext, seq=None, cat="cpu_op"):
    args = {"External id": ext}
    if seq is not None:
        args["Sequence number"] = seq
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def _trace() -> dict:
    return {"traceEvents": [
        _op("weft.dispatch", 0, 100, 1, 1, cat="user_annotation"),
        _op("aten::index_select", 10, 20, 1, 2, seq=7),
        _op("weft.experts", 40, 50, 1, 3, cat="user_annotation"),
        _op("aten::bmm", 45, 30, 1, 4, seq=8),
        _op("autograd::engine::evaluate_function: BmmBackward0", 200, 50, 2, 5, seq=8),
        _op("aten::bmm", 205, 20, 2, 6),
        _op("autograd::engine::evaluate_function: IndexSelectBackward0", 260, 40, 2, 7, seq=7),
        _op("aten::index_add", 265, 30, 2, 8),
        _op("aten::add", 400, 5, 1, 9),  # outside every stage
        _op("cudaStreamSynchronize", 266, 2, 2, 8, cat="cuda_runtime"),
        _op("index_select_kernel", 1000, 30, 7, 2, cat="kernel"),
        _op("gemm", 1040, 60, 7, 4, cat="kernel"),
        _op("ncclDevKernel_AllToAll", 1040, 100, 8, 2, cat="kernel"),  # comm, whatever launched it
        _op("gemm_dgrad", 1200, 50, 7, 6, cat="kernel"),
        _op("index_add_kernel", 1300, 40, 7, 8, cat="kernel"),
        _op("add_kernel", 1400, 10, 7, 9, cat="kernel"),
    ]}


def test_kernels_go_to_the_stage_that_launched_them_forward_and_backward():
    b = breakdown(_trace(), steps=2)
    st = b.stages
    assert st["dispatch"].forward_ms == pytest.approx(0.030 / 2)
    assert st["dispatch"].backward_ms == pytest.approx(0.040 / 2)
    assert st["experts"].forward_ms == pytest.approx(0.060 / 2)
    assert st["experts"].backward_ms == pytest.approx(0.050 / 2)
    assert st["comm"].forward_ms == pytest.approx(0.100 / 2)
    assert st["other"].forward_ms == pytest.approx(0.010 / 2)
    assert st["dispatch"].syncs == pytest.approx(0.5)
    # Host time: dispatch's range without the experts range nested in it; backward by node.
    assert st["dispatch"].host_forward_ms == pytest.approx((100 - 50) * 1e-3 / 2)
    assert st["experts"].host_backward_ms == pytest.approx(50 * 1e-3 / 2)
    assert b.kernel_ms == pytest.approx(0.290 / 2)
    # Busy: the union [1000, 1030] + [1040, 1140] + [1200, 1250] + [1300, 1340] + [1400, 1410].
    assert b.busy_ms == pytest.approx(0.230 / 2)
    assert b.window_ms == pytest.approx(0.410 / 2)
    assert b.idle_ms == pytest.approx(0.180 / 2)
    table = format_breakdown(b, "t")
    assert table.index("dispatch") < table.index("experts") < table.index("comm") < table.index("other")


def test_a_backward_op_takes_the_stage_of_the_forward_op_that_made_its_node():
    """An op records the sequence number the next autograd node will take, so an op that makes no
    node (an integer cumsum in the exchange, before the experts' GEMM) carries the GEMM's number:
    the backward belongs to the last forward op with that number. Before, the first one won and a
    dropless layer's grouped-GEMM backward was counted as the exchange's on a GPU."""
    def step(x, w, counts):
        with stage("exchange"):
            counts.cumsum(0).to(torch.int32)  # no node: it records the number the matmul's node takes
            with stage("experts"):
                y = x @ w
        y.sum().backward()

    w = torch.randn(8, 8, requires_grad=True)
    trace = profile_trace(lambda: step(torch.randn(4, 8), w, torch.tensor([3, 4, 5])), steps=2)
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    contexts, _ = _op_contexts(events)
    numbers = [e["args"].get("Sequence number") for e in events if e["name"] in ("aten::cumsum", "aten::mm")
               and e.get("cat") == "cpu_op" and "Sequence number" in e["args"]]
    assert len(set(numbers)) < len(numbers)  # the case itself: the cumsum shares the mm's number
    stages = {contexts[e["args"]["External id"]] for e in events
              if e.get("cat") == "cpu_op" and e["name"] == "aten::mm" and "External id" in e["args"]}
    assert stages == {("experts", False), ("experts", True)}


def test_kernels_are_summed_by_name_which_is_all_a_graph_replay_leaves():
    """A CUDA graph's kernels have no launching op: they all land in "other", and the time per
    kernel name is what tells them apart (summed per step, ranked, kept through the JSON)."""
    scan = "void at::native::tensor_kernel_scan_outer_dim<long, unsigned int, std::plus<long> >(long*, long const*)"
    events = [_op(name, ts, dur, 7, None, cat="kernel") for name, ts, dur in
              [(scan, 0, 385), ("nvjet_gemm", 400, 150), (scan, 600, 383), ("nvjet_gemm", 1000, 140),
               ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 1200, 700)]]
    b = Breakdown.from_dict(breakdown({"traceEvents": events}, steps=2).to_dict())
    assert set(b.stages) == {"other", "comm"}
    top = b.top_kernels(2)
    assert [name for name, _, _ in top] == ["tensor_kernel_scan_outer_dim<long, unsigned int, std::plus<long> >",
                                           "ncclDevKernel_SendRecv"]
    assert top[0][1:] == pytest.approx((0.384, 1.0))
    table = format_breakdown(b, "graph", top=3)
    assert table.index("tensor_kernel_scan") < table.index("ncclDevKernel_SendRecv") < table.index("nvjet_gemm")


@pytest.mark.parametrize("name, label", [
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<2> >(T1, T2)", "multi_tensor_apply_kernel<TensorListMetadata<2> >"),
    ("_gather_rows_kernel", "_gather_rows_kernel"),
    ("memcpy128", "memcpy128"),
    ("x" * 100, "x" * 69 + "..."),
])
def test_kernel_labels_drop_namespaces_and_arguments(name, label):
    assert kernel_label(name) == label


def test_benchmark_rows_print_their_breakdown(capsys):
    b = breakdown(_trace(), steps=2)
    print_breakdowns([{"mode": "plain", "breakdown": b.to_dict()}, {"mode": "none"}], lambda r: r["mode"])
    out = capsys.readouterr().out
    assert "plain (rank 0): GPU window 0.205 ms/step" in out and "none" not in out


def windows_by_rank_worker() -> list[str]:
    """`profile_parts` with a breakdown on several ranks gathers every rank's GPU window and busy
    time (each rank's trace stands in here: a CPU has no kernels), in rank order, on every rank."""
    import torch.distributed as dist

    from weft.bench import breakdown as module

    rank = dist.get_rank()
    module.profile_trace = lambda step, steps, path=None: {"traceEvents": []}
    module.breakdown = lambda trace, steps: Breakdown(window_ms=1.0 + rank, busy_ms=0.5 + rank)
    parts = module.profile_parts(lambda: None, 1, with_breakdown=True)
    expected = [[1.0 + r, 0.5 + r] for r in range(dist.get_world_size())]
    return [] if parts.get("windows_by_rank_ms") == expected else [f"rank {rank}: {parts.get('windows_by_rank_ms')}"]


def test_a_breakdown_on_several_ranks_gathers_every_ranks_window(capsys):
    from weft.testing import run_checks

    assert not run_checks(windows_by_rank_worker, 2, timeout=120)
    windows = [[4.9, 4.8], [5.2, 5.0]]
    row = {"mode": "plain", "breakdown": breakdown(_trace(), steps=2).to_dict(), "windows_by_rank_ms": windows}
    print_breakdowns([row], lambda r: r["mode"])
    assert "GPU window by rank (busy), ms/step: rank 0 4.900 (4.800), rank 1 5.200 (5.000)" in capsys.readouterr().out


def test_the_experts_stage_gives_the_expert_matmuls_rate():
    """`weft bench layer --breakdown`'s experts rate: the routed matmuls' FLOPs over the experts
    stage's forward and backward kernel time (here 0.030 + 0.025 ms a step); none where no
    kernel was attributed to that stage (a graph replay, or no profile)."""
    from weft.bench.layer import experts_stage_tflops

    stages = breakdown(_trace(), steps=2).to_dict()
    assert experts_stage_tflops(stages, 55e9) == pytest.approx(55e9 / 0.055e-3 / 1e12)
    graphed = breakdown({"traceEvents": [_op("nvjet_gemm", 0, 100, 7, None, cat="kernel")]}).to_dict()
    assert experts_stage_tflops(graphed, 55e9) is None and experts_stage_tflops(None, 55e9) is None


def test_a_real_profile_of_the_layer_maps_its_ops_to_stages():
    torch.manual_seed(0)
    moe = MoE(16, 32, 4, top_k=2, capacity_factor=1.0, kernels="torch")
    x = torch.randn(32, 16, requires_grad=True)

    def step():
        moe(x).square().sum().backward()

    trace = profile_trace(step, steps=2)
    contexts, host = _op_contexts([e for e in trace["traceEvents"] if e.get("ph") == "X"])
    by_name: dict[str, set] = {}
    for e in trace["traceEvents"]:
        ext = e.get("args", {}).get("External id")
        if e.get("cat") == "cpu_op" and ext in contexts:
            by_name.setdefault(e["name"], set()).add(contexts[ext])
    assert ("experts", False) in by_name["aten::bmm"] and ("experts", True) in by_name["aten::bmm"]
    assert ("combine", False) in by_name["aten::index_add"]
    assert ("router", False) in by_name["aten::matmul"]
    assert ("routing", False) in by_name["aten::softmax"]
    assert ("routing", True) in by_name["aten::_softmax_backward_data"]
    assert host[("experts", False)] > 0 and host[("experts", True)] > 0
