"""Slot positions under the priority rule (weft.moe.capacity): the counting path (running counts
over a one-hot, token order) and the sort path give the same positions, counts and order, and
both match the rule written out as a loop."""
from __future__ import annotations

import pytest
import torch

from weft.moe import capacity


def _by_loop(experts: torch.Tensor, num_experts: int):
    """The rule itself: j-major, then token order; a slot's position counts the earlier slots of its expert."""
    num_tokens, k = experts.shape
    seen = [0] * num_experts
    positions = torch.zeros(num_tokens, k, dtype=torch.long)
    for j in range(k):
        for t in range(num_tokens):
            e = int(experts[t, j])
            positions[t, j] = seen[e]
            seen[e] += 1
    return positions, torch.tensor(seen)


@pytest.mark.parametrize("num_tokens, k, num_experts",
                         [(0, 2, 4), (1, 1, 1), (16, 2, 8), (37, 3, 5), (200, 4, 64), (300, 1, 16)])
def test_counting_and_sorting_give_the_rule(num_tokens, k, num_experts, monkeypatch):
    gen = torch.Generator().manual_seed(num_tokens)
    experts = torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(num_tokens)]) \
        if num_tokens else torch.zeros(0, k, dtype=torch.long)
    want_positions, want_counts = _by_loop(experts, num_experts)
    counted = capacity._counted_positions(experts, num_experts, True)  # the layer counts for k = 1 only
    monkeypatch.setattr(capacity, "COUNTING_LIMIT", -1)  # force the sort path
    sorted_ = capacity.slot_positions(experts, num_experts)
    for got in (counted, sorted_):
        assert torch.equal(got.positions, want_positions)
        assert torch.equal(got.counts, want_counts)
        # sort_index lists slot ids grouped by expert, in position order
        slots = got.sort_index
        assert torch.equal(experts.reshape(-1)[slots], torch.sort(experts.reshape(-1), stable=True).values)
        assert torch.equal(got.positions.reshape(-1)[slots],
                           torch.cat([torch.arange(int(c)) for c in want_counts]).long())
    assert torch.equal(counted.sort_index, sorted_.sort_index)


def test_without_the_sort_index_the_counting_path_skips_it():
    experts = torch.tensor([[0, 1], [1, 0], [0, 2]])
    got = capacity._counted_positions(experts, 3, with_sort_index=False)
    assert got.sort_index is None
    assert got.positions.tolist() == [[0, 1], [0, 2], [1, 0]]  # j = 0 first: t0, t1, t2; then j = 1
