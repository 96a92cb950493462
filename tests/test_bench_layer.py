"""`weft bench layer` end to end on 2 gloo ranks: every mode, both capacity regimes, JSON."""
from __future__ import annotations

import dataclasses
import json
import math
import re
import time

import pytest
import torch

from weft import MoE
from weft.bench import layer, timing
from weft.bench.layer import LayerBenchConfig
from weft.graphs import live_gradient_accumulators
from weft.testing import Checks, DistributedTestError, run_checks, run_distributed
from weft.tune import run_until_tuned


def test_tiny_layer_benchmark_writes_well_formed_json(tmp_path):
    out = tmp_path / "tiny.json"
    cfg = LayerBenchConfig("tiny", 64, capacity=(1.0, None), activation="swiglu", steps=3, warmup=1, json=str(out),
                           modes=("plain", "no-comm", "megatron"))
    run_distributed(layer.run, 2, args=(cfg,), timeout=300)
    report = json.loads(out.read_text())
    assert report["meta"]["world_size"] == 2 and report["meta"]["tokens_per_rank"] == 64
    rows = report["results"]
    assert [(r["capacity_factor"], r["mode"]) for r in rows] == [
        (1.0, "plain"), (1.0, "no-comm"), (1.0, "megatron"), (None, "plain"), (None, "no-comm"), (None, "megatron")]
    for r in rows:
        if r["mode"] == "megatron":  # not installed here: reported, not fatal
            assert r["median_ms"] is None and r["error"]
            continue
        assert r["median_ms"] > 0 and r["ratio"] == pytest.approx(r["median_ms"] / next(
            b["median_ms"] for b in rows if b["mode"] == "plain" and b["capacity_factor"] == r["capacity_factor"]))
        assert r["max_abs_error"] == (0.0 if r["mode"] == "plain" else None)
        assert r["min_ms"] <= r["median_ms"] and r["iqr_ms"] >= 0
        assert "decomposition" not in r  # the profiler decomposition is GPU-only


def test_a_capacity_whose_every_mode_fails_is_reported_not_fatal(tmp_path):
    """Every mode of a capacity unavailable (a peer that is not installed; a dropless comet+graph
    where the counts cannot stay on the GPUs, as on one GPU or here): the rows say why, and the
    run goes on to the next capacity."""
    out = tmp_path / "none.json"
    cfg = LayerBenchConfig("tiny", 32, capacity=(None, 1.0), steps=2, warmup=1, json=str(out),
                           modes=("megatron", "comet+graph"), baseline="megatron")
    run_distributed(layer.run, 1, args=(cfg,), timeout=300)
    rows = json.loads(out.read_text())["results"]
    assert [(r["capacity_factor"], r["mode"], r["median_ms"]) for r in rows] == [
        (None, "megatron", None), (None, "comet+graph", None), (1.0, "megatron", None), (1.0, "comet+graph", None)]
    assert all("megatron.core is not installed" in r["error"] for r in rows if r["mode"] == "megatron")
    assert "a dropless comet call is a CUDA graph only on 2+ CUDA ranks" in rows[1]["error"]


def test_unknown_mode_is_refused():
    with pytest.raises(DistributedTestError, match=r"unknown modes \['fastest'\]"):
        run_distributed(layer.run, 1, args=(LayerBenchConfig("tiny", 16, capacity=(1.0,), modes=("fastest",)),))


def test_modes_are_checked_before_the_timed_optimizer_steps(tmp_path):
    out = tmp_path / "sgd.json"
    cfg = LayerBenchConfig("tiny", 64, capacity=(1.0,), steps=3, warmup=1, json=str(out),
                           modes=("plain", "d2", "d4", "2dh", "r0", "auto"), optimizer="sgd")
    run_distributed(layer.run, 2, args=(cfg,), timeout=300)
    rows = json.loads(out.read_text())["results"]
    assert [r["mode"] for r in rows] == ["plain", "d2", "d4", "2dh", "r0", "auto"]
    assert all(r["max_abs_error"] < 1e-5 for r in rows)
    # auto is timed once tuning has decided, and says what it chose (one node: linear only)
    assert len(rows[-1]["tuned"]) == 1 and re.fullmatch(r"d[1248]-linear(-r0)?", rows[-1]["tuned"][0])


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_the_timed_optimizer_steps_leave_the_checked_weights(name):
    """The optimizer's kernels run in every timed step, at learning rate 0: at 1e-6 SGD's router
    updates moved a skewed routing within the timing (docs/benchmarks.md, thirty-seventh session)."""
    weight = torch.nn.Parameter(torch.ones(8))
    weight.grad = torch.full((8,), 1e3)
    opt = layer._optimizer(name, [weight])
    opt.step()
    assert torch.equal(weight.detach(), torch.ones(8))
    if name == "adamw":  # its moments were updated: the step ran
        assert torch.equal(opt.state[weight]["exp_avg"], torch.full((8,), 100.0))
    assert layer._optimizer("none", [weight]) is None


def test_the_balanced_twin_shares_the_layers_tuning():
    """Comet's copy programs, picked per shape by timing, are the plain layer's in the balanced
    twin: one tuning dictionary, so that the two are timed with the same kernels."""
    moe = MoE(32, 64, 4, 2, capacity_factor=None)
    twin = layer.balanced_twin(moe, None, torch.randn(16, 32), copy_overhead=False)
    assert twin.tuning is moe.tuning and twin is not moe and twin.balancer is not None
    assert all(torch.equal(a, b) for a, b in zip(twin.state_dict().values(), moe.state_dict().values()))


