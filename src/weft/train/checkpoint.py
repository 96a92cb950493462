"""Checkpoints of expert-parallel training: sharded experts, atomic folders, resharding on load.

    RUN_DIR/checkpoints/step_N/
      manifest.json               written last: format version, step, world_size, ep_size, extra,
                                  expert range of every shard file, size + sha256 of every file,
                                  and the sha256 of the manifest's own content (from format 2)
      model_part{r:05d}.pt        rank r's share of the non-expert entries of model.state_dict()
                                  (every rank holds them all: each writes the share
                                  `dense_shares` gives it, the bytes spread evenly; format 3)
      optim_part{r:05d}.pt        the optimizer state of rank r's share of the non-expert
                                  parameters by name, and the param_groups, parameters named
      experts_ep{r:03d}.pt        local tensors of every Experts module of EP rank r and their
                                  global expert ranges              (expert-data-parallel rank 0)
      optim_experts_ep{r:03d}.pt  optimizer state of those parameters by name, per expert alike
      rng_rank{r:05d}.pt          torch CPU (and CUDA) and python `random` states     (every rank)

Tensor-parallel models (weft.tp) are saved in the dense layout: each slice of a split parameter
(and of its optimizer state) is gathered over the TP group into the tensor of the unsplit model,
one tensor at a time and kept only by the rank whose part holds it (so a save costs a rank its
share of the dense state in memory, not the whole model), and each rank takes its slice again on
load, so a run may continue with another TP size.
Checkpoints of formats 1 and 2 hold the non-expert entries in one `model.pt` and `optim.pt`,
written by rank 0; they load as before.

Files go to `checkpoints/.step_N.tmp`, which becomes `step_N` by a rename only after the manifest
is on disk: a crash leaves the earlier checkpoints and at worst a `.tmp` folder, never loaded.
Loading may use another world or EP size: each rank takes the global experts it holds from the
shard files that contain them. RNG states are restored only for the same world size.

`save_checkpoint` writes in the call; `CheckpointWriter` (what `weft train` uses) copies the
state to host memory in the call and writes the same files from a thread while training goes on.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from weft.distributed import MoEGroups, group_rank, group_size
from weft.hostcopy import HostStage
from weft.moe.experts import Experts
from weft.tp import dense_tensor, local_tensor, sharded_entries

__all__ = ["CheckpointError", "CheckpointWriter", "dense_shares", "save_checkpoint", "load_checkpoint",
           "latest_checkpoint", "verify_checkpoint"]

FORMAT_VERSION = 3  # 3: the non-expert entries in parts, one per rank; 2: the manifest carries the sha256 of its
# own content; 1 (older) loads unchecked
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"step_(\d+)")
Pieces = list[tuple[str, int, int]]  # (shard file, start, stop) in the shard's own expert indices


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete, corrupt, or does not fit the model it is loaded into."""


# -- helpers --------------------------------------------------------------------------------
def _experts_modules(model: nn.Module) -> dict[str, Experts]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Experts)}


def _expert_keys(model: nn.Module) -> dict[str, str]:
    """state_dict key -> name of the Experts module it belongs to."""
    return {f"{name}.{k}": name for name, m in _experts_modules(model).items() for k in m.state_dict()}


