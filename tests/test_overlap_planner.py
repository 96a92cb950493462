"""Lancet's forward partition planner: the fig. 9 pipeline simulator on hand-computed cases, and the
5.1 dynamic programme against a brute force over every segmentation and every k per segment."""
from __future__ import annotations

import itertools
import json
import math
import random

import pytest

from weft.overlap import planner
from weft.overlap.planner import (
    ComputeUnit,
    MoEUnit,
    Plan,
    plan,
    simulate,
    simulate_timeline,
)


def compute(name: str, **times: float) -> ComputeUnit:
    """compute("c", k1=2.0, k2=1.0) -> ComputeUnit("c", {1: 2.0, 2: 1.0})."""
    return ComputeUnit(name, {int(k[1:]): t for k, t in times.items()})


def moe(name: str, stages: dict[int, tuple[float, float, float, float]], before: bool = True) -> MoEUnit:
    """stages: k -> (gate, dispatch, experts, combine) seconds per partition."""
    return MoEUnit(name, *({k: s[j] for k, s in stages.items()} for j in range(4)), partition_before=before)


# --- simulator ------------------------------------------------------------------------------------

def test_k1_is_the_serial_sum():
    units = [compute("a", k1=1.0), moe("m", {1: (2.0, 3.0, 4.0, 5.0)}), compute("b", k1=6.0)]
    assert simulate(units, 1) == 21.0
    assert simulate([moe("m", {1: (2.0, 3.0, 4.0, 5.0)})], 1) == 14.0
    assert simulate([compute("a", k1=1.5), compute("b", k1=2.5)], 1) == 4.0


def test_k2_comm_bound():
    # Per partition: S1 = pre 1 + gate 1 = 2, S2 = 3, S3 = 1, S4 = 3, S5 = 1.
    # compute: S1 p0 0-2, p1 2-4 | S3 p0 max(5,4)=5-6, p1 max(8,6)=8-9 | S5 p0 max(11,9)=11-12,
    #          p1 max(14,12)=14-15
    # comm:    S2 p0 2-5, p1 5-8 | S4 p0 max(6,8)=8-11, p1 max(9,11)=11-14          -> P = 15
    units = [compute("a", k1=9.0, k2=1.0), moe("m", {1: (9, 9, 9, 9), 2: (1.0, 3.0, 1.0, 3.0)}),
             compute("b", k1=9.0, k2=1.0)]
    assert simulate(units, 2) == 15.0
    got = {(iv.stage, iv.partition): (iv.start, iv.end) for iv in simulate_timeline(units, 2)}
    assert got == {("pre", 0): (0, 2), ("pre", 1): (2, 4), ("dispatch", 0): (2, 5), ("dispatch", 1): (5, 8),
                   ("experts", 0): (5, 6), ("experts", 1): (8, 9), ("combine", 0): (8, 11),
                   ("combine", 1): (11, 14), ("post", 0): (11, 12), ("post", 1): (14, 15)}


def test_the_overlap_costs_what_the_measured_efficiency_does_not_save():
    # test_k2_comm_bound's timeline: 5 s of computation beside communication (pre p1 under dispatch
    # p0: 2, then the experts and post partitions: 1 each), 15 s to the end.
    units = [compute("a", k1=9.0, k2=1.0), moe("m", {1: (9, 9, 9, 9), 2: (1.0, 3.0, 1.0, 3.0)}),
             compute("b", k1=9.0, k2=1.0)]
    assert planner.overlap_seconds(simulate_timeline(units, 2)) == 5.0
    assert simulate(units, 2, efficiency=0.5) == 15.0 + 2.5
    assert simulate(units, 2, efficiency=0.0) == 20.0  # every instruction one after another
    assert simulate(units, 1, efficiency=0.0) == simulate(units, 1)  # nothing overlaps unpartitioned
    # Splitting evenly gains only by overlapping: with no efficiency, the plan keeps k = 1.
    m = moe("m", {1: (2.0, 6.0, 2.0, 6.0), 2: (1.0, 3.0, 1.0, 3.0)})
    assert simulate([m], 2) == 13.0 and simulate([m], 2, efficiency=0.0) == simulate([m], 1) == 16.0
    assert [s.partitions for s in plan([m], max_partitions=2).segments] == [2]
    assert [s.partitions for s in plan([m], max_partitions=2, efficiency=0.0).segments] == [1]
    with pytest.raises(ValueError, match="efficiency must be in"):
        simulate([m], 2, efficiency=1.5)


