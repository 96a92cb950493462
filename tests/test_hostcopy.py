"""weft.hostcopy: host values on a device, as `torch.tensor` gives them, device values on the host
(the GPU tests in test_gpu.py check that neither copy waits for kernels queued after it), and the
host stage a background checkpoint copies into."""
from __future__ import annotations

import io

import pytest
import torch

from weft.hostcopy import HostStage, device_tensor, host_tensor_async, offsets


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


def saved_bytes(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save({"t": tensor}, buffer)
    return buffer.getvalue()


def test_the_host_stage_copies_each_storage_into_its_own_and_reuses_the_memory_next_round(monkeypatch):
    """Every copy equals its source and is a storage of exactly the source's size (so `torch.save`
    writes the source's bytes, not its segment's); a round of the same sizes lands on the same
    memory without a new segment; a storage larger than a segment gets one of its own; a round
    overwrites the one before."""
    monkeypatch.setattr(HostStage, "SEGMENT", 4096)
    stage = HostStage()
    sources = [torch.randn(100), torch.arange(7), torch.randn(3000), torch.zeros(0), torch.randn(5)]
    rounds = []
    for scale in (1, 2):
        stage.begin()
        copies = [stage.copy((s * scale).untyped_storage()) for s in sources]
        for source, copy in zip(sources, copies):
            assert copy.nbytes() == source.untyped_storage().nbytes()
            rebuilt = torch.empty(0, dtype=source.dtype).set_(copy, 0, source.shape, source.stride())
            assert torch.equal(rebuilt, source * scale)
            assert saved_bytes(rebuilt) == saved_bytes(source * scale)
        assert stage.staged_bytes == sum(s.untyped_storage().nbytes() for s in sources) and stage.pinned_bytes == 0
        rounds.append(([c.data_ptr() for c in copies if c.nbytes()], len(stage._segments)))
        if scale == 1:
            first = torch.empty(0).set_(copies[0], 0, (100,), (1,))
    assert rounds[0] == rounds[1] and rounds[0][1] == 2  # 100 floats and 7 ints; 3000 floats (16 KiB) and 5 floats
    assert torch.equal(first, sources[0] * 2)  # the first round's copy holds the second round's values now
