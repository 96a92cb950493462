"""`--tp-overlap auto` (weft.tp.search): the candidates the batch and width allow, the fastest by
the slowest rank's median (every rank picks the same), the decision cached and reused without
timing, a broken cache a one-line error on every rank."""
from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed as dist

from test_train import config as train_config
from test_train import corpus, losses, run  # noqa: F401  (corpus is a fixture)
from test_train_tp import DENSE
from weft.testing import Checks, run_checks
from weft.tp import Domino, Sequential
from weft.tp.search import candidate_schedules, choose_schedule, schedule_name
from weft.train.config import TrainConfig


def test_candidates_fit_the_batch_and_width():
    assert [schedule_name(s) for s in candidate_schedules(8, 64)] == [
        "none", "domino p1=2 p2=1", "domino p1=4 p2=1", "domino p1=1 p2=2", "domino p1=1 p2=4", "domino p1=2 p2=2"]
    assert [schedule_name(s) for s in candidate_schedules(1, 2)] == ["none", "domino p1=1 p2=2"]
    assert isinstance(candidate_schedules(1, 1)[0], Sequential) and len(candidate_schedules(1, 1)) == 1


def search_worker(cache: str) -> list[str]:
    rank = dist.get_rank()
    checks = Checks(f"rank {rank}")
    calls = []

    def step(schedule) -> None:
        calls.append(schedule_name(schedule))
        # Megatron's schedule is fastest on rank 0 but slowest on rank 1; p1=2 p2=2 is second
        # everywhere: by the slowest rank's time it wins.
        if isinstance(schedule, Sequential):
            time.sleep(0.001 if rank == 0 else 0.03)
        elif isinstance(schedule, Domino) and (schedule.p1, schedule.p2) == (2, 2):
            time.sleep(0.005)
        else:
            time.sleep(0.02)

    device = torch.device("cpu")
    chosen, report = choose_schedule(step, 4, 32, device, "shape-a", cache, trials=2, warmup=1)
    checks.expect(schedule_name(chosen) == "domino p1=2 p2=2", f"chose {report}")
    checks.expect(not report["from_cache"] and len(calls) == 3 * len(report["times_ms"]), f"{len(calls)} calls")
    calls.clear()
    again, report = choose_schedule(step, 4, 32, device, "shape-a", cache, trials=2, warmup=1)
    checks.expect(report["from_cache"] and not calls and schedule_name(again) == "domino p1=2 p2=2",
                  f"the cached decision was not reused: {report}, {len(calls)} calls")
    dist.barrier()
    if rank == 0:
        with open(cache, "w") as f:
            f.write("[1, 2")
    dist.barrier()
    try:
        choose_schedule(step, 4, 32, device, "shape-b", cache)
        checks.expect(False, "a broken cache was read")
    except ValueError as e:
        checks.expect("is not valid JSON" in str(e), f"unexpected error {e}")
    return checks.failures


def test_the_fastest_schedule_by_the_slowest_rank_is_chosen_and_cached(tmp_path):
    cache = tmp_path / "tp_schedules.json"
    failures = run_checks(search_worker, 2, args=(str(cache),), timeout=120)
    assert not failures, "\n".join(failures)


def test_train_tp_overlap_auto_picks_a_schedule_and_trains_like_one_rank(corpus, tmp_path):  # noqa: F811
    out = tmp_path / "auto"
    run(train_config(corpus, out, model=dict(DENSE), steps=4, tp=2, tp_overlap="auto"), 2,
                  tmp_path / "cache")
    reference = tmp_path / "one"
    run(train_config(corpus, reference, model=dict(DENSE), steps=4), 1, tmp_path / "cache")
    assert [losses(out)[s] for s in range(1, 5)] == pytest.approx([losses(reference)[s] for s in range(1, 5)],
                                                                  abs=2e-4)
    table = json.loads((tmp_path / "cache" / "tp_schedules.json").read_text())
    (key, decision), = table.items()
    assert "tp2-world2-cpu" in key and decision["chosen"] in decision["times_ms"], table
    with pytest.raises(ValueError, match="set --tp > 1"):
        TrainConfig(tp_overlap="auto").validate()
