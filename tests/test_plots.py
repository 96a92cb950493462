"""Specification of weft.train.plots: reading metrics.jsonl and drawing a run's figures."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from matplotlib.collections import QuadMesh

from weft.train import plots
from weft.train.plots import compare_figure, load_metrics, plot_run, plot_runs

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def train_row(step: int, layers: int = 2, experts: int = 8, loss: float | None = None) -> dict:
    rng = random.Random(step)
    load = [[rng.randint(0, 100) + (400 if e == step % experts else 0) for e in range(experts)] for _ in range(layers)]
    return {"step": step, "loss": 5.0 / step ** 0.3 if loss is None else loss, "ce_loss": 4.9 / step ** 0.3,
            "aux_loss": 0.01 + 0.001 * rng.random(), "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 4e4 + step,
            "mfu": 0.3 if layers else None, "dropped_share": 0.01, "expert_load": load,
            "imbalance": [max(c) / (sum(c) / len(c)) for c in load], "elapsed_s": 0.1}


def write_run(run_dir: Path, rows: list[dict], tail: str = "") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return path


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    assert path.stat().st_size > 5_000


@pytest.fixture
def resumed_run(tmp_path: Path) -> Path:
    """Steps 1-6 with a val line, killed and resumed from step 4 (steps 5-6 re-logged), truncated at the end."""
    rows = [train_row(s) for s in range(1, 7)] + [{"step": 5, "val_loss": 4.0}]
    rows += [train_row(s, loss=1.0) for s in (5, 6)] + [{"step": 6, "val_loss": 3.5}, train_row(7)]
    write_run(tmp_path / "run", rows, tail='{"step": 8, "loss": 2.')
    return tmp_path / "run"


def test_load_metrics_keeps_the_last_row_of_each_step(resumed_run: Path):
    with pytest.warns(UserWarning, match="metrics.jsonl:12: skipping truncated last line"):
        train, val = load_metrics(resumed_run / "metrics.jsonl")
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6, 7]
    assert [r["loss"] for r in train if r["step"] in (5, 6)] == [1.0, 1.0]
    assert val == [{"step": 5, "val_loss": 4.0}, {"step": 6, "val_loss": 3.5}]


def test_plot_run_writes_three_pngs(resumed_run: Path):
    with pytest.warns(UserWarning, match="truncated"):
        paths = plot_run(resumed_run)
    assert [p.name for p in paths] == ["loss.png", "throughput.png", "expert_load.png"]
    for path in paths:
        assert path.parent == resumed_run / "plots"
        assert_png(path)


def test_plot_run_out_dir_and_log_y(resumed_run: Path, tmp_path: Path):
    with pytest.warns(UserWarning):
        paths = plot_run(str(resumed_run), tmp_path / "figs" / "nested", log_y=True)
    assert all(p.parent == tmp_path / "figs" / "nested" and p.is_file() for p in paths)


def test_dense_run_skips_the_expert_heatmap(tmp_path: Path):
    write_run(tmp_path, [train_row(s, layers=0) for s in range(1, 20)])
    paths = plot_run(tmp_path)
    assert [p.name for p in paths] == ["loss.png", "throughput.png"]
    assert not (tmp_path / "plots" / "expert_load.png").exists()
    for path in paths:
        assert_png(path)


def test_single_step_without_optional_fields(tmp_path: Path):
    write_run(tmp_path, [{"step": 1, "loss": 3.0}])
    assert [p.name for p in plot_run(tmp_path)] == ["loss.png", "throughput.png"]


def test_layers_missing_from_some_steps_still_plot(tmp_path: Path):
    """A step that logged fewer layers (or none) leaves a gap in that layer's heatmap, not an error."""
    rows = [train_row(1, layers=2), train_row(2, layers=1), {"step": 3, "loss": 2.0, "expert_load": []}]
    write_run(tmp_path, rows)
    assert_png(plot_run(tmp_path)[-1])