def _optimizer_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[tuple[str, Any]]]:
    """(name, parameter) per param group, in the order torch's optimizer state_dict numbers them."""
    names = {id(p): name for name, p in model.named_parameters()}
    try:
        return [[(names[id(p)], p) for p in group["params"]] for group in optimizer.param_groups]
    except KeyError:
        raise ValueError("the optimizer holds a parameter that is not a parameter of the model") from None


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's `obj`, in rank order (a barrier too), over `group` (every rank; default the
    default group)."""
    out: list[Any] = [obj] * _world()[1]
    if len(out) > 1:
        dist.all_gather_object(out, obj, group=group)
    return out


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- save -----------------------------------------------------------------------------------
class _HashingFile:
    """A file being written, with the sha256 and size of every byte written to it so far (so a
    written file need not be read back to checksum it)."""

    def __init__(self, f):
        self.f, self.digest, self.size = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _write(folder: Path, name: str, obj: Any) -> dict[str, dict[str, Any]]:
    """torch.save + fsync, the sha256 taken as the bytes go out; returns {name: {size, sha256}}
    for the manifest."""
    with open(folder / name, "wb") as f:
        out = _HashingFile(f)
        torch.save(obj, out)
        f.flush()
        os.fsync(f.fileno())
    return {name: {"size": out.size, "sha256": out.digest.hexdigest()}}


def _optimizer_files(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int) -> tuple[dict, dict]:
    """Contents of this rank's optim_part file (its share, by `dense_shares`, of the dense
    parameters' state and the param_groups, by name) and of its expert file. Collective: the
    moments of tensor-parallel slices are gathered (`_dense_of_kept`), kept by the rank that
    writes them."""
    state_dict, expert_keys, sliced = optimizer.state_dict(), _expert_keys(model), sharded_entries(model)
    named = _optimizer_names(model, optimizer)
    dense, experts, split = {}, {}, {}
    for index, (name, param) in enumerate(pair for group in named for pair in group):
        state = state_dict["state"].get(index, {})
        if name in expert_keys and state:  # tensors shaped like the parameter are per expert
            per_expert = {k for k, v in state.items() if torch.is_tensor(v) and v.dim() and v.shape == param.shape}
            experts[name] = {
                "per_expert": {k: state[k] for k in per_expert},
                "shared": {k: v for k, v in state.items() if k not in per_expert},  # e.g. Adam's step
            }
        elif state:
            dense[name] = state
            if name in sliced:  # the moments of a tensor-parallel slice (not Adam's step)
                split[name] = {k for k, v in state.items() if torch.is_tensor(v) and v.dim() and v.shape == param.shape}
    sizes = {name: sum(_dense_nbytes(v, sliced[name] if k in split.get(name, ()) else None) for k, v in state.items())
             for name, state in dense.items()}
    mine = dense_shares(sizes, world)[rank]
    flat = {(name, k): v for name, state in dense.items() for k, v in state.items()}
    gathered = _dense_of_kept(flat, {(name, k): sliced[name] for name, keys in split.items() for k in keys},
                              {key for key in flat if key[0] in mine})
    shared = {name: {k: gathered[name, k] for k in dense[name]} for name in mine}
    param_groups = [
        {**{k: v for k, v in saved.items() if k != "params"}, "params": [name for name, _ in group]}
        for saved, group in zip(state_dict["param_groups"], named)
    ]
    return {"state": shared, "param_groups": param_groups}, {"state": experts}


def _dense_nbytes(value: Any, split: tuple[nn.Module, str] | None) -> int:
    """The bytes `value` has in the dense layout: a tensor-parallel slice (`split`: its module and
    name) times the ranks it is split over (they split evenly), known before anything is gathered."""
    return _nbytes(value) * (group_size(split[0].group) if split is not None else 1)


def _dense_of_kept(entries: dict[Any, Any], sliced: dict[Any, tuple[nn.Module, str]], keep: set) -> dict[Any, Any]:
    """The entries named in `keep`, each tensor-parallel slice gathered into its dense tensor.
    Collective: every rank gathers every slice, in the same order (the ranks of a group keep
    different ones), and drops what it does not write once the next one is gathered, so a rank
    holds its own share of the dense state and at most two gathered tensors more, not the whole
    model gathered."""
    kept = {}
    for name, value in entries.items():
        dense = dense_tensor(*sliced[name], value) if name in sliced else value
        if name in keep:
            kept[name] = dense
    return kept


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def dense_shares(sizes: dict[str, int], world: int) -> list[list[str]]:
    """The entries (name -> bytes) each of `world` ranks writes: the largest first, each to the
    rank with the fewest bytes so far (ties to the lowest rank), so every rank writes about as
    much. A pure function of its arguments: every rank computes the same shares."""
    shares: list[list[str]] = [[] for _ in range(world)]
    loads = [0] * world
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        shares[rank].append(name)
        loads[rank] += sizes[name]
    return shares


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    return 0


def _rank_payload(model: nn.Module, optimizer: torch.optim.Optimizer | None, groups: MoEGroups
                  ) -> tuple[dict[str, Any], dict]:
    """What this rank writes: ({file name: object to save}, {module: (shard, expert range)}).
    Collective (tensor-parallel slices are gathered into the dense tensors): every rank, in step."""
    (rank, world), files, ranges = _world(), {}, {}
    state, expert_keys, sliced = model.state_dict(), _expert_keys(model), sharded_entries(model)
    sizes = {k: _dense_nbytes(v, sliced.get(k)) for k, v in state.items() if k not in expert_keys}
    mine = dense_shares(sizes, world)[rank]
    state = _dense_of_kept(state, sliced, set(mine) | set(expert_keys))
    files[f"model_part{rank:05d}.pt"] = {k: state[k] for k in mine}
    if optimizer is not None:
        files[f"optim_part{rank:05d}.pt"], expert_optim = _optimizer_files(model, optimizer, rank, world)
    if _experts_modules(model) and group_rank(groups.edp) == 0:  # one copy of each EP shard
        shard = f"experts_ep{group_rank(groups.ep):03d}.pt"
        spans = {n: [m.first_expert, m.first_expert + m.num_local] for n, m in _experts_modules(model).items()}
        files[shard] = {"tensors": {k: v for k, v in state.items() if k in expert_keys}, "ranges": spans}
        if optimizer is not None:
            files[f"optim_{shard}"] = expert_optim
        ranges = {n: (shard, span) for n, span in spans.items()}
    files[f"rng_rank{rank:05d}.pt"] = _rng_state()
    return files, ranges


def _write_files(folder: Path, payload: tuple[dict[str, Any], dict]) -> tuple[dict, dict]:
    """Write this rank's payload; return (the files' sizes and checksums, the expert ranges)."""
    contents, ranges = payload
    files: dict[str, Any] = {}
    for name, obj in contents.items():
        files |= _write(folder, name, obj)
    return files, ranges


def _on_host(obj: Any, copy: Callable[[torch.UntypedStorage], torch.UntypedStorage], copies: dict | None = None
             ) -> Any:
    """`obj` with every tensor replaced by a host copy (dicts, lists and tuples walked): a snapshot
    whose originals training may go on changing. Each storage is copied once, by `copy`, and the
    tensors are rebuilt as the same views of it, so tensors that shared storage (tied weights, views
    of one buffer) still do; containers without tensors are kept as they are (the same objects,
    e.g. the optimizer's betas in every param group): `torch.save` writes the snapshot as the same
    bytes as the originals."""
    copies = {} if copies is None else copies
    if isinstance(obj, torch.Tensor):
        tensor = obj.detach()
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), str(tensor.device))
        if key not in copies:
            copies[key] = copy(storage)
        return torch.empty(0, dtype=tensor.dtype).set_(copies[key], tensor.storage_offset(), tensor.shape,
                                                        tensor.stride())
    if isinstance(obj, dict):
        new = {k: _on_host(v, copy, copies) for k, v in obj.items()}
        return obj if all(new[k] is v for k, v in obj.items()) else new
    if isinstance(obj, (list, tuple)):
        items = [_on_host(v, copy, copies) for v in obj]
        return obj if all(a is b for a, b in zip(items, obj)) else type(obj)(items)
    return obj


def _manifest(step: int, ep_size: int, extra: dict, gathered: list) -> dict[str, Any]:
    files: dict[str, Any] = {}
    experts: dict[str, dict[str, list[int]]] = {}
    for rank_files, rank_ranges in gathered:
        files |= rank_files
        for module, (shard, span) in rank_ranges.items():
            experts.setdefault(module, {})[shard] = span
    manifest = {
        "format_version": FORMAT_VERSION, "step": step, "world_size": len(gathered), "ep_size": ep_size,
        "extra": extra, "experts": experts, "files": dict(sorted(files.items())),
    }
    return {**manifest, "sha256": _content_sha256(manifest)}


def _content_sha256(manifest: dict[str, Any]) -> str:
    """sha256 of a manifest's fields other than "sha256", as canonical JSON."""
    content = {k: v for k, v in manifest.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def _publish(tmp: Path, final: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest, then swap `tmp` in as `final` (an old `final` is renamed away first)."""
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    old = final.with_name(f".{final.name}.old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _check_extra(extra: dict[str, Any] | None) -> dict[str, Any]:
    extra = {} if extra is None else extra
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as e:
        raise TypeError(f"extra must be JSON-serialisable (it goes into {MANIFEST}): {e}") from None
    return extra


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    groups: MoEGroups,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write `run_dir/checkpoints/step_{step}` atomically and return it; every rank must call it.

    `extra` (JSON-serialisable: model and train config, data position, ...) is returned by
    `load_checkpoint`. An existing `step_{step}` is replaced. `CheckpointWriter` does the same
    in the background.
    """
    extra = _check_extra(extra)
    return _commit(run_dir, step, _prepare(run_dir, step, model, optimizer, groups), groups.ep_size, extra, None)[0]


def _folders(run_dir: str | Path, step: int) -> tuple[Path, Path]:
    root = Path(run_dir) / "checkpoints"
    return root / f".step_{step}.tmp", root / f"step_{step}"


def _prepare(run_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
             groups: MoEGroups) -> tuple[dict[str, Any], dict]:
    """This rank's payload (`_rank_payload`); a failure on any rank fails it on every rank."""
    try:
        return _on_every_rank(lambda: _rank_payload(model, optimizer, groups), _folders(run_dir, step)[1],
                              "write its files", share=False)
    except CheckpointError as e:
        raise _failed(e, run_dir, step) from None


def _commit(run_dir: str | Path, step: int, payload: tuple[dict[str, Any], dict], ep_size: int,
            extra: dict[str, Any], group: dist.ProcessGroup | None) -> tuple[Path, dict[str, Any]]:
    """Write every rank's payload into `.step_N.tmp`, then publish it as `step_N` (the ranks agree
    over `group` at each stage; any rank's failure fails the save on every rank); returns the
    folder and its manifest."""
    rank = _world()[0]
    tmp, final = _folders(run_dir, step)
    try:
        _on_every_rank(lambda: _fresh_folder(tmp) if rank == 0 else None, final, "create its folder", group)
        gathered = _on_every_rank(lambda: _write_files(tmp, payload), final, "write its files", group)
        manifest = _manifest(step, ep_size, extra, gathered)
        _on_every_rank(lambda: _publish(tmp, final, manifest) if rank == 0 else None, final, "publish it", group)
    except CheckpointError as e:
        raise _failed(e, run_dir, step) from None
    return final, manifest


def _failed(error: CheckpointError, run_dir: str | Path, step: int) -> CheckpointError:
    """The error every rank raises for a failed save, saying where the run stands; rank 0 removes
    the partial folder, so a full disk is not kept full by it (every rank gets here together: the
    errors are gathered)."""
    tmp, _ = _folders(run_dir, step)
    if _world()[0] == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    root = tmp.parent
    free = shutil.disk_usage(root if root.exists() else Path(run_dir)).free
    latest = latest_checkpoint(run_dir)
    return CheckpointError(f"{error}; {free / 2**20:.0f} MiB free on the disk holding {root} (a full disk shows as "
                           f"'unexpected pos' or 'No space left'); the partial checkpoint was removed; the latest "
                           f"complete checkpoint is {latest.name if latest else 'none'}")


class CheckpointWriter:
    """A training run's checkpoints, written in the background (`background=True`) or in the call.

    `save` does on the calling thread what needs the model and the collectives of training:
    the tensor-parallel gathers and a host copy of everything a rank writes (the parameters,
    optimizer state and RNG states as they are at the call; masters swapped in by the caller stay
    valid only during it), into memory the writer keeps from one checkpoint to the next
    (`weft.hostcopy.HostStage`: page-locked when the state is on GPUs, so the copies run at the
    link's speed). A thread then writes the files, checksums them as they go out,
    publishes the folder (the ranks agreeing over a gloo group of their own, so training's
    collectives and these never share a group) and prunes to `keep_last`. Invariants: a
    checkpoint appears only complete (the atomic publish of `save_checkpoint`); at most one is in
    flight (the next `save` waits for the last); an error of any rank's write is raised on every
    rank by the next `save` or `wait`, which a run calls before it ends. Every rank constructs it
    at the same point (the gloo group is made collectively). `report` gets one line per published
    checkpoint, on the calling thread: its size, how long it held the step, and when it was on
    disk."""

    def __init__(self, run_dir: str | Path, keep_last: int = 0, background: bool = True,
                 report: Callable[[str], None] | None = None):
        self.run_dir, self.keep_last, self.background = Path(run_dir), keep_last, background
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.group = dist.new_group(backend="gloo") if background and distributed else None
        self.report = report
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._step: int | None = None
        self._done: tuple[int, int, float] | None = None  # step, bytes, seconds from the call to on disk
        self._held = 0.0  # seconds the latest save held its caller
        self._stage = HostStage()  # the snapshot's host memory, page-locked from GPUs, kept from save to save

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None, groups: MoEGroups,
             extra: dict[str, Any] | None = None) -> None:
        """Checkpoint the state as it is now as `step_{step}` (written before this returns unless
        background); every rank must call it."""
        self.wait()
        start = time.perf_counter()
        extra = _check_extra(extra)
        payload = _prepare(self.run_dir, step, model, optimizer, groups)
        if not self.background:
            self._publish_and_prune(step, payload, groups.ep_size, extra, start)
            self._held = time.perf_counter() - start
            self._report()
            return
        self._stage.begin()  # the last checkpoint's files are written (wait above): its copies may go
        snapshot = _on_host(payload, self._stage.copy)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the copies are complete before training writes the originals again
        self._step = step
        self._thread = threading.Thread(target=self._run, args=(step, snapshot, groups.ep_size, extra, start),
                                        name=f"weft-checkpoint-{step}", daemon=True)
        self._thread.start()
        self._held = time.perf_counter() - start

    def _run(self, step: int, payload: tuple[dict[str, Any], dict], ep_size: int, extra: dict[str, Any],
             start: float) -> None:
        try:
            self._publish_and_prune(step, payload, ep_size, extra, start)
        except BaseException as e:  # noqa: BLE001 - raised on the training thread by wait()
            self._error = e

    def _publish_and_prune(self, step: int, payload: tuple[dict[str, Any], dict], ep_size: int,
                           extra: dict[str, Any], start: float) -> None:
        _, manifest = _commit(self.run_dir, step, payload, ep_size, extra, self.group)
        if _world()[0] == 0:
            prune_checkpoints(self.run_dir, self.keep_last)
        self._done = (step, sum(meta["size"] for meta in manifest["files"].values()), time.perf_counter() - start)

    def _report(self) -> None:
        if self._done is None:
            return
        (step, size, on_disk), self._done = self._done, None
        if self.report is not None:
            where = "in the background" if self.background else "in the step"
            self.report(f"weft train: checkpoint step_{step} ({size / 2**30:.2f} GiB) written {where}: the step "
                        f"was held {self._held:.2f} s, on disk {on_disk:.1f} s after it began")

    @property
    def pending(self) -> int | None:
        """The step of the checkpoint being written in the background, or None."""
        return self._step if self._thread is not None and self._thread.is_alive() else None

    def wait_quietly(self) -> None:
        """`wait`, its error dropped (for a run already ending with another)."""
        try:
            self.wait()
        except BaseException:  # noqa: BLE001
            pass

    def wait(self) -> None:
        """Until the background checkpoint (if any) is published; raises its error (on every rank)."""
        if self._thread is not None:
            self._thread.join()
            self._thread, self._step = None, None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        self._report()


def _fresh_folder(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)  # left by a crash
    path.mkdir(parents=True)


def _on_every_rank(action: Callable[[], Any], final: Path, what: str, group: dist.ProcessGroup | None = None,
                   share: bool = True) -> Any:
    """Run `action` here and gather every rank's result (`share`; else only whether it failed, and
    return this rank's own); if any rank failed, raise on all of them (a rank raising alone would
    leave the others waiting forever in the next collective)."""
    try:
        value, failure = action(), None
    except Exception as e:  # noqa: BLE001
        value, failure = None, f"rank {_world()[0]} could not {what}: {e!r}"
    gathered = _all_gather((failure, value if share else None), group)
    for failed, _ in gathered:
        if failed is not None:
            raise CheckpointError(f"checkpoint {final} was not saved: {failed}")
    return [v for _, v in gathered] if share else value


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete `step_N` folder (one with a manifest) with the largest N, or None."""
    root = Path(run_dir) / "checkpoints"
    steps = [
        (int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else [])
        if (m := _STEP_DIR.fullmatch(p.name)) and (p / MANIFEST).is_file()
    ]
    return max(steps)[1] if steps else None


def prune_checkpoints(run_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the `keep_last` newest complete checkpoints (0 keeps all); returns the deleted
    folders. Each goes in two steps: its manifest first (from then on no reader takes it for a
    complete checkpoint), then its files, so a crash midway never leaves a half checkpoint that
    looks whole. Call on one rank after a save has been published."""
    if keep_last <= 0:
        return []
    root = Path(run_dir) / "checkpoints"
    folders = sorted((int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else [])
                     if (m := _STEP_DIR.fullmatch(p.name)))
    complete = [(step, p) for step, p in folders if (p / MANIFEST).is_file()]
    if len(complete) <= keep_last:
        return []
    oldest_kept = complete[-keep_last][0]
    # Older complete ones, and what an interrupted pruning left (a step folder without manifest).
    doomed = [p for step, p in folders if step < oldest_kept]
    for path in doomed:
        (path / MANIFEST).unlink(missing_ok=True)
        _fsync_dir(path)
        shutil.rmtree(path)
    return doomed


# -- load -----------------------------------------------------------------------------------
class _Files:
    """The files a manifest lists: sizes checked up front, sha256 checked before a file is read."""

    def __init__(self, path: Path, manifest: dict[str, Any]):
        self.path, self.listed, self._cache = path, manifest["files"], {}
        for name, meta in self.listed.items():
            if not (path / name).is_file():
                raise CheckpointError(f"checkpoint {path}: file {name} listed in the manifest is missing")
            if (size := (path / name).stat().st_size) != meta["size"]:
                raise CheckpointError(f"checkpoint {path}: file {name} has {size} bytes, not {meta['size']}")

    def verify(self, name: str) -> None:
        if name not in self.listed:
            raise CheckpointError(f"checkpoint {self.path}: the manifest lists no file {name}")
        if _sha256(self.path / name) != self.listed[name]["sha256"]:
            raise CheckpointError(f"checkpoint {self.path}: file {name} fails its sha256 check (corrupt)")

    def load(self, name: str) -> Any:
        if name not in self._cache:
            self.verify(name)
            self._cache[name] = torch.load(self.path / name, map_location="cpu", weights_only=True)
        return self._cache[name]


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is missing (incomplete checkpoint)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable or corrupt: {e}") from None
    required = ("format_version", "step", "world_size", "ep_size", "extra", "experts", "files")
    if not isinstance(manifest, dict) or any(k not in manifest for k in required):
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} lacks one of the fields {', '.join(required)}")
    if manifest["format_version"] not in range(1, FORMAT_VERSION + 1):
        raise CheckpointError(f"checkpoint {path}: format version {manifest['format_version']} is unknown")
    if manifest["format_version"] >= 2 and manifest.get("sha256") != _content_sha256(manifest):
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} does not match its checksum (it was edited or "
                              "damaged); refusing to load it")
    return manifest


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check the manifest and the size and sha256 of every file it lists; return the manifest."""
    manifest = _read_manifest(Path(path))
    files = _Files(Path(path), manifest)
    for name in manifest["files"]:
        files.verify(name)
    return manifest


def _expert_layout(path: Path, manifest: dict[str, Any], model: nn.Module, ep_size: int) -> dict[str, Pieces]:
    """For each Experts module: where its global experts [first, first + num_local) lie in the shards."""
    modules, saved = _experts_modules(model), manifest["experts"]
    if modules.keys() != saved.keys():
        raise CheckpointError(
            f"checkpoint {path}: parameter names differ from the model's; expert modules in the "
            f"checkpoint: {sorted(saved)}, in the model: {sorted(modules)}"
        )
    layout = {}
    for module, expert in modules.items():
        total, expected = max(stop for _, stop in saved[module].values()), expert.num_local * ep_size
        if total != expected:
            raise CheckpointError(f"checkpoint {path}: {module} has {total} experts, the model {expected}")
        pieces, pos, stop = [], expert.first_expert, expert.first_expert + expert.num_local
        for shard, (a, b) in sorted(saved[module].items(), key=lambda item: item[1]):
            if a <= pos < min(b, stop):
                pieces.append((shard, pos - a, min(b, stop) - a))
                pos = min(b, stop)
        if pos != stop:
            raise CheckpointError(f"checkpoint {path}: no shard holds expert {pos} of {module}")
        layout[module] = pieces
    return layout


def _gather_experts(files: _Files, pieces: Pieces, get: Callable[[Any], torch.Tensor]) -> torch.Tensor:
    """Concatenate `get(contents of shard)[start:stop]` over the pieces."""
    parts = [get(files.load(shard))[a:b] for shard, a, b in pieces]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _model_state(files: _Files, model: nn.Module, layout: dict[str, Pieces]) -> dict[str, torch.Tensor]:
    """This rank's full state_dict, checked against the model name by name and shape by shape."""
    state = _dense(files, "model")
    for key, module in _expert_keys(model).items():
        if any(key not in files.load(shard)["tensors"] for shard, _, _ in layout[module]):
            raise CheckpointError(f"checkpoint {files.path}: expert parameter {key} is missing")
        state[key] = _gather_experts(files, layout[module], lambda contents: contents["tensors"][key])
    for key, (module, name) in sharded_entries(model).items():  # this rank's slice of the dense tensor
        if key in state:
            try:
                state[key] = local_tensor(module, name, state[key])
            except RuntimeError:
                raise CheckpointError(f"checkpoint {files.path}: parameter {key} of shape {tuple(state[key].shape)} "
                                      "does not split into this model's tensor-parallel slices") from None
    expected = model.state_dict()
    missing, unexpected = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {files.path}: parameter names differ from the model's; "
            f"not in the checkpoint: {missing}, not in the model: {unexpected}"
        )
    for name, tensor in expected.items():
        if state[name].shape != tensor.shape:
            raise CheckpointError(
                f"checkpoint {files.path}: parameter {name} has shape {tuple(state[name].shape)} "
                f"in the checkpoint but {tuple(tensor.shape)} in the model"
            )
    return state


