"""Specification of weft.balance: Pro-Prophet's load history, performance model (eqs. 1-8) and
greedy placement search (Alg. 1)."""
from __future__ import annotations

import pytest
import torch

from weft.balance import (
    ExpertBalancer,
    LayerCostModel,
    LoadHistory,
    Placement,
    greedy_placement,
    is_balanced,
    loads,
)
from weft.balance.planner import host_slot_rows

# 4 devices, 8 experts, two per device: expert e lives on device e // 2.
OWNERS = (0, 0, 1, 1, 2, 2, 3, 3)


def model(**overrides) -> LayerCostModel:
    """Round numbers: 1000 bytes/s, 10 rows/s, 1-byte rows, 100-byte experts."""
    values = dict(num_devices=4, bandwidth=1000.0, throughput=10.0, row_bytes=1.0, expert_param_bytes=100.0,
                  expert_grad_bytes=100.0)
    return LayerCostModel(**{**values, **overrides})


def skewed_tokens() -> torch.Tensor:
    """Every device sends 10 slots to each expert, and 90 more to expert 0 (a hot expert on device 0)."""
    tokens = torch.full((4, 8), 10.0)
    tokens[:, 0] += 90
    return tokens


def test_loads_follow_the_placement():
    tokens = torch.arange(32, dtype=torch.float64).view(4, 8)
    h, r = loads(tokens, Placement(OWNERS))
    owner_sum = torch.stack([tokens[:, 2 * d:2 * d + 2].sum() for d in range(4)])
    assert torch.equal(h, owner_sum)
    own = torch.stack([tokens[d, 2 * d:2 * d + 2].sum() for d in range(4)])
    assert torch.equal(r, owner_sum - own)
    # a copy of expert 0 on devices 1 and 3: their tokens for expert 0 stay home
    h2, r2 = loads(tokens, Placement(OWNERS, {0: frozenset({1, 3})}))
    moved = tokens[1, 0] + tokens[3, 0]
    assert h2[0] == h[0] - moved and h2[1] == h[1] + tokens[1, 0] and h2[3] == h[3] + tokens[3, 0]
    assert r2[0] == r[0] - moved and r2[1] == r[1] and r2[2] == r[2]
    assert h2.sum() == h.sum()  # every slot is computed exactly once


def test_an_owner_cannot_hold_a_copy_of_its_own_expert():
    with pytest.raises(ValueError, match="expert 2: its owner 1"):
        Placement(OWNERS, {2: frozenset({1})})


def test_the_performance_model_is_eqs_1_to_8():
    m = model(forward_non_moe_s=0.5, backward_non_moe_s=0.5)
    h = torch.tensor([40.0, 20.0, 10.0, 10.0])
    r = torch.tensor([30.0, 5.0, 0.0, 0.0])
    assert m.all_to_all_s(r) == pytest.approx(30 / 1000)  # eq. 1
    assert m.forward_experts_s(h) == pytest.approx(4.0)  # eq. 2
    assert m.backward_experts_s(h) == pytest.approx(8.0)  # eq. 3
    assert m.trans_s(2, 1) == pytest.approx(2 * 3 * 100 / (4 * 1000))  # eq. 4
    assert m.agg_s(2, 1) == pytest.approx(2 * 3 * 100 / (4 * 1000))  # eq. 5
    unscheduled = 4 * 0.03 + 4.0 + 8.0 + 0.15 + 0.15  # eq. 6
    assert m.layer_s(r, h, 2, 1, scheduled=False) == pytest.approx(unscheduled)
    assert m.layer_s(r, h, 2, 1) == pytest.approx(4 * 0.03 + 12.0)  # eq. 8: both hidden
    slow = model(expert_param_bytes=1e5, expert_grad_bytes=1e5)  # Trans 150 s: 146 of it exposed
    assert slow.layer_s(r, h, 2, 1) == pytest.approx(4 * 0.03 + 12.0 + (150 - 4.0) + (150 - 8.0))
    # the measured overhead per copied expert (beyond the paper's model) is paid in both forms
    dear = model(forward_non_moe_s=0.5, backward_non_moe_s=0.5, copy_overhead_s=0.25)
    assert dear.layer_s(r, h, 2, 1, scheduled=False) == pytest.approx(unscheduled + 0.5)
    assert dear.layer_s(r, h, 2, 1) == pytest.approx(4 * 0.03 + 12.0 + 0.5)
    assert dear.layer_s(r, h, 0, 1) == m.layer_s(r, h, 0, 1)  # nothing copied: nothing added