def test_k2_compute_bound():
    # Per partition: S1 = 3 + 1 = 4, S2 = 1, S3 = 4, S4 = 1, S5 = 4.
    # compute: S1 0-4, 4-8 | S3 p0 max(5,8)=8-12, p1 max(9,12)=12-16 | S5 p0 max(13,16)=16-20, p1 20-24
    # comm:    S2 4-5, 8-9 | S4 p0 max(12,9)=12-13, p1 max(16,13)=16-17 -> P = 24 = all compute,
    # the communication is hidden entirely.
    units = [compute("a", k1=9.0, k2=3.0), moe("m", {1: (9, 9, 9, 9), 2: (1.0, 1.0, 4.0, 1.0)}),
             compute("b", k1=9.0, k2=4.0)]
    assert simulate(units, 2) == 24.0


def test_k3_without_pre_or_post_is_tutel_overlap():
    # Only the MoE unit (as in Tutel): S1 = gate 1, S2 = 2, S3 = 2, S4 = 2, S5 = 0, k = 3.
    # compute S1: 0-1, 1-2, 2-3; comm S2: 1-3, 3-5, 5-7; compute S3: 3-5, 5-7, 7-9;
    # comm S4: max(5,7)=7-9, max(7,9)=9-11, max(9,11)=11-13; S5 zero-length, ends 13 -> P = 13.
    assert simulate([moe("m", {1: (1, 1, 1, 1), 3: (1.0, 2.0, 2.0, 2.0)})], 3) == 13.0


def test_chunked_exchange_is_tutels_pipeline_with_the_weight_gradients_after_it():
    # degree 1: send 0-3, compute 3-5, receive 5-8; the tail starts after the compute (5-9)
    assert planner.chunked_exchange(3.0, 2.0, 3.0, 1) == 8.0
    assert planner.chunked_exchange(3.0, 2.0, 3.0, 1, tail=4.0) == 9.0
    # nothing saved where they overlap (efficiency 0): every instruction one after another
    assert planner.chunked_exchange(3.0, 2.0, 3.0, 1, tail=4.0, efficiency=0.0) == 12.0
    # degree 2, each chunk's send, compute and receive 1 s, tail 1.5 s:
    # comm: send 0-1, 1-2 | receive max(2, 2)=2-3, max(3, 3)=3-4
    # compute: chunk 0 1-2 (beside send 1), chunk 1 2-3 (beside receive 0) | tail 3-4.5 (beside receive 1)
    assert planner.chunked_exchange(1.0, 1.0, 1.0, 2, tail=1.5) == 4.5
    assert planner.chunked_exchange(1.0, 1.0, 1.0, 2, tail=1.5, efficiency=0.5) == 4.5 + 0.5 * 3.0
    assert planner.chunked_exchange(1.0, 1.0, 1.0, 2, tail=1.5, efficiency=0.0) == 2 * 3.0 + 1.5
    # compute-bound chunks hide the exchanges but the first send and the last receive
    assert planner.chunked_exchange(0.5, 2.0, 0.5, 4) == 0.5 + 4 * 2.0 + 0.5
    for bad, match in (({"efficiency": 1.5}, "efficiency must be in"), ({"tail": -1.0}, "tail must be"),
                       ({"tail": math.inf}, "tail must be")):
        with pytest.raises(ValueError, match=match):
            planner.chunked_exchange(1.0, 1.0, 1.0, 2, **bad)


