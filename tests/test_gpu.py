"""GPU checks (run on a lent GPU machine: scripts/gpu_check.sh): the CPU equivalence suite
again on NCCL with bfloat16, on every GPU of the machine."""
from __future__ import annotations

import pytest
import torch

from test_moe_equivalence import GATES, equivalence_worker
from test_moe_pipeline import dropless_worker, pipeline_worker
from weft.testing import run_distributed

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs")


@needs_cuda
@pytest.mark.parametrize("gate", GATES)
def test_matches_dense_reference_on_nccl_bf16(gate):
    world = torch.cuda.device_count()
    failures = run_distributed(
        equivalence_worker, world, args=(gate, (torch.bfloat16,), "cuda"), backend="nccl", timeout=600
    )
    flat = [f for rank_failures in failures for f in rank_failures]
    assert not flat, f"{len(flat)} mismatches, first ones:\n" + "\n".join(flat[:15])


@needs_cuda
def test_pipelined_exchange_matches_degree_one_on_nccl():
    failures = run_distributed(pipeline_worker, torch.cuda.device_count(), args=((torch.bfloat16,), "cuda"),
                               backend="nccl", timeout=600)
    flat = [f for rank_failures in failures for f in rank_failures]
    assert not flat, "\n".join(flat[:15])


@needs_cuda
def test_dropless_pipelining_matches_degree_one_on_nccl():
    failures = run_distributed(dropless_worker, torch.cuda.device_count(), args=((torch.bfloat16,), "cuda"),
                               backend="nccl", timeout=600)
    flat = [f for rank_failures in failures for f in rank_failures]
    assert not flat, "\n".join(flat[:15])