def test_eq_2_weighs_own_and_copied_rows_by_their_measured_scales():
    tokens = skewed_tokens()
    placement = Placement(OWNERS, {0: frozenset({1, 3})})
    slot = host_slot_rows(tokens.tolist(), placement)
    assert slot == [0.0, 100.0, 0.0, 100.0]  # each holder computes its own 100 slots of expert 0
    h, _ = loads(tokens, placement)  # [240, 180, 80, 180]: devices 1 and 3 compute 80 own rows each
    assert model().forward_experts_s(h, slot) == model().forward_experts_s(h) == pytest.approx(24.0)  # the paper's
    # own rows at 0.5, copied rows at 1.5: device 0 240 * 0.5 = 120, devices 1 and 3 80 * 0.5 + 100 * 1.5 = 190
    scaled = model(expert_scale=0.5, slot_scale=1.5)
    assert scaled.forward_experts_s(h, slot) == pytest.approx(19.0)
    assert scaled.backward_experts_s(h, slot) == pytest.approx(38.0)
    assert scaled.forward_experts_s(h) == pytest.approx(12.0)  # without slot rows every row is the owner's


def test_greedy_keeps_copies_whose_rows_cost_more_where_they_land():
    # copying expert 0 cuts device 0 from 440 to 140 rows and gives the others 100 copied rows each:
    # at twice eq. 2's rate for copied rows, 80 own + 200 = 280 (less than 440), at five times 580
    assert greedy_placement(skewed_tokens(), OWNERS, model(slot_scale=2.0), n=1, alpha=0.5).placement.replicated == [0]
    plan = greedy_placement(skewed_tokens(), OWNERS, model(slot_scale=5.0), n=1, alpha=0.5)
    assert plan.placement.replicated == [] and plan.predicted_s == plan.plain_s


def test_balance_condition_is_eq_7():
    assert is_balanced(torch.tensor([10.0, 12.0]), total_inputs=40, num_experts=4, alpha=0.5)  # 2 < 5
    assert not is_balanced(torch.tensor([10.0, 16.0]), total_inputs=40, num_experts=4, alpha=0.5)


def test_greedy_copies_the_hot_expert_where_its_tokens_are():
    plan = greedy_placement(skewed_tokens(), OWNERS, model(), n=1, alpha=0.5)
    assert plan.placement.replicated == [0]
    assert plan.placement.copies[0] == frozenset({1, 2, 3})  # n = 1: every device but the owner
    h, _ = loads(skewed_tokens(), plan.placement)
    # device 0 keeps its own 100 slots of expert 0 and all 40 of expert 1; the others add their own 100
    assert torch.equal(h, torch.tensor([140.0, 180.0, 180.0, 180.0], dtype=torch.float64))
    assert plan.predicted_s < plan.plain_s
    # the busiest device over the mean, plain (440 of 680 / 4) and placed (180 of 680 / 4)
    assert plan.plain_rank_load == pytest.approx(440 / 170) and plan.rank_load == pytest.approx(180 / 170)
    # n = 3: only the one device sending the most inputs for the expert gets a copy
    tokens = skewed_tokens()
    tokens[2, 0] += 50
    plan3 = greedy_placement(tokens, OWNERS, model(), n=3, alpha=0.5)
    assert plan3.placement.copies[0] == frozenset({2})


def test_greedy_keeps_the_plain_placement_when_moving_weights_costs_more():
    huge = model(expert_param_bytes=1e9, expert_grad_bytes=1e9)  # Trans/Agg far above what they save
    plan = greedy_placement(skewed_tokens(), OWNERS, huge, n=1, alpha=0.5)
    assert plan.placement.replicated == [] and plan.predicted_s == plan.plain_s
    assert plan.rank_load == plan.plain_rank_load == pytest.approx(440 / 170)  # the copies it tried are not kept
    balanced = torch.full((4, 8), 10.0)
    assert greedy_placement(balanced, OWNERS, model(), n=1).placement.replicated == []


def test_greedy_copies_only_where_the_gain_beats_the_measured_overhead():
    # the hot expert's copy cuts the busiest device from 440 to 180 rows: 78 s of expert time
    assert greedy_placement(skewed_tokens(), OWNERS, model(copy_overhead_s=1.0), n=1, alpha=0.5
                            ).placement.replicated == [0]
    plan = greedy_placement(skewed_tokens(), OWNERS, model(copy_overhead_s=100.0), n=1, alpha=0.5)
    assert plan.placement.replicated == [] and plan.predicted_s == plan.plain_s