def test_fewer_experts_than_ranks_times_every_r(tmp_path):
    out = tmp_path / "sliced.json"
    cfg = LayerBenchConfig("tiny", 32, num_experts=2, capacity=(1.0, None), activation="swiglu", steps=2, warmup=1,
                           json=str(out), modes=("plain", "r0", "r1", "r2", "r4", "auto", "d2"))
    run_distributed(layer.run, 4, args=(cfg,), timeout=300)
    report = json.loads(out.read_text())
    assert report["meta"]["num_experts"] == 2
    rows = {(r["capacity_factor"], r["mode"]): r for r in report["results"]}
    for cf in (1.0, None):
        for mode in ("plain", "r0", "r1", "r2", "auto"):
            assert rows[cf, mode]["median_ms"] > 0 and rows[cf, mode]["max_abs_error"] < 1e-5, (cf, mode)
        # 2 ranks per expert: r = 4 is not a divisor
        assert "r = 4 needs a divisor" in rows[cf, "r4"]["error"]
    # sharded experts pipeline in padded modes; dropless runs degree 1 there
    assert rows[1.0, "d2"]["median_ms"] > 0 and rows[1.0, "d2"]["max_abs_error"] < 1e-5
    assert "needs a padded capacity mode" in rows[None, "d2"]["error"]


def test_interleaved_timing_switches_before_every_step_and_rotates():
    log = []
    runs = [timing.Run(lambda m=m: log.append(("switch", m)), lambda r, m=m: log.append(("step", m, r)))
            for m in "abc"]
    times = timing.interleaved_ms(runs, steps=3, warmup=1, device=torch.device("cpu"))
    assert times.shape == (3, 1, 3) and bool((times >= 0).all())
    steps = [entry for entry in log if entry[0] == "step"]
    assert [m for _, m, _ in steps] == list("abc" "bca" "cab" "abc")  # the start rotates every round
    assert all(log[2 * i] == ("switch", step[1]) for i, step in enumerate(steps))  # each step right after its switch


def test_sequential_timing_runs_each_mode_in_turn_and_keeps_the_last_steps():
    """Tutel's protocol: every step of a mode before the next mode's, the warm-up steps left out."""
    log = []

    def step(mode: str, seconds: float, s: int) -> None:
        log.append((mode, s))
        time.sleep(0.08 if s < 2 else seconds)  # the two warm-up steps are the slowest

    runs = [timing.Run(lambda m=m: log.append(("switch", m)), lambda s, m=m, t=t: step(m, t, s))
            for m, t in (("a", 0.0), ("b", 0.03))]
    rounds = []
    times = timing.sequential_ms(runs, steps=3, warmup=2, device=torch.device("cpu"),
                                 progress=lambda *a: rounds.append(a))
    assert log == [("switch", "a"), *(("a", s) for s in range(5)), ("switch", "b"), *(("b", s) for s in range(5))]
    assert times.shape == (2, 1, 3) and rounds == [(1, 2), (2, 2)]
    assert bool((times[0] < 30).all()) and bool((times[1] >= 30).all()) and bool((times < 80).all()), times


def test_back_to_back_timing_runs_each_mode_in_turn_and_times_each_step():
    """Steps launched one after another: each run's steps in a row, each step's time its own (the
    marks between steps), the warm-up steps left out."""
    log = []

    def step(mode: str, seconds: float, s: int) -> None:
        log.append((mode, s))
        time.sleep(0.08 if s < 2 else seconds)

    runs = [timing.Run(lambda m=m: log.append(("switch", m)), lambda s, m=m, t=t: step(m, t, s))
            for m, t in (("a", 0.0), ("b", 0.03))]
    times = timing.back_to_back_ms(runs, steps=3, warmup=2, device=torch.device("cpu"))
    assert log == [("switch", "a"), *(("a", s) for s in range(5)), ("switch", "b"), *(("b", s) for s in range(5))]
    assert times.shape == (2, 1, 3)
    assert bool((times[0] < 30).all()) and bool((times[1] >= 30).all()) and bool((times < 80).all()), times


def rank_0_times_worker() -> list[str]:
    """Every rank gets rank 0's step times (Tutel prints rank 0's), here the faster rank's."""
    rank = torch.distributed.get_rank()
    checks = Checks(f"rank {rank}")
    runs = [timing.Run(lambda: None, lambda s: time.sleep(0.005 if rank == 0 else 0.06))]
    times = timing.sequential_ms(runs, steps=2, warmup=1, device=torch.device("cpu"))
    checks.expect(times.shape == (1, 1, 2) and bool((times < 50).all()) and bool((times >= 5).all()),
                  f"not rank 0's times: {times.flatten().tolist()}")
    return checks.failures


def test_sequential_timing_reports_rank_0s_times_on_every_rank():
    assert run_checks(rank_0_times_worker, 2, timeout=120) == []


@pytest.mark.parametrize("protocol", ["sequential", "back-to-back"])
def test_the_layer_bench_times_in_other_protocols(tmp_path, protocol):
    out = tmp_path / "timed.json"
    cfg = LayerBenchConfig("tiny", 64, capacity=(1.0,), steps=3, warmup=2, json=str(out), modes=("plain", "no-comm"),
                           timing=protocol)
    run_distributed(layer.run, 2, args=(cfg,), timeout=300)
    report = json.loads(out.read_text())
    assert report["meta"]["timing"] == protocol
    for r in report["results"]:
        assert 0 < r["min_ms"] <= r["median_ms"] and r["mean_ms"] >= r["min_ms"], r


