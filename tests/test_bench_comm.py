"""Specification of weft.comm.cost_model (piecewise-linear fit) and weft.bench.comm (measurement)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from weft.bench import comm
from weft.comm.cost_model import FORMAT, CommCostModel
from weft.testing import run_distributed

# all_to_all: 10 us latency, then 1 GB/s up to 4 KiB and 2 GB/s after; all_reduce: one point.
POINTS = {
    "all_to_all": [(1024, 10e-6 + 1024e-9), (4096, 10e-6 + 4096e-9), (16384, 10e-6 + 4096e-9 + 12288 * 0.5e-9)],
    "all_reduce": [(2048, 30e-6)],
}


def model() -> CommCostModel:
    return CommCostModel.fit(POINTS, world_size=4, backend="nccl", device_name="test GPU")


def test_predict_is_exact_at_the_breakpoints():
    m = model()
    for name, pts in POINTS.items():
        for nbytes, seconds in pts:
            assert m.predict(name, nbytes) == pytest.approx(seconds, rel=1e-12)


def test_predict_is_linear_between_breakpoints():
    m = model()
    (b0, t0), (b1, t1) = POINTS["all_to_all"][1:]
    for nbytes in (b0 + 1, 6000, 10_000, b1 - 1):
        assert m.predict("all_to_all", nbytes) == pytest.approx(t0 + (nbytes - b0) / (b1 - b0) * (t1 - t0))


def test_predict_extrapolates_with_the_end_segments():
    m = model()
    (b0, t0), (b1, t1) = POINTS["all_to_all"][:2]
    # Below the first point the first line continues down to its intercept (the latency), here 10 us.
    assert m.predict("all_to_all", 512) == pytest.approx(t0 - 512 * (t1 - t0) / (b1 - b0))
    assert m.predict("all_to_all", 1) == pytest.approx(10e-6, rel=1e-3)
    # Above the last point the last slope (2 GB/s) continues.
    b_last, t_last = POINTS["all_to_all"][-1]
    assert m.predict("all_to_all", b_last + 2_000_000) == pytest.approx(t_last + 2_000_000 * 0.5e-9)
    assert m.predict("all_to_all", 0) == 0.0


def test_extrapolation_never_goes_negative_or_downhill():
    # A first segment steeper than its own time would cross zero; a noisy last segment falls.
    m = CommCostModel.fit({"x": [(1000, 1e-6), (2000, 5e-6), (3000, 4e-6)]}, 2, "gloo", "cpu")
    assert m.predict("x", 100) == 0.0
    assert m.predict("x", 10_000) == pytest.approx(4e-6)


def test_single_point_is_flat_below_and_proportional_above():
    m = model()
    assert m.predict("all_reduce", 100) == pytest.approx(30e-6)
    assert m.predict("all_reduce", 4096) == pytest.approx(60e-6)


def test_fit_takes_the_median_of_repeated_sizes():
    m = CommCostModel.fit({"all_reduce": [(4096, 3.0), (1024, 1.0), (4096, 9.0), (4096, 4.0)]}, 2, "gloo", "cpu")
    assert m.points["all_reduce"] == [(1024, 1.0), (4096, 4.0)]


def test_unknown_collective_names_the_known_ones():
    with pytest.raises(ValueError, match=r"'all_gather'.*all_reduce, all_to_all"):
        model().predict("all_gather", 1024)


def test_json_round_trip(tmp_path: Path):
    m = model()
    path = m.to_json(tmp_path / "sub" / "comm_model.json")
    assert json.loads(path.read_text())["format"] == FORMAT
    assert CommCostModel.from_json(path) == m
    assert [p.name for p in path.parent.iterdir()] == ["comm_model.json"]  # no temp file left behind


def test_from_json_errors(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="missing.json"):
        CommCostModel.from_json(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "weft.comm_cost_model/1", "meta": {')
    with pytest.raises(ValueError, match="bad.json is not valid JSON"):
        CommCostModel.from_json(bad)
    bad.write_text('[1, 2]')
    with pytest.raises(ValueError, match="not a weft communication cost model"):
        CommCostModel.from_json(bad)
    doc = json.loads(model().to_json(tmp_path / "ok.json").read_text())
    doc["points"]["all_to_all"] = [[1024, "fast"]]
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="bad.json: malformed"):
        CommCostModel.from_json(bad)
    doc["points"]["all_to_all"] = [[4096, 1.0], [1024, 2.0]]
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="strictly increasing"):
        CommCostModel.from_json(bad)


def test_bench_comm_on_two_gloo_ranks(tmp_path: Path):
    out, model_path = tmp_path / "comm.json", tmp_path / "model.json"
    sizes = [1024, 16384]
    cfg = comm.CommBenchConfig(sizes, comm.COLLECTIVES, steps=3, warmup=1, json=str(out), model=str(model_path))
    results = run_distributed(comm.run, 2, args=(cfg,), timeout=60)
    assert results[0] == results[1]  # every rank returns the slowest rank's medians

    doc = json.loads(out.read_text())
    assert doc["meta"]["world_size"] == 2 and doc["meta"]["backend"] == "gloo"
    rows = doc["results"]
    assert [(r["bytes"], r["collective"]) for r in rows] == [
        (s, c) for s in sizes for c in ("all_to_all", "all_reduce")]
    for r in rows:
        assert r["median_ms"] > 0 and r["algbw_gbps"] > 0
        factor = 0.5 if r["collective"] == "all_to_all" else 1.0  # (W-1)/W and 2(W-1)/W at W=2
        assert r["busbw_gbps"] == pytest.approx(factor * r["algbw_gbps"])
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["median_ms"] * 1e-3) / 1e9)

    m = CommCostModel.from_json(model_path)
    assert (m.world_size, m.backend, m.device_name) == (2, "gloo", "cpu")
    for r in rows:
        assert m.predict(r["collective"], r["bytes"]) == pytest.approx(r["median_ms"] * 1e-3)


def test_model_defaults_to_a_file_beside_the_json(tmp_path: Path):
    cfg = comm.CommBenchConfig([4096], ("all_reduce",), steps=2, warmup=0, json=str(tmp_path / "c.json"))
    run_distributed(comm.run, 2, args=(cfg,), timeout=60)
    assert CommCostModel.from_json(tmp_path / "c.model.json").collectives == ["all_reduce"]
