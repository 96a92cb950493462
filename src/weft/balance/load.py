"""Per-layer expert-load history and the next iteration's load predicted from it (Pro-Prophet
sec. II, "locality": the routing of adjacent iterations is alike, so the planner can plan the
next iteration from the last ones and run during the current one)."""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

Counts = list[list[float]]  # (devices, experts) on the host


def host_counts(tokens_DE: torch.Tensor | Sequence[Sequence[float]]) -> Counts:
    """(D, E) counts as nested Python floats: the planner's arithmetic is a few hundred numbers,
    which plain Python does in microseconds where torch's CPU ops cost a dispatch each (and a
    busy GPU host's CPU runs those slowly: docs/benchmarks.md, "Dropless comet")."""
    rows = tokens_DE.tolist() if isinstance(tokens_DE, torch.Tensor) else tokens_DE
    return [[float(v) for v in row] for row in rows]


class LoadHistory:
    """The (D, E) slot counts (source device x expert) of one MoE layer's last `window`
    iterations, kept on the host (`ExpertBalancer` records host copies, made in the background,
    so that planning never waits for the GPU)."""

    def __init__(self, window: int = 1):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._loads: deque[Counts] = deque(maxlen=window)

    def __len__(self) -> int:
        return len(self._loads)

    def record(self, tokens_DE: torch.Tensor | Sequence[Sequence[float]]) -> None:
        """Keep one iteration's counts (a copy; the oldest beyond the window is dropped)."""
        if isinstance(tokens_DE, torch.Tensor) and tokens_DE.dim() != 2:
            raise ValueError(f"expected (devices, experts) counts, got shape {tuple(tokens_DE.shape)}")
        counts = host_counts(tokens_DE)
        shape = (len(counts), len(counts[0]) if counts else 0)
        if self._loads and shape != (len(self._loads[-1]), len(self._loads[-1][0])):
            last = self._loads[-1]
            raise ValueError(f"counts of shape {shape} after {(len(last), len(last[0]))}")
        self._loads.append(counts)

    def predict_counts(self) -> Counts:
        """The next iteration's (D, E) load: the mean of the recorded ones."""
        if not self._loads:
            raise ValueError("no load recorded yet: record an iteration before predicting the next")
        n = len(self._loads)
        return [[sum(values) / n for values in zip(*rows)] for rows in zip(*self._loads)]

    def last_counts(self) -> Counts:
        """The latest recorded iteration's (D, E) load."""
        if not self._loads:
            raise ValueError("no load recorded yet")
        return self._loads[-1]

    def predict(self) -> torch.Tensor:
        """`predict_counts()` as a float64 tensor."""
        return torch.tensor(self.predict_counts(), dtype=torch.float64)
