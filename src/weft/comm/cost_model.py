"""Communication cost model: predicted seconds of a collective from the bytes it moves.

Lancet (section 3, "Communication Cost Model") profiles each collective at a ladder of sizes and
linearly interpolates between the measurements; a planner then asks for the cost of, e.g., an
all-to-all cut into n partitions by querying the model at 1/n of the bytes. `weft bench comm`
measures the points on the machine at hand and saves a `CommCostModel` as JSON:

    model = CommCostModel.from_json("bench/comm_model.json")
    seconds = model.predict("all_to_all", 8 << 20)

For a collective, the model is piecewise linear in bytes with a breakpoint at every measured
size (the median of the repeated measurements there). Between two breakpoints it is the line
through them. Below the first breakpoint it follows the first segment down towards zero bytes,
which gives the latency floor, but it stays within [0, first time]. Above the last breakpoint it
extends the last segment's slope. The metadata records what the model was measured on, because a
model is only valid for that machine, world size and backend.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from weft.jsonfile import read_json

__all__ = ["CommCostModel", "FORMAT"]

FORMAT = "weft.comm_cost_model/1"

Points = list[tuple[int, float]]


@dataclass(frozen=True)
class CommCostModel:
    """Per collective, sorted breakpoints (bytes, seconds). Build with `fit` or `from_json`."""

    points: dict[str, Points]
    world_size: int
    backend: str
    device_name: str
    torch_version: str = field(default_factory=lambda: torch.__version__)
    date: str = field(
        default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))

    def __post_init__(self) -> None:
        for name, pts in self.points.items():
            _check_points(name, pts)

    @classmethod
    def fit(
        cls,
        measurements: dict[str, list[tuple[int, float]]],
        world_size: int,
        backend: str,
        device_name: str,
    ) -> CommCostModel:
        """Fit a model from measured (bytes, seconds) pairs per collective.

        Repeated sizes are reduced to their median, so raw per-step timings can be passed as they
        are. Every collective needs at least one measurement.
        """
        points: dict[str, Points] = {}
        for name, pairs in measurements.items():
            by_size: dict[int, list[float]] = {}
            for nbytes, seconds in pairs:
                by_size.setdefault(int(nbytes), []).append(float(seconds))
            points[name] = [(b, statistics.median(ts)) for b, ts in sorted(by_size.items())]
        return cls(points, int(world_size), str(backend), str(device_name))

    @property
    def collectives(self) -> list[str]:
        """Names `predict` accepts."""
        return sorted(self.points)

    def predict(self, collective: str, nbytes: int) -> float:
        """Predicted seconds for one `collective` moving `nbytes` (its per-rank buffer size)."""
        if collective not in self.points:
            raise ValueError(f"no cost model for collective {collective!r}; this model knows "
                             f"{', '.join(self.collectives) or 'none'}")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if nbytes == 0:  # nothing to send: the planner skips the collective altogether
            return 0.0
        pts = self.points[collective]
        if len(pts) == 1:
            # No segment to follow: assume a constant time below the only point and bandwidth-bound
            # (time proportional to bytes) above it.
            b0, t0 = pts[0]
            return t0 if nbytes <= b0 else t0 * nbytes / b0
        # The segment containing nbytes; the first one also covers smaller sizes, the last one larger.
        i = 1
        while i < len(pts) - 1 and nbytes > pts[i][0]:
            i += 1
        (b0, t0), (b1, t1) = pts[i - 1], pts[i]
        slope = (t1 - t0) / (b1 - b0)
        if nbytes < pts[0][0]:
            # Never below zero. Never above the first time either: a smaller message cannot be slower.
            return min(max(t0 + slope * (nbytes - b0), 0.0), t0)
        if nbytes > b1:
            # Timing noise can make the last segment fall; more data never takes less time.
            return t1 + max(slope, 0.0) * (nbytes - b1)
        return t0 + slope * (nbytes - b0)

    def to_json(self, path: str | Path) -> Path:
        """Write the model as JSON atomically (a reader never sees half a file); return the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"world_size": self.world_size, "backend": self.backend, "device_name": self.device_name,
                "torch_version": self.torch_version, "date": self.date}
        # One [bytes, seconds] point per line: json's indent would spread each over four.
        curves = ",\n".join(
            f"    {json.dumps(name)}: [\n" + ",\n".join(f"      [{b}, {t!r}]" for b, t in pts) + "\n    ]"
            for name, pts in sorted(self.points.items()))
        text = (f'{{\n  "format": {json.dumps(FORMAT)},\n  "meta": {json.dumps(meta)},\n'
                f'  "units": {{"bytes": "bytes per rank", "seconds": "seconds"}},\n'
                f'  "points": {{\n{curves}\n  }}\n}}\n')
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def from_json(cls, path: str | Path) -> CommCostModel:
        """Load a model written by `to_json`; ValueError if the file is not one."""
        path = Path(path)
        doc = read_json(path, f"no communication cost model at {path} (write one with `weft bench comm`)",
                        "re-run `weft bench comm` to rewrite it")
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise ValueError(f"{path} is not a weft communication cost model "
                             f"(expected format {FORMAT!r}, found {found!r})")
        try:
            meta, raw = doc["meta"], doc["points"]
            points = {str(name): [(int(b), float(t)) for b, t in pts] for name, pts in raw.items()}
            return cls(points, int(meta["world_size"]), str(meta["backend"]), str(meta["device_name"]),
                       str(meta["torch_version"]), str(meta["date"]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{path}: malformed communication cost model ({type(e).__name__}: {e})") from None


def _check_points(name: str, pts: Points) -> None:
    if not pts:
        raise ValueError(f"collective {name!r} has no measurements")
    for b, t in pts:
        if b <= 0 or not math.isfinite(t) or t < 0:
            raise ValueError(f"collective {name!r}: a point needs bytes > 0 and finite seconds >= 0, got ({b}, {t})")
    sizes = [b for b, _ in pts]
    if any(b1 <= b0 for b0, b1 in zip(sizes, sizes[1:])):
        raise ValueError(f"collective {name!r}: sizes must be strictly increasing, got {sizes}")
