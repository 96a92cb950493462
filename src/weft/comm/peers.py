"""Buffers every rank of a group can address: the memory Comet's kernels communicate through.

`peer_buffers(group, device)` gives the group's `PeerBuffers` (one per group and device type,
kept with the process groups, like `weft.distributed.side_group`); `get(name, shape, dtype)`
allocates a named buffer on every rank (collective, the first time) and returns this rank's view
of all of them, with their addresses in a table for the kernels:

- CUDA: PyTorch symmetric memory (`torch.distributed._symmetric_memory`): the peers' buffers are
  mapped into this process over NVLink / P2P; `barrier()` is a device-side barrier on the
  current stream (no host synchronisation).
- CPU: files in shared memory (/dev/shm), mapped by every process of the (gloo) group, which must
  all run on one machine; `barrier()` is `dist.barrier`. This is what runs Comet's kernels (in
  Triton's interpreter) across real processes in the CPU test suite.
- one rank (or no process group): plain tensors, no barrier.

Every user keeps one protocol, which makes reusing a buffer between calls and layers safe: write
your own buffer; `barrier()`; read and write the peers' buffers; `barrier()`; read your own.
"""
from __future__ import annotations

import math
import os
import secrets
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.distributed as dist

from weft.distributed import group_rank, group_size, resolve_group


@dataclass(frozen=True)
class PeerBuffer:
    """One named buffer: `local` is this rank's; `peers[r]` rank r's as this process addresses it
    (`peers[rank] is local`); `table` their addresses (int64, on the buffer's device)."""

    local: torch.Tensor
    peers: list[torch.Tensor]
    table: torch.Tensor