def test_progress_lines_come_from_rank_0_with_seconds_rounds_and_an_eta(capsys):
    rounds = []
    runs = [timing.Run(lambda: None, lambda r: None) for _ in "ab"]
    timing.interleaved_ms(runs, steps=3, warmup=1, device=torch.device("cpu"), progress=lambda *a: rounds.append(a))
    assert rounds == [(1, 4), (2, 4), (3, 4), (4, 4)]
    log = timing.ProgressLog("model", rank=0, every_s=3600.0)
    log.phase("lancet configured")
    for done in range(1, 5):
        log.round(done, 4)
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"weft bench model: lancet configured \(\d+\.\d s\)", lines[0]), lines
    # the first round and the last; the ones between fall within every_s
    assert len(lines) == 3 and lines[1].startswith("weft bench model: round 1/4 (") and "ETA" in lines[1], lines
    assert lines[2].startswith("weft bench model: round 4/4 (") and lines[2].endswith("ETA 0m00s)"), lines
    quiet = timing.ProgressLog("model", rank=1, every_s=0.0)
    quiet.phase("lancet configured")
    quiet.round(4, 4)
    assert capsys.readouterr().out == ""


def test_run_until_tuned_stops_when_nothing_is_measured_and_refuses_endless_tuning():
    count = [0]
    calls = []

    def step(i):
        calls.append(i)
        count[0] += 1 if len(calls) < 4 else 0

    assert run_until_tuned(step, lambda: count[0], torch.device("cpu")) == 4
    assert calls == [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match="still measuring after 5 steps"):
        run_until_tuned(lambda i: count.__setitem__(0, count[0] + 1), lambda: count[0], torch.device("cpu"),
                               max_steps=5)


def test_zipf_shift_is_the_logit_bias_of_a_fixed_random_ranking():
    weight = torch.randn(8, 32, generator=torch.Generator().manual_seed(3))
    shift = layer.zipf_shift(weight, 1.5)
    bias = (weight.double() @ shift.double())
    ranks = torch.exp(-bias / 1.5)  # back to the ranks 1..8
    assert torch.allclose(ranks, ranks.round(), atol=1e-6)
    assert sorted(ranks.round().long().tolist()) == list(range(1, 9))
    assert torch.equal(layer.zipf_shift(weight, 1.5), shift)  # the same on every rank and call
    assert torch.count_nonzero(layer.zipf_shift(weight, 0.0)) == 0


def test_load_imbalance_per_expert_and_per_rank():
    counts = torch.tensor([6, 2, 0, 0])  # one process, no group: the counts are the totals
    assert layer.load_imbalance(counts, 2) == (3.0, 2.0)  # the ranks hold 8 and 0 rows: max 8, mean 4
    assert layer.load_imbalance(counts, 1) == (3.0, 1.0)
    # 2 experts over 4 ranks: each of an expert's ranks computes all its rows
    assert layer.load_imbalance(torch.tensor([3, 1]), 4) == (1.5, 1.5)


def test_skew_makes_the_expert_load_uneven(tmp_path):
    loads = {}
    for skew in (0.0, 1.5):
        out = tmp_path / f"skew{skew}.json"
        cfg = LayerBenchConfig("tiny", 256, capacity=(None,), steps=2, warmup=1, json=str(out), skew=skew)
        run_distributed(layer.run, 2, args=(cfg,), timeout=300)
        report = json.loads(out.read_text())
        assert report["meta"]["skew"] == skew
        plain = next(r for r in report["results"] if r["mode"] == "plain")
        assert plain["max_abs_error"] == 0.0
        loads[skew] = plain["expert_load_max_over_mean"], plain["rank_load_max_over_mean"]
    assert loads[0.0][0] < 1.5 < 2.5 < loads[1.5][0]  # 8 experts, top-2: Zipf(1.5) puts ~3x the mean on the hottest
    # the ranks' loads are sums of 4 experts' each: less uneven than the experts', more than without skew
    assert 1.0 <= loads[0.0][1] < loads[1.5][1] < loads[1.5][0]


def test_balance_mode_runs_the_replicated_experts_on_dropless_layers(tmp_path, capsys):
    out = tmp_path / "balance.json"
    # 4 experts, top-1, Zipf(2): the hottest expert takes ~3x its share and its rank ~all the rows.
    # Planned with the paper's model alone: on the CPU a copy of these tiny experts costs more than it
    # saves, and the measured overhead (the default) rightly keeps them home (the next test).
    cfg = LayerBenchConfig("tiny", 256, num_experts=4, top_k=1, capacity=(1.0, None), steps=2, warmup=1,
                           json=str(out), skew=2.0, modes=("plain", "balance"), copy_overhead="none",
                           optimizer="sgd")
    run_distributed(layer.run, 2, args=(cfg,), timeout=300)
    rows = {(r["capacity_factor"], r["mode"]): r for r in json.loads(out.read_text())["results"]}
    assert "dropless layers only" in rows[1.0, "balance"]["error"]
    balanced = rows[None, "balance"]
    assert balanced["median_ms"] > 0 and balanced["max_abs_error"] < 1e-5
    assert balanced["copied_experts"], "the skewed check call copied no expert"
    # the model prices the layer: its error is against the step less the optimizer step timed alone
    for row in (balanced, rows[None, "plain"]):
        assert 0 < row["optimizer_ms"] < row["median_ms"]
        layer_ms = row["median_ms"] - row["optimizer_ms"]
        assert row["prediction_error"] == pytest.approx(row["predicted_ms"] / layer_ms - 1)
    # the plan's rank loads: plain, on the counts of the input it planned from (the checked one,
    # so the plain rows' measured load), and with the copies, lower
    plain_load, placed_load = balanced["planned_plain_rank_load"], balanced["planned_rank_load"]
    assert plain_load == pytest.approx(rows[None, "plain"]["rank_load_max_over_mean"])
    assert 1.0 <= placed_load < plain_load
    capsys.readouterr()
    layer.print_table(json.loads(out.read_text()))
    assert f"(rank load {plain_load:.2f} -> {placed_load:.2f})" in capsys.readouterr().out


