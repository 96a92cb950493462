"""Specification of weft.bench.plot: stacked bars from `weft bench layer --json` output."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from weft.bench.plot import load_layer_results, plot_layer_results

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def row(mode: str, median: float, cf: float | None = 1.0, config: str = "mixtral", profiled: bool = True) -> dict:
    r = {"config": config, "mode": mode, "capacity_factor": cf, "median_ms": median, "ratio": median / 10.0,
         "max_abs_error": None if mode == "baseline" else 1e-3}
    if profiled:
        comm, compute, overlap = 0.4 * median, 0.55 * median, (0.0 if mode == "baseline" else 0.2 * median)
        r["decomposition"] = {"comm_ms": comm, "compute_ms": compute, "comm_only_ms": comm - overlap,
                              "overlap_ms": overlap, "compute_only_ms": compute - overlap,
                              "hidden_share": overlap / comm}
    return r


def write(path: Path, doc) -> Path:
    path.write_text(json.dumps(doc))
    return path


def test_plot_with_decomposition_and_groups(tmp_path: Path):
    rows = [row(m, t, cf) for cf in (1.0, None) for m, t in (("baseline", 10.0), ("chunked", 8.5), ("lancet", 7.9))]
    meta = {"world_size": 8, "device_name": "NVIDIA H100", "dtype": "bf16", "tokens_per_rank": 4096}
    path = write(tmp_path / "layer.json", {"meta": meta, "results": rows})
    out = plot_layer_results(path)
    assert out == tmp_path / "layer.png"
    assert out.read_bytes()[:8] == PNG_SIGNATURE


def test_plot_without_decomposition_and_with_a_failed_mode(tmp_path: Path):
    failed = {"config": "mixtral", "mode": "tutel", "capacity_factor": 1.0, "median_ms": None,
              "error": "ImportError: tutel is not installed"}
    rows = [row("baseline", 3.0, profiled=False), row("chunked", 3.3, profiled=False), failed]
    path = write(tmp_path / "cpu.json", {"meta": {}, "results": rows})
    out = plot_layer_results(path, tmp_path / "figs" / "cpu_bars.png")
    assert out == tmp_path / "figs" / "cpu_bars.png"
    assert out.read_bytes()[:8] == PNG_SIGNATURE


def test_a_bare_list_of_rows_is_read_as_results(tmp_path: Path):
    path = write(tmp_path / "old.json", [row("baseline", 1.0, profiled=False)])
    meta, rows = load_layer_results(path)
    assert meta == {} and rows[0]["mode"] == "baseline"


@pytest.mark.parametrize("content, match", [
    ("{not json", "is not valid JSON"),
    ('{"meta": {}}', "expected an object with a 'results' list"),
    ('{"meta": {}, "results": []}', "has no timed results"),
    ('{"results": [{"median_ms": null, "error": "x"}]}', "has no timed results"),
    ('{"results": [{"mode": "baseline"}]}', r"results\[0\] needs a numeric 'median_ms'"),
    ('{"results": [{"median_ms": 1.0, "decomposition": {"overlap_ms": 1}}]}', "'decomposition' needs numeric"),
])
def test_bad_input_is_a_value_error_naming_the_file(tmp_path: Path, content: str, match: str):
    path = tmp_path / "broken.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match) as info:
        plot_layer_results(path)
    assert "broken.json" in str(info.value)
    assert not (tmp_path / "broken.png").exists()


def test_missing_file(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="nothing.json"):
        plot_layer_results(tmp_path / "nothing.json")
