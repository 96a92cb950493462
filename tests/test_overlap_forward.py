"""Lancet's partitioned forward pass computes the unpartitioned model: same logits, losses,
gradients and dropped slots, for every gate it allows, on 1, 2 and 4 gloo ranks."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from weft.models import GPT, GPTConfig
from weft.overlap.forward import PartitionedRunner, Range, check_range
from weft.testing import run_checks

BATCH, SEQ = 5, 8

# (gate, top_k, capacity_factor): forced drops (cf 0.5), no-drop modes, dropless.
CASES = [
    ("topk", 1, 0.5), ("topk", 2, 0.5), ("topk", 2, None), ("topk", 2, 0), ("topk", 1, -0.5),
    ("bpr", 2, 0.5), ("expert_choice", 2, 0.5), ("random", 1, 0.75), ("cosine", 2, None),
]


def _config(gate: str, top_k: int, cf) -> GPTConfig:
    return GPTConfig(vocab_size=64, block_size=SEQ, n_layer=4, n_head=2, dim=16, moe_every=2, num_experts=8,
                     top_k=top_k, gate=gate, capacity_factor=cf, aux_loss_coef=0.1, z_loss_coef=0.01)


def _step(model: GPT, idx, targets, ranges, seed: int):
    model.zero_grad(set_to_none=True)
    model.unit_runner = PartitionedRunner(tuple(ranges)) if ranges else None
    torch.manual_seed(seed)  # the random gate draws from torch's RNG
    logits, loss = model(idx, targets)
    loss.backward()
    stats = [(m.stats.dropped.item(), m.stats.expert_counts.tolist(), m.stats.capacity) for m in model.moe_layers()]
    aux = [(m.aux_loss.item(), m.z_loss.item()) for m in model.moe_layers()]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), loss.item(), grads, stats, aux


def _ranges_for(model: GPT) -> list[list[Range]]:
    """Post-only ranges for every gate; ranges starting before the MoE unit where allowed."""
    choices = [
        [Range(3, 3, 2, 3)],  # the MoE layer alone, two partitions
        [Range(3, 5, 3, 3), Range(7, 7, 2, 7)],  # MoE + the next block's attention and MLP
    ]
    units = model.units((None, None))
    try:
        check_range(units, Range(2, 4, 2, 3))
        choices += [[Range(2, 4, 2, 3), Range(5, 7, 5, 7)], [Range(0, 3, 4, 3)]]
    except ValueError:
        pass
    return choices


def forward_worker() -> list[str]:
    rank = dist.get_rank()
    failures = []
    for gate, top_k, cf in CASES:
        torch.manual_seed(0)
        model = GPT(_config(gate, top_k, cf), group=dist.group.WORLD)
        gen = torch.Generator().manual_seed(100 + rank)
        idx = torch.randint(0, 64, (BATCH, SEQ), generator=gen)
        targets = torch.randint(0, 64, (BATCH, SEQ), generator=gen)
        ref = _step(model, idx, targets, [], seed=7)
        if cf == 0.5 and gate != "expert_choice" and sum(s[0] for s in ref[3]) == 0:
            failures.append(f"rank {rank} {gate}: the reference dropped nothing; the case proves nothing")
        for ranges in _ranges_for(model):
            got = _step(model, idx, targets, ranges, seed=7)
            spans = [(r.start, r.end, r.partitions) for r in ranges]
            label = f"rank {rank} gate={gate} k={top_k} cf={cf} ranges={spans}"
            failures += _compare(label, got, ref)
    return failures


def _compare(label: str, got, ref) -> list[str]:
    out = []
    if not torch.allclose(got[0], ref[0], rtol=1e-4, atol=1e-5):
        out.append(f"{label}: logits differ by {(got[0] - ref[0]).abs().max():.2e}")
    if abs(got[1] - ref[1]) > 1e-5 * max(1.0, abs(ref[1])):
        out.append(f"{label}: loss {got[1]} != {ref[1]}")
    if got[3] != ref[3]:
        out.append(f"{label}: routing stats (dropped, counts, capacity) {got[3]} != {ref[3]}")
    for (a, z), (ra, rz) in zip(got[4], ref[4]):
        if abs(a - ra) > 1e-5 * max(1, abs(ra)) or abs(z - rz) > 1e-5 * max(1, abs(rz)):
            out.append(f"{label}: aux/z loss {(a, z)} != {(ra, rz)}")
    if set(got[2]) != set(ref[2]):
        out.append(f"{label}: parameters with gradients differ: {sorted(set(got[2]) ^ set(ref[2]))}")
    for name in ref[2]:
        if name in got[2] and not torch.allclose(got[2][name], ref[2][name], rtol=1e-4, atol=1e-6):
            out.append(f"{label}: grad {name} differs by {(got[2][name] - ref[2][name]).abs().max():.2e}")
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_partitioned_forward_equals_unpartitioned(world_size):
    failures = run_checks(forward_worker, world_size, timeout=300)
    assert not failures, "\n".join(failures[:12])


def test_ranges_that_would_change_routing_are_refused():
    model = GPT(_config("bpr", 2, 0.5))
    units = model.units((None, None))
    with pytest.raises(ValueError, match="only ops after it"):
        check_range(units, Range(2, 3, 2, 3))
    with pytest.raises(ValueError, match="more than one MoE"):
        check_range(units, Range(3, 7, 2, 3))
    with pytest.raises(ValueError, match="not an MoE layer"):
        check_range(units, Range(0, 2, 2, 1))
    topk2 = GPT(_config("topk", 2, 1.0))  # top-2 with drops: the second choices rank after all first ones
    with pytest.raises(ValueError, match="only ops after it"):
        check_range(topk2.units((None, None)), Range(2, 3, 2, 3))