def test_balance_copy_mode_copies_the_heaviest_expert_in_every_call(tmp_path, capsys):
    """`balance-copy`: the balanced twin with the load's heaviest expert copied to every other
    rank whatever the plan, computing the plain layer; a one-line refusal on padded capacity."""
    out = tmp_path / "copy.json"
    cfg = LayerBenchConfig("tiny", 256, num_experts=4, top_k=1, capacity=(1.0, None), steps=2, warmup=1,
                           json=str(out), skew=2.0, modes=("plain", "balance-copy"))
    run_distributed(layer.run, 2, args=(cfg,), timeout=300)
    report = json.loads(out.read_text())
    rows = {(r["capacity_factor"], r["mode"]): r for r in report["results"]}
    assert "dropless layers only" in rows[1.0, "balance-copy"]["error"]
    copied, plain = rows[None, "balance-copy"], rows[None, "plain"]
    assert copied["median_ms"] > 0 and copied["max_abs_error"] < 1e-5
    hottest = int(layer.zipf_bias(4, 2.0).argmax())  # the skew's favourite: Zipf(2) gives it most rows
    assert copied["copied_experts"] == [hottest] and plain["max_abs_error"] == 0.0
    assert f"expert {hottest} copied to every rank" in copied["description"]
    capsys.readouterr()
    layer.print_table(report)
    assert re.search(rf"balance-copy .* copied experts \[{hottest}\]", capsys.readouterr().out)


def test_balance_comet_mode_places_the_copies_in_replica_slots(tmp_path, capsys):
    """`balance-comet`: the balanced twin on Comet's dropless path (the ranks' buffers shared
    through files on the CPU), its copies in replica slots, computing the plain layer; planned by
    the paper's model alone it copies the hot expert; with the copy overhead measured on its eager
    calls (the default; here each copying call timed a second slower, so that the test does not
    depend on the CPU's timing noise) it copies nothing; `+graph` needs CUDA; `--graph-placement
    updated` builds the twin whose graphs follow the placement (eagerly the same calls)."""
    out = tmp_path / "slots.json"
    cfg = LayerBenchConfig("tiny", 256, num_experts=4, top_k=1, capacity=(None,), steps=2, warmup=1,
                           json=str(out), skew=2.0, modes=("comet", "balance-comet", "balance-comet+graph"),
                           baseline="comet", copy_overhead="none")
    run_distributed(layer.run, 2, args=(cfg,), timeout=300)
    rows = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    slots, comet = rows["balance-comet"], rows["comet"]
    assert slots["median_ms"] > 0 and slots["max_abs_error"] == 0.0 and comet["max_abs_error"] == 0.0
    hottest = int(layer.zipf_bias(4, 2.0).argmax())
    assert slots["copied_experts"] == [hottest] and "replica slots" in slots["description"]
    assert "need CUDA" in rows["balance-comet+graph"]["error"]
    measured = dataclasses.replace(cfg, modes=("comet", "balance-comet"), copy_overhead="measured")
    run_distributed(slow_copy_bench_worker, 2, args=(measured, 1.0), timeout=300)
    rows = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["balance-comet"]["copied_experts"] == [] and rows["balance-comet"]["max_abs_error"] == 0.0
    assert 0.9 < rows["balance-comet"]["cost_model"]["copy_overhead_s"] < 1.1
    updated = dataclasses.replace(cfg, modes=("comet", "balance-comet"), graph_placement="updated")
    run_distributed(layer.run, 2, args=(updated,), timeout=300)
    row = {r["mode"]: r for r in json.loads(out.read_text())["results"]}["balance-comet"]
    assert row["copied_experts"] == [hottest] and row["max_abs_error"] == 0.0
    assert "shaped for any placement" in row["description"]


def slow_copy_bench_worker(cfg: LayerBenchConfig, extra_s: float) -> dict:
    """`layer.run` where a copy costs `extra_s` seconds beyond its bytes: the copy overhead's timing
    adds them to the calls that copy, per copied expert (this spawned process's module only)."""
    from weft.overlap import balance_model

    timed = balance_model.time_candidates

    def time_with_slow_copies(step, candidates, device, trials, warmup):
        return [t + extra_s * len(copies) for t, copies in zip(timed(step, candidates, device, trials, warmup),
                                                                  candidates)]

    balance_model.time_candidates = time_with_slow_copies
    return layer.run(cfg)