def random_units(rng: random.Random, n: int, n_moe: int, max_k: int) -> list:
    """A random cost table: times on a quarter grid (ties happen), some k >= 2 missing."""
    def table() -> dict[int, float]:
        base = rng.choice([0.25, 0.5, 1.0, 2.0, 3.0])
        return {k: round(base / k * rng.choice([1.0, 1.25, 1.5, 2.0]) * 4) / 4
                for k in range(1, max_k + 1) if k == 1 or rng.random() > 0.2}

    moes = set(rng.sample(range(n), n_moe))
    return [MoEUnit(f"m{i}", table(), table(), table(), table(), partition_before=rng.random() < 0.7)
            if i in moes else ComputeUnit(f"c{i}", table()) for i in range(n)]


@pytest.mark.parametrize("seed", range(30))
def test_timeline_streams_never_overlap_and_stages_stay_in_order(seed):
    rng = random.Random(seed)
    units = random_units(rng, rng.randint(1, 5), 1, 4)
    ks = [k for k in range(1, 5) if planner._invalid(units, k) is None]
    for k in ks:
        timeline = simulate_timeline(units, k)
        assert len(timeline) == 5 * k
        for stream, order in (("compute", ["pre", "experts", "post"]), ("comm", ["dispatch", "combine"])):
            ivs = [iv for iv in timeline if iv.stream == stream]
            # issue order of fig. 9: stage by stage, partitions in index order
            assert [(iv.stage, iv.partition) for iv in ivs] == [(s, p) for s in order for p in range(k)]
            for a, b in itertools.pairwise(ivs):
                assert a.end <= b.start
        for p in range(k):
            stages = {iv.stage: iv for iv in timeline if iv.partition == p}
            names = ["pre", "dispatch", "experts", "combine", "post"]
            for a, b in itertools.pairwise(names):
                assert stages[a].end <= stages[b].start
        assert simulate(units, k) == max(iv.end for iv in timeline)
        # pipelining never loses against running the k partitions one after another
        assert simulate(units, k) <= k * sum(iv.end - iv.start for iv in timeline if iv.partition == 0) + 1e-9


@pytest.mark.parametrize("units, k, match", [
    ([], 1, "empty"),
    ([moe("a", {1: (1, 1, 1, 1)}), moe("b", {1: (1, 1, 1, 1)})], 1, "exactly one MoE"),
    ([compute("c", k1=1, k2=1), moe("a", {1: (1, 1, 1, 1), 2: (1, 1, 1, 1)}, before=False)], 2,
     "partition_before=False"),
    ([compute("c", k1=1), moe("a", {1: (1, 1, 1, 1)}, before=False)], 1, "partition_before=False"),
    ([compute("c", k1=1, k2=1)], 2, "without an MoE unit"),
    ([compute("c", k1=1), moe("a", {1: (1, 1, 1, 1), 2: (1, 1, 1, 1)})], 2, "k=2.*c"),
    ([moe("a", {1: (1, 1, 1, 1), 2: (1, 1, 1, 1)})], 0, ">= 1"),
])
def test_simulate_rejects_invalid_ranges(units, k, match):
    with pytest.raises(ValueError, match=match):
        simulate(units, k)


def test_moe_k_needs_all_four_stages():
    m = MoEUnit("m", {1: 1, 2: 1}, {1: 1, 2: 1}, {1: 1}, {1: 1, 2: 1}, partition_before=True)
    with pytest.raises(ValueError, match="k=2"):
        simulate([m], 2)


# --- dynamic programme ----------------------------------------------------------------------------

def brute_force(units: list, max_k: int, max_range: int | None, starts: list[int] | None = None) -> float:
    """Min total time over every segmentation (cuts only at `starts` if given) and every k per segment;
    a (segment, k) is allowed iff simulate accepts it. max_range counts items of `starts`."""
    n = len(units)
    starts = list(range(n)) if starts is None else starts
    best = math.inf
    for mask in itertools.product([False, True], repeat=len(starts) - 1):
        cuts = [0] + [s for s, cut in zip(starts[1:], mask) if cut] + [n]
        options = []
        for a, b in itertools.pairwise(cuts):
            if max_range is not None and sum(a <= s < b for s in starts) > max_range:
                break
            times = []
            for k in range(1, max_k + 1):
                try:
                    times.append(simulate(units[a:b], k))
                except ValueError:
                    pass
            if not times:
                break
            options.append(times)
        else:
            for combo in itertools.product(*options):
                best = min(best, sum(combo))
    return best


