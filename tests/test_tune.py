"""The tuning dictionary (Tutel 3.3): "auto" never changes results, all ranks agree on the
choice, decisions are reused per capacity bucket and survive a reload from JSON."""
from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed as dist

from weft import MoE
from weft.testing import run_distributed
from weft.tune import Setting, TuningDictionary
from weft.tune.dictionary import candidates_for, layer_key

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
    candidates = candidates_for(auto)
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
    expected = ["d1-linear", "d2-linear", "d4-linear", "d8-linear"]
    expected += ["d1-2dh", "d2-2dh", "d4-2dh", "d8-2dh"] if a2a_auto else []  # 2DH pipelines too
    assert results[0]["candidates"] == expected
    assert all(r["measured"] == 2 * len(expected) for r in results)  # each candidate twice, then reused
    assert all(r["remeasured"] == 0 for r in results)  # the reloaded dictionary knows the answer
    doc = json.loads(path.read_text())
    assert doc["format"] == "weft.tuning/1"


def test_buckets_are_tuned_separately_and_dropless_needs_no_tuning():
    tuning = TuningDictionary(bucket_size=4, trials=1)
    moe = MoE(DIM, HIDDEN, EXPERTS, capacity_factor=1.0, overlap_degree="auto", tuning=tuning)
    for tokens in (32, 32, 32, 32, 128):
        moe(torch.randn(tokens, DIM))
    buckets = next(iter(tuning.table.values()))
    assert set(buckets) == {str(8 // 4), str(32 // 4)}  # C = 8 and C = 32 (k=2, E=8, cf=1)
    dropless = MoE(DIM, HIDDEN, EXPERTS, capacity_factor=None, overlap_degree="auto", tuning=TuningDictionary())
    assert candidates_for(dropless) == [Setting(1, "linear")]
    dropless(torch.randn(8, DIM))
    assert dropless.tuning.measurements == 0


def test_corrupt_tuning_file_is_refused(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON"):
        TuningDictionary(path)
    path.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not a weft tuning file"):
        TuningDictionary(path)


def test_weft_tune_writes_a_dictionary_that_layers_reuse(tmp_path):
    from weft.tune.run import run

    path = tmp_path / "tiny.json"
    summary = run_distributed(run, 2, args=("tiny", 64, 1.0, "relu", torch.float32, str(path), 1, "auto"))[0]
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
    names = [c.name for c in candidates_for(moe)]
    for _ in range(3):
        assert torch.allclose(moe(x), plain(x), atol=1e-6)
    fixed = [c.name for c in (moe.__setattr__("parallel_r", 0) or candidates_for(moe))]
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
    tuning = TuningDictionary(trials=2)
    fast, slow = Setting(1, "linear"), Setting(2, "linear")
    execute = lambda s, rows: _SlowBackward.apply(rows, 0.05 if s == slow else 0.0)  # noqa: E731
    for _ in range(5):
        x = torch.randn(8, DIM, requires_grad=True)
        tuning.run(moe, 8, [fast, slow], execute, x).sum().backward()
        assert torch.equal(x.grad, torch.full_like(x, 2.0))  # the marks pass gradients through
    times = tuning.table[layer_key(moe)]["0"]["times_ms"]
    assert min(times[slow.name]) >= 50 > max(times[fast.name])
    assert tuning.best(layer_key(moe), 8) == fast
    # No backward: the pending trial is closed by the next call with its forward time only.
    other = TuningDictionary(trials=1)
    other.run(moe, 8, [fast, slow], lambda s, rows: _SlowBackward.apply(rows, 0.05), torch.randn(8, DIM, requires_grad=True))
    other.run(moe, 8, [fast, slow], lambda s, rows: _SlowBackward.apply(rows, 0.05), torch.randn(8, DIM, requires_grad=True))
    recorded = other.table[layer_key(moe)]["0"]["times_ms"]
    assert len(recorded[fast.name]) == 1 and recorded[fast.name][0] < 50
