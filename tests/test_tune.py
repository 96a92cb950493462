"""The tuning dictionary (Tutel 3.3): "auto" never changes results, all ranks agree on the
choice, decisions are reused per capacity bucket and survive a reload from JSON."""
from __future__ import annotations

import json
import random
import time

import pytest
import torch
import torch.distributed as dist

from weft import MoE
from weft.bench.tune import TuneConfig, run
from weft.testing import run_distributed
from weft.tune import Setting, TuningDictionary
from weft.tune.dictionary import next_round

DIM, HIDDEN, EXPERTS = 16, 24, 8


def auto_worker(path: str, a2a_auto: bool) -> dict:
    rank = dist.get_rank()
    tuning = TuningDictionary(path, bucket_size=4, trials=2)
    torch.manual_seed(0)
    auto = MoE(DIM, HIDDEN, EXPERTS, capacity_factor=1.0, overlap_degree="auto", tuning=tuning,
               a2a_algo="auto" if a2a_auto else "linear")
    torch.manual_seed(0)
    plain = MoE(DIM, HIDDEN, EXPERTS, capacity_factor=1.0)
    gen = torch.Generator().manual_seed(rank)
    candidates = auto.candidates()
    for step in range(len(candidates) * 2 + 3):
        x = torch.randn(32, DIM, generator=gen)
        xa, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yp = auto(xa), plain(xp)
        ya.square().sum().backward()
        yp.square().sum().backward()
        assert torch.allclose(ya, yp, atol=1e-5) and torch.allclose(xa.grad, xp.grad, atol=1e-5), step
    for (name, pa), pp in zip(auto.named_parameters(), plain.parameters()):
        assert torch.allclose(pa.grad, pp.grad, atol=1e-4), name
    best = tuning.best(next(iter(tuning.table)), auto.stats.capacity)
    measured = tuning.measurements
    reloaded = TuningDictionary(path, bucket_size=4, trials=2)
    torch.manual_seed(0)
    again = MoE(DIM, HIDDEN, EXPERTS, capacity_factor=1.0, overlap_degree="auto", tuning=reloaded,
                a2a_algo="auto" if a2a_auto else "linear")
    again(torch.randn(32, DIM, generator=gen))
    return {"best": best, "measured": measured, "remeasured": reloaded.measurements,
            "candidates": [c.name for c in candidates]}


@pytest.mark.parametrize("world_size, a2a_auto", [(1, False), (2, False), (4, True)])
def test_auto_equals_plain_and_all_ranks_agree(tmp_path, world_size, a2a_auto):
    path = tmp_path / "tuning.json"
    results = run_distributed(auto_worker, world_size, args=(str(path), a2a_auto), timeout=300,
                              env={"LOCAL_WORLD_SIZE": 2})
    assert len({r["best"] for r in results}) == 1 and results[0]["best"] is not None
    # no d1-dedup: top_k 2 x cf 1.0 <= 4 ranks, so it could send no fewer rows (dedup_sends_fewer)
    expected = ["d1-linear", "d2-linear", "d4-linear", "d8-linear"]
    expected += ["d1-2dh", "d2-2dh", "d4-2dh", "d8-2dh"] if a2a_auto else []  # 2DH pipelines too
    assert results[0]["candidates"] == expected
    assert all(r["measured"] == 2 * len(expected) for r in results)  # each candidate twice, then reused
    assert all(r["remeasured"] == 0 for r in results)  # the reloaded dictionary knows the answer
    doc = json.loads(path.read_text())
    assert doc["format"] == "weft.tuning/1"


