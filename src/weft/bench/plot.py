"""Stacked bars of `weft bench layer --json` results: where each mode's time goes.

One horizontal bar per row (mode), grouped by config and capacity factor. A profiled row is cut
into communication not hidden by computation, the overlap of the two, and computation alone, so
the overlap a mode achieves shows as the middle segment shrinking the bar. Time the profiler saw
neither kernel running (idle gaps, host overhead) fills the bar up to the measured median. Rows
without a profile (CPU runs) are one grey bar of the median; a mode that could not run (its row
has "median_ms": null and an "error") keeps its line, with the error instead of a bar. Drawn on an explicit Agg canvas,
not through pyplot, so no display is needed and no global figure state is touched.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from weft.jsonfile import read_json

Row = dict[str, Any]

_DPI = 120
_DECOMPOSITION_KEYS = ("comm_only_ms", "overlap_ms", "compute_only_ms")
# (key, legend label, colour): the order is the stacking order, left to right.
_SEGMENTS = (
    ("comm_only_ms", "communication, not overlapped", "#d62728"),
    ("overlap_ms", "communication overlapped with computation", "#9467bd"),
    ("compute_only_ms", "computation, not overlapped", "#1f77b4"),
    ("other_ms", "other (idle gaps, host)", "#d9d9d9"),
)
_NO_PROFILE = ("total (no profile)", "#8c8c8c")
# Idle time below this share of the median is rounding between profiler and timer, not a segment.
_MIN_OTHER_SHARE = 0.01


def load_layer_results(json_path: str | Path) -> tuple[dict[str, Any], list[Row]]:
    """(meta, rows) of a `weft bench layer --json` file, checked enough to plot."""
    path = Path(json_path)
    doc = read_json(path, f"no benchmark results at {path} (write them with `weft bench layer --json`)")
    if isinstance(doc, list):  # files written before the {"meta", "results"} format
        doc = {"meta": {}, "results": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
        raise ValueError(f"{path} is not `weft bench layer --json` output: expected an object with a "
                         f"'results' list")
    meta, rows = doc.get("meta") or {}, doc["results"]
    for i, row in enumerate(rows):
        _check_row(path, i, row)
    if not any(_is_number(row["median_ms"]) for row in rows):
        raise ValueError(f"{path} has no timed results to plot")
    return meta, rows


def _check_row(path: Path, i: int, row: Any) -> None:
    where = f"{path}: results[{i}]"
    failed = isinstance(row, dict) and row.get("median_ms") is None and "error" in row
    if not isinstance(row, dict) or not (_is_number(row.get("median_ms")) or failed):
        raise ValueError(f"{where} needs a numeric 'median_ms' (or null with an 'error'), got {str(row)[:80]}")
    dec = row.get("decomposition")
    if dec is None:
        return
    if not isinstance(dec, dict) or not all(_is_number(dec.get(k)) for k in _DECOMPOSITION_KEYS):
        raise ValueError(f"{where}: 'decomposition' needs numeric {', '.join(_DECOMPOSITION_KEYS)}, "
                         f"got {str(dec)[:120]}")


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def plot_layer_results(json_path: str | Path, out_png: str | Path | None = None) -> Path:
    """Draw the results in `json_path` as stacked bars; write `out_png` (default: beside it, .png)."""
    meta, rows = load_layer_results(json_path)
    out = Path(out_png) if out_png is not None else Path(json_path).with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig = _figure(meta, rows)
    fig.canvas.print_png(str(out))
    return out


def _group_label(row: Row) -> str:
    cf = row.get("capacity_factor")
    capacity = "dropless" if cf is None else f"capacity {cf:g}"
    return f"{row.get('config', '?')} · {capacity}"


def _segments(row: Row) -> list[tuple[str, float]]:
    """(segment key, ms) from left to right; the no-profile bar is the single key 'total'."""
    dec = row.get("decomposition")
    if dec is None:
        return [("total", row["median_ms"])]
    segs = [(k, max(float(dec[k]), 0.0)) for k in _DECOMPOSITION_KEYS]
    other = row["median_ms"] - sum(ms for _, ms in segs)
    if other > _MIN_OTHER_SHARE * row["median_ms"]:
        segs.append(("other_ms", other))
    return segs


def _format_ms(ms: float) -> str:
    # Same decimals for neighbouring bars, so 11.00 and 11.80 line up as numbers do in a table.
    return f"{ms:.3f} ms" if ms < 1 else f"{ms:.2f} ms" if ms < 100 else f"{ms:.0f} ms"


def _annotation(row: Row, baseline: str) -> str:
    if row["median_ms"] is None:
        return f"not run: {str(row['error'])[:70]}"
    parts = [_format_ms(row["median_ms"])]
    if _is_number(row.get("ratio")):
        parts.append(f"{row['ratio']:.2f}× {baseline}")
    hidden = (row.get("decomposition") or {}).get("hidden_share")
    if _is_number(hidden):
        parts.append(f"hidden {hidden:.0%}")
    return "  ·  ".join(parts)


def _layout(rows: list[Row]) -> tuple[list[tuple[str, Row | None]], bool]:
    """Lines from top to bottom: (label, row) for a bar, (group label, None) for a heading."""
    groups: dict[str, list[Row]] = {}
    for row in rows:
        groups.setdefault(_group_label(row), []).append(row)
    headed = len(groups) > 1  # one group goes in the title instead
    lines: list[tuple[str, Row | None]] = []
    for label, members in groups.items():
        if headed:
            lines.append((label, None))
        lines.extend((str(r.get("mode") or "—"), r) for r in members)
    return lines, headed


def _title(meta: dict[str, Any], rows: list[Row], headed: bool) -> str:
    head = "weft bench layer" + ("" if headed else f": {_group_label(rows[0])}")
    device = meta.get("device_name") or meta.get("device")
    optimizer = meta.get("optimizer")
    bits = [f"{meta['world_size']} × {device}" if "world_size" in meta and device else device,
            meta.get("dtype"),
            f"{meta['tokens_per_rank']} tokens/rank" if "tokens_per_rank" in meta else None,
            f"{meta['activation']} experts" if "activation" in meta else None,
            "forward+backward" + (f" + {optimizer}" if optimizer and optimizer != "none" else ""),
            "NCCL_P2P_DISABLE=1" if meta.get("p2p_disabled") else None]
    return f"{head}\n" + ", ".join(str(b) for b in bits if b)


def _figure(meta: dict[str, Any], rows: list[Row]) -> Figure:
    lines, headed = _layout(rows)
    fig = Figure(figsize=(10, 1.9 + 0.42 * len(lines)), dpi=_DPI, layout="constrained")
    ax = fig.add_subplot()
    colours = {key: (label, colour) for key, label, colour in _SEGMENTS} | {"total": _NO_PROFILE}
    used: dict[str, Any] = {}
    labels = []
    baseline = str(meta.get("baseline") or "baseline")
    timed = [r for r in rows if r["median_ms"] is not None]
    longest = max(max(r["median_ms"], sum(ms for _, ms in _segments(r))) for r in timed)
    for y, (_, row) in enumerate(lines):
        if row is None:
            continue
        if row["median_ms"] is None:
            ax.text(0.01 * longest, y, _annotation(row, baseline), va="center", fontsize=9, color="#666666",
                    style="italic")
            continue
        left = 0.0
        for key, ms in _segments(row):
            name, colour = colours[key]
            used[name] = ax.barh(y, ms, left=left, height=0.7, color=colour, edgecolor="white", linewidth=0.6)
            left += ms
        x = max(left, row["median_ms"]) + 0.01 * longest
        labels.append((x, ax.text(x, y, _annotation(row, baseline), va="center", fontsize=9)))

    ax.set_yticks(range(len(lines)), [label for label, _ in lines])
    for tick, (_, row) in zip(ax.get_yticklabels(), lines):
        if row is None:
            tick.set_fontweight("bold")
    ax.set_ylim(len(lines) - 0.4, -0.6)  # first line on top
    ax.set_xlabel("milliseconds per forward+backward (median of the slowest rank)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(_title(meta, rows, headed), fontsize=11, loc="left")
    # Legend in stacking order, only for segments actually drawn.
    order = [label for _, label, _ in _SEGMENTS] + [_NO_PROFILE[0]]
    names = [n for n in order if n in used]
    fig.legend([used[n] for n in names], names, loc="outside lower center", ncols=min(len(names), 2),
               fontsize=9, frameon=False)
    _fit_annotations(fig, ax, labels)
    return fig


def _fit_annotations(fig: Figure, ax: Any, labels: list[tuple[float, Any]]) -> None:
    """Widen the x-axis until every annotation ends inside it.

    A label is fixed in pixels while the bars scale with the axis, so the room needed depends on
    the rendered text: a label w pixels wide starting at data x fits when x <= xmax (1 - w / W)
    for an axis W pixels wide.
    """
    FigureCanvasAgg(fig).draw()  # lays out the figure, so the axis and text sizes are final
    renderer = fig.canvas.get_renderer()
    axis_px = ax.get_window_extent(renderer).width
    need = max(x / max(1 - (t.get_window_extent(renderer).width + 4) / axis_px, 0.2) for x, t in labels)
    ax.set_xlim(0, max(need, ax.get_xlim()[1]))
