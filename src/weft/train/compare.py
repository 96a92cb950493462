"""Runs side by side as numbers: the table `weft plot RUN RUN ...` prints beside compare.png.

Per run: the last step and tokens read, the last and the best validation loss, the share of
routed token slots dropped over the logged steps after `drops_after` (mean and worst; the train
rows are logged every `log_interval` steps, so this is a sample of the steps), and the median
throughput and MFU. A dense run has no drops (shown as "-").
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

Row = dict[str, Any]


@dataclass(frozen=True)
class RunSummary:
    name: str
    steps: int
    tokens: int | None
    final_val_loss: float | None
    best_val_loss: float | None
    best_val_step: int | None
    dropped_mean: float | None  # mean dropped_share of the logged steps after drops_after; None: dense or none logged
    dropped_max: float | None
    tokens_per_s: float | None  # median over the logged steps
    mfu: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(name: str, train: list[Row], val: list[Row], drops_after: int = 0) -> RunSummary:
    """The summary of one run from its (train rows, val rows) as `load_metrics` returns them."""
    if not train:
        raise ValueError(f"run {name} has no logged training steps")
    last = train[-1]
    best = min(val, key=lambda r: r["val_loss"]) if val else None
    drops = [r["dropped_share"] for r in train
             if r["step"] > drops_after and r.get("dropped_share") is not None and r.get("expert_load")]
    return RunSummary(
        name=name, steps=last["step"], tokens=last.get("tokens"),
        final_val_loss=val[-1]["val_loss"] if val else None,
        best_val_loss=best["val_loss"] if best else None, best_val_step=best["step"] if best else None,
        dropped_mean=statistics.fmean(drops) if drops else None, dropped_max=max(drops) if drops else None,
        tokens_per_s=_median(train, "tokens_per_s"), mfu=_median(train, "mfu"),
    )


def _median(rows: list[Row], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def format_table(summaries: list[RunSummary], drops_after: int = 0) -> str:
    """A Markdown table of the summaries, one row per run."""
    def num(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [f"| run | steps | tokens | val loss (last) | val loss (best, step) | dropped after step {drops_after} "
             "(mean / max) | tokens/s | MFU |",
             "|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        best = "-" if s.best_val_loss is None else f"{s.best_val_loss:.4f} ({s.best_val_step})"
        drops = "-" if s.dropped_mean is None else f"{100 * s.dropped_mean:.1f}% / {100 * s.dropped_max:.1f}%"
        mfu = "-" if s.mfu is None else f"{100 * s.mfu:.1f}%"
        lines.append(f"| {s.name} | {s.steps} | {num(s.tokens, ',')} | {num(s.final_val_loss, '.4f')} | {best} | "
                     f"{drops} | {num(s.tokens_per_s, ',.0f')} | {mfu} |")
    return "\n".join(lines)