def test_buckets_are_tuned_separately_and_one_rank_dropless_needs_no_tuning():
    tuning = TuningDictionary(bucket_size=4, trials=1)
    moe = MoE(DIM, HIDDEN, EXPERTS, capacity_factor=1.0, overlap_degree="auto", tuning=tuning)
    for tokens in (32, 32, 32, 32, 128):
        moe(torch.randn(tokens, DIM))
    buckets = next(iter(tuning.table.values()))
    assert set(buckets) == {str(8 // 4), str(32 // 4)}  # C = 8 and C = 32 (k=2, E=8, cf=1)
    # On one rank dropless exchanges nothing: no setting to choose (several ranks: see below).
    dropless = MoE(DIM, HIDDEN, EXPERTS, capacity_factor=None, overlap_degree="auto", parallel="adaptive",
                   tuning=TuningDictionary())
    assert dropless.candidates() == [Setting(1, "linear")]
    dropless(torch.randn(8, DIM))
    assert dropless.tuning.measurements == 0 and not dropless.tuning.table


def _unimodal(rng: random.Random, rs: list[int]) -> dict[int, float]:
    """Distinct times falling strictly to a random r, then rising strictly."""
    values = sorted(rng.sample(range(1000), len(rs)))
    low, rest = values[0], values[1:]
    rng.shuffle(rest)
    at = rng.randrange(len(rs))
    return dict(zip(rs, sorted(rest[:at], reverse=True) + [low] + sorted(rest[at:])))


def test_ternary_search_of_r_finds_the_fastest_of_unimodal_times():
    rng = random.Random(0)
    for length in range(1, 9):
        rs = sorted(rng.sample(range(1, 65), length))
        counts = []
        for _ in range(300):
            f = _unimodal(rng, rs)
            measured, rounds = {}, 0
            while more := next_round(rs, measured):
                assert more and not set(more) & set(measured) and set(more) <= set(rs)
                measured.update({r: f[r] for r in more})
                rounds += 1
            assert min(measured, key=measured.get) == min(f, key=f.get), (rs, f, measured)
            assert length > 3 or rounds == 1  # up to 3 values: one round, as exhaustive tuning
            counts.append(len(measured))
        if length >= 7:
            assert max(counts) < length  # the search saves measurements on long lists
        if length >= 6:
            assert sum(counts) < length * len(counts)
    assert next_round([1, 2, 4, 8, 16], {}) == [1, 16]  # Tutel: both ends first


# Per-rank sleeps (ms) of each r at degree 1: rank 0 is fastest at r = 4, rank 1 at r = 0 (and, of
# the divisors, at 64), so ranks deciding on their own would search and choose differently.
SEARCH_MS = {0: (70, 5), 1: (60, 70), 2: (40, 60), 4: (10, 50), 8: (25, 40), 16: (45, 30), 32: (55, 20),
             64: (65, 10)}


def search_worker(path: str) -> dict:
    rank = dist.get_rank()
    key = "E1-k1-dim4-h64-relu-W2-float32-linear-adaptive"
    candidates = [Setting(d, "linear", r) for r in (1, 2, 4, 8, 16, 32, 64) for d in (1, 2)]
    candidates.append(Setting(1, "linear", 0))
    ran = []

    def execute(setting: Setting, x: torch.Tensor) -> torch.Tensor:
        ran.append(setting)  # no collective here: rank 0's times must be its own
        time.sleep((SEARCH_MS[setting.parallel][rank] + 20 * (setting.overlap_degree - 1)) / 1e3)
        return x

    tuning = TuningDictionary(path, trials=2)
    for _ in range(13 * 2 + 3):  # 13 settings timed twice (r = 32 is never timed), then reused
        tuning.run(key, 8, candidates, dist.group.WORLD, execute, torch.zeros(1))
    entry = tuning.table[key]["0"]
    return {"ran": ran, "best": tuning.best(key, 8), "r_searched": entry["r_searched"],
            "measured": tuning.measurements}


def test_r_search_runs_the_same_candidates_on_every_rank(tmp_path):
    """Ranks time differently; rank 0's times steer the search, so every rank runs the same
    candidate at every call and ends on the same best."""
    path = tmp_path / "search.json"
    results = run_distributed(search_worker, 2, args=(str(path),), timeout=120)
    assert results[0]["ran"] == results[1]["ran"]
    assert results[0]["best"] == results[1]["best"] == Setting(1, "linear", 4)
    assert results[0]["r_searched"] == [0, 1, 2, 4, 8, 16, 64]  # r = 32 ruled out by the search
    assert all(r["measured"] == 26 for r in results)
    assert results[0]["ran"][-3:] == [Setting(1, "linear", 4)] * 3
    assert {s.parallel for s in results[0]["ran"][:10]} == {0, 1, 64}  # round 0: r = 0 and both ends
    reloaded = TuningDictionary(path)
    entry = next(iter(reloaded.table.values()))["0"]
    assert entry["best"] == [1, "linear", 4] and entry["r_searched"] == [0, 1, 2, 4, 8, 16, 64]


def test_old_files_without_search_state_load(tmp_path):
    """Files written before the r search (no "r_searched") still load; an unfinished entry starts
    the search from its first round, reusing the times it holds."""
    moe = MoE(DIM, HIDDEN, EXPERTS, capacity_factor=1.0, overlap_degree="auto")
    key = moe.tuning_key()
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"format": "weft.tuning/1", "table": {key: {
        "0": {"times_ms": {"d1-linear": [1.0]}, "best": [2, "linear", 1]},
        "1": {"times_ms": {"d1-linear": [1.0], "d2-linear": [0.5]}, "best": None}}}}))
    tuning = TuningDictionary(path, trials=1)
    assert tuning.best(key, 8) == Setting(2, "linear")
    candidates = [Setting(1, "linear"), Setting(2, "linear"), Setting(4, "linear")]
    tuning.run(key, 128, candidates, None, lambda s, rows: rows, torch.zeros(1))  # times d4, the one missing
    tuning.run(key, 128, candidates, None, lambda s, rows: rows, torch.zeros(1))
    assert tuning.measurements == 1 and tuning.best(key, 128) is not None


