"""Figures of a run from its metrics.jsonl: loss, throughput, and per-layer expert load; and
several runs' losses overlaid (e.g. an MoE model against its dense twin), by step and by tokens.

The expert-load heatmap (x = step, y = expert, colour = share of the layer's routed tokens) follows
the load-over-time figures of Pro-Prophet (figs. 3-4): it shows which experts stay hot, and for how
long. Figures are drawn on an explicit Agg canvas rather than through pyplot, so plotting needs no
display and leaves the process's matplotlib backend and global figure list alone.
"""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, FormatStrFormatter, LogLocator, NullFormatter

Row = dict[str, Any]

# Wider than the rendered heatmap in pixels: more columns would only be averaged by the renderer.
_MAX_HEATMAP_COLUMNS = 800
_MAX_PANEL_ROWS = 8
_DPI = 120


def load_metrics(path: str | Path) -> tuple[list[Row], list[Row]]:
    """(train rows, val rows) of a metrics.jsonl, each sorted by step; a re-logged step keeps its last row."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path}")
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    train: dict[int, Row] = {}
    val: dict[int, Row] = {}
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if i == last:  # a run killed mid-write leaves a partial final line
                warnings.warn(f"{path}:{i + 1}: skipping truncated last line ({e.msg})", stacklevel=2)
                continue
            raise ValueError(f"{path}:{i + 1}: not valid JSON ({e}): {line[:80]!r}; a run killed mid-write "
                             "and then resumed leaves such a line, delete it") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ValueError(f"{path}:{i + 1}: expected a JSON object with an integer 'step', got {line[:80]!r}")
        if "loss" in row:
            train[row["step"]] = row
        elif "val_loss" in row:
            val[row["step"]] = row
    return [train[s] for s in sorted(train)], [val[s] for s in sorted(val)]


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None, *, log_y: bool = False) -> list[Path]:
    """Write loss.png, throughput.png and (for MoE runs) expert_load.png; return their paths.

    `out_dir` defaults to RUN_DIR/plots; `log_y` puts the loss on a log scale.
    """
    run_dir = Path(run_dir)
    train, val = _read_run(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    steps = np.array([row["step"] for row in train])
    name = run_dir.resolve().name
    drawers = {"loss.png": lambda: _loss_figure(name, steps, train, val, log_y),
               "throughput.png": lambda: _throughput_figure(name, steps, train)}
    layers = _expert_counts(train)
    if layers:  # dense runs log no expert load
        copied = _copied_experts(train, len(layers))
        drawers["expert_load.png"] = lambda: _expert_load_figure(name, steps, layers, copied)
    return [_save(draw(), out / file_name) for file_name, draw in drawers.items()]


def _read_run(run_dir: Path) -> tuple[list[Row], list[Row]]:
    """(train rows, val rows) of a run folder; errors name a missing folder or an empty run."""
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    metrics = run_dir / "metrics.jsonl"
    train, val = load_metrics(metrics)
    if not train:
        raise ValueError(f"{metrics} has no training steps (no line with a 'loss'), so there is nothing to plot")
    return train, val


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=_DPI)
    return path


def plot_runs(run_dirs: list[str | Path], out_dir: str | Path = ".") -> Path:
    """Overlay the losses of several runs in `out_dir`/compare.png and return its path: train
    cross-entropy (thin) and validation loss (dots) of each run against the step, and the tokens
    read (runs whose metrics predate the `tokens` field are left out of that panel)."""
    return save_compare_figure(read_runs(run_dirs), out_dir)


def save_compare_figure(runs: list[tuple[str, list[Row], list[Row]]], out_dir: str | Path) -> Path:
    """`compare_figure(runs)` saved as `out_dir`/compare.png; returns its path."""
    fig = compare_figure(runs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return _save(fig, out / "compare.png")


def read_runs(run_dirs: list[str | Path]) -> list[tuple[str, list[Row], list[Row]]]:
    """(name, train rows, val rows) of each of at least two run folders, named by the folder's
    name, or by its path where two names clash."""
    if len(run_dirs) < 2:
        raise ValueError("comparing needs at least two run directories")
    runs = [(run_dir, *_read_run(run_dir)) for run_dir in map(Path, run_dirs)]
    names = [d.resolve().name for d, _, _ in runs]
    if len(set(names)) < len(names):  # e.g. a/run and b/run: name them by path
        names = [str(d) for d, _, _ in runs]
    return [(name, train, val) for name, (_, train, val) in zip(names, runs)]


def compare_figure(runs: list[tuple[str, list[Row], list[Row]]]) -> Figure:
    """The figure of `plot_runs` from (name, train rows, val rows) per run: two axes, by step and by
    tokens, each run a thin train line (its cross-entropy where logged, else its loss) and a dotted
    validation line labelled "NAME (val)"."""
    fig = Figure(figsize=(13, 5), layout="constrained")
    by_step, by_tokens = fig.subplots(1, 2, sharey=True)
    for i, (name, train, val) in enumerate(runs):
        color = f"C{i % 10}"
        for ax, key in ((by_step, "step"), (by_tokens, "tokens")):
            rows = [r for r in train if r.get(key) is not None]
            if not rows:
                continue
            # The cross-entropy, not the total loss: runs with other aux/z-loss weights compare alike.
            loss_key = "ce_loss" if all(r.get("ce_loss") is not None for r in rows) else "loss"
            ax.plot([r[key] for r in rows], _series(rows, loss_key), lw=0.8, alpha=0.4, color=color)
            points = [r for r in val if r.get(key) is not None]
            ax.plot([r[key] for r in points], _series(points, "val_loss"), "o-", ms=4, color=color,
                    label=f"{name} (val)")
    by_step.set(xlabel="step", ylabel="loss", title="Loss by step (lines: train cross-entropy, dots: validation)")
    by_tokens.set(xlabel="tokens read", title="Loss by tokens")
    by_tokens.xaxis.set_major_formatter(EngFormatter())
    for ax in (by_step, by_tokens):
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
    return fig


def _series(rows: list[Row], key: str) -> np.ndarray:
    """rows[i][key] as floats, NaN where missing or null (e.g. MFU on CPU)."""
    return np.array([np.nan if row.get(key) is None else float(row[key]) for row in rows])


def _present(values: np.ndarray) -> bool:
    return bool(np.isfinite(values).any())


def _loss_figure(name: str, steps: np.ndarray, train: list[Row], val: list[Row], log_y: bool) -> Figure:
    fig = Figure(figsize=(9, 6), layout="constrained")
    aux = _series(train, "aux_loss")
    if _present(aux):
        axes: list[Axes] = list(fig.subplots(2, 1, sharex=True, height_ratios=[3, 1]))
    else:
        axes = [fig.subplots()]
    ax = axes[0]
    ax.plot(steps, _series(train, "loss"), lw=1, color="C0", label="train loss")
    ce = _series(train, "ce_loss")
    if _present(ce):
        ax.plot(steps, ce, lw=1, ls="--", color="C1", label="train CE loss")
    if val:
        ax.plot([r["step"] for r in val], _series(val, "val_loss"), "o", ms=5, color="C3", zorder=3, label="val loss")
    if log_y:
        ax.set_yscale("log")
        # Losses often span less than a decade, where the default log ticks leave the axis unlabelled.
        ax.yaxis.set_major_locator(LogLocator(subs=(1, 1.5, 2, 3, 5, 7)))
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set(ylabel="loss", title=f"Loss: {name}")
    ax.legend()
    if len(axes) == 2:
        axes[1].plot(steps, aux, lw=1, color="C2")
        axes[1].set(ylabel="aux loss")
    for a in axes:
        a.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    return fig


def _throughput_figure(name: str, steps: np.ndarray, train: list[Row]) -> Figure:
    fig = Figure(figsize=(9, 4), layout="constrained")
    ax = fig.subplots()
    tokens_per_s = _series(train, "tokens_per_s")
    lines = ax.plot(steps, tokens_per_s, lw=1, color="C0", label="tokens/s")
    ax.set(xlabel="step", title=f"Throughput: {name}")
    ax.set_ylabel("tokens / s", color="C0")
    ax.yaxis.set_major_formatter(EngFormatter())
    _from_zero(ax, tokens_per_s)
    ax.grid(alpha=0.3)
    mfu = _series(train, "mfu")
    if _present(mfu):  # null on CPU and on GPUs without a known peak
        right = ax.twinx()
        lines += right.plot(steps, 100 * mfu, lw=1, ls="--", color="C1", label="MFU")
        right.set_ylabel("MFU (%)", color="C1")
        _from_zero(right, 100 * mfu)
    ax.legend(handles=lines, loc="lower right")
    return fig


def _from_zero(ax: Axes, values: np.ndarray) -> None:
    """y from 0 with headroom, so a steady rate is not drawn along the top edge."""
    if _present(values):
        ax.set_ylim(0, 1.1 * float(values[np.isfinite(values)].max()) or 1)


def _expert_counts(train: list[Row]) -> list[np.ndarray]:
    """Per MoE layer, a (steps, experts) array of routed-token counts; NaN where a step lacks the layer."""
    loads = [row.get("expert_load") or [] for row in train]
    layers = []
    for layer in range(max(map(len, loads))):
        num_experts = max(len(load[layer]) for load in loads if len(load) > layer)
        counts = np.full((len(loads), num_experts), np.nan)
        for i, load in enumerate(loads):
            if len(load) > layer and len(load[layer]) == num_experts:
                counts[i] = load[layer]
        if num_experts:
            layers.append(counts)
    return layers


def _copied_experts(train: list[Row], num_layers: int) -> list[tuple[list[int], list[int]]] | None:
    """Per MoE layer, (steps, experts) of every expert Pro-Prophet copied (`copied_experts` in the
    metrics of a `--balance pro-prophet` run); None when the run logged none."""
    rows = [r for r in train if r.get("copied_experts") is not None]
    if not rows:
        return None
    found: list[tuple[list[int], list[int]]] = [([], []) for _ in range(num_layers)]
    for row in rows:
        for layer, experts in enumerate(row["copied_experts"][:num_layers]):
            found[layer][0].extend([row["step"]] * len(experts))
            found[layer][1].extend(experts)
    return found


def _expert_load_figure(name: str, steps: np.ndarray, layers: list[np.ndarray],
                        copied: list[tuple[list[int], list[int]]] | None = None) -> Figure:
    """Per MoE layer a heatmap of the experts' token shares over steps (with the experts
    Pro-Prophet copied marked, where the run balanced), and the max/mean load of every layer."""
    ncols = math.ceil(len(layers) / _MAX_PANEL_ROWS)
    nrows = math.ceil(len(layers) / ncols)
    fig = Figure(figsize=(8 * ncols, 2.3 * nrows + 2.6), layout="constrained")
    grid = fig.add_gridspec(nrows + 1, ncols, height_ratios=[1] * nrows + [1.1])
    # Bin consecutive steps so a 10k-step run draws ~800 columns; a bin's share is of its summed counts.
    bounds = np.linspace(0, len(steps), min(len(steps), _MAX_HEATMAP_COLUMNS) + 1).astype(int)
    edges = np.append(steps[bounds[:-1]] - 0.5, steps[-1] + 0.5)
    for layer, counts in enumerate(layers):
        binned = np.add.reduceat(np.nan_to_num(counts), bounds[:-1], axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            shares = binned / binned.sum(axis=1, keepdims=True)
        ax = fig.add_subplot(grid[layer // ncols, layer % ncols])
        num_experts = counts.shape[1]
        mesh = ax.pcolormesh(edges, np.arange(num_experts + 1) - 0.5, shares.T, cmap="viridis", vmin=0)
        fig.colorbar(mesh, ax=ax, label="token share", pad=0.01)
        ax.set(ylabel="expert", title=f"MoE layer {layer}: {num_experts} experts (uniform share {1 / num_experts:.3g})")
        if num_experts <= 16:
            ax.set_yticks(range(num_experts))
        else:
            ax.yaxis.get_major_locator().set_params(integer=True)
        if copied is not None and copied[layer][0]:
            ax.scatter(*copied[layer], s=6, marker="s", color="red", linewidths=0, label="copied")
            ax.legend(loc="upper right", fontsize="x-small")
        if layer + ncols >= len(layers):  # no panel below
            ax.set_xlabel("step")
    ax = fig.add_subplot(grid[nrows, :])
    centers = (edges[:-1] + edges[1:]) / 2
    for layer, counts in enumerate(layers):
        with np.errstate(invalid="ignore", divide="ignore"):
            imbalance = counts.max(axis=1) / counts.mean(axis=1)
            finite = np.isfinite(imbalance)
            mean = np.add.reduceat(np.where(finite, imbalance, 0), bounds[:-1]) / np.add.reduceat(finite, bounds[:-1])
        ax.plot(centers, mean, lw=1, label=f"layer {layer}")
    ax.axhline(1, color="grey", ls=":", lw=1)
    binned = f", mean over ~{len(steps) / len(centers):.3g}-step bins" if len(centers) < len(steps) else ""
    ax.set(xlabel="step", ylabel="max / mean", title=f"Load imbalance per MoE layer (1 = balanced{binned})",
           xlim=(edges[0], edges[-1]))
    ax.grid(alpha=0.3)
    if len(layers) <= 12:
        ax.legend(ncols=min(len(layers), 6), fontsize="small")
    fig.suptitle(f"Expert load: {name}")
    return fig