def _optimizer_state_dict(
    files: _Files, model: nn.Module, optimizer: torch.optim.Optimizer, layout: dict[str, Pieces]
) -> dict[str, Any]:
    """A torch optimizer state_dict (integer ids in param_groups order) rebuilt from names."""
    saved, expert_keys, sliced = _dense(files, "optim"), _expert_keys(model), sharded_entries(model)
    current = [[name for name, _ in group] for group in _optimizer_names(model, optimizer)]
    if [g["params"] for g in saved["param_groups"]] != current:
        raise CheckpointError(f"checkpoint {files.path}: the optimizer's parameter groups differ from the saved ones")
    state = {}
    for index, name in enumerate(name for group in current for name in group):
        if name in expert_keys:
            value = _expert_optim_state(files, name, layout[expert_keys[name]])
        else:
            value = saved["state"].get(name)
        if value is not None and name in sliced:  # the slice of each dense moment
            value = {k: local_tensor(*sliced[name], v) if torch.is_tensor(v) and v.dim() else v
                     for k, v in value.items()}
        if value is not None:
            state[index] = value
    ids = iter(range(sum(map(len, current))))
    groups = [{**g, "params": [next(ids) for _ in names]} for g, names in zip(saved["param_groups"], current)]
    return {"state": state, "param_groups": groups}