def auto_equals_plain_worker(experts: int, capacity_factor: float | None) -> dict:
    """`overlap_degree="auto"` with free r against the same layer at d = 1, r = 1, every call (while
    tuning and after): outputs, input gradients, every parameter gradient."""
    rank = dist.get_rank()
    tuning = TuningDictionary(trials=1)
    torch.manual_seed(0)
    moe = MoE(DIM, HIDDEN, experts, top_k=min(2, experts), capacity_factor=capacity_factor, activation="swiglu",
              overlap_degree="auto", parallel="adaptive", tuning=tuning)
    gen = torch.Generator().manual_seed(rank)
    tokens = 20 + 4 * rank if capacity_factor is None else 24  # dropless: uneven on purpose
    candidates = moe.candidates()
    failures = []
    for step in range(len(candidates) * tuning.trials + 2):
        x = torch.randn(tokens, DIM, generator=gen) + torch.eye(DIM)[0] * rank
        dy = torch.randn(tokens, DIM, generator=gen)
        runs = []
        # the reference, auto, and a call fixing r = 0 (one candidate: no tuning, no bucket)
        for overrides in ({"overlap_degree": 1, "parallel": 1}, {}, {"parallel": 0}):
            moe.zero_grad(set_to_none=True)
            xr = x.clone().requires_grad_()
            y = moe(xr, **overrides)
            (y * dy).sum().backward()
            runs.append([("y", y.detach()), ("dx", xr.grad)] + [(n, p.grad.clone()) for n, p in moe.named_parameters()])
        for label, result in zip(("auto", "r0"), runs[1:]):
            for (name, ref), (_, got) in zip(runs[0], result):
                err = float((got - ref).norm() / ref.norm().clamp_min(1e-12))
                if err > 1e-5:
                    failures.append(f"rank {rank} step {step} {label}: {name} rel err {err:.2e}")
    keys = sorted(tuning.table)
    bests = [entry["best"] for key in keys for entry in tuning.table[key].values()]
    measured = tuning.measurements
    if capacity_factor is None and moe.ep_size > 1:  # padded calls of the layer keep their own entry
        moe(torch.randn(24, DIM, generator=gen), capacity_factor=1.0)
        if len(tuning.table) != 2:
            failures.append(f"keys {sorted(tuning.table)}")
    return {"failures": failures, "keys": keys, "bests": bests, "measured": measured,
            "candidates": candidates}


@pytest.mark.parametrize("world_size, experts, capacity_factor",
                         [(1, 8, None), (2, 8, None), (4, 8, None), (2, 1, None), (4, 2, None), (4, 1, None),
                          (4, 1, 1.0)])