def test_balance_mode_measures_what_a_copy_costs_and_plans_with_it(tmp_path):
    out = tmp_path / "balance.json"
    cfg = LayerBenchConfig("tiny", 256, num_experts=4, top_k=1, capacity=(None,), steps=2, warmup=1,
                           json=str(out), skew=2.0, modes=("plain", "balance"))
    run_distributed(slow_copy_bench_worker, 2, args=(cfg, 1.0), timeout=300)
    balanced = next(r for r in json.loads(out.read_text())["results"] if r["mode"] == "balance")
    assert balanced["max_abs_error"] < 1e-5
    overhead = balanced["cost_model"]["copy_overhead_s"]
    # a second per copy beyond what the model prices, less the model's own (ms-sized) difference
    assert 0.9 < overhead < 1.1, f"copy overhead {overhead} s, timed with 1 s added to each copying call"
    # the plan was made with it: no copy pays a second
    assert not balanced["copied_experts"], f"copied {balanced['copied_experts']} despite a 1 s copy overhead"
    assert balanced["predicted_ms"] <= balanced["plain_predicted_ms"]


def comet_bench_worker(cfg: LayerBenchConfig) -> dict:
    from weft.kernels import comet as K

    def choices(device, n_comm=None, dtype=None):  # the interpreter's tiles, with two copy-program counts to time
        return dataclasses.replace(K.CometTiles(16, 16, 16, 32, 2, 1, 1), n_comm_choices=(1, 2))

    K.CometTiles.for_device = staticmethod(choices)
    return layer.run(cfg)


def test_comet_rows_report_the_copy_programs_they_chose(tmp_path, triton_interpreter, capsys):
    out = tmp_path / "comet.json"
    cfg = LayerBenchConfig("tiny", 32, capacity=(1.0,), steps=1, warmup=1, json=str(out), modes=("plain", "comet"))
    run_distributed(comet_bench_worker, 2, args=(cfg,), timeout=300)
    report = json.loads(out.read_text())
    plain, comet = report["results"]
    assert "comet_copy_programs" not in plain and comet["max_abs_error"] == pytest.approx(0.0, abs=1e-5)
    assert comet["comet_copy_programs"] and set(comet["comet_copy_programs"].values()) <= {1, 2}
    # the peer buffers it exchanged through: at least the dispatched rows' (tokens * k, dim) in float32
    assert "peer_buffers_mib" not in plain and comet["peer_buffers_mib"] >= 32 * 2 * 64 * 4 / 2**20
    capsys.readouterr()
    layer.print_table(report)
    out = capsys.readouterr().out
    assert re.search(r"comet .* copy programs [12]", out)
    assert re.search(r"peer buffers .*: [0-9.]+ MiB a rank", out)


TABLE_META = {"config": "tiny", "num_experts": 8, "top_k": 2, "dim": 64, "hidden_dim": 128, "world_size": 2,
              "device": "cuda", "dtype": "bfloat16", "tokens_per_rank": 256, "activation": "relu", "optimizer": "none",
              "p2p_disabled": False, "baseline": "plain"}


def test_the_share_of_the_exchange_hidden_comes_from_plain_and_no_comm_of_the_same_kind(capsys):
    """(plain - mode) / (plain - no-comm): graphed rows against the graphed references, eager rows
    against the eager ones, per capacity; none where a reference is missing, for the references
    themselves, or where no-comm is not faster than plain."""
    def row(mode, cf, ms):
        return {"mode": mode, "capacity_factor": cf, "median_ms": ms}

    rows = [row("plain+graph", 1.0, 2.549), row("comet+graph", 1.0, 1.966), row("no-comm+graph", 1.0, 1.923),
            row("comet+graph", 1.0, 1.972), row("plain", 1.0, 4.0), row("no-comm", 1.0, 3.0), row("d2", 1.0, 3.5),
            row("plain", None, 5.881), row("comet+graph", None, 2.116), row("no-comm", None, 4.9),
            row("plain", 2.0, 3.0), row("no-comm", 2.0, 3.1), row("d2", 2.0, 2.9)]
    layer.exchange_hidden(rows)
    hidden = {(r["mode"], r["capacity_factor"], r["median_ms"]): r.get("exchange_hidden") for r in rows}
    assert hidden["comet+graph", 1.0, 1.966] == pytest.approx((2.549 - 1.966) / (2.549 - 1.923))
    assert hidden["comet+graph", 1.0, 1.972] == pytest.approx((2.549 - 1.972) / (2.549 - 1.923))
    assert hidden["d2", 1.0, 3.5] == pytest.approx(0.5)
    assert hidden["comet+graph", None, 2.116] is None  # no graphed dropless no-comm in this run
    assert hidden["d2", 2.0, 2.9] is None  # no-comm no faster than plain: nothing to hide
    assert all(hidden[m] is None for m in hidden if m[0] in ("plain", "plain+graph", "no-comm", "no-comm+graph"))
    table = [{**r, "iqr_ms": 0.0, "ratio": 1.0, "max_abs_error": 0.0, "tflops_per_rank": 1.0} for r in rows[:3]]
    layer.print_table({"meta": TABLE_META, "results": table})
    assert "(plain - mode) / (plain - no-comm), +graph rows against +graph: cf 1 comet+graph 93%" in \
        capsys.readouterr().out