def check_cover(result: Plan, units: list, max_k: int, max_range: int | None, starts: list[int]) -> None:
    segs = result.segments
    assert segs[0].start == 0 and segs[-1].end == len(units) - 1
    for a, b in itertools.pairwise(segs):
        assert b.start == a.end + 1
    for s in segs:
        assert s.start in starts and 1 <= s.partitions <= max_k
        if max_range is not None:
            assert sum(s.start <= g <= s.end for g in starts) <= max_range
        rng = units[s.start:s.end + 1]
        moes = [i for i in range(s.start, s.end + 1) if isinstance(units[i], MoEUnit)]
        assert s.moe == (moes[0] if moes else None)
        assert s.time == pytest.approx(simulate(rng, s.partitions))
        assert s.serial == pytest.approx(simulate(rng, 1))
    assert sum(s.time for s in segs) == pytest.approx(result.predicted)
    assert result.unpartitioned == pytest.approx(sum(simulate([u], 1) for u in units))


@pytest.mark.parametrize("seed", range(60))
@pytest.mark.parametrize("max_range", [None, 1, 2, 3])
def test_dp_equals_brute_force(seed, max_range):
    rng = random.Random(seed)
    n = rng.randint(1, 7)
    n_moe = rng.randint(1, min(3, n))
    max_k = rng.randint(1, 4)
    units = random_units(rng, n, n_moe, max_k)
    result = plan(units, max_partitions=max_k, max_range=max_range)
    assert result.predicted == pytest.approx(brute_force(units, max_k, max_range))
    check_cover(result, units, max_k, max_range, list(range(n)))
    assert result.predicted <= result.unpartitioned + 1e-9


def reference_group_starts(units: list, group_time: float) -> list[int]:
    """First unit of each group: compute units gather until their k=1 time reaches group_time."""
    starts, acc = [], None
    for i, u in enumerate(units):
        if isinstance(u, MoEUnit):
            starts.append(i)
            acc = None
            continue
        if acc is None:
            starts.append(i)
            acc = 0.0
        acc += u.time[1]
        if acc >= group_time:
            acc = None
    return starts


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("max_range", [None, 2])
def test_grouping_matches_brute_force_over_group_aligned_cuts(seed, max_range):
    rng = random.Random(1000 + seed)
    n = rng.randint(2, 7)
    max_k = rng.randint(2, 4)
    units = random_units(rng, n, rng.randint(1, min(3, n)), max_k)
    group_time = rng.choice([1.0, 2.0, 4.0, 8.0])
    starts = reference_group_starts(units, group_time)
    grouped = plan(units, max_partitions=max_k, max_range=max_range, group_time=group_time)
    assert grouped.predicted == pytest.approx(brute_force(units, max_k, max_range, starts))
    check_cover(grouped, units, max_k, max_range, starts)
    free = plan(units, max_partitions=max_k)   # grouping only restricts the choices
    assert grouped.predicted >= free.predicted - 1e-9


def test_grouping_by_hand_reports_original_indices():
    # group_time 2: [c0 c1] (1+1), [c2] (3), [m3], [c4 c5 c6] (0.5+0.5 < 2, +2 -> 3)
    units = [compute(f"c{i}", k1=t, k2=t / 2) for i, t in enumerate([1.0, 1.0, 3.0])]
    units += [moe("m3", {1: (0.5, 4.0, 1.0, 4.0), 2: (0.25, 2.0, 0.5, 2.0)})]
    units += [compute(f"c{i}", k1=t, k2=t / 2) for i, t in zip([4, 5, 6], [0.5, 0.5, 2.0])]
    assert reference_group_starts(units, 2.0) == [0, 2, 3, 4]
    result = plan(units, max_partitions=2, group_time=2.0)
    assert all(s.start in (0, 2, 3, 4) for s in result.segments)
    (pipe,) = result.pipelines()
    assert pipe.moe == 3 and pipe.partitions == 2
    assert pipe.end in (3, 6)   # a range ends at a group's last unit
    assert result.segments[-1].end == 6
    # one group per range: the segments are exactly the groups
    one = plan(units, max_partitions=2, max_range=1, group_time=2.0)
    assert [(s.start, s.end) for s in one.segments] == [(0, 1), (2, 2), (3, 3), (4, 6)]


