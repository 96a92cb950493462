"""Fixtures shared by the test files."""
from __future__ import annotations

import pytest


@pytest.fixture
def triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the test's Triton kernels in Triton's CPU interpreter: TRITON_INTERPRET=1 for the test
    (the ranks `weft.testing.run_distributed` starts define their kernels under it); skipped where
    Triton is not installed (it is in the test extra; CPU-only installs run the torch path)."""
    pytest.importorskip("triton", reason="Triton is in the test extra; CPU-only installs run the torch path")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