def test_the_table_says_what_the_gpu_ran_at(monkeypatch, capsys):
    """`gpu_state`: NVML's clock, power and temperature on CUDA, None off it or without NVML (an
    optional readout, never an error); the table prints it per capacity where a row has it."""
    from weft.bench import timing

    cuda = torch.device("cuda", 0)
    assert timing.gpu_state(torch.device("cpu")) is None

    def no_nvml(device):
        raise ModuleNotFoundError("nvidia-ml-py does not seem to be installed")

    monkeypatch.setattr(torch.cuda, "clock_rate", no_nvml)
    assert timing.gpu_state(cuda) is None
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda device: 1755)
    monkeypatch.setattr(torch.cuda, "power_draw", lambda device: 689_500)
    monkeypatch.setattr(torch.cuda, "temperature", lambda device: 67)
    state = timing.gpu_state(cuda)
    assert state == {"sm_clock_mhz": 1755, "power_w": 689.5, "temperature_c": 67}
    row = {"mode": "plain", "capacity_factor": None, "median_ms": 2.0, "iqr_ms": 0.1, "ratio": 1.0,
           "max_abs_error": 0.0, "tflops_per_rank": 1.0, "gpu_after_timing": state}
    layer.print_table({"meta": TABLE_META, "results": [row]})
    assert "timed rounds (rank 0): dropless SM 1755 MHz, 690 W, 67 C" in capsys.readouterr().out


def graphed_auto_worker() -> list[str]:
    """`auto+graph` (`layer.graphed_auto`): every candidate of the layer's auto call run as the
    graph would capture it, here by a stand-in timer that runs each step eagerly (a capture needs
    CUDA) and calls dedup fastest; no earlier call's autograd graph holds the gradient accumulators
    when they are captured (`weft.graphs.GraphedStep` refuses to capture then: every candidate
    would time as infinite); each candidate computes the plain layer, and the forward it returns
    runs the fastest setting."""
    rank = torch.distributed.get_rank()
    checks = Checks(f"rank {rank}")
    torch.manual_seed(0)
    moe = MoE(16, 24, 8, top_k=4, capacity_factor=1.0, parallel="adaptive", a2a_algo="auto")
    gen = torch.Generator().manual_seed(rank)
    x, grad = torch.randn(32, 16, generator=gen), torch.randn(32, 16, generator=gen)
    y_plain = moe(x, **layer.MODES["plain"]).detach()
    ran = []

    def timer(step_of, candidates, args, grads_of):
        grads_of = list(grads_of)
        for setting in candidates:
            step = step_of(setting)  # as `time_graphed` makes each step, then captures it
            checks.expect(not live_gradient_accumulators(grads_of), f"{setting.name}: an earlier call's autograd "
                          "graph is alive, so the step could not be captured")
            y, x_grad = step(args[0].detach().requires_grad_(), args[1])
            ran.append(setting.name)
            checks.expect(torch.allclose(y, y_plain, rtol=1e-5, atol=1e-6), f"{setting.name}: not the plain output")
            checks.expect(x_grad is not None, f"{setting.name}: no input gradient")
        return [0.5 if s.a2a_algo == "dedup" else 1.0 for s in candidates]

    forward, candidates_ms = layer.graphed_auto(moe, x, grad, timer)
    names = [s.name for s in moe.candidates(moe.call_with(**layer.MODES["auto"]))]
    checks.expect(ran == names == list(candidates_ms) and "d1-dedup" in names and "d2-linear" in names,
                  f"ran {ran}, candidates {names}, reported {list(candidates_ms)}")
    checks.expect(min(candidates_ms, key=candidates_ms.get) == "d1-dedup", f"times {candidates_ms}")
    calls, real_forward = [], moe.forward

    def recording(x, **overrides):
        calls.append(overrides.get("a2a_algo"))
        return real_forward(x, **overrides)

    moe.forward = recording
    checks.expect(torch.allclose(forward(x), y_plain, rtol=1e-5, atol=1e-6) and calls == ["dedup"],
                  f"the chosen forward ran {calls}")
    return checks.failures


def test_auto_as_graphs_captures_the_candidate_whose_graph_is_fastest():
    failures = run_checks(graphed_auto_worker, 2, timeout=300)
    assert not failures, "\n".join(failures)


def test_auto_as_graphs_stops_when_no_candidate_could_be_captured():
    """Every candidate timed as infinite (none could be captured: `time_graphed` warned why each)
    is an error naming them, not a silent choice of the first."""
    moe = MoE(16, 24, 8, top_k=2, capacity_factor=1.0, parallel="adaptive", a2a_algo="auto")
    x, grad = torch.randn(32, 16), torch.randn(32, 16)
    with pytest.raises(RuntimeError, match="none of its candidates .* could be captured"):
        layer.graphed_auto(moe, x, grad, lambda step_of, candidates, args, grads_of: [math.inf] * len(candidates))


