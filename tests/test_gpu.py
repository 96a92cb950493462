"""GPU checks (run on a lent GPU machine: scripts/gpu_check.sh): the CPU equivalence tests of
the layer and of both pipelined exchanges again on NCCL with bfloat16, and Lancet's two passes
in training (fp32), on every GPU."""
from __future__ import annotations

import pytest
import torch

from test_moe_equivalence import GATES, equivalence_worker
from test_moe_pipeline import dropless_worker, pipeline_worker
from test_overlap_passes import both_passes_worker
from weft.testing import run_checks

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
def test_pipelined_exchange_matches_degree_one_on_nccl():
    flat = _check_on_every_gpu(pipeline_worker)
    assert not flat, "\n".join(flat[:15])


@needs_cuda
def test_dropless_pipelining_matches_degree_one_on_nccl():
    flat = _check_on_every_gpu(dropless_worker)
    assert not flat, "\n".join(flat[:15])


@needs_cuda
@pytest.mark.parametrize("budget", [1.0, 1e-7])
def test_lancet_passes_train_like_the_plain_model_on_nccl(budget):
    flat = run_checks(both_passes_worker, torch.cuda.device_count(), args=(budget, "cuda"), backend="nccl",
                      timeout=600)
    assert not flat, "\n".join(flat[:15])