def test_a_call_that_copies_its_experts_itself_is_planned_with_trans_and_agg_exposed():
    # Trans and Agg 75 s each: hidden behind 100 s of non-MoE work when launched ahead (eq. 8),
    # more than the copy saves (78 s) when the call waits for them (eq. 6)
    cost = model(expert_param_bytes=1e5, expert_grad_bytes=1e5, forward_non_moe_s=100.0, backward_non_moe_s=100.0)
    balancer = ExpertBalancer(8, 4, cost, alpha=0.5)
    assert balancer.next_copies() == {} and balancer.last_plan is None  # no load recorded yet
    balancer.record(skewed_tokens().long().tolist())
    assert balancer.next_copies(scheduled=False) == {}
    assert balancer.last_plan.predicted_s == balancer.last_plan.plain_s
    assert balancer.next_copies() == {0: frozenset({1, 2, 3})}
    assert balancer.last_copied == [0]
    balancer.record(torch.full((4, 8), 10).tolist())  # a balanced load: both plans made again
    assert balancer.next_copies() == {} and balancer.next_copies(scheduled=False) == {}


def test_greedy_keeps_only_the_best_prefix_of_copies():
    # Two hot experts on different devices: loads (440, 320, 80, 80); copying expert 0 everywhere
    # gives (140, 420, 180, 180), then expert 2 (210, 210, 250, 250): balanced for alpha 0.5 (40 < 57.5).
    tokens = torch.full((4, 8), 10.0)
    tokens[:, 0] += 90
    tokens[:, 2] += 60
    plan = greedy_placement(tokens, OWNERS, model(), n=1, alpha=0.5)
    assert plan.placement.replicated == [0, 2]
    # The search can pass its best placement: with expert 0 very hot and expert 2 a little, the
    # copies made are 0, 2, 4, 6 with max loads 438, 412, 422, 392 (from 1280). With Trans and Agg
    # exposed (eq. 6) at 15 s per copy only the first pays; at 0.15 s per copy all four do.
    tokens = torch.full((4, 8), 10.0)
    tokens[:, 0] += 300
    tokens[:, 2] += 12
    dear, cheap = model(expert_param_bytes=1e4, expert_grad_bytes=1e4), model()
    def copied(m):
        return greedy_placement(tokens, OWNERS, m, n=1, alpha=0.01, scheduled=False).placement.replicated

    assert copied(dear) == [0] and copied(cheap) == [0, 2, 4, 6]


def test_more_rounds_let_a_hot_device_give_away_several_experts():
    """On 2 devices whose first holds both hot experts, Alg. 1 (rounds=1) copies one of them and
    stops when device 0 comes up again; rounds=2 copies the second too, where the model says it
    pays, and evens the loads out further. Hand-computed rows: with expert 0 copied, device 0 its
    own 80 of experts 0 and 1 and device 1's 30 of expert 1 (110), device 1 its own 50 of expert 0
    and both devices' 20 of experts 2 and 3 (70); with both copied, 80 and 100."""
    owners = (0, 0, 1, 1)
    tokens = torch.tensor([[50.0, 30.0, 5.0, 5.0], [50.0, 30.0, 5.0, 5.0]])
    two = model(num_devices=2)
    one_round = greedy_placement(tokens, owners, two, n=1, alpha=0.5)
    assert one_round.placement.replicated == [0]  # device 1's 50 rows of expert 0 stay there
    assert loads(tokens, one_round.placement)[0].tolist() == [110.0, 70.0]
    two_rounds = greedy_placement(tokens, owners, two, n=1, alpha=0.5, rounds=2)
    assert two_rounds.placement.replicated == [0, 1]
    assert loads(tokens, two_rounds.placement)[0].tolist() == [80.0, 100.0]
    assert two_rounds.predicted_s < one_round.predicted_s and two_rounds.rank_load < one_round.rank_load
    with pytest.raises(ValueError, match="rounds must be a positive int"):
        greedy_placement(tokens, owners, two, rounds=0)
    with pytest.raises(ValueError, match="balance rounds must be a positive int"):
        ExpertBalancer(4, 2, two, rounds=0)


def test_greedy_checks_its_inputs():
    with pytest.raises(ValueError, match="n must be in \\[1, 3\\]"):
        greedy_placement(skewed_tokens(), OWNERS, model(), n=0)
    with pytest.raises(ValueError, match="one device in \\[0, 4\\) per expert"):
        greedy_placement(skewed_tokens(), OWNERS[:-1], model())


def test_load_history_predicts_the_mean_of_its_window():
    history = LoadHistory(window=2)
    with pytest.raises(ValueError, match="no load recorded"):
        history.predict()
    for value in (1.0, 3.0, 5.0):
        history.record(torch.full((2, 3), value))
    assert len(history) == 2
    assert torch.equal(history.predict(), torch.full((2, 3), 4.0, dtype=torch.float64))  # the last two
    with pytest.raises(ValueError, match="shape \\(3, 3\\) after \\(2, 3\\)"):
        history.record(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="window must be >= 1"):
        LoadHistory(window=0)