def graphed_auto_dropless_worker(winner: str) -> list[str]:
    """`auto+graph` on a dropless layer (`layer.graphed_auto_dropless`): auto's eager call against
    dedup-fixed at degrees 1 and 2 and with the own pairs apart as graphs, and Comet's call where
    the ranks reach each other's memory (here told so: shared files between the gloo ranks), or on
    one rank the plain call (told that its grouped GEMM keeps the ends on the device, as on an
    H200), timed here by stand-ins that run each step eagerly (a capture needs CUDA), the eager
    call's autograd graph dropped before the captures; all compute the plain layer, and the
    forward returned runs the fastest."""
    from weft.moe.experts import Experts

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    Experts.offsets_stay_on_device = lambda self, dtype: True
    checks = Checks(f"rank {rank}")
    torch.manual_seed(0)
    moe = MoE(16, 24, 8, top_k=4, capacity_factor=None, parallel="adaptive", a2a_algo="auto")
    gen = torch.Generator().manual_seed(rank)
    x, grad = torch.randn(32, 16, generator=gen), torch.randn(32, 16, generator=gen)
    y_plain = moe(x, **layer.MODES["plain"]).detach()
    ran = []
    seconds = {"auto": 1.0, "dedup-fixed": 2.0, "dedup-fixed-d2": 3.0, "dedup-fixed-own": 4.0, "comet": 5.0,
               "plain": 6.0}
    seconds[winner] = 0.5

    def run(name, step, args):
        y, x_grad = step(args[0].detach().requires_grad_(), args[1])
        ran.append(name)
        checks.expect(torch.allclose(y, y_plain, rtol=1e-5, atol=1e-6), f"{name}: not the plain output")
        checks.expect(x_grad is not None, f"{name}: no input gradient")

    def eager_timer(step, args):
        run("auto", step, args)
        return seconds["auto"]

    def timer(step_of, candidates, args, grads_of):
        grads_of = list(grads_of)
        for mode in candidates:
            step = step_of(mode)  # as `time_graphed` makes each step, then captures it
            checks.expect(not live_gradient_accumulators(grads_of), f"{mode}: an earlier call's autograd graph "
                          "is alive, so the step could not be captured")
            run(mode, step, args)
        return [seconds[mode] for mode in candidates]

    forward, graphed, candidates_ms = layer.graphed_auto_dropless(moe, x, grad, timer, eager_timer,
                                                                   comet=world > 1)
    forms = ["dedup-fixed", "dedup-fixed-d2", "dedup-fixed-own"]
    forms = [*forms, "comet"] if world > 1 else ["plain", *forms]
    checks.expect(ran == ["auto", *forms] and graphed == (winner != "auto"), f"ran {ran}, graphed {graphed}")
    want_ms = {"auto (eager)": seconds["auto"] * 1e3, **{f"{form} (graph)": seconds[form] * 1e3 for form in forms}}
    checks.expect(candidates_ms == want_ms, f"times {candidates_ms}")
    calls, real_forward = [], moe.forward

    def recording(x, **overrides):
        calls.append((overrides.get("a2a_algo"), overrides.get("overlap_degree", 1), overrides.get("kernels")))
        return real_forward(x, **overrides)

    moe.forward = recording
    want = {"auto": ("auto", "auto", None), "dedup-fixed": ("dedup-fixed", 1, None),
            "dedup-fixed-d2": ("dedup-fixed", 2, None), "dedup-fixed-own": ("dedup-fixed-own", 1, None),
            "comet": ("linear", 1, "comet"), "plain": ("linear", 1, None)}[winner]
    checks.expect(torch.allclose(forward(x), y_plain, rtol=1e-5, atol=1e-6) and calls == [want],
                  f"the chosen forward ran {calls}")
    return checks.failures


@pytest.mark.parametrize("world, winner", [(2, "dedup-fixed"), (2, "dedup-fixed-d2"), (2, "dedup-fixed-own"),
                                           (2, "comet"), (2, "auto"), (1, "plain"), (1, "dedup-fixed"), (1, "auto")])
def test_auto_as_a_graph_on_a_dropless_layer_runs_the_fastest_of_eager_auto_and_the_fixed_size_graphs(world, winner):
    failures = run_checks(graphed_auto_dropless_worker, world, args=(winner,), timeout=300)
    assert not failures, "\n".join(failures)


def blocker_worker() -> list[str]:
    """`dropless_graph_blocker` on two ranks: the fixed-size exchanges graph, and no-comm where the
    grouped GEMM runs on the GPU; the others read their counts on the host (and Comet's here, on
    CPU processes, as no GPU graph runs)."""
    from weft.moe.experts import Experts

    moe = MoE(16, 32, 4, top_k=2, capacity_factor=None)
    checks = Checks(f"rank {torch.distributed.get_rank()}")
    blocker = layer.dropless_graph_blocker("no-comm+graph", moe)  # float32 experts on the CPU
    checks.expect(blocker is not None and "no-comm on several" in blocker, f"no-comm+graph on the CPU: {blocker}")
    Experts.offsets_stay_on_device = lambda self, dtype: True  # as on an H200
    for mode in ("dedup-fixed", "dedup-fixed-own+graph", "auto+graph", "no-comm+graph"):
        checks.expect(layer.dropless_graph_blocker(mode, moe) is None, f"{mode} cannot graph on 2 ranks")
    for mode in ("plain+graph", "d2+graph", "comet+graph"):
        blocker = layer.dropless_graph_blocker(mode, moe)
        checks.expect(blocker is not None and "host" in blocker, f"{mode} graphs on 2 ranks: {blocker}")
    return checks.failures


def test_dropless_graphs_on_several_ranks_only_for_the_exchanges_that_read_nothing_on_the_host(monkeypatch):
    """A CUDA graph of a dropless call needs one that reads nothing on the host: on several ranks
    `dedup-fixed` (and Comet's where the GPUs map each other's memory); on one rank every mode
    (nothing to exchange), and no-comm on several, where the grouped GEMM takes its groups' ends
    from the device."""
    from weft.moe.experts import Experts

    LayerBenchConfig("tiny", 16, capacity=(None, 1.0), modes=("plain", "plain+graph", "auto+graph")).validate()
    moe = MoE(16, 32, 4, top_k=2, capacity_factor=None)
    blocker = layer.dropless_graph_blocker("plain+graph", moe)
    assert blocker is not None and "on 1 ranks reads its counts" in blocker  # float32 experts on the CPU
    monkeypatch.setattr(Experts, "offsets_stay_on_device", lambda self, dtype: True)
    assert all(layer.dropless_graph_blocker(m, moe) is None for m in ("plain+graph", "d2+graph", "no-comm+graph"))
    assert "comet" in layer.dropless_graph_blocker("comet+graph", moe)  # Comet's needs 2+ ranks
    failures = run_checks(blocker_worker, 2, timeout=120)
    assert not failures, "\n".join(failures)