def test_batch_dependent_gate_pipelines_only_after_the_moe():
    units = [compute("attn", k1=4.0, k2=2.0), moe("bpr", {1: (1.0, 4.0, 2.0, 4.0), 2: (0.5, 2.0, 1.0, 2.0)},
             before=False), compute("next", k1=4.0, k2=2.0)]
    (pipe,) = plan(units, max_partitions=2).pipelines()
    assert pipe.start == 1 and pipe.end == 2 and pipe.partitions == 2
    switch = [units[0], moe("switch", {1: (1.0, 4.0, 2.0, 4.0), 2: (0.5, 2.0, 1.0, 2.0)}), units[2]]
    (pipe,) = plan(switch, max_partitions=2).pipelines()
    assert pipe.start == 0 and pipe.end == 2


def test_ties_prefer_fewer_partitions_then_shorter_ranges():
    # k=1: 1 + 0 + 1 + 0 = 2; k=2: S1 0-.5, .5-1, S3 1-1.5, 1.5-2, comm is free -> also 2.
    m = moe("m", {1: (1.0, 0.0, 1.0, 0.0), 2: (0.5, 0.0, 0.5, 0.0)})
    assert simulate([m], 2) == simulate([m], 1) == 2.0
    result = plan([m], max_partitions=2)
    assert [s.partitions for s in result.segments] == [1]
    assert result.pipelines() == result.segments   # an MoE unit left unpartitioned is still listed
    # [c][m] and [c m] both take 3 at k=1: the last range is the shorter one.
    result = plan([compute("c", k1=1.0), m], max_partitions=1)
    assert [(s.start, s.end) for s in result.segments] == [(0, 0), (1, 1)]
    # A tie up to rounding is a tie: 0.1 + (0.1+0.1+0.1+0.3) != (0.1+0.1)+0.1+0.1+0.3 in floats.
    c, m = compute("c", k1=0.1), moe("m", {1: (0.1, 0.1, 0.1, 0.3)})
    assert simulate([c, m], 1) < c.time[1] + simulate([m], 1)
    result = plan([c, m], max_partitions=1)
    assert [(s.start, s.end) for s in result.segments] == [(0, 0), (1, 1)]
    # Fewer partitions beats the shorter range. [c m] at k=2: S1 = 1 + 0.5, S2 = 2, S3 = 2, S4 = 0.5:
    # S1 0-1.5, 1.5-3; S2 1.5-3.5, 3.5-5.5; S3 3.5-5.5, 5.5-7.5; S4 5.5-6, 7.5-8 -> 8.
    # [c] + [m] at k=4: S1 = 1, S2 = 1, S3 = S4 = 0.25: S1 ends 1,2,3,4; S2 ends 2,3,4,5;
    # S3 4-4.25, 4.25-4.5, 4.5-4.75, 5-5.25; S4 5-5.25, ..., 5.75-6 -> 2 + 6 = 8 as well.
    c = compute("c", k1=2.0, k2=1.0, k4=2.0)
    m = moe("m", {1: (1.0, 4.0, 2.0, 4.0), 2: (0.5, 2.0, 2.0, 0.5), 4: (1.0, 1.0, 0.25, 0.25)})
    assert simulate([c, m], 2) == c.time[1] + simulate([m], 4) == 8.0
    result = plan([c, m], max_partitions=4)
    assert result.predicted == 8.0
    assert [(s.start, s.end, s.partitions) for s in result.segments] == [(0, 1, 2)]