def test_auto_with_free_r_equals_plain_and_ranks_agree(world_size, experts, capacity_factor):
    """Dropless "auto" (E >= W: d in 1/2/4/8 and r = 0; E < W: every r, d = 1) and the padded
    sliced layer (r in 0, 1, 2, 4: one round) compute the layer exactly; ranks agree."""
    results = run_distributed(auto_equals_plain_worker, world_size, args=(experts, capacity_factor), timeout=300)
    failures = [f for r in results for f in r["failures"]]
    assert not failures, "\n".join(failures[:10])
    first = results[0]
    assert all(r["keys"] == first["keys"] and r["bests"] == first["bests"] for r in results)
    if world_size == 1:
        assert first["measured"] == 0 and first["candidates"] == [Setting(1, "linear")]
        return
    assert len(first["keys"]) == 1 and first["keys"][0].endswith("-dropless") == (capacity_factor is None)
    assert first["bests"] and all(first["bests"])
    # Up to 3 divisors of W / E: one round, every candidate timed once (trials=1).
    assert all(r["measured"] == len(first["candidates"]) > 1 for r in results)
    shards = max(1, world_size // experts)
    divisors = {r for r in range(1, shards + 1) if shards % r == 0}
    assert {c.parallel for c in first["candidates"]} == {0} | divisors
    pipelined = capacity_factor is not None or shards == 1  # sliced dropless has no d > 1
    degrees = {c.overlap_degree for c in first["candidates"] if c.parallel > 0}
    assert degrees == ({1, 2, 4, 8} if pipelined else {1})


def test_corrupt_tuning_file_is_refused(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON"):
        TuningDictionary(path)
    path.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not a weft tuning file"):
        TuningDictionary(path)


def test_weft_tune_writes_a_dictionary_that_layers_reuse(tmp_path):
    path = tmp_path / "tiny.json"
    cfg = TuneConfig("tiny", 64, 1.0, "relu", "fp32", trials=1, a2a="auto", out=str(path))
    summary = run_distributed(run, 2, args=(cfg,))[0]
    assert "best d" in summary
    tuning = TuningDictionary(path)
    assert len(tuning.table) == 1 and all(e["best"] for e in next(iter(tuning.table.values())).values())


def adaptive_tuning_worker() -> dict:
    tuning = TuningDictionary(bucket_size=4, trials=1)
    torch.manual_seed(0)
    moe = MoE(DIM, HIDDEN, EXPERTS, capacity_factor=1.0, parallel="adaptive", tuning=tuning)
    torch.manual_seed(0)
    plain = MoE(DIM, HIDDEN, EXPERTS, capacity_factor=1.0)
    x = torch.randn(32, DIM, generator=torch.Generator().manual_seed(dist.get_rank()))
    names = [c.name for c in moe.candidates()]
    for _ in range(3):
        assert torch.allclose(moe(x), plain(x), atol=1e-6)
    fixed = [c.name for c in moe.candidates(moe.call_with(parallel=0))]
    return {"candidates": names, "fixed_r0": fixed, "measured": tuning.measurements,
            "best": tuning.best(next(iter(tuning.table)), moe.stats.capacity)}


def test_adaptive_layers_tune_r_unless_a_call_fixes_it():
    results = run_distributed(adaptive_tuning_worker, 2)
    assert results[0]["candidates"] == ["d1-linear", "d1-linear-r0"]
    assert results[0]["fixed_r0"] == ["d1-linear-r0"]
    assert all(r["measured"] == 2 for r in results) and len({r["best"] for r in results}) == 1


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad * 2, None


def test_trials_time_the_backward_too():
    """A candidate that is only slower in backward loses; a trial never backpropagated counts its
    forward alone at the next call."""
    moe = MoE(DIM, HIDDEN, EXPERTS, capacity_factor=1.0, overlap_degree="auto")
    key = moe.tuning_key()
    tuning = TuningDictionary(trials=2)
    fast, slow = Setting(1, "linear"), Setting(2, "linear")
    # 250 ms of sleep in the slow backward: a margin no load on a busy test machine eats
    execute = lambda s, rows: _SlowBackward.apply(rows, 0.25 if s == slow else 0.0)  # noqa: E731
    for _ in range(5):
        x = torch.randn(8, DIM, requires_grad=True)
        tuning.run(key, 8, [fast, slow], None, execute, x).sum().backward()
        assert torch.equal(x.grad, torch.full_like(x, 2.0))  # the marks pass gradients through
    times = tuning.table[key]["0"]["times_ms"]
    assert min(times[slow.name]) >= 250 > max(times[fast.name])
    assert tuning.best(key, 8) == fast
    # No backward: the pending trial is closed by the next call with its forward time only.
    other = TuningDictionary(trials=1)
    other.run(key, 8, [fast, slow], None, lambda s, rows: _SlowBackward.apply(rows, 0.25),
              torch.randn(8, DIM, requires_grad=True))
    other.run(key, 8, [fast, slow], None, lambda s, rows: _SlowBackward.apply(rows, 0.25),
              torch.randn(8, DIM, requires_grad=True))
    recorded = other.table[key]["0"]["times_ms"]
    assert len(recorded[fast.name]) == 1 and recorded[fast.name][0] < 250


def test_layers_with_other_candidate_sets_do_not_share_a_choice():
    """A shared dictionary keys each layer on its candidate set too: a layer (or call) with a
    fixed degree must never run the degree an "auto" layer of the same shape chose, and only an
    "adaptive" layer may run r = 0."""
    layers = [MoE(DIM, HIDDEN, EXPERTS, capacity_factor=1.0, overlap_degree="auto"),
              MoE(DIM, HIDDEN, EXPERTS, capacity_factor=1.0, overlap_degree=2),
              MoE(DIM, HIDDEN, EXPERTS, capacity_factor=1.0, overlap_degree="auto", parallel="adaptive"),
              MoE(DIM, HIDDEN, EXPERTS, capacity_factor=None, overlap_degree="auto")]
    keys = [m.tuning_key() for m in layers]
    assert len(set(keys)) == len(keys), keys
    assert keys[1].endswith("-d2-linear") and keys[2].endswith("-adaptive") and keys[3].endswith("-dropless")


def test_kernel_parameters_are_timed_once_and_kept_with_the_dictionary(tmp_path, monkeypatch):
    """`pick` (Comet's copy programs): the fastest candidate by its best trial, each candidate run
    once to warm up, then `trials` rounds timing every candidate in turn; the choice is reused
    without running, saved beside the exchange settings and reloaded; a kept choice that is no
    longer a candidate is timed anew."""
    fake_ms = {16: [3.0, 2.0], 32: [1.5, 9.0], 64: [1.8, 1.7]}  # 32 wins on its best trial
    served = {c: iter(v) for c, v in fake_ms.items()}
    runs = []

    def fake_seconds(fn, device):  # the next fake time of the candidate fn just ran
        fn()
        return next(served[runs[-1]]) / 1e3
    monkeypatch.setattr("weft.tune.dictionary.seconds_per_call", fake_seconds)
    path = tmp_path / "tuning.json"
    tuning = TuningDictionary(path, trials=2)
    assert tuning.picked("comet.pull-x") is None
    assert tuning.pick("comet.pull-x", (16, 32, 64), runs.append, torch.device("cpu")) == 32
    assert runs == [16, 32, 64, 16, 32, 64, 16, 32, 64] and tuning.measurements == 6
    assert tuning.pick("comet.pull-x", (16, 32, 64), runs.append, torch.device("cpu")) == 32
    assert len(runs) == 9 and tuning.picked("comet.pull-x") == 32
    assert tuning.pick("one", (8,), runs.append, torch.device("cpu")) == 8 and len(runs) == 9
    assert "comet.pull-x: best 32; fastest ms: 16 2.000, 32 1.500, 64 1.700" in tuning.summary()
    reloaded = TuningDictionary(path, trials=2)
    assert reloaded.picked("comet.pull-x") == 32
    assert reloaded.pick("comet.pull-x", (16, 32, 64), runs.append, torch.device("cpu")) == 32 and len(runs) == 9
    served = {c: iter([5.0, 4.0]) for c in (16, 64)}
    assert reloaded.pick("comet.pull-x", (16, 64), runs.append, torch.device("cpu")) == 16 and len(runs) == 15


def test_tuning_files_without_kernels_load_and_bad_kernel_sections_are_refused(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": "weft.tuning/1", "table": {}}))
    assert TuningDictionary(path).kernels == {}
    path.write_text(json.dumps({"format": "weft.tuning/1", "table": {}, "kernels": {"k": {"times": 1}}}))
    with pytest.raises(ValueError, match="'kernels' section is not a table of choices"):
        TuningDictionary(path)


def test_comet_settings_are_kept_in_the_file_and_older_entries_load(tmp_path):
    """A decided Comet setting is written as [d, algo, r, true] and read back as itself; the
    three-entry form of files written before it still reads (as an all-to-all setting)."""
    comet, plain = Setting(1, "linear", 1, comet=True), Setting(2, "linear")
    assert comet.name == "d1-linear-comet" and Setting(*comet.to_json()) == comet
    assert plain.to_json() == [2, "linear", 1] and Setting(*plain.to_json()) == plain
    path = tmp_path / "tuning.json"
    tuning = TuningDictionary(path, bucket_size=4, trials=1)
    tuning.table["key"] = {"0": {"times_ms": {}, "best": comet.to_json()}, "1": {"times_ms": {}, "best": [4, "2dh", 1]}}
    tuning._save()
    again = TuningDictionary(path, bucket_size=4)
    assert again.best("key", 0) == comet and again.best("key", 4) == Setting(4, "2dh")
    assert again.chosen() == ["d1-linear-comet", "d4-2dh"]