class PeerBuffers(ABC):
    """Named buffers on every rank of `group`, each addressable by every rank."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device):
        self.group, self.device = group, device
        self.rank, self.world = group_rank(group), group_size(group)
        self._buffers: dict[tuple, PeerBuffer] = {}
        self._memo: dict[tuple, object] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> PeerBuffer:
        """The buffer `name` of this shape and dtype; allocated on first use, which is a collective:
        every rank of the group must ask for it in the same order."""
        key = (name, tuple(shape), dtype)
        if key not in self._buffers:
            self._buffers[key] = self._allocate(f"{name}{len(self._buffers)}", tuple(shape), dtype)
        return self._buffers[key]

    def memo(self, key: tuple, build):
        """`build()`, computed once per key for this group (e.g. a fixed map of rows to buffers)."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def ordinal(self, kind: str, owner: object) -> int:
        """A number for `owner` among the owners of `kind` asked for so far, the same number on
        every rank where every rank asks in the same order (e.g. a name for a layer's buffers)."""
        return self.memo((kind, id(owner)), lambda: sum(1 for key in self._memo if key[0] == kind))

    def names(self) -> list[str]:
        """The buffers allocated so far, by the names they were asked for."""
        return sorted({name for name, _, _ in self._buffers})

    def nbytes(self) -> int:
        """Bytes of this rank's buffers allocated so far (symmetric memory on 2+ CUDA ranks is outside
        torch's caching allocator, so `torch.cuda.memory_allocated` does not count it)."""
        return sum(b.local.numel() * b.local.element_size() for b in self._buffers.values())

    def _table(self, peers: list[torch.Tensor]) -> torch.Tensor:
        return torch.tensor([p.data_ptr() for p in peers], dtype=torch.int64, device=self.device)

    @abstractmethod
    def _allocate(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> PeerBuffer:
        """A new buffer on every rank (collective)."""

    @abstractmethod
    def barrier(self, channel: int = 0) -> None:
        """Every rank's earlier writes to any buffer are visible to every rank after this. Users
        that may run at once on different streams take different channels."""


class LocalPeers(PeerBuffers):
    """One rank: plain tensors."""

    def _allocate(self, name, shape, dtype):
        local = torch.zeros(shape, dtype=dtype, device=self.device)
        return PeerBuffer(local, [local], self._table([local]))

    def barrier(self, channel: int = 0) -> None:
        pass


class SymmetricMemoryPeers(PeerBuffers):
    """CUDA ranks that map each other's memory (NVLink / P2P): PyTorch symmetric memory."""

    def __init__(self, group, device):
        super().__init__(group, device)
        from torch.distributed import _symmetric_memory as symm_mem

        self._symm_mem = symm_mem
        symm_mem.enable_symm_mem_for_group(self.group.group_name)
        self._handle = None  # the latest buffer's; any handle's barrier synchronises the group

    def _allocate(self, name, shape, dtype):
        local = self._symm_mem.empty(shape, dtype=dtype, device=self.device).zero_()
        handle = self._symm_mem.rendezvous(local, self.group)
        peers = [local if r == self.rank else handle.get_buffer(r, shape, dtype) for r in range(self.world)]
        self._handle = handle
        return PeerBuffer(local, peers, self._table(peers))

    def barrier(self, channel: int = 0) -> None:
        if self._handle is not None:
            self._handle.barrier(channel=channel)


class SharedFilePeers(PeerBuffers):
    """CPU processes of one machine: each buffer a file in shared memory mapped by every rank.
    The files are unlinked once every rank has mapped them (the mappings stay)."""

    def __init__(self, group, device):
        super().__init__(group, device)
        token = [secrets.token_hex(8)]
        dist.broadcast_object_list(token, src=dist.get_global_rank(self.group, 0), group=self.group)
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self._prefix = os.path.join(folder, f"weft-peers-{token[0]}")

    def _allocate(self, name, shape, dtype):
        numel, path = math.prod(shape), lambda r: f"{self._prefix}-{name}-{r}"
        mine = torch.from_file(path(self.rank), shared=True, size=numel, dtype=dtype)  # created, zeros
        dist.barrier(group=self.group)
        peers = [mine if r == self.rank else torch.from_file(path(r), shared=True, size=numel, dtype=dtype)
                 for r in range(self.world)]
        dist.barrier(group=self.group)
        os.unlink(path(self.rank))
        peers = [p.view(shape) for p in peers]
        return PeerBuffer(peers[self.rank], peers, self._table(peers))

    def barrier(self, channel: int = 0) -> None:
        dist.barrier(group=self.group)


_PEERS: dict[tuple, PeerBuffers] = {}  # beside the process-group registry: one set per group


def peer_buffers(group: dist.ProcessGroup | None, device: torch.device) -> PeerBuffers:
    """The buffers of `group` (None: the default group if initialised) on `device`'s type."""
    group, device = resolve_group(group), torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (group, device)
    if key not in _PEERS:
        if group_size(group) == 1:
            _PEERS[key] = LocalPeers(group, device)
        elif device.type == "cuda":
            _PEERS[key] = SymmetricMemoryPeers(group, device)
        elif device.type == "cpu":
            _PEERS[key] = SharedFilePeers(group, device)
        else:
            raise ValueError(f"peer buffers: no way to share {device.type} memory between ranks")
    return _PEERS[key]


def held_peer_bytes(device: torch.device) -> int:
    """Bytes of every group's peer buffers this process holds on `device` (creates no registry)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return sum(peers.nbytes() for (_, on), peers in _PEERS.items() if on == device)


def peers_unavailable(group: dist.ProcessGroup | None, device: torch.device) -> str | None:
    """Why the ranks of `group` cannot address each other's memory on `device` (None: they can).
    CUDA needs every rank on this node (LOCAL_WORLD_SIZE) and P2P (not NCCL_P2P_DISABLE=1, which
    weft's benchmarks use to stand in for ranks on several nodes); CPU needs one machine."""
    group, device = resolve_group(group), torch.device(device)
    world = group_size(group)
    if world == 1:
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if local < world:
        return f"the group's {world} ranks span several nodes ({local} per node)"
    if device.type == "cuda" and os.environ.get("NCCL_P2P_DISABLE") == "1":
        return "NCCL_P2P_DISABLE=1: the GPUs do not reach each other's memory"
    if device.type not in ("cuda", "cpu"):
        return f"no peer memory on {device.type}"
    return None