def test_dp_evaluates_at_most_n_squared_k_ranges_and_stops_at_a_second_moe(monkeypatch):
    ranges, calls = [], []
    real_invalid, real_simulate = planner._invalid, planner.simulate
    monkeypatch.setattr(planner, "_invalid", lambda units, k: ranges.append(units) or real_invalid(units, k))
    monkeypatch.setattr(planner, "simulate",
                        lambda units, k, efficiency=1.0: calls.append(k) or real_simulate(units, k, efficiency))
    units = random_units(random.Random(7), 40, 8, 4)
    plan(units, max_partitions=4)
    assert 0 < len(calls) <= 40 * 41 // 2 * 4
    # Lancet 5.1 keeps the DP cheap: a range that already holds two MoE units is never grown further.
    assert all(sum(isinstance(u, MoEUnit) for u in r) <= 1 for r in ranges)


@pytest.mark.parametrize("make, match", [
    (lambda: plan([]), "at least one unit"),
    (lambda: plan([compute("c", k2=1.0)]), "k=1"),
    (lambda: plan([moe("m", {2: (1, 1, 1, 1)})]), "k=1"),
    (lambda: plan([compute("c", k1=1.0)], max_partitions=0), "max_partitions"),
    (lambda: plan([compute("c", k1=1.0)], max_range=0), "max_range"),
    (lambda: plan([compute("c", k1=1.0)], group_time=0.0), "group_time"),
    (lambda: ComputeUnit("c", {}), "no times"),
    (lambda: ComputeUnit("c", {0: 1.0}), "k >= 1"),
    (lambda: ComputeUnit("c", {1: -1.0}), "finite"),
    (lambda: ComputeUnit("c", {1: math.nan}), "finite"),
    (lambda: MoEUnit("m", {1: 1}, {}, {1: 1}, {1: 1}, partition_before=True), "dispatch has no times"),
])
def test_invalid_input_is_rejected(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# --- reporting ------------------------------------------------------------------------------------

def two_layer_model() -> list:
    """Two (attention, MoE) layers and a head, in seconds, comm-heavy enough to pipeline."""
    def layer(i: int) -> list:
        return [compute(f"attn{i}", k1=2.0e-3, k2=1.1e-3, k4=0.6e-3),
                moe(f"moe{i}", {1: (0.4e-3, 3.0e-3, 2.0e-3, 3.0e-3), 2: (0.2e-3, 1.6e-3, 1.0e-3, 1.6e-3),
                                4: (0.1e-3, 0.9e-3, 0.5e-3, 0.9e-3)})]
    return layer(0) + layer(1) + [compute("head", k1=1.0e-3, k2=0.55e-3, k4=0.3e-3)]


def test_summary_names_each_moe_unit_and_its_k():
    result = plan(two_layer_model(), max_partitions=4)
    text = result.summary()
    pipes = result.pipelines()
    assert [s.moe for s in pipes] == [1, 3]
    for s in pipes:
        (row,) = [line.split() for line in text.splitlines() if line.startswith(f"moe{s.moe // 2} ")]
        assert row[1] == f"{result.names[s.start]}..{result.names[s.end]}"
        assert row[2] == str(s.partitions) and s.partitions > 1
        assert float(row[3]) == pytest.approx(s.time * 1e3, abs=1e-3)
        assert float(row[4]) == pytest.approx(s.serial * 1e3, abs=1e-3)
    gain = 100 * (1 - result.predicted / result.unpartitioned)
    assert gain > 0
    assert text.splitlines()[-1].endswith(f"gain {gain:.1f}%")
    assert "L1" in result.summary(names=[f"L{i}" for i in range(5)])


def test_plan_round_trips_through_json():
    result = plan(two_layer_model(), max_partitions=4, group_time=1.0)
    back = Plan.from_dict(json.loads(json.dumps(result.to_dict())))
    assert back == result and back.summary() == result.summary()
    with pytest.raises(ValueError, match="format"):
        Plan.from_dict({**result.to_dict(), "format": "something else"})