class StepCounter:
    """A stand-in for NVML's energy counter: each step of a mode adds that mode's millijoules."""

    def __init__(self):
        self.mj = 0.0

    def step(self, mj: float, seconds: float) -> None:
        time.sleep(seconds)
        self.mj += mj


def test_energy_per_step_reads_the_counter_around_each_modes_steps_back_to_back():
    """Each mode's steps in blocks (as many as fit its share of the seconds at its timed step),
    the blocks interleaved over the rounds, the counter read around each block: joules a step,
    watts and milliseconds a step per mode."""
    counter, log = StepCounter(), []
    runs = [timing.Run(lambda m=m: log.append(m), lambda s, mj=mj, t=t: counter.step(mj, t))
            for m, mj, t in (("a", 100.0, 0.004), ("b", 300.0, 0.012))]
    rounds = []
    energy = timing.energy_per_step(runs, [4.0, 12.0], seconds=0.36, device=torch.device("cpu"),
                                    read_mj=lambda: counter.mj, progress=lambda *a: rounds.append(a))
    assert log == list("ab" "ba" "ab") and rounds == [(1, 3), (2, 3), (3, 3)]
    a, b = energy
    assert a["joules_per_step"] == pytest.approx(0.1) and b["joules_per_step"] == pytest.approx(0.3), energy
    assert 4.0 <= a["ms_per_step"] < 8.0 and 12.0 <= b["ms_per_step"] < 18.0, energy
    # watts are joules over the blocks' seconds: at most 0.1 J / 4 ms and 0.3 J / 12 ms
    assert 12.0 < a["watts"] <= 25.0 and 16.0 < b["watts"] <= 25.0, energy
    # 0.36 s over 3 rounds of 2 modes: 0.06 s a block, 15 steps of 4 ms and 5 of 12 ms
    assert counter.mj == pytest.approx(3 * (15 * 100.0 + 5 * 300.0))


def energy_ranks_worker() -> list[str]:
    """Each rank reads its own GPU's counter: joules and watts are the ranks' mean, the
    milliseconds a step the slowest rank's."""
    rank = torch.distributed.get_rank()
    checks = Checks(f"rank {rank}")
    counter = StepCounter()
    runs = [timing.Run(lambda: None, lambda s: counter.step(100.0 * (1 + 2 * rank), 0.004 * (1 + 2 * rank)))]
    (energy,) = timing.energy_per_step(runs, [8.0], seconds=0.12, device=torch.device("cpu"),
                                       read_mj=lambda: counter.mj)
    checks.expect(energy["joules_per_step"] == pytest.approx(0.2), f"not the ranks' mean: {energy}")
    checks.expect(12.0 <= energy["ms_per_step"] < 20.0, f"not the slower rank's step: {energy}")
    checks.expect(counter.mj == pytest.approx(3 * 5 * 100.0 * (1 + 2 * rank)), f"{counter.mj} mJ spent")
    return checks.failures


def test_energy_per_step_on_two_ranks_averages_the_gpus_and_times_the_slowest():
    assert run_checks(energy_ranks_worker, 2, timeout=120) == []


def test_no_energy_counter_means_no_readout_not_an_error(monkeypatch, capsys):
    runs = [timing.Run(lambda: None, lambda s: None)]
    assert timing.energy_counter(torch.device("cpu")) is None
    assert timing.energy_per_step(runs, [1.0], 0.1, torch.device("cpu")) is None

    def no_nvml(device):
        raise ModuleNotFoundError("pynvml does not seem to be installed")

    monkeypatch.setattr(torch.cuda, "_get_pynvml_handler", no_nvml)
    assert timing.energy_counter(torch.device("cuda", 0)) is None
    row = {"mode": "plain", "capacity_factor": 1.0, "median_ms": 2.0, "iqr_ms": 0.1, "ratio": 1.0,
           "max_abs_error": 0.0, "tflops_per_rank": 1.0,
           "energy": {"joules_per_step": 1.25, "watts": 650.0, "ms_per_step": 1.9}}
    layer.print_table({"meta": TABLE_META, "results": [row]})
    assert "cf 1 plain 1250.0 mJ a step at 650 W (1.900 ms a step)" in capsys.readouterr().out


def clock_energy_bench(cfg: LayerBenchConfig) -> dict:
    """`layer.run` in a rank whose stand-in energy counter is a 5 W clock (NVML needs a GPU)."""
    timing.energy_counter = lambda device: (lambda: time.perf_counter() * 5e3)
    return layer.run(cfg)


def test_the_layer_bench_reports_each_modes_energy_when_asked(tmp_path):
    out = tmp_path / "energy.json"
    cfg = LayerBenchConfig("tiny", 64, capacity=(1.0,), steps=3, warmup=1, json=str(out), modes=("plain", "no-comm"),
                           energy_s=0.6)
    run_distributed(clock_energy_bench, 2, args=(cfg,), timeout=300)
    for r in json.loads(out.read_text())["results"]:
        energy = r["energy"]
        assert energy["watts"] == pytest.approx(5.0, rel=0.05), r
        # the slowest rank's milliseconds a step, so each rank's own joules are at most 5 W times them
        assert 0 < energy["joules_per_step"] <= 5.0 * energy["ms_per_step"] * 1e-3 * 1.05, r