def _dense(files: _Files, kind: str) -> dict[str, Any]:
    """The non-expert entries of `kind` ("model": state_dict entries; "optim": {"state",
    "param_groups"}): one `{kind}.pt` (formats 1-2) or the parts every rank wrote, joined."""
    if f"{kind}.pt" in files.listed:
        return dict(files.load(f"{kind}.pt"))
    parts = sorted(name for name in files.listed if re.fullmatch(rf"{kind}_part\d+\.pt", name))
    if not parts:
        raise CheckpointError(f"checkpoint {files.path}: its manifest lists no {kind} file ({kind}_part*.pt)")
    if kind == "model":
        return {k: v for part in parts for k, v in files.load(part).items()}
    contents = [files.load(part) for part in parts]
    return {"state": {k: v for c in contents for k, v in c["state"].items()},
            "param_groups": contents[0]["param_groups"]}


def _expert_optim_state(files: _Files, name: str, pieces: Pieces) -> dict[str, Any] | None:
    pieces = [(f"optim_{shard}", a, b) for shard, a, b in pieces]
    first = files.load(pieces[0][0])["state"].get(name)
    if first is None:  # no optimizer step taken yet
        return None
    per_expert = {
        k: _gather_experts(files, pieces, lambda contents: contents["state"][name]["per_expert"][k])
        for k in first["per_expert"]
    }
    return {**first["shared"], **per_expert}


def _restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    groups: MoEGroups,
) -> dict[str, Any]:
    """Load a checkpoint folder into this rank's model (and optimizer); return the saved `extra`.

    Everything is checked before anything changes: the manifest, the size of every listed file,
    the sha256 of every file this rank reads (a rank reads only the shards it needs;
    `verify_checkpoint` hashes them all), parameter names and shapes, the number of experts.
    The checkpoint may come from another world or EP size: the experts are resharded. RNG
    states are restored only when the world size is the same, else left alone. No collectives:
    a rank that finds a problem raises on its own.
    """
    path = Path(path)
    manifest = _read_manifest(path)
    files = _Files(path, manifest)
    layout = _expert_layout(path, manifest, model, groups.ep_size)
    state = _model_state(files, model, layout)
    optim_state = _optimizer_state_dict(files, model, optimizer, layout) if optimizer is not None else None
    rank, world = _world()
    rng = files.load(f"rng_rank{rank:05d}.pt") if manifest["world_size"] == world else None
    model.load_state_dict(state)
    if optim_state is not None:
        optimizer.load_state_dict(optim_state)
    if rng is not None:
        _restore_rng(rng)
    return manifest["extra"]
