"""`weft bench tp` end to end on 2 gloo ranks: every schedule, a repeated one, JSON."""
from __future__ import annotations

import json
import re

import pytest
import torch

from weft.bench import tp
from weft.bench.peers import build_tp_peer
from weft.bench.tp import TPBenchConfig, flops_per_step
from weft.testing import run_distributed


def test_tiny_tp_benchmark_writes_well_formed_json(tmp_path):
    out = tmp_path / "tp.json"
    cfg = TPBenchConfig("tiny", layers=2, batch_size=4, p1=2, modes=("none", "domino", "no-comm", "domino"),
                        steps=2, warmup=1, json=str(out))
    run_distributed(tp.run, 2, args=(cfg,), timeout=300)
    report = json.loads(out.read_text())
    assert report["meta"]["tp"] == 2 and report["meta"]["p1"] == 2 and report["meta"]["layers"] == 2
    rows = report["results"]
    assert [(r["mode"], r["repeat"]) for r in rows] == [("none", 0), ("domino", 0), ("no-comm", 0), ("domino", 1)]
    for r in rows:
        assert r["median_ms"] > 0 and r["min_ms"] <= r["median_ms"] and r["iqr_ms"] >= 0
        assert r["speedup"] == pytest.approx(rows[0]["median_ms"] / r["median_ms"])
        assert "decomposition" not in r  # GPU only
    assert rows[0]["max_abs_error"] == 0.0 and rows[1]["max_abs_error"] < 1e-5  # domino computes Megatron's function
    assert rows[2]["max_abs_error"] is None  # no-comm is not the model's function
    for r in rows:  # the share of the no-communication time each schedule reaches
        assert r["of_no_comm"] == pytest.approx(rows[2]["median_ms"] / r["median_ms"])
    shape = tp.SHAPES["tiny"]
    assert rows[0]["tflops_per_rank"] == pytest.approx(
        flops_per_step(shape, 2, 4, shape.seq_len) / 2 / (rows[0]["median_ms"] * 1e-3) / 1e12)


def test_model_benchmark_times_the_tensor_parallel_schedules(tmp_path):
    """`weft bench model --tp 2`: a dense preset split over 2 gloo ranks, Megatron's and Domino's
    schedules checked against each other on the same weights and batch, then timed."""
    from weft.bench import model
    from weft.bench.model import ModelBenchConfig
    out = tmp_path / "model.json"
    cfg = ModelBenchConfig(preset="tiny-dense", batch_size=4, modes=("tp", "domino", "no-comm"), steps=2, warmup=1,
                           json=str(out), tp=2, p1=2, p2=2, profile_steps=0)
    run_distributed(model.run, 2, args=(cfg,), timeout=300)
    report = json.loads(out.read_text())
    assert (report["meta"]["tp"], report["meta"]["p1"], report["meta"]["p2"]) == (2, 2, 2)
    rows = {r["mode"]: r for r in report["results"]}
    assert rows["tp"]["max_error"] == 0.0 and rows["domino"]["max_error"] < 1e-5
    assert rows["no-comm"]["max_error"] is None
    assert all(r["iteration_ms"] > 0 for r in rows.values()) and rows["tp"]["speedup"] == 1.0


@pytest.mark.parametrize("kw, message", [
    (dict(tp=2, modes=("none",)), "choose from tp, domino, domino-copy, no-comm (with --tp 2)"),
    (dict(modes=("domino",)), "tp, domino, domino-copy, no-comm need --tp"),
    (dict(tp=3, preset="tiny", modes=("tp",), batch_size=1), "do not divide evenly"),
    (dict(tp=2, modes=("domino",), p1=16, batch_size=8), "--p1 16 exceeds --batch-size 8"),
])
def test_model_benchmark_refuses_tensor_parallel_settings_it_cannot_run(kw, message):
    from weft.bench.model import ModelBenchConfig
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelBenchConfig(**{"preset": "tiny-dense", **kw}).validate()


def test_graphed_modes_need_cuda():
    from weft.testing import DistributedTestError
    cfg = TPBenchConfig("tiny", layers=1, batch_size=2, modes=("none", "domino+graph"), steps=1, warmup=1)
    cfg.validate()  # a known mode
    with pytest.raises(DistributedTestError, match=r"\+graph need CUDA"):
        run_distributed(tp.run, 1, args=(cfg,), timeout=120)


def test_peer_rows_say_why_they_cannot_run_here(tmp_path, capsys):
    """`--modes ...,megatron,deepspeed` where a peer cannot run (not installed; Megatron-Core also
    needs CUDA): its row names the reason and the other modes are timed as usual."""
    out = tmp_path / "tp.json"
    cfg = TPBenchConfig("tiny", layers=1, batch_size=2, p1=2, modes=("none", "megatron", "domino", "deepspeed"),
                        steps=1, warmup=1, json=str(out))
    run_distributed(tp.run, 2, args=(cfg,), timeout=300)
    report = json.loads(out.read_text())
    rows = report["results"]
    assert [r["mode"] for r in rows] == ["none", "megatron", "domino", "deepspeed"]
    assert rows[0]["median_ms"] > 0 and rows[2]["max_abs_error"] < 1e-5
    megatron, deepspeed = rows[1], rows[3]
    assert megatron["median_ms"] is None and megatron["speedup"] is None
    assert "megatron.core is not installed" in megatron["error"] or "need CUDA" in megatron["error"]
    if deepspeed["median_ms"] is None:  # DeepSpeed runs on gloo where it is installed
        assert "deepspeed is not installed" in deepspeed["error"], deepspeed["error"]
    else:
        assert deepspeed["max_abs_error"] is None and "Domino" in deepspeed["description"]
    capsys.readouterr()
    tp.print_table(report)
    assert re.search(r"megatron  unavailable: PeerUnavailable: ", capsys.readouterr().out)


def test_graphs_of_peers_and_unknown_peers_are_refused():
    with pytest.raises(ValueError, match="choose from none, domino, domino-copy, no-comm, megatron, deepspeed"):
        TPBenchConfig("tiny", modes=("megatron+graph",)).validate()
    with pytest.raises(ValueError, match="unknown tensor-parallel peer 'apex'"):
        build_tp_peer("apex", 64, 4, 256, 1, 32, 1e-5, 1e4, torch.float32, "cpu", 1)
    with pytest.raises(ValueError, match=r"heads \(4\) and MLP width \(256\) must split over 3 ranks"):
        build_tp_peer("deepspeed", 64, 4, 256, 1, 32, 1e-5, 1e4, torch.float32, "cpu", 3)
