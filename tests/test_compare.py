"""Specification of weft.train.compare: the numbers `weft plot RUN RUN` prints per run."""
from __future__ import annotations

import pytest

from weft.train.compare import format_table, summarize


def rows(steps, fields):
    return [{"step": s, "loss": 3.0, "tokens": 10 * s, "expert_load": [[1, 2]], **fields(s)} for s in steps]


def test_summary_of_an_moe_run():
    train = rows(range(1, 11), lambda s: {"dropped_share": s / 100, "tokens_per_s": 100.0 * s, "mfu": 0.01 * s})
    val = [{"step": 5, "val_loss": 2.0}, {"step": 10, "val_loss": 2.2}]
    s = summarize("moe", train, val, drops_after=6)
    assert (s.steps, s.tokens, s.final_val_loss, s.best_val_loss, s.best_val_step) == (10, 100, 2.2, 2.0, 5)
    assert s.dropped_mean == pytest.approx((0.07 + 0.08 + 0.09 + 0.10) / 4)  # the steps after 6 only
    assert s.dropped_max == pytest.approx(0.10)
    assert s.tokens_per_s == 550.0 and s.mfu == pytest.approx(0.055)  # medians


def test_a_dense_run_and_a_run_without_validation_show_dashes():
    dense = [{"step": s, "loss": 3.0, "dropped_share": 0.0, "expert_load": []} for s in (1, 2)]
    s = summarize("dense", dense, [], drops_after=0)
    assert s.dropped_mean is None and s.final_val_loss is None and s.tokens is None and s.mfu is None
    table = format_table([s], drops_after=0).splitlines()
    assert table[2] == "| dense | 2 | - | - | - | - | - | - |"


def test_no_drops_logged_after_the_cut_shows_a_dash():
    s = summarize("moe", rows(range(1, 4), lambda s: {"dropped_share": 0.5}), [], drops_after=3)
    assert s.dropped_mean is None and s.dropped_max is None


def test_a_run_without_training_rows_is_an_error():
    with pytest.raises(ValueError, match="run empty has no logged training steps"):
        summarize("empty", [], [{"step": 1, "val_loss": 2.0}])
