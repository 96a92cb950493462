"""GPU checks (run on a lent GPU machine: scripts/gpu_check.sh): the CPU equivalence tests of
the layer, of every exchange strategy (fp32), of both pipelined exchanges (padded also with 2DH
chunks) and of every r of the switchable parallelism again on NCCL with bfloat16, and Lancet's
two passes in training (fp32), on every GPU."""
from __future__ import annotations

import functools
import importlib.util
import itertools
import json
import math

import pytest
import torch
import torch.distributed as dist

from test_backward_sgd import backward_sgd_worker, empty_rank_worker
from test_balance_equivalence import balance_worker
from test_balance_schedule import schedule_worker
from test_balance_slots import slots_graph_worker, slots_updated_graph_worker, slots_worker
from test_comet import kernels_worker, map_kernel_worker
from test_grouped_wgrad import kernel_worker as grouped_wgrad_worker
from test_moe_adaptive import adaptive_worker, sliced_worker
from test_moe_equivalence import ACTIVATIONS, GATES, equivalence_worker
from test_moe_exchange import exchange_worker, reads_worker
from test_moe_pipeline import dropless_worker, pipeline_worker, two_dim_pipeline_worker
from test_optim import many_tensors, squares_cases
from test_overlap_passes import (
    both_passes_worker,
    graph_profile_captures_worker,
    graphed_schedule_worker,
    pipelined_dw_worker,
)
from test_overlapped_reduce import (
    BUCKET_MB,
    Branchy,
    branchy_means,
    check_branchy_means,
    mean_worker,
    some_ranks_worker,
)
from test_rmsnorm_kernel import rmsnorm_worker
from test_rotary_kernel import qkv_heads_worker
from test_router_matmul import kernel_worker as router_matmul_worker
from test_routing_kernel import one_pass_worker, routing_kernels_worker
from test_row_kernels import kernels_worker as row_kernels_worker
from test_tp import copy_reduce_worker, tp_worker
from test_tp_moe import tp_balance_worker, tp_moe_worker
from weft import MoE
from weft.bench import layer
from weft.bench.peers import build_tp_peer
from weft.hostcopy import HostStage, device_tensor, host_tensor_async, offsets
from weft.testing import Checks, run_checks, run_distributed

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs")


def _check_on_every_gpu(worker, *args) -> list[str]:
    return run_checks(worker, torch.cuda.device_count(), args=(*args, (torch.bfloat16,), "cuda"),
                      backend="nccl", timeout=600)


@needs_cuda
@pytest.mark.parametrize("gate", GATES)
def test_matches_dense_reference_on_nccl_bf16(gate):
    flat = _check_on_every_gpu(equivalence_worker, gate)
    assert not flat, f"{len(flat)} mismatches, first ones:\n" + "\n".join(flat[:15])