def test_corrupt_middle_line_names_its_number(tmp_path: Path):
    path = write_run(tmp_path, [train_row(1)], tail='{"step": 2, "lo\n' + json.dumps(train_row(3)) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not valid JSON"):
        load_metrics(path)
    with pytest.raises(ValueError, match=r":2: "):
        plot_run(tmp_path)


def test_row_without_integer_step_names_its_line(tmp_path: Path):
    path = write_run(tmp_path, [train_row(1), {"loss": 2.0}, train_row(3)])
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: expected a JSON object with an integer 'step'"):
        load_metrics(path)


def test_missing_run_dir_or_metrics_file(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        plot_run(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_run(tmp_path)
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        load_metrics(tmp_path / "metrics.jsonl")


def test_no_training_steps(tmp_path: Path):
    write_run(tmp_path, [{"step": 10, "val_loss": 3.0}])
    with pytest.raises(ValueError, match="no training steps"):
        plot_run(tmp_path)


def test_large_runs_draw_binned_heatmaps(tmp_path: Path):
    """10k steps x 2 layers x 64 experts: each heatmap bins the steps into at most
    `_MAX_HEATMAP_COLUMNS` columns (what keeps a long run's plot fast to draw; its time is no unit
    test's business), each column's shares summing to 1; the run still plots."""
    row = train_row(1, layers=2, experts=64)
    lines = [json.dumps({**row, "step": s, "loss": 5.0 / s ** 0.3}) for s in range(1, 10_001)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert len(plot_run(tmp_path)) == 3
    gen = np.random.default_rng(0)
    layers = [gen.integers(0, 50, size=(10_000, 64)).astype(float) for _ in range(2)]
    figure = plots._expert_load_figure("large", np.arange(1, 10_001), layers)
    meshes = [c for ax in figure.axes if ax.get_title().startswith("MoE layer") for c in ax.collections
              if isinstance(c, QuadMesh)]
    assert len(meshes) == 2
    for mesh in meshes:
        shares = np.asarray(mesh.get_array()).reshape(64, -1)
        assert shares.shape[1] == plots._MAX_HEATMAP_COLUMNS
        np.testing.assert_allclose(shares.sum(axis=0), 1.0, rtol=1e-9)


def test_several_runs_overlay_by_step_and_by_tokens(tmp_path: Path):
    """Each run draws its train loss and its validation points against the step and the tokens
    read; a run logged before `tokens` existed is left out of the tokens panel only."""
    moe = [{**train_row(s), "tokens": 1000 * s} for s in range(1, 11)]
    moe += [{"step": 10, "tokens": 10_000, "val_loss": 2.5}]
    dense = [{**train_row(s, layers=0), "loss": 6.0 / s ** 0.2, "tokens": 2000 * s} for s in range(1, 6)]
    dense += [{"step": 5, "tokens": 10_000, "val_loss": 3.0}]
    old = [train_row(s) for s in range(1, 4)] + [{"step": 3, "val_loss": 4.0}]
    runs = [("moe", *load_metrics(write_run(tmp_path / "moe", moe))),
            ("dense", *load_metrics(write_run(tmp_path / "dense", dense))),
            ("old", *load_metrics(write_run(tmp_path / "old", old)))]
    by_step, by_tokens = compare_figure(runs).axes
    step_lines, token_lines = by_step.get_lines(), by_tokens.get_lines()
    assert len(step_lines) == 6 and len(token_lines) == 4
    assert [line.get_label() for line in token_lines if not line.get_label().startswith("_")] == \
        ["moe (val)", "dense (val)"]
    assert list(step_lines[2].get_xdata()) == [1, 2, 3, 4, 5]  # dense train loss by step
    # the train lines show the cross-entropy (runs with other aux-loss weights compare alike)
    assert list(step_lines[2].get_ydata()) == [4.9 / s ** 0.3 for s in range(1, 6)]
    assert list(token_lines[2].get_xdata()) == [2000, 4000, 6000, 8000, 10000]  # ... by tokens
    assert list(token_lines[3].get_ydata()) == [3.0]  # dense val loss at 10k tokens


def test_plot_runs_writes_compare_png_and_checks_its_inputs(tmp_path: Path):
    for name in ("a", "b"):
        write_run(tmp_path / name / "run", [{**train_row(s), "tokens": 100 * s} for s in range(1, 5)])
    path = plot_runs([tmp_path / "a" / "run", tmp_path / "b" / "run"], tmp_path / "figs")
    assert path == tmp_path / "figs" / "compare.png"
    assert_png(path)
    with pytest.raises(ValueError, match="at least two"):
        plot_runs([tmp_path / "a" / "run"])
    with pytest.raises(FileNotFoundError, match="nowhere"):
        plot_runs([tmp_path / "a" / "run", tmp_path / "nowhere"])


def test_a_run_without_cross_entropy_shows_its_loss():
    rows = [{"step": s, "loss": 3.0 / s} for s in range(1, 4)]
    by_step, _ = compare_figure([("a", rows, []), ("b", rows, [])]).axes
    assert list(by_step.get_lines()[0].get_ydata()) == [3.0, 1.5, 1.0]


def test_weft_plot_with_several_runs_prints_the_comparison(tmp_path: Path, capsys, monkeypatch):
    from weft.cli import main

    write_run(tmp_path / "moe", [{**train_row(s), "tokens": 100 * s, "dropped_share": 0.1 * s} for s in range(1, 5)]
              + [{"step": 4, "tokens": 400, "val_loss": 2.5}])
    write_run(tmp_path / "dense", [{**train_row(s, layers=0), "tokens": 100 * s} for s in range(1, 5)])
    monkeypatch.chdir(tmp_path)
    main(["plot", "moe", "dense", "--drops-after", "2"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| run | steps | tokens | val loss (last)") and "after step 2" in lines[0]
    assert lines[2].startswith("| moe | 4 | 400 | 2.5000 | 2.5000 (4) | 35.0% / 40.0% |")  # steps 3-4
    assert lines[3].startswith("| dense | 4 | 400 | - | - | - |")
    assert lines[4:] == ["compare.png", "compare.json"]
    assert_png(tmp_path / "compare.png")
    doc = json.loads((tmp_path / "compare.json").read_text())
    assert doc["drops_after"] == 2 and [r["name"] for r in doc["runs"]] == ["moe", "dense"]
    assert doc["runs"][0]["dropped_max"] == pytest.approx(0.4) and doc["runs"][1]["dropped_mean"] is None
    with pytest.raises(SystemExit):
        main(["plot", "moe", "missing"])
    assert "missing does not exist" in capsys.readouterr().err


def test_the_experts_pro_prophet_copied_are_marked_on_the_load_heatmap():
    from weft.train.plots import _copied_experts, _expert_counts, _expert_load_figure

    rows = [{**train_row(s), "copied_experts": [[s % 8] if s % 3 == 0 else [], [1, 2] if s == 5 else []]}
            for s in range(1, 10)]
    copied = _copied_experts(rows, 2)
    assert copied == [([3, 6, 9], [3, 6, 1]), ([5, 5], [1, 2])]
    fig = _expert_load_figure("run", np.array([r["step"] for r in rows]), _expert_counts(rows), copied)
    heatmaps = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"][:2]
    marks = [ax.collections[-1].get_offsets().tolist() for ax in heatmaps]
    assert marks == [[[3, 3], [6, 6], [9, 1]], [[5, 1], [5, 2]]]
    assert _copied_experts([train_row(1)], 2) is None  # runs without balancing draw no marks
