"""weft.bench.peers on the CPU, without the peers installed: errors and reasons only."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from weft.bench import peers
from weft.bench.peers import PEERS, PeerLayer, PeerUnavailable, build_peer

SHAPE = dict(dim=64, hidden_dim=128, num_experts=8, top_k=2, dtype=torch.bfloat16, device="cpu", world_size=1)


def _build(name: str, capacity_factor: float | None = None, activation: str = "swiglu", **overrides):
    kwargs = {**SHAPE, **overrides}
    return build_peer(name, capacity_factor=capacity_factor, activation=activation, **kwargs)


def _hide(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """Make `modules` look uninstalled: a None entry in sys.modules stops their import."""
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


def test_peer_names():
    assert PEERS == ("torchtitan", "megatron")


def test_importing_peers_imports_no_peer():
    code = ("import sys, weft.bench.peers; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torchtitan', 'megatron', 'spmd_types')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_unknown_peer_is_a_value_error():
    with pytest.raises(ValueError, match="unknown peer 'deepspeed'"):
        _build("deepspeed")


@pytest.mark.parametrize("name", PEERS)
def test_bad_shapes_and_activation_are_value_errors(name):
    with pytest.raises(ValueError, match="multiple of world_size"):
        _build(name, num_experts=6, world_size=4)
    with pytest.raises(ValueError, match="unknown activation"):
        _build(name, activation="tanh")
    with pytest.raises(ValueError, match="top_k"):
        _build(name, top_k=9)
    with pytest.raises(ValueError, match="capacity_factor"):
        _build(name, capacity_factor=0.0)


def test_missing_torchtitan(monkeypatch):
    _hide(monkeypatch, "torchtitan")
    with pytest.raises(PeerUnavailable, match=r"torchtitan is not installed .*torchtitan==0\.3\.0"):
        _build("torchtitan")


def test_missing_megatron(monkeypatch):
    _hide(monkeypatch, "megatron", "megatron.core")
    with pytest.raises(PeerUnavailable, match=r"megatron\.core is not installed .*megatron-core==0\.19"):
        _build("megatron", capacity_factor=1.0, activation="relu")


def test_failing_import_reports_the_import_error(monkeypatch, tmp_path):
    pkg = tmp_path / "torchtitan"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('needs torch 9.0 for this test')\n")
    for name in [m for m in sys.modules if m == "torchtitan" or m.startswith("torchtitan.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PeerUnavailable, match=r"importing torchtitan failed: ImportError: needs torch 9\.0"):
        _build("torchtitan")


def test_torchtitan_has_no_capacity_factor(monkeypatch):
    _hide(monkeypatch, "torchtitan")  # the configuration is refused before any import
    with pytest.raises(PeerUnavailable, match="dropless only"):
        _build("torchtitan", capacity_factor=1.0)


@pytest.mark.parametrize("activation", ["relu", "gelu", "silu"])
def test_torchtitan_is_swiglu_only(monkeypatch, activation):
    _hide(monkeypatch, "torchtitan")
    with pytest.raises(PeerUnavailable, match="SwiGLU only"):
        _build("torchtitan", activation=activation)


def test_megatron_needs_cuda():
    with pytest.raises(PeerUnavailable, match="needs CUDA"):
        peers._require_cuda(torch.device("cpu"))


def test_peer_unavailable_is_a_runtime_error():
    assert issubclass(PeerUnavailable, RuntimeError)


def test_peer_layer_forward_maps_tokens_to_tokens():
    linear = nn.Linear(4, 4)
    layer = PeerLayer(linear, "a linear map", lambda x: linear(x))
    x = torch.randn(3, 4, requires_grad=True)
    out = layer.forward(x)
    out.backward(torch.ones_like(out))
    assert out.shape == (3, 4) and x.grad is not None
    with pytest.raises(ValueError, match=r"\(tokens, dim\)"):
        layer.forward(torch.randn(2, 3, 4))