@needs_cuda
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_every_exchange_computes_the_expert_function_on_nccl(activation):
    world = torch.cuda.device_count()
    for experts in sorted({2 * world, max(1, world // 2)}):  # E >= W, and fewer experts than ranks
        flat = run_checks(exchange_worker, world, args=(experts, activation, "cuda"), backend="nccl", timeout=600,
                          env={"LOCAL_WORLD_SIZE": max(1, world // 2)})
        assert not flat, "\n".join(flat[:15])


@needs_cuda
def test_leave_sms_sends_cublas_matmuls_through_cublaslt_and_restores_the_backend():
    """cuBLAS proper ignores PyTorch's SM carveout; inside `leave_sms` a `bmm` goes through
    cuBLASLt, which honours it, with the same product; both settings are back on exit."""
    from weft.kernels.grouped_mm import leave_sms

    backend, carveout = torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental()
    a_GMK = torch.randn(8, 512, 256, device="cuda", dtype=torch.bfloat16)
    b_GKN = torch.randn(8, 256, 384, device="cuda", dtype=torch.bfloat16)
    with leave_sms(8):
        assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt
        assert torch._C._get_sm_carveout_experimental() == 8
        inside = torch.bmm(a_GMK, b_GKN)
    assert torch.backends.cuda.preferred_blas_library() == backend
    assert torch._C._get_sm_carveout_experimental() == carveout
    reference = torch.bmm(a_GMK.float(), b_GKN.float())
    torch.testing.assert_close(inside.float(), reference, rtol=2e-2, atol=2e-2)


@needs_cuda
def test_lancet_dw_items_under_a_collective_leave_it_sms():
    """A dW item that Lancet's scheduler runs under a collective launches its matmuls on all but
    `EXCHANGE_SM_MARGIN` SMs (cuBLASLt with PyTorch's carveout); both settings are back after."""
    from test_overlap_wgrad import items_under_a_collective_see
    from weft.kernels.grouped_mm import EXCHANGE_SM_MARGIN

    before = (torch._C._get_sm_carveout_experimental(), torch.backends.cuda.preferred_blas_library())
    inside, after = items_under_a_collective_see("cuda")
    assert inside == (EXCHANGE_SM_MARGIN, torch._C._BlasBackend.Cublaslt)
    assert after == before


@needs_cuda
def test_pipelined_exchange_matches_degree_one_on_nccl():
    flat = _check_on_every_gpu(pipeline_worker)
    assert not flat, "\n".join(flat[:15])


@needs_cuda
def test_dropless_pipelining_matches_degree_one_on_nccl():
    flat = _check_on_every_gpu(dropless_worker)
    assert not flat, "\n".join(flat[:15])


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_pipelined_two_dim_exchange_matches_linear_on_nccl():
    # Local size 1: the 2 GPUs are 2 "nodes", so each chunk's inter-node phase runs on the side stream.
    flat = run_checks(two_dim_pipeline_worker, 2, args=((torch.bfloat16,), "cuda"), backend="nccl",
                      env={"LOCAL_WORLD_SIZE": 1}, timeout=600)
    assert not flat, "\n".join(flat[:15])


@needs_cuda
@pytest.mark.parametrize("budget", [1.0, 1e-7])
def test_lancet_passes_train_like_the_plain_model_on_nccl(budget):
    flat = run_checks(both_passes_worker, torch.cuda.device_count(), args=(budget, "cuda"), backend="nccl",
                      timeout=600)
    assert not flat, "\n".join(flat[:15])


@needs_cuda
@pytest.mark.parametrize("capacity", [1.0, None])
def test_lancets_dw_items_under_pipelined_chunks_on_nccl(capacity):
    flat = run_checks(pipelined_dw_worker, torch.cuda.device_count(), args=("cuda", capacity), backend="nccl",
                      timeout=600)
    assert not flat, "\n".join(flat[:15])


@needs_cuda
def test_data_parallel_experts_equal_expert_parallel_on_nccl():
    flat = _check_on_every_gpu(adaptive_worker)
    assert not flat, "\n".join(flat[:15])


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_fewer_experts_than_ranks_every_r_on_nccl():
    # One expert per GPU pair or fewer: E = W / 2 shards each expert over 2 ranks (r in 0, 1, 2).
    flat = _check_on_every_gpu(sliced_worker, torch.cuda.device_count() // 2)
    assert not flat, "\n".join(flat[:15])


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_replicated_experts_compute_the_plain_layer_on_nccl():
    # Pro-Prophet's Trans (all-gather) and Agg (reduce-scatter) on NCCL, fp32, placements changing per step.
    world = torch.cuda.device_count()
    flat = run_checks(balance_worker, world, args=(2 * world, "swiglu", "cuda", 1e-4), backend="nccl", timeout=600)
    assert not flat, "\n".join(flat[:15])


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_copies_in_replica_slots_compute_the_plain_layer_and_replay_as_a_graph():
    # Pro-Prophet on Comet's dropless path: Trans and Agg by address through symmetric memory, the
    # slots' rows between layer0 and layer1; fp32 against the plain layer over changing placements,
    # then bf16 captured as one CUDA graph, bitwise as the eager step.
    world = torch.cuda.device_count()
    flat = run_checks(slots_worker, world, args=(2 * world, "swiglu", False, 5, "cuda", 64, 1e-4), backend="nccl",
                      timeout=600)
    flat += run_checks(slots_graph_worker, world, backend="nccl", timeout=600)
    assert not flat, "\n".join(flat[:15])


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("capture_copies", [None, {}], ids=["captured-with-copies", "captured-with-none"])
def test_replica_slots_graph_follows_updated_placements(capture_copies):
    # graph_placement="updated": one capture (with the planner's copies placed, or none), replays
    # with placements written in place between them (the link kernels read them on the device),
    # each bitwise as the eager step's copies.
    flat = run_checks(slots_updated_graph_worker, torch.cuda.device_count(), args=(capture_copies,),
                      backend="nccl", timeout=600)
    assert not flat, "\n".join(flat[:15])


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_blockwise_balance_schedule_computes_the_plain_model_on_nccl():
    # Pro-Prophet's Trans a layer early and Agg under the preceding layer's backward, on the side
    # communicator beside the all-to-alls (NCCL), fp32, placements changing per step.
    flat = run_checks(schedule_worker, torch.cuda.device_count(), args=(4, "cuda"), backend="nccl", timeout=600)
    assert not flat, "\n".join(flat[:15])


def determinism_worker(dtypes, device, kernels: str = "auto", a2a_algo: str = "linear") -> list[str]:
    """Two forward+backward runs of the layer (kernels "auto": Triton on CUDA) on the same input give
    bitwise equal outputs and gradients, padded and dropless; the torch path's atomics do not promise it."""
    failures = []
    rank = torch.distributed.get_rank()
    for cap in (1.0, None):
        torch.manual_seed(0)
        moe = MoE(256, 512, 16, top_k=4, capacity_factor=cap, activation="gelu", dtype=dtypes[0], device=device,
                  kernels=kernels, a2a_algo=a2a_algo)
        gen = torch.Generator(device=device).manual_seed(10 + rank)
        x = torch.randn(2048, 256, device=device, dtype=dtypes[0], generator=gen)
        dy = torch.randn(2048, 256, device=device, dtype=dtypes[0], generator=gen)
        runs = []
        for _ in range(2):
            xi = x.clone().requires_grad_()
            y = moe(xi)
            y.backward(dy)
            runs.append([y.detach(), xi.grad] + [p.grad.clone() for p in moe.parameters()])
            moe.zero_grad(set_to_none=True)
        failures += differences(f"rank {rank} cf={cap}, two runs", *runs)
    return failures


def differences(label: str, actual: list[torch.Tensor], expected: list[torch.Tensor], exact: bool = True) -> list[str]:
    """One line per tensor pair that is not bitwise equal (or, `exact=False`, not within 2e-2)."""
    found = []
    for i, (a, b) in enumerate(zip(actual, expected)):
        if not (torch.equal(a, b) if exact else torch.allclose(a.float(), b.float(), atol=2e-2)):
            found.append(f"{label}: tensor {i} differs (max {float((a.float() - b.float()).abs().max()):.2e})")
    return found


@needs_cuda
def test_two_runs_are_bitwise_equal_on_nccl():
    flat = _check_on_every_gpu(determinism_worker)
    assert not flat, "\n".join(flat[:15])


@needs_cuda
def test_one_pass_routing_matches_its_reference_on_cuda():
    failures = run_distributed(one_pass_worker, 1, args=("cuda",), timeout=600)[0]
    assert not failures, "\n".join(failures)


@needs_cuda
def test_routing_kernels_match_the_reference_and_the_torch_path_on_cuda():
    """`topk_positions` (the choose and slots kernels without the one pass's outputs) and every
    gate's fused routing on one GPU, as the CPU suite checks them under the interpreter."""
    failures = run_distributed(routing_kernels_worker, 1, args=("cuda",), timeout=600)[0]
    assert not failures, "\n".join(failures)


@needs_cuda
def test_row_kernels_match_their_references_on_cuda():
    """The dispatch and combine row kernels at their default and smaller tiles on one GPU, as the
    CPU suite checks them under the interpreter."""
    failures = run_distributed(row_kernels_worker, 1, args=("cuda",), timeout=600)[0]
    assert not failures, "\n".join(failures)


@needs_cuda
def test_grouped_wgrad_matches_its_reference_on_cuda():
    """The grouped weight gradient kernel at the GPU tiles (TMA loads, persistent programs), as the
    CPU suite checks it under the interpreter."""
    failures = run_checks(grouped_wgrad_worker, 1, args=("cuda",), timeout=600)
    assert not failures, "\n".join(failures)


@needs_cuda
def test_router_matmul_matches_its_reference_on_cuda():
    """The router's product from bf16 rows at the GPU's tiles, the layer shapes among them."""
    failures = run_checks(router_matmul_worker, 1, args=("cuda",), timeout=600)
    assert not failures, "\n".join(failures)


@needs_cuda
def test_comet_kernels_match_their_references_on_cuda():
    """Both Comet kernels on one GPU, W = 1, 2, 4 ranks' buffers in one process: copy and compute
    programs really run side by side, so the flags' ordering is tested, not just the addressing."""
    flat = run_checks(kernels_worker, 1, args=("cuda",), timeout=600)
    assert not flat, "\n".join(flat[:15])


@needs_cuda
def test_comets_map_kernel_matches_its_reference_on_cuda():
    """`RowMap`'s one-launch build against its PyTorch reference on the GPU."""
    flat = run_checks(map_kernel_worker, 1, args=("cuda",), timeout=600)
    assert not flat, "\n".join(flat[:15])


@needs_cuda
@pytest.mark.parametrize("gate", GATES)
def test_comet_matches_dense_reference_on_every_gpu(gate):
    """kernels="comet" on every GPU of the machine (symmetric memory over NCCL's group; one GPU:
    the kernels on local buffers), fp32 and bf16, every capacity mode, k and activation."""
    flat = run_checks(equivalence_worker, torch.cuda.device_count(),
                      args=(gate, (torch.float32, torch.bfloat16), "cuda", "comet"), backend="nccl", timeout=600)
    assert not flat, f"{len(flat)} mismatches, first ones:\n" + "\n".join(flat[:15])


@needs_cuda
@pytest.mark.parametrize("dtype,tol,lr,reference", [(torch.float32, 1e-4, 0.5, "auto"),
                                                    (torch.bfloat16, 1e-2, 0.01, "comet")])
def test_experts_stepped_in_the_backward_match_sgd_on_every_gpu(dtype, tol, lr, reference):
    """`weft.BackwardSGD` through Comet's exchange on every GPU: the step in cuBLAS's `baddbmm_`
    (padded) and in the grouped weight-gradient kernel (dropless) gives torch SGD's weights (fp32:
    the plain layer's; bf16: Comet's own, stepped after the backward)."""
    flat = run_checks(backward_sgd_worker, torch.cuda.device_count(), args=("cuda", dtype, tol, lr, reference),
                      backend="nccl",
                      timeout=600)
    assert not flat, f"{len(flat)} mismatches, first ones:\n" + "\n".join(flat[:15])


@needs_cuda
def test_a_rank_without_rows_takes_its_step_on_cuda():
    """The plain exchange's stepped grouped products with no rows on the GPU (bf16, the grouped
    GEMM's path): no launch on empty operands, the weights decayed alone."""
    flat = run_checks(empty_rank_worker, 1, args=("cuda", torch.bfloat16), timeout=300)
    assert not flat, "\n".join(flat)


@needs_cuda
def test_comet_two_runs_are_bitwise_equal():
    flat = run_checks(determinism_worker, torch.cuda.device_count(), args=((torch.bfloat16,), "cuda", "comet"),
                      backend="nccl", timeout=600)
    assert not flat, "\n".join(flat[:15])


def graph_worker(dtypes, device, a2a_algo: str = "linear", overlap_degree: int = 1,
                 capacity_factor: float | None = 1.0, kernels_of_all: str | None = None) -> list[str]:
    """The layer's forward and backward replayed as one CUDA graph (weft.graphs.GraphedStep) give
    the eager step's outputs, input gradients and parameter gradients on new inputs (padded
    capacity, or dropless with `capacity_factor` None where the call reads nothing on the host:
    a2a_algo "dedup-fixed", Comet's, or one GPU's; token and expert
    choice; bitwise with the Triton kernels, whose results are deterministic; the torch path's
    atomics only promise rounding). A graph that accumulates adds two replays' gradients as two
    eager backwards do; one that owns its gradients holds the last replay's only, as an eager
    backward into `.grad = None` does, even after `.grad` was freed. `kernels_of_all`: every case
    with these kernels (e.g. "comet", whose dropless calls read nothing on the host)."""
    from weft.graphs import GraphedStep

    failures, rank = [], torch.distributed.get_rank()
    cases = (("topk", 1, "auto"), ("topk", 4, "auto"), ("bpr", 2, "torch"), ("expert_choice", 2, "auto"))
    if a2a_algo.startswith("dedup") or capacity_factor is None:  # token choice only
        cases = cases[:3]
    if kernels_of_all is not None:
        cases = tuple((gate, k, kernels_of_all) for gate, k, _ in cases)
    for (gate, k, kernels), accumulate in itertools.product(cases, (True, False)):
        # expert choice combines with torch's index_add; the torch path's atomics promise rounding only
        exact = kernels in ("auto", "comet") and gate != "expert_choice"
        torch.manual_seed(0)
        moe = MoE(256, 512, 16, top_k=k, gate=gate, capacity_factor=capacity_factor, activation="gelu", dtype=dtypes[0],
                  device=device, kernels=kernels, a2a_algo=a2a_algo, overlap_degree=overlap_degree)
        params = list(moe.parameters())
        gen = torch.Generator(device=device).manual_seed(10 + rank)
        xs = [torch.randn(1024, 256, device=device, dtype=dtypes[0], generator=gen) for _ in range(3)]
        dys = [torch.randn(1024, 256, device=device, dtype=dtypes[0], generator=gen) for _ in range(3)]

        def fwd_bwd(x, dy):
            y = moe(x)
            y.backward(dy)
            return y.detach()

        graphed = GraphedStep(fwd_bwd, [xs[0].clone().requires_grad_(), dys[0]], grads_of=params,
                              accumulate=accumulate)

        def eager(pairs):
            kept = [t.grad for t in params]  # the graph's (an accumulating graph adds into these very tensors)
            for t in params:
                t.grad = None
            for x, dy in pairs:
                xi = x.clone().requires_grad_()
                y = moe(xi)
                y.backward(dy)
            result = [y.detach(), xi.grad] + [p.grad.clone() for p in params]
            for t, grad in zip(params, kept):
                t.grad = grad
            return result

        def replayed(pairs):
            if accumulate:
                for t in (*params, graphed.inputs[0]):
                    t.grad.zero_()
            else:
                params[0].grad = None  # freed by a caller: the replay puts its own back
            for x, dy in pairs:
                if accumulate:
                    graphed.inputs[0].grad.zero_()
                y = graphed(x, dy)
            return [y.clone(), graphed.inputs[0].grad.clone()] + [p.grad.clone() for p in params]

        for pairs in ([(xs[1], dys[1])], [(xs[1], dys[1]), (xs[2], dys[2])]):
            expected = eager(pairs if accumulate else pairs[-1:])  # tensors: output, input grad, parameter grads
            failures += differences(f"rank {rank} {gate} k{k} {kernels} accumulate={accumulate}, {len(pairs)} step(s)",
                                    replayed(pairs), expected, exact)
    return failures


def dropless_syncs_worker(device, kernels: str = "comet", communicate: bool = True) -> list[str]:
    """A dropless call with `kernels` (forward and backward, bf16) after the first: no
    synchronisation of the stream with the host (PyTorch's sync debug mode). Comet's on 2+ GPUs;
    any on one; any not communicating (`communicate=False`, the no-comm bound) on several."""
    from test_moe_exchange import _count_syncs

    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    moe = MoE(256, 512, 16, top_k=4, capacity_factor=None, activation="gelu", dtype=torch.bfloat16, device=device,
              kernels=kernels)
    gen = torch.Generator(device=device).manual_seed(10 + rank)
    xs = [torch.randn(1024, 256, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(3)]

    def call():
        moe(xs.pop().requires_grad_(), communicate=communicate).float().square().sum().backward()

    call()  # the first: the ranks agree, layer0's copy programs timed
    call()
    syncs = _count_syncs(call)
    return [f"rank {rank}: a dropless {kernels} call synchronised {len(syncs)} times: {syncs}"] if syncs else []


@needs_cuda
def test_dropless_comet_replays_as_a_cuda_graph_and_never_synchronises():
    """kernels="comet" dropless on every GPU: the map built from the counts on the device, so no
    host synchronisation in a call, and the step captured as one CUDA graph equal (bitwise) to the
    eager step over new inputs (topk k 1 and 4, bpr k 2); the dense reference and bitwise runs are
    `-k comet_matches` and `-k comet_two_runs` (their dropless cases now take this path)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs: one rank's dropless call has no exchange")
    world = torch.cuda.device_count()
    flat = run_checks(dropless_syncs_worker, world, args=("cuda",), backend="nccl", timeout=600)
    flat += run_checks(graph_worker, world, args=((torch.bfloat16,), "cuda", "linear", 1, None, "comet"),
                       backend="nccl", timeout=600)
    assert not flat, "\n".join(flat[:15])


@needs_cuda
def test_no_comm_dropless_call_on_several_gpus_never_synchronises_and_graphs_in_the_bench(tmp_path):
    """The no-comm bound's dropless call on every GPU: nothing crosses a rank, so its grouped GEMM
    takes the groups' ends from the device (no host synchronisation in a call), and `weft bench
    layer --capacity dropless --modes no-comm,no-comm+graph` runs both rows (the graph captured)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs: one GPU's dropless calls are test_one_gpu_dropless_replays_...")
    world = torch.cuda.device_count()
    flat = run_checks(dropless_syncs_worker, world, args=("cuda", "auto", False), backend="nccl", timeout=600)
    assert not flat, "\n".join(flat[:15])
    out = tmp_path / "no_comm.json"
    cfg = layer.LayerBenchConfig("qwen2", 1024, capacity=(None,), modes=("no-comm", "no-comm+graph"), steps=3,
                                 warmup=1, json=str(out), profile_steps=0, baseline="no-comm")
    cfg.validate()
    run_distributed(layer.run, world, args=(cfg,), backend="nccl", timeout=600)
    rows = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"no-comm", "no-comm+graph"} and all(r["median_ms"] > 0 for r in rows.values()), rows


@needs_cuda
def test_one_gpu_dropless_replays_as_a_cuda_graph_and_never_synchronises():
    """Dropless on one GPU: nothing to exchange, so the grouped GEMM takes the groups' ends from the
    device: no host synchronisation in a call (Triton and torch kernels), and the step captured
    as one CUDA graph equal to the eager step over new inputs (topk k 1 and 4 bitwise, bpr k 2
    with torch's kernels)."""
    flat = []
    for kernels in ("auto", "torch"):
        flat += run_checks(dropless_syncs_worker, 1, args=("cuda", kernels), backend="nccl", timeout=600)
    flat += run_checks(graph_worker, 1, args=((torch.bfloat16,), "cuda", "linear", 1, None), backend="nccl",
                       timeout=600)
    assert not flat, "\n".join(flat[:15])


@needs_cuda
def test_a_graphed_layer_step_equals_the_eager_one_on_nccl():
    flat = _check_on_every_gpu(graph_worker)
    assert not flat, "\n".join(flat[:15])


@needs_cuda
def test_dropless_dedup_in_fixed_size_exchanges_on_nccl_matches_the_reference_and_replays_as_a_graph():
    """a2a_algo="dedup-fixed" on every GPU: the dense reference (topk, dropless and cf 1.0, k
    1/2/4, every activation, bf16: torch._grouped_mm over a buffer longer than its groups), its
    dropless step captured as one CUDA graph (nothing read on the host) and equal to the eager
    step, two runs bitwise equal."""
    world = torch.cuda.device_count()
    flat = run_checks(equivalence_worker, world,
                      args=("topk", (torch.bfloat16,), "cuda", "auto", ACTIVATIONS, "dedup-fixed"), backend="nccl",
                      timeout=600)
    flat += run_checks(graph_worker, world, args=((torch.bfloat16,), "cuda", "dedup-fixed", 1, None), backend="nccl",
                       timeout=600)
    flat += run_checks(determinism_worker, world, args=((torch.bfloat16,), "cuda", "auto", "dedup-fixed"),
                       backend="nccl", timeout=600)
    assert not flat, "\n".join(flat[:15])


@needs_cuda
def test_pipelined_dropless_dedup_in_fixed_size_exchanges_on_nccl_matches_the_reference_and_replays_as_a_graph():
    """a2a_algo="dedup-fixed" at overlap_degree 2 and 3 on every GPU: the chunks' exchanges
    launched asynchronously, one grouped weight-gradient product (torch._grouped_mm over x^T)
    per weight; the dense reference (topk, dropless, k 1/2/4, every activation, bf16) and the
    dropless step captured as one CUDA graph, equal to the eager step."""
    world = torch.cuda.device_count()
    flat = []
    for degree in (2, 3):
        flat += run_checks(equivalence_worker, world,
                           args=("topk", (torch.bfloat16,), "cuda", "auto", ACTIVATIONS, "dedup-fixed", degree),
                           backend="nccl", timeout=600)
    flat += run_checks(graph_worker, world, args=((torch.bfloat16,), "cuda", "dedup-fixed", 2, None), backend="nccl",
                       timeout=600)
    assert not flat, "\n".join(flat[:15])


@needs_cuda
def test_dropless_dedup_with_the_own_pairs_apart_on_nccl_matches_the_reference_and_replays_as_a_graph():
    """a2a_algo="dedup-fixed-own" on every GPU: the exchanges with static splits that leave the
    own block out, the own pairs' experts under the returned sums' exchange, each weight's
    gradient the own share plus the tap's; the dense reference (topk, dropless and cf 1.0, k
    1/2/4, every activation, bf16) and the dropless step captured as one CUDA graph, equal to the
    eager step, two runs bitwise equal; at overlap_degree 2 the reference and the graph."""
    world = torch.cuda.device_count()
    flat = run_checks(equivalence_worker, world,
                      args=("topk", (torch.bfloat16,), "cuda", "auto", ACTIVATIONS, "dedup-fixed-own"),
                      backend="nccl", timeout=600)
    flat += run_checks(graph_worker, world, args=((torch.bfloat16,), "cuda", "dedup-fixed-own", 1, None),
                       backend="nccl", timeout=600)
    flat += run_checks(determinism_worker, world, args=((torch.bfloat16,), "cuda", "auto", "dedup-fixed-own"),
                       backend="nccl", timeout=600)
    # the others' pairs in two chunks (their experts leaving SMs to the next chunk's exchange)
    flat += run_checks(equivalence_worker, world,
                       args=("topk", (torch.bfloat16,), "cuda", "auto", ("relu", "swiglu"), "dedup-fixed-own", 2),
                       backend="nccl", timeout=600)
    flat += run_checks(graph_worker, world, args=((torch.bfloat16,), "cuda", "dedup-fixed-own", 2, None),
                       backend="nccl", timeout=600)
    assert not flat, "\n".join(flat[:15])


@needs_cuda
def test_dedup_exchange_on_nccl_matches_the_reference_replays_as_a_graph_and_is_bitwise_reproducible():
    """a2a_algo="dedup" on every GPU: the dense reference (topk, every capacity mode, k 1/2/4, every
    activation, bf16), a CUDA graph of its padded step equal to the eager one, two runs bitwise equal;
    with overlap_degree=2, the dense reference (padded modes) and the graph."""
    world = torch.cuda.device_count()
    flat = run_checks(equivalence_worker, world, args=("topk", (torch.bfloat16,), "cuda", "auto", ACTIVATIONS, "dedup"),
                      backend="nccl", timeout=600)
    flat += run_checks(graph_worker, world, args=((torch.bfloat16,), "cuda", "dedup"), backend="nccl", timeout=600)
    flat += run_checks(determinism_worker, world, args=((torch.bfloat16,), "cuda", "auto", "dedup"), backend="nccl",
                       timeout=600)
    # overlap_degree=2: the own pairs computed while the others' rows travel in (padded modes)
    flat += run_checks(equivalence_worker, world,
                       args=("topk", (torch.bfloat16,), "cuda", "auto", ("gelu",), "dedup", 2), backend="nccl",
                       timeout=600)
    flat += run_checks(graph_worker, world, args=((torch.bfloat16,), "cuda", "dedup", 2), backend="nccl", timeout=600)
    assert not flat, "\n".join(flat[:15])


@needs_cuda
def test_the_layer_benchmark_captures_auto_at_the_candidate_whose_graph_is_fastest(tmp_path):
    """`weft bench layer --modes plain+graph,auto+graph` on every GPU: each of auto's candidates
    (degrees, dedup) captured and timed, the fastest captured again, and checked against plain."""
    out = tmp_path / "auto.json"
    cfg = layer.LayerBenchConfig("qwen2", 1024, capacity=(1.0,), modes=("plain+graph", "auto+graph"),
                                 baseline="plain+graph", steps=3, warmup=1, json=str(out), profile_steps=0)
    run_distributed(layer.run, torch.cuda.device_count(), args=(cfg,), backend="nccl", timeout=600)
    rows = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    auto = rows["auto+graph"]
    assert auto["median_ms"] > 0 and auto["max_abs_error"] < 3e-2, auto
    assert auto["tuned"] == [min(auto["candidates_ms"], key=auto["candidates_ms"].get)], auto
    assert "d2-linear" in auto["candidates_ms"] and all(map(math.isfinite, auto["candidates_ms"].values())), auto
    if torch.cuda.device_count() == 2:  # qwen2: top_k 4 x cf 1.0 > 2 ranks, so dedup is a candidate
        assert "d1-dedup" in auto["candidates_ms"], auto


@needs_cuda
def test_the_layer_benchmark_runs_dropless_auto_as_the_faster_of_its_eager_call_and_the_fixed_size_graph(tmp_path):
    """`weft bench layer --capacity dropless --modes plain,auto+graph` on every GPU: auto's eager
    call (tuned) and dedup-fixed's graphs at degrees 1 and 2 and with the own pairs apart all timed
    (and Comet's graph where the GPUs map each other's memory; on one GPU the plain call's), the
    fastest run, checked against plain."""
    out = tmp_path / "auto.json"
    cfg = layer.LayerBenchConfig("qwen2", 1024, capacity=(None,), modes=("plain", "auto+graph"), steps=3, warmup=1,
                                 json=str(out), profile_steps=0)
    run_distributed(layer.run, torch.cuda.device_count(), args=(cfg,), backend="nccl", timeout=600)
    auto = {r["mode"]: r for r in json.loads(out.read_text())["results"]}["auto+graph"]
    assert auto["median_ms"] > 0 and auto["max_abs_error"] < 3e-2, auto
    times = auto["candidates_ms"]
    fixed = ["dedup-fixed (graph)", "dedup-fixed-d2 (graph)", "dedup-fixed-own (graph)"]
    if torch.cuda.device_count() == 1:  # nothing to exchange: the plain call graphs
        assert list(times) == ["auto (eager)", "plain (graph)", *fixed], auto
    else:  # Comet's graph where the GPUs map each other's memory
        comet = ["comet (graph)"] if "comet (graph)" in times else []
        assert list(times) == ["auto (eager)", *fixed, *comet], auto
    assert all(map(math.isfinite, times.values())), auto
    assert auto["graphed"] == (min(times.values()) < times["auto (eager)"]), auto


def train_tiny(tmp_path, name: str, *args: str) -> tuple[str, list[float]]:
    """`weft train --preset tiny` for 8 steps of batch 8 on every GPU with `args`, run dir
    tmp_path / name: its stdout and the losses it logged."""
    import os
    import subprocess
    import sys

    out = tmp_path / name
    done = subprocess.run([sys.executable, "-m", "weft", "train", "--preset", "tiny", "--steps", "8", "--batch-size",
                           "8", "--device", "cuda", "--sample-tokens", "0", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "WEFT_CACHE": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return done.stdout, [r["loss"] for r in rows if "loss" in r]


@needs_cuda
def test_dropless_training_at_auto_runs_the_faster_of_eager_and_the_fixed_size_graph_with_the_plain_losses(tmp_path):
    """`weft train` of a dropless model with `--a2a-algo auto` (every GPU): on several GPUs
    `--cuda-graphs auto` times the eager step (the layers' own tuning) against the fixed-size forms
    as CUDA graphs (dedup-fixed's, and Comet's where the GPUs reach each other's memory) and says
    what it measured, and `--cuda-graphs on` runs the fastest form's graph; on one GPU, with
    nothing to exchange, both replay the plain call as a graph (it reads nothing on the host); all
    log the losses of the linear all-to-all run eagerly (to bf16 rounding: the first step's loss,
    from the same weights, to 2e-3; the dropless steps' sums in another order drift the later ones
    by a few 1e-3 on H100s)."""
    config = tmp_path / "dropless.toml"
    config.write_text('[model]\ncapacity_factor = "dropless"\n')
    losses, logs = {}, {}
    for algo, graphs in (("auto", "auto"), ("auto", "on"), ("linear", "off")):
        logs[graphs], losses[graphs] = train_tiny(tmp_path, f"{algo}-{graphs}", "--config", str(config),
                                                  "--a2a-algo", algo, "--cuda-graphs", graphs)
    if torch.cuda.device_count() == 1:  # nothing to exchange: the plain call reads nothing on the host, and graphs
        for graphs in ("auto", "on"):
            assert "replays as one CUDA graph" in logs[graphs] and "dedup-fixed" not in logs[graphs], logs[graphs]
    else:
        def runs_a_graphed_form(log: str) -> bool:
            return "runs a2a_algo=dedup-fixed" in log or "runs kernels=comet" in log

        assert "measured: eager with a2a_algo auto" in logs["auto"], logs["auto"]
        assert ("replays as one CUDA graph" in logs["auto"]) == runs_a_graphed_form(logs["auto"]), logs["auto"]
        assert runs_a_graphed_form(logs["on"]) and "replays as one CUDA graph" in logs["on"], logs["on"]
    assert len(losses["on"]) == 8
    for graphs in ("auto", "on"):
        assert losses[graphs][0] == pytest.approx(losses["off"][0], abs=2e-3), losses
        assert losses[graphs] == pytest.approx(losses["off"], abs=1e-2), losses


@needs_cuda
def test_rmsnorm_kernels_match_the_norm_and_autocasts_cast_on_cuda():
    """`weft.kernels.rmsnorm` on a GPU: the output in autocast's dtype, rounded to nearest as
    PyTorch's cast rounds (at most 2% of the bf16 outputs a unit apart), and the gradients of
    PyTorch's RMSNorm to float32 rounding, the weight's bitwise from run to run."""
    failures = run_checks(rmsnorm_worker, 1, args=("cuda",), timeout=300)
    assert not failures, "\n".join(failures)


@needs_cuda
def test_qkv_heads_write_the_projection_gradient_of_the_split_they_replace_on_cuda():
    """`weft.kernels.rotary.qkv_heads` on a GPU: the outputs and the qkv projection's gradient of
    autograd's views with the rotary kernel, bit for bit (also through attention)."""
    failures = run_checks(qkv_heads_worker, 1, args=("cuda",), timeout=300)
    assert not failures, "\n".join(failures)


@needs_cuda
@pytest.mark.parametrize("grad_accum", [1, 2])  # the graph owns the gradients / accumulates into them
def test_training_with_cuda_graphs_has_the_eager_losses(tmp_path, grad_accum):
    """`weft train --cuda-graphs on` (every GPU) logs the losses of `--cuda-graphs off`, step by step."""
    losses = {}
    for mode in ("on", "off"):
        stdout, losses[mode] = train_tiny(tmp_path, mode, "--grad-accum", str(grad_accum), "--cuda-graphs", mode)
        assert ("replays as one CUDA graph" in stdout) == (mode == "on"), stdout
    assert len(losses["on"]) == 8
    assert losses["on"] == pytest.approx(losses["off"], abs=2e-3), losses


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (data-parallel ranks to reduce over)")
def test_the_mean_reduction_on_nccl_divides_inside_the_all_reduce():
    """`mean_reduction` on NCCL (every GPU): NCCL's PREMUL_SUM, nothing left to divide; the bits
    of the sum divided after it (divisors of powers of two), also replayed from a CUDA graph."""
    flat = run_checks(mean_worker, torch.cuda.device_count(), args=("cuda",), backend="nccl", timeout=120)
    assert not flat, "\n".join(flat[:15])


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (data-parallel ranks to reduce over)")
def test_gradients_reduced_during_the_backward_train_with_the_losses_of_a_reduction_after_it(tmp_path):
    """`weft train --grad-reduce overlap` (every GPU: the replicated gradients' buckets sent
    during the backward on a communicator of their own, and with `--ep-size 1` on several GPUs
    the expert gradients' over their replicas too), eager and captured in each micro-step's CUDA
    graph, logs the losses of `--grad-reduce after` run eagerly (the same sums; 2e-3 for bf16
    kernels that need not repeat bitwise between runs); with `--grad-accum 2` the last
    micro-batch's backward (its own graph, in the first one's memory pool) sends the sums, the
    bf16 weights' float32 accumulators of the first micro-batch added in."""
    for ep, accum in (([], "1"), (["--ep-size", "1"], "1"), ([], "2"), (["--ep-size", "1"], "2")):
        losses, logs = {}, {}
        for reduce, graphs in (("overlap", "off"), ("overlap", "on"), ("after", "off")):
            logs[reduce, graphs], losses[reduce, graphs] = train_tiny(
                tmp_path, f"{reduce}-{graphs}{len(ep)}{accum}", "--grad-reduce", reduce, "--cuda-graphs", graphs,
                "--grad-accum", accum, *ep)
        several = torch.cuda.device_count() > 1
        when = "each backward" if accum == "1" else "the backward of each step's last of 2 micro-batches"
        for key, log in logs.items():
            assert (f"summed during {when}" in log) == (key[0] == "overlap" and several), log
            if ep and key[0] == "overlap" and several:
                assert "expert gradients" in log, log
        assert "replays as one CUDA graph" in logs["overlap", "on"], logs["overlap", "on"]
        assert len(losses["overlap", "on"]) == 8
        norms = {key: [json.loads(line).get("grad_norm") for line in
                       (tmp_path / f"{key[0]}-{key[1]}{len(ep)}{accum}" / "metrics.jsonl").read_text().splitlines()]
                 for key in logs}
        for key in (("overlap", "off"), ("overlap", "on")):
            assert losses[key] == pytest.approx(losses["after", "off"], abs=2e-3), (ep, accum, losses)
            # the norm sees a wrong sum (a micro-batch or a rank left out) that AdamW's update would hide
            assert [n for n in norms[key] if n is not None] == pytest.approx(
                [n for n in norms["after", "off"] if n is not None], rel=2e-2), (ep, accum, norms)


@needs_cuda
def test_tutel_training_replays_its_fastest_degree_as_cuda_graphs_with_the_plain_losses(tmp_path):
    """`weft train --overlap tutel --cuda-graphs on` (every GPU): each pipelining degree's step
    is timed as a CUDA graph, the fastest captured; the losses are those of `--overlap none` run
    eagerly (the chunked exchange computes the same function: to bf16 rounding)."""
    losses, logs = {}, {}
    for overlap, graphs in (("tutel", "on"), ("none", "off")):
        logs[overlap], losses[overlap] = train_tiny(tmp_path, overlap, "--overlap", overlap, "--cuda-graphs", graphs)
    assert "measured as CUDA graphs" in logs["tutel"] and "replays as one CUDA graph" in logs["tutel"], logs["tutel"]
    assert len(losses["tutel"]) == 8
    assert losses["tutel"] == pytest.approx(losses["none"], abs=2e-3), losses


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (an all-to-all to schedule under)")
def test_lancets_dw_schedule_replays_as_a_cuda_graph_with_the_eager_gradients():
    flat = run_checks(graphed_schedule_worker, torch.cuda.device_count(), backend="nccl", timeout=300)
    assert not flat, "\n".join(flat[:15])


@needs_cuda
def test_a_graphed_lancet_profile_captures_every_call_it_times():
    flat = run_checks(graph_profile_captures_worker, torch.cuda.device_count(), backend="nccl", timeout=300)
    assert not flat, "\n".join(flat[:15])


@needs_cuda
def test_candidates_timed_as_graphs_that_own_their_gradients():
    """`time_graphed(..., accumulate=False)`, as a graphed step with one micro-batch is timed: each
    candidate's graph writes its own gradients (no add into earlier ones), the times are finite,
    every `.grad` is None afterwards, and the memory the graphs held is released with them. The
    candidates share one capture stream: cuBLAS keeps a workspace per stream it ran on for the life
    of the process, so what stays allocated after timing three candidates is what one leaves."""
    from weft.graphs import time_graphed

    weight = torch.randn(2048, 2048, device="cuda", requires_grad=True)
    x = torch.randn(4096, 2048, device="cuda")

    def step_of(depth: int):
        def step(x_in: torch.Tensor) -> None:
            h = x_in
            for _ in range(depth):
                h = (h @ weight).relu()
            h.sum().backward()
        return step

    def left_after(candidates, accumulate: bool) -> int:
        torch.cuda.synchronize()
        torch._C._cuda_clearCublasWorkspaces()
        base = torch.cuda.memory_allocated()
        seconds = time_graphed(step_of, candidates, (x,), [weight], trials=2, accumulate=accumulate)
        assert all(0 < s < float("inf") for s in seconds), seconds
        assert weight.grad is None
        torch.cuda.synchronize()
        left = torch.cuda.memory_allocated() - base
        torch._C._cuda_clearCublasWorkspaces()
        assert torch.cuda.memory_allocated() - base < 2**20, (
            f"the graphs' memory outlived the timing: {torch.cuda.memory_allocated() - base} bytes beyond cuBLAS's "
            f"workspaces ({left} with them)")
        return left

    for accumulate in (True, False):
        one, three = left_after((1,), accumulate), left_after((1, 2, 3), accumulate)
        assert three == one, f"three candidates left {three} bytes of per-stream workspaces, one {one}"


def some_ranks_graphed_worker() -> list[str]:
    """`some_ranks_worker`'s overlapped sums with the armed backward and `finish` captured in a CUDA
    graph that owns its gradients (as `weft train` graphs a micro-step): the hosts' agreement is
    made at the capture, and every replay's `write_back` still gives rank 1 the mean."""
    from weft.distributed import build_moe_groups
    from weft.graphs import GraphedStep
    from weft.moe.grads import overlapped_reduce, reduce_gradients

    rank, world = dist.get_rank(), dist.get_world_size()
    checks = Checks(f"rank {rank}")
    model = Branchy().cuda()
    groups = build_moe_groups(ep_size=None)
    reducer = overlapped_reduce(model, groups, bucket_mb=BUCKET_MB)
    x0 = torch.arange(8.0, device="cuda")
    want = branchy_means(model, x0, world)

    def step(x: torch.Tensor) -> None:
        with reducer.armed():
            model(x).backward()
        reducer.finish()

    step(x0 + rank)  # the first armed backward builds the buckets, before any capture
    reduce_gradients(model, groups, reducer)
    model.zero_grad(set_to_none=True)
    graphed = GraphedStep(step, [x0 + rank], grads_of=list(model.parameters()), accumulate=False)
    for replay in range(2):
        graphed(x0 + rank)
        reduce_gradients(model, groups, reducer)
        torch.cuda.synchronize()
        check_branchy_means(checks, model, want, f"replay {replay}")
    return checks.failures


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (data-parallel ranks to reduce over)")
@pytest.mark.parametrize("form", ["after", "overlapped", "overlapped graphed"])
def test_a_gradient_some_gpus_lack_counts_as_zeros_there_on_nccl(form):
    """The CPU suite's check (a weight with a gradient on rank 0 only) on NCCL ranks: every GPU ends
    with the mean, the hosts agreeing over gloo, the sums over NCCL; and with the overlapped sums
    captured in the step's CUDA graph."""
    worker = (some_ranks_graphed_worker if form == "overlapped graphed"
              else functools.partial(some_ranks_worker, form == "overlapped", "cuda"))
    failures = run_checks(worker, 2, backend="nccl", timeout=300)
    assert not failures, "\n".join(failures[:10])


@needs_cuda
def test_a_graph_that_owns_its_gradients_leaves_none_where_its_backward_gives_none():
    """`GraphedStep(..., accumulate=False)` replays as an eager step into `.grad = None` does: a
    weight its backward does not reach has no gradient after a replay, even one set between
    replays (`reduce_gradients` gives such a weight zeros to sum on a rank where another rank had
    a gradient; kept, they would carry that step's mean into the next); the weight it reaches
    holds this replay's gradient."""
    from weft.graphs import GraphedStep

    used = torch.randn(64, 64, device="cuda", requires_grad=True)
    unused = torch.randn(64, device="cuda", requires_grad=True)
    x = torch.randn(32, 64, device="cuda")

    def step(x_in: torch.Tensor) -> None:
        (x_in @ used).square().sum().backward()

    graphed = GraphedStep(step, [x], grads_of=[used, unused], accumulate=False)
    for scale in (1.0, 2.0):
        unused.grad = torch.ones_like(unused)
        graphed(x * scale)
        torch.cuda.synchronize()
        assert unused.grad is None, f"replay {scale}: a gradient set between replays outlived the next one"
        want = torch.autograd.grad(((x * scale) @ used).square().sum(), used)[0]
        assert torch.allclose(used.grad, want, rtol=1e-4, atol=1e-3), f"replay {scale}: not this replay's gradient"


@needs_cuda
def test_a_profiled_call_holds_one_calls_activations():
    """Lancet's profile times `inner` back-to-back calls (eagerly and as one CUDA graph): each call's
    output, with the activations its autograd graph saved, is dropped before the next, so the peak
    is about one call's (a graphed gpt2-s-moe profile peaked at 23.3 GiB while keeping all five)."""
    from weft.overlap.profile import graph_seconds, time_call

    weight = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    x = torch.randn(8192, 1024, device="cuda")

    def forward():  # saves ~4 x 32 MiB of activations for its backward
        h = x @ weight
        return (h.relu() @ weight).relu() @ weight

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    forward()
    one = torch.cuda.max_memory_allocated() - base
    for timer in (time_call, graph_seconds):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        assert timer(forward, torch.device("cuda"), repeats=2, warmup=1, inner=5) is not None
        peak = torch.cuda.max_memory_allocated() - base
        assert peak < 2.5 * one, f"{timer.__name__}: peak {peak / 2**20:.0f} MiB for one call's {one / 2**20:.0f} MiB"


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (an all-to-all to schedule under)")
def test_lancet_training_replays_as_cuda_graphs_with_the_plain_losses(tmp_path):
    """`weft train --overlap lancet --cuda-graphs on` (every GPU): the dW schedule and the plain
    step are timed as CUDA graphs, the faster captured (the log says which and why), with bf16
    master weights as `--overlap none` (the dW schedule writes each weight's gradient once, in
    bf16); the losses are those of `--overlap none` run eagerly (bf16 GEMMs summed in another
    order: 2e-3)."""
    losses, logs = {}, {}
    for overlap, graphs in (("lancet", "on"), ("none", "off")):
        logs[overlap], losses[overlap] = train_tiny(tmp_path, overlap, "--overlap", overlap, "--cuda-graphs", graphs)
    assert "weight-gradient schedule (measured as CUDA graphs" in logs["lancet"], logs["lancet"]
    assert "replays as one CUDA graph" in logs["lancet"], logs["lancet"]
    assert "stored in bf16 with float32 masters" in logs["lancet"], logs["lancet"]
    assert len(losses["lancet"]) == 8
    assert losses["lancet"] == pytest.approx(losses["none"], abs=2e-3), losses


@needs_cuda
@pytest.mark.parametrize("schedule, p1, p2", [("none", 1, 1), ("domino", 2, 1), ("domino", 3, 1), ("domino", 2, 3),
                                              ("domino-copy", 2, 1), ("domino-copy", 2, 3)])
def test_tensor_parallel_blocks_compute_the_dense_blocks_on_nccl(schedule, p1, p2):
    """weft.tp on every GPU with NCCL (float64): Megatron's and Domino's schedules (row split,
    hybrid; domino-copy with its all-reduces copied through symmetric memory on a side stream)
    against the dense blocks, outputs and every gradient, over two SGD steps."""
    flat = run_checks(tp_worker, torch.cuda.device_count(), args=(schedule, p1, "cuda", p2), backend="nccl",
                      timeout=300)
    assert not flat, "\n".join(flat[:15])


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_the_copy_all_reduce_sums_like_nccl_on_every_gpu():
    """copy_all_reduce_ through symmetric memory on its side stream: the rank-order sum, the bits
    of NCCL's all-reduce on 2 GPUs, the same on every rank, blocking and through the handle."""
    flat = run_checks(copy_reduce_worker, torch.cuda.device_count(), args=("cuda",), backend="nccl", timeout=120)
    assert not flat, "\n".join(flat[:15])


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("schedule, capacity_factor", [("none", 1.0), ("domino", None)])
def test_tensor_parallel_moe_model_computes_expert_and_data_parallelism_on_nccl(schedule, capacity_factor):
    """An MoE GPT with its attention split over the GPUs and its experts over all of them, each
    TP rank routing its share of the tokens (NCCL, float64): plain EP + DP's losses and gradients."""
    world = torch.cuda.device_count()
    flat = run_checks(tp_moe_worker, world, args=(world, schedule, capacity_factor, "cuda"), backend="nccl",
                      timeout=300)
    assert not flat, "\n".join(flat[:15])


def tp_peers_worker(device) -> list[str]:
    """Each installed tensor-parallel peer built over every GPU, in bf16: every parameter on the GPU
    in bf16 (their norms are built on the CPU in fp32 and must be moved), forward and backward run."""
    failures = []
    world = torch.distributed.get_world_size()
    device = torch.device(device, torch.cuda.current_device())
    for name, package in (("megatron", "megatron.core"), ("deepspeed", "deepspeed")):
        if importlib.util.find_spec(package.split(".")[0]) is None:
            continue
        block, run, _ = build_tp_peer(name, 256, 8, 1024, 2, 128, 1e-5, 1e4, torch.bfloat16, device, world)
        kinds = {(p.device.type, p.dtype) for p in block.parameters()}
        if kinds != {("cuda", torch.bfloat16)}:
            failures.append(f"{name}: parameters {kinds}")
        x = torch.randn(2, 128, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
        y = run(x)
        y.float().square().mean().backward()
        finite = bool(torch.isfinite(x.grad).all())
        if y.shape != x.shape or not finite:
            failures.append(f"{name}: output {tuple(y.shape)}, input gradient finite: {finite}")
    return failures


@needs_cuda
def test_tensor_parallel_peers_run_on_every_gpu():
    if all(importlib.util.find_spec(p) is None for p in ("megatron", "deepspeed")):
        pytest.skip("no TP peer installed (bash scripts/peer_wheels.sh, then carry .whl)")
    flat = run_checks(tp_peers_worker, torch.cuda.device_count(), args=("cuda",), backend="nccl", timeout=300)
    assert not flat, "\n".join(flat)


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tensor_parallel_moe_with_pro_prophet_computes_plain_parallelism_on_nccl():
    flat = run_checks(tp_balance_worker, torch.cuda.device_count(), args=(2, "domino", "cuda"), backend="nccl",
                      timeout=600)
    assert not flat, "\n".join(flat[:15])



@needs_cuda
def test_the_adamw_pass_on_cuda_matches_the_reference_and_rounds_its_copy_to_nearest():
    from weft.kernels.adamw import AdamWHyper, adamw_step, adamw_step_reference

    gen = torch.Generator(device="cuda").manual_seed(0)
    n = 3 * 2**20 + 17
    master = torch.randn(n, device="cuda", generator=gen)
    m, v = torch.randn(n, device="cuda", generator=gen) * 0.1, torch.rand(n, device="cuda", generator=gen) * 0.01
    grad = torch.randn(n, device="cuda", generator=gen).bfloat16()
    hyper = AdamWHyper(3e-3, 0.9, 0.95, 1e-8, 0.1, 5)
    ours = [master.clone(), m.clone(), v.clone(), torch.empty(n, device="cuda", dtype=torch.bfloat16)]
    adamw_step(ours[0], grad, ours[1], ours[2], hyper, grad_scale=0.3, copy=ours[3])
    ref = [master.clone(), m.clone(), v.clone()]
    adamw_step_reference(ref[0], grad, ref[1], ref[2], hyper, grad_scale=0.3)
    for a, b in zip(ours, ref):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    assert not torch.equal(ours[0], master)
    assert torch.equal(ours[3], ours[0].bfloat16())  # the bf16 weight is the new master rounded to nearest


@needs_cuda
def test_one_adamw_launch_over_many_tensors_gives_the_bits_of_one_launch_each():
    """`adamw_steps` (the tensors' addresses and hyperparameters in a table, one launch per kind)
    against `adamw_step` for each tensor (its hyperparameters as the kernel's arguments): bitwise,
    with bf16, float16 and float32 gradients, copies, partial blocks, an empty tensor and views
    that are not 16-byte aligned (the unvectorised kind); a true skip flag writes nothing."""
    from weft.kernels.adamw import AdamWUpdate, adamw_step, adamw_steps

    for scale, skip in ((0.7, None), (torch.tensor(0.4, device="cuda"), torch.tensor(False, device="cuda")),
                        (0.5, torch.tensor(True, device="cuda"))):
        alone, together = many_tensors("cuda"), many_tensors("cuda")
        start = [case[0].clone() for case in alone]
        for master, grad, m, v, copy, hyper in alone:
            adamw_step(master, grad, m, v, hyper, grad_scale=scale, copy=copy, skip=skip)
        adamw_steps([AdamWUpdate(master, grad, m, v, hyper, copy) for master, grad, m, v, copy, hyper in together],
                    grad_scale=scale, skip=skip)
        for i, (a, b) in enumerate(zip(alone, together)):
            for name, x, y in zip(("master", "grad", "exp_avg", "exp_avg_sq", "copy"), a, b):
                assert x is None or torch.equal(x, y), (i, name, scale)
            assert torch.equal(b[0], start[i]) == (skip is not None and bool(skip) or not b[0].numel()), (i, skip)


@needs_cuda
def test_the_sum_of_squares_of_many_tensors_on_cuda_is_exact_to_float32_and_repeats_bitwise():
    """`sum_of_squares` (gradient clipping's norm; one launch per kind of tensor) on the GPU:
    within float32 rounding of the exact sum (mixed dtypes, partial blocks, unaligned views, a
    non-contiguous tensor), the same bits twice."""
    from weft.kernels.sumsq import sum_of_squares

    cases = squares_cases("cuda")
    got = sum_of_squares(cases)
    exact = sum(float(t.double().square().sum()) for t in cases)
    assert abs(float(got) - exact) <= 1e-6 * exact
    assert torch.equal(sum_of_squares(squares_cases("cuda")), got)


@needs_cuda
@pytest.mark.parametrize("graphs, gpus, accum", [("on", "0", 1), ("off", "0", 1), ("on", "all", 1), ("on", "0", 2)])
def test_master_weights_train_like_float32_weights_and_resume_exactly(tmp_path, graphs, gpus, accum):
    """`weft train --master-weights on` logs the losses of `off` to bf16 rounding, the first
    step's exactly; a run resumed from its checkpoint continues with the same losses. On one GPU
    with one micro-batch every weight's gradient goes to the optimizer directly; on all GPUs
    (expert parallel) the attention's are summed over the ranks, with --grad-accum 2 every one
    over micro-batches, in float32 accumulators."""
    if gpus == "all" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    import json
    import os
    import subprocess
    import sys

    (tmp_path / "run.toml").write_text("[train]\nckpt_interval = 4\n")

    def train(name: str, master: str, steps: int, *extra: str) -> list[float]:
        out = tmp_path / name
        done = subprocess.run([sys.executable, "-m", "weft", "train", "--preset", "tiny", "--steps", str(steps),
                               "--batch-size", "8", "--grad-accum", str(accum), "--device", "cuda",
                               "--cuda-graphs", graphs, "--master-weights", master, "--sample-tokens", "0", "--config",
                               str(tmp_path / "run.toml"), "--out", str(out), *extra],
                              capture_output=True, text=True, timeout=600,
                              env={**os.environ, "WEFT_CACHE": str(tmp_path),
                                   **({"CUDA_VISIBLE_DEVICES": gpus} if gpus != "all" else {})})
        assert done.returncode == 0, done.stderr[-2000:]
        assert ("with float32 masters" in done.stdout) == (master == "on"), done.stdout
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if "loss" in r]

    on, off = train("on", "on", 8), train("off", "off", 8)
    # the same bf16 weights at step 1; then AdamW's float32 rounding (torch's kernel and weft's
    # differ in the last bit) flips a few bf16 weights, which this small, fast-learning model
    # amplifies (one H100: 1.8e-4 at step 2, 6.6e-3 at step 7)
    assert len(on) == 8 and on[0] == off[0]
    assert on[1] == pytest.approx(off[1], abs=1e-3)
    assert on == pytest.approx(off, rel=2e-2), (on, off)
    assert on[-1] < on[0] - 0.5  # it learns
    train("resumed", "on", 4)
    resumed = train("resumed", "on", 8, "--resume")
    assert resumed[-4:] == pytest.approx(on[-4:], abs=2e-4), (resumed, on)


@needs_cuda
@pytest.mark.parametrize("preset, tp_overlap", [("tiny-dense", "domino"), ("tiny-dense", "none"), ("tiny", "domino"),
                                                ("tiny-dense", "domino-copy")])
def test_tensor_parallel_training_replays_as_cuda_graphs_with_the_eager_losses(tmp_path, preset, tp_overlap):
    """`weft train --tp 2 --cuda-graphs on` captures the TP micro-step with its all-reduces
    (Domino's asynchronous ones on their side streams included; an MoE preset's experts expert-
    parallel beside it) and logs the losses of the same run with eager steps; `--tp-overlap auto`
    times its candidates as CUDA graphs."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    import json
    import os
    import subprocess
    import sys

    def train(name: str, graphs: str, overlap: str = tp_overlap) -> tuple[list[float], str]:
        out = tmp_path / name
        done = subprocess.run([sys.executable, "-m", "weft", "train", "--preset", preset, "--steps", "6",
                               "--batch-size", "4", "--device", "cuda", "--tp", "2", "--tp-overlap", overlap,
                               "--cuda-graphs", graphs, "--sample-tokens", "0", "--out", str(out)],
                              capture_output=True, text=True, timeout=600,
                              env={**os.environ, "WEFT_CACHE": str(tmp_path)})
        assert done.returncode == 0, done.stderr[-2000:]
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if "loss" in r], done.stdout

    graphed, log = train("graphed", "on")
    assert "replays as one CUDA graph" in log, log
    eager, _ = train("eager", "off")
    assert len(graphed) == 6 and graphed == pytest.approx(eager, rel=2e-3), (graphed, eager)
    if tp_overlap == "domino" and preset == "tiny-dense":
        _, log = train("auto", "auto", "auto")
        assert "--tp-overlap auto runs" in log and "measured as CUDA graphs" in log, log


@needs_cuda
def test_host_values_reach_the_gpu_without_waiting_for_queued_kernels():
    """`weft.hostcopy.device_tensor` (the grouped GEMM's offsets, Pro-Prophet's indices) returns
    while a long kernel is still running, where `torch.tensor(..., device="cuda")` waits for it."""
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time at ~2 GHz
    got = device_tensor([5, 1, 2], "cuda")
    still_running = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert still_running, "device_tensor waited for the queued kernel"
    assert torch.equal(got.cpu(), torch.tensor([5, 1, 2]))
    assert torch.equal(offsets([5, 1, 2], "cuda").cpu(), torch.tensor([5, 6, 8], dtype=torch.int32))


@needs_cuda
def test_a_step_s_metrics_are_read_without_waiting_for_the_next_step():
    """`host_tensor_async` (the training loop's metrics of step N, read after step N + 1 is
    launched) is ready once the work before it has run, while a long kernel queued after it is
    still running; a `.cpu()` at read time would have waited for that kernel."""
    values = torch.arange(6, dtype=torch.float32, device="cuda") * 2
    torch.cuda.synchronize()
    host, ready = host_tensor_async(values)
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time: the next step
    ready.synchronize()
    still_running = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert still_running, "the read waited for the kernel queued after the copy"
    assert host.device.type == "cpu" and host.is_pinned() and torch.equal(host, values.cpu())


@needs_cuda
def test_a_checkpoint_s_host_stage_copies_into_page_locked_memory_without_waiting():
    """`HostStage` (a background checkpoint's snapshot) copies into page-locked memory; a round
    that reuses the memory of the one before queues each copy on the stream, so `copy` returns
    while a long kernel queued before it still runs; the copies hold the values once the stream
    has run."""
    stage = HostStage()
    sources = [torch.randn(3 << 20, device="cuda"), torch.arange(10, device="cuda")]
    pointers = []
    for scale in (1, 3):
        scaled = [s * scale for s in sources]
        stage.begin()
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU time
        copies = [stage.copy(s.untyped_storage()) for s in scaled]
        still_running = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        assert still_running or scale == 1, "the stage's copy into reused memory waited for the queued kernel"
        assert stage.pinned_bytes == stage.staged_bytes == sum(s.untyped_storage().nbytes() for s in sources), (
            stage.pinned_bytes, stage.staged_bytes)
        for source, copy in zip(scaled, copies):
            host = torch.empty(0, dtype=source.dtype).set_(copy, 0, source.shape, source.stride())
            assert torch.equal(host, source.cpu())
        pointers.append([c.data_ptr() for c in copies])
    assert pointers[0] == pointers[1]


@needs_cuda
def test_a_dropless_call_synchronises_once_on_nccl():
    """Plain, tuned ("auto") and Pro-Prophet's balanced dropless calls, forward and backward, on
    every GPU: one synchronisation each (every rank's counts to the host), by PyTorch's sync debug
    mode."""
    failures = run_checks(reads_worker, torch.cuda.device_count(), args=("cuda",), backend="nccl", timeout=600)
    assert not failures, "\n".join(failures[:10])
