"""weft.hostcopy: host values on a device, as `torch.tensor` gives them, and device values on the
host (the GPU tests in test_gpu.py check that neither copy waits for kernels queued after it)."""
from __future__ import annotations

import pytest
import torch

from weft.hostcopy import device_tensor, host_tensor_async, offsets


def test_device_tensor_is_torch_tensor_of_the_values():
    cases = (([3, 0, 7], torch.int64), ([True, False], torch.bool), ([0.5, 2.0], torch.float64), ([], torch.int64))
    for values, dtype in cases:
        got = device_tensor(values, "cpu", dtype)
        assert got.dtype == dtype and torch.equal(got, torch.tensor(values, dtype=dtype))


def test_offsets_are_the_int32_cumulative_sums():
    counts = [4, 0, 3, 9, 0]
    got = offsets(counts, torch.device("cpu"))
    assert got.dtype == torch.int32
    assert torch.equal(got, torch.cumsum(torch.tensor(counts), 0).to(torch.int32))
    assert offsets([], "cpu").numel() == 0


def test_a_copy_inside_a_graph_capture_is_refused(monkeypatch):
    """A captured copy would replay from a pinned buffer freed after the capture: refused before
    any copy (checked without a GPU by saying the stream is capturing)."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        device_tensor([1, 2], "cuda")


def test_a_host_tensor_is_ready_at_once():
    values = torch.tensor([1.5, 2.0, 4.0])
    host, ready = host_tensor_async(values)
    assert host is values and ready is None  # nothing queued: the training loop reads it as it is
