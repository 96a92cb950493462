"""Per-layer expert-load history and the next iteration's load predicted from it (Pro-Prophet
sec. II, "locality": the routing of adjacent iterations is alike, so the planner can plan the
next iteration from the last ones and run during the current one)."""
from __future__ import annotations

from collections import deque

import torch


class LoadHistory:
    """The (D, E) slot counts (source device x expert) of one MoE layer's last `window`
    iterations, kept on the device they were recorded on (`ExpertBalancer` records host copies,
    made in the background, so that planning never waits for the GPU)."""

    def __init__(self, window: int = 1):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._loads: deque[torch.Tensor] = deque(maxlen=window)

    def __len__(self) -> int:
        return len(self._loads)

    def record(self, tokens_DE: torch.Tensor) -> None:
        """Keep one iteration's counts (a copy; the oldest beyond the window is dropped)."""
        if tokens_DE.dim() != 2:
            raise ValueError(f"expected (devices, experts) counts, got shape {tuple(tokens_DE.shape)}")
        if self._loads and tokens_DE.shape != self._loads[-1].shape:
            raise ValueError(f"counts of shape {tuple(tokens_DE.shape)} after {tuple(self._loads[-1].shape)}")
        self._loads.append(tokens_DE.detach().clone())

    def predict(self) -> torch.Tensor:
        """The next iteration's (D, E) load: the mean of the recorded ones (float64)."""
        if not self._loads:
            raise ValueError("no load recorded yet: record an iteration before predicting the next")
        return torch.stack([t.to(torch.float64) for t in self._loads]).mean(0)
