"""Checkpoints: exact resume, resharding across EP sizes, atomic folders, corruption detected.

A source run trains two steps, saves `step_2`, and records a snapshot (its state, optimizer state
by parameter name, logits on fixed batches, its next RNG draws, its parameters after a third
step). A loader builds a differently seeded model, loads the checkpoint and must match the
snapshot on the experts it holds; with the same layout it must also continue identically.
"""
from __future__ import annotations

import dataclasses
import json
import random
import shutil
import threading
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from weft.distributed import build_moe_groups
from weft.models.gpt import GPT, GPTConfig
from weft.moe.grads import reduce_gradients
from weft.testing import run_distributed
from weft.train import checkpoint
from weft.train.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)

CONFIG = GPTConfig(
    block_size=16, n_layer=2, n_head=2, dim=32, moe_every=1, num_experts=4, top_k=2,
    moe_hidden_dim=32, capacity_factor=None,
)
EXTRA = {"model": CONFIG.to_dict(), "train": {"lr": 1e-2}, "data_step": 2}


# -- a tiny training run ---------------------------------------------------------------------
def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def build(groups, seed: int, **overrides):
    torch.manual_seed(seed)
    model = GPT(dataclasses.replace(CONFIG, **overrides), group=groups.ep)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 256, (2, 16), generator=gen), torch.randint(0, 256, (2, 16), generator=gen)


def train(model, opt, groups, steps: range) -> None:
    for step in steps:
        _, loss = model(*batch(step, _rank()))
        loss.backward()
        reduce_gradients(model, groups)
        opt.step()
        opt.zero_grad()


def logits_on(model, rank: int) -> torch.Tensor:
    with torch.no_grad():
        return model(batch(99, rank)[0])[0]


def named_optim_state(model, opt) -> dict[str, dict[str, torch.Tensor]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}


def clone_state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


# -- source runs and loaders (module level: they run in spawned ranks) -------------------------
def train_and_save(run_dir: str, ep_size: int | None) -> None:
    groups = build_moe_groups(ep_size)
    model, opt = build(groups, seed=0)
    train(model, opt, groups, range(2))
    save_checkpoint(run_dir, 2, model, opt, groups, EXTRA)
    snap = {"state": clone_state(model), "optim": named_optim_state(model, opt), "ep_size": groups.ep_size}
    snap["draws"] = (torch.rand(4), random.random())
    ranks = range(4) if _world() == 1 else [_rank()]
    snap["logits"] = {r: logits_on(model, r) for r in ranks}
    train(model, opt, groups, range(2, 3))
    snap["next"] = clone_state(model)
    torch.save(snap, Path(run_dir) / f"snapshot_rank{_rank()}.pt")


def full_experts(snaps: list[dict], part: str) -> dict:
    """The source's state with every expert tensor concatenated over its first EP group."""
    ep = snaps[0]["ep_size"]

    def join(key: str, values: list):
        if isinstance(values[0], dict):
            return {k: join(key, [v[k] for v in values]) for k in values[0]}
        is_expert = ".experts." in key and values[0].dim() > 0
        return torch.cat(values) if is_expert else values[0]

    return {k: join(k, [s[part][k] for s in snaps[:ep]]) for k in snaps[0][part]}


def local_slice(full: dict, model) -> dict:
    """`full` cut down to the experts this rank's model holds."""
    moe = model.moe_layers()[0].experts
    cut = slice(moe.first_expert, moe.first_expert + moe.num_local)

    def pick(key: str, value):
        if isinstance(value, dict):
            return {k: pick(key, v) for k, v in value.items()}
        return value[cut] if ".experts." in key and value.dim() > 0 else value

    return {k: pick(k, v) for k, v in full.items()}


def assert_equal_nested(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for k in expected:
        if isinstance(expected[k], dict):
            assert_equal_nested(actual[k], expected[k], f"{what} {k}")
        else:
            assert torch.equal(actual[k], expected[k]), f"{what}: {k} differs"


def load_and_check(source_dir: str, ep_size: int | None = None) -> None:
    """Load the source's latest checkpoint into a fresh model here and compare with its snapshot."""
    snaps = [torch.load(p, weights_only=True) for p in sorted(Path(source_dir).glob("snapshot_rank*.pt"))]
    groups = build_moe_groups(ep_size)
    model, opt = build(groups, seed=1)
    rng_before = torch.get_rng_state()
    extra = load_checkpoint(latest_checkpoint(source_dir), model, opt, groups)
    same_layout = len(snaps) == _world() and snaps[0]["ep_size"] == groups.ep_size
    if len(snaps) == _world():  # RNG restored: the next draws are the source's
        draws = (torch.rand(4), random.random())
        assert torch.equal(draws[0], snaps[_rank()]["draws"][0]) and draws[1] == snaps[_rank()]["draws"][1]
    else:  # another world size: RNG left alone
        assert torch.equal(torch.get_rng_state(), rng_before)
    assert extra == EXTRA
    assert_equal_nested(clone_state(model), local_slice(full_experts(snaps, "state"), model), "model")
    assert_equal_nested(named_optim_state(model, opt), local_slice(full_experts(snaps, "optim"), model), "optim")
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["weight_decay"] == 0.1
    source_logits = {r: v for s in snaps for r, v in s["logits"].items()}
    for rank in source_logits if _world() == 1 else [_rank()]:
        torch.testing.assert_close(logits_on(model, rank), source_logits[rank], rtol=1e-5, atol=1e-5)
    if same_layout:  # resuming continues exactly as the uninterrupted run
        train(model, opt, groups, range(2, 3))
        assert_equal_nested(clone_state(model), snaps[_rank()]["next"], "after the next step")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> str:
    run_dir = str(tmp_path_factory.mktemp("one_process"))
    train_and_save(run_dir, None)
    return run_dir


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> str:
    run_dir = str(tmp_path_factory.mktemp("two_ranks"))
    run_distributed(train_and_save, 2, args=(run_dir, None), timeout=120)
    return run_dir


@pytest.fixture(scope="module")
def four_ranks_ep2(tmp_path_factory) -> str:
    run_dir = str(tmp_path_factory.mktemp("four_ranks_ep2"))
    run_distributed(train_and_save, 4, args=(run_dir, 2), timeout=120)
    return run_dir


# -- resume and reshard ----------------------------------------------------------------------
def test_single_process_resume_is_exact(one_process):
    load_and_check(one_process)


def test_two_ranks_resume_is_exact(two_ranks):
    run_distributed(load_and_check, 2, args=(two_ranks,), timeout=120)


def test_reshard_two_ranks_into_one_process(two_ranks):
    load_and_check(two_ranks)


def test_reshard_one_process_into_two_ranks(one_process):
    run_distributed(load_and_check, 2, args=(one_process,), timeout=120)


def test_four_ranks_ep2_write_one_copy_per_shard_and_load_into_two(four_ranks_ep2):
    files = sorted(p.name for p in latest_checkpoint(four_ranks_ep2).iterdir())
    assert files == [
        "experts_ep000.pt", "experts_ep001.pt", "manifest.json",
        *[f"model_part{r:05d}.pt" for r in range(4)], "optim_experts_ep000.pt", "optim_experts_ep001.pt",
        *[f"optim_part{r:05d}.pt" for r in range(4)],
        "rng_rank00000.pt", "rng_rank00001.pt", "rng_rank00002.pt", "rng_rank00003.pt",
    ]
    # the non-expert entries: each once, spread over the ranks by bytes
    parts = [torch.load(latest_checkpoint(four_ranks_ep2) / f"model_part{r:05d}.pt", weights_only=True)
             for r in range(4)]
    names = [k for part in parts for k in part]
    assert len(names) == len(set(names)) and all(parts)
    manifest = json.loads((latest_checkpoint(four_ranks_ep2) / "manifest.json").read_text())
    assert (manifest["step"], manifest["world_size"], manifest["ep_size"]) == (2, 4, 2)
    assert manifest["experts"]["blocks.0.ffn.experts"] == {"experts_ep000.pt": [0, 2], "experts_ep001.pt": [2, 4]}
    run_distributed(load_and_check, 2, args=(four_ranks_ep2,), timeout=120)


# -- finding the latest ----------------------------------------------------------------------
def test_latest_checkpoint_is_the_largest_complete_step(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    groups = build_moe_groups()
    model, opt = build(groups, seed=0)
    for step in (2, 10):
        save_checkpoint(tmp_path, step, model, opt, groups, {})
    (tmp_path / "checkpoints" / ".step_11.tmp").mkdir()
    (tmp_path / "checkpoints" / ".step_11.tmp" / "manifest.json").write_text("{}")
    (tmp_path / "checkpoints" / "step_12").mkdir()  # crashed before its manifest
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_10"


def test_saving_over_an_existing_step_replaces_it_and_leaves_no_temporary_folders(tmp_path):
    groups = build_moe_groups()
    model, opt = build(groups, seed=0)
    save_checkpoint(tmp_path, 3, model, opt, groups, {"version": 1})
    (tmp_path / "checkpoints" / ".step_3.tmp").mkdir()  # left by a crash
    train(model, opt, groups, range(1))
    path = save_checkpoint(tmp_path, 3, model, opt, groups, {"version": 2})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_3"]
    fresh, fresh_opt = build(groups, seed=1)
    assert load_checkpoint(path, fresh, fresh_opt, groups) == {"version": 2}
    assert_equal_nested(clone_state(fresh), clone_state(model), "model")


def test_extra_must_be_json_serialisable(tmp_path):
    groups = build_moe_groups()
    model, opt = build(groups, seed=0)
    with pytest.raises(TypeError, match="extra must be JSON-serialisable"):
        save_checkpoint(tmp_path, 1, model, opt, groups, {"bad": object()})
    assert latest_checkpoint(tmp_path) is None


def test_a_crash_while_publishing_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    groups = build_moe_groups()
    model, opt = build(groups, seed=0)
    save_checkpoint(tmp_path, 1, model, opt, groups, {"step": 1})

    def crash(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(checkpoint.os, "replace", crash)
    with pytest.raises(CheckpointError, match="step_2 was not saved.*disk gone"):
        save_checkpoint(tmp_path, 2, model, opt, groups, {"step": 2})
    monkeypatch.undo()
    # A failure weft sees removes the partial folder (a full disk must not stay full); a process
    # killed mid-publish leaves it, and the next save of that step clears it.
    assert not (tmp_path / "checkpoints" / ".step_2.tmp").exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_1"
    assert load_checkpoint(latest_checkpoint(tmp_path), model, opt, groups) == {"step": 1}


def _no_rng_state():
    raise OSError("no space left on device")


def save_with_rank_one_failing(run_dir: str) -> str:
    groups = build_moe_groups()
    model, opt = build(groups, seed=0)
    if dist.get_rank() == 1:
        checkpoint._rng_state = _no_rng_state
    with pytest.raises(CheckpointError) as error:
        save_checkpoint(run_dir, 1, model, opt, groups, {})
    return str(error.value)


def test_a_rank_that_fails_to_write_fails_the_save_on_every_rank(tmp_path):
    errors = run_distributed(save_with_rank_one_failing, 2, args=(str(tmp_path),), timeout=60)
    assert all("rank 1 could not write its files" in e and "no space left" in e for e in errors)
    assert latest_checkpoint(tmp_path) is None


# -- checkpoints written in the background ------------------------------------------------------
def _held_writes(release: threading.Event) -> None:
    """Make this process's checkpoint writes wait for `release` (so training changes the state
    before a byte of the background checkpoint is written)."""
    write = checkpoint._write_files

    def held(folder, payload):
        assert release.wait(60), "the test never released the writes"
        return write(folder, payload)

    checkpoint._write_files = held


def save_in_background_while_training(run_dir: str) -> None:
    """step_2 and step_3 saved in the call (the references, in run_dir/sync) and by the background
    writer, whose writes start only after the next training step has changed every parameter and
    moment; step_3's snapshot goes into the host memory step_2's went to."""
    groups = build_moe_groups()
    model, opt = build(groups, seed=0)
    train(model, opt, groups, range(2))
    writer = CheckpointWriter(Path(run_dir) / "background", keep_last=0, background=True)
    for step in (2, 3):
        save_checkpoint(Path(run_dir) / "sync", step, model, opt, groups, EXTRA)
        release = threading.Event()
        _held_writes(release)
        writer.save(step, model, opt, groups, EXTRA)
        before = clone_state(model)
        train(model, opt, groups, range(step, step + 1))
        assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
        published = latest_checkpoint(Path(run_dir) / "background")
        assert writer.pending == step and (published.name if published else None) == (
            None if step == 2 else "step_2")  # nothing half-published
        release.set()
    writer.wait()
    assert writer.pending is None


@pytest.mark.parametrize("world", [1, 2, 4])
def test_a_background_checkpoint_holds_the_state_of_its_step_while_training_goes_on(tmp_path, world):
    """The background writer's files are byte for byte those `save_checkpoint` writes in the call
    at the same step (sizes and sha256 in the manifests), although training changed every tensor
    before they were written: the state is copied at `save`; the second checkpoint's copies reuse
    the first's host memory."""
    run_distributed(save_in_background_while_training, world, args=(str(tmp_path),), timeout=120)
    for step in (2, 3):
        sync = verify_checkpoint(tmp_path / "sync" / "checkpoints" / f"step_{step}")
        background = verify_checkpoint(tmp_path / "background" / "checkpoints" / f"step_{step}")
        assert background["step"] == sync["step"] == step and background["extra"] == EXTRA
        assert background["files"] == sync["files"]
        assert len(sync["files"]) >= 3 * world  # rng of every rank, experts of every shard, model and optim


def fail_rank_one_in_background(run_dir: str) -> str:
    groups = build_moe_groups()
    model, opt = build(groups, seed=0)
    writer = CheckpointWriter(run_dir, background=True)
    writer.save(1, model, opt, groups, {"step": 1})
    writer.wait()
    if dist.get_rank() == 1:
        real_save = torch.save

        def full_disk(obj, f, *args, **kwargs):
            real_save({"partial": torch.zeros(1000)}, f)
            raise OSError("No space left on device")

        checkpoint.torch.save = full_disk
    writer.save(2, model, opt, groups, {"step": 2})
    with pytest.raises(CheckpointError) as failed:
        writer.wait()
    writer.wait()  # the error is raised once
    return str(failed.value)


def test_a_failed_background_write_fails_on_every_rank_at_the_next_wait(tmp_path):
    """Rank 1's disk fills while the background thread writes step_2: every rank raises the one-line
    error at its next wait, naming the rank and the cause; step_2's partial folder is removed and
    step_1 stays the latest."""
    errors = run_distributed(fail_rank_one_in_background, 2, args=(str(tmp_path),), timeout=120)
    for error in errors:
        assert "rank 1 could not write its files" in error and "No space left" in error, error
        assert "the latest complete checkpoint is step_1" in error
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]


def save_twice_keeping_one(run_dir: str, background: bool) -> list[str]:
    groups = build_moe_groups()
    model, opt = build(groups, seed=0)
    lines: list[str] = []
    writer = CheckpointWriter(run_dir, keep_last=1, background=background, report=lines.append)
    for step in (1, 2):
        train(model, opt, groups, range(step - 1, step))
        writer.save(step, model, opt, groups, {"step": step})  # the second waits for the first
    writer.wait()
    return lines


@pytest.mark.parametrize("background", [True, False])
def test_checkpoints_are_written_in_order_pruned_and_reported(tmp_path, background):
    """Two saves, the newest one kept: in order (a background save waits for the one before), and
    one report line per checkpoint with its size (the manifest's files) and where it was written."""
    reports = run_distributed(save_twice_keeping_one, 2, args=(str(tmp_path), background), timeout=120)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2"]
    manifest = verify_checkpoint(tmp_path / "checkpoints" / "step_2")
    assert manifest["extra"] == {"step": 2}
    size = sum(meta["size"] for meta in manifest["files"].values()) / 2**30
    where = "in the background" if background else "in the step"
    for lines in reports:
        assert [line.split(" (")[0] for line in lines] == ["weft train: checkpoint step_1",
                                                           "weft train: checkpoint step_2"]
        assert f"({size:.2f} GiB) written {where}: the step was held" in lines[1], lines


# -- tensor parallelism: the dense tensors gathered share by share ------------------------------
def gathered_while_saving(_: str) -> tuple[int, int, int, int, list[str], list[str]]:
    """A tensor-parallel GPT (TP over both ranks) with AdamW state: what `_rank_payload` gathers.
    Returns the bytes gathered in all, the most alive at once, those its files keep, the largest
    gathered tensor's, and the names of the model and optimizer entries its files hold."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=4, n_head=2, dim=32, moe_every=0), tp_group=dist.group.WORLD)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # the moments exist
    alive: list[tuple[weakref.ref, int]] = []
    most, real = 0, checkpoint.dense_tensor

    def tracking(module, name, local):
        nonlocal most
        dense = real(module, name, local)
        alive.append((weakref.ref(dense), dense.numel() * dense.element_size()))
        most = max(most, sum(n for ref, n in alive if ref() is not None))
        return dense

    checkpoint.dense_tensor = tracking
    files, _ = checkpoint._rank_payload(model, opt, build_moe_groups())
    kept = sum(n for ref, n in alive if ref() is not None)
    rank = dist.get_rank()
    return (sum(n for _, n in alive), most, kept, max(n for _, n in alive), list(files[f"model_part{rank:05d}.pt"]),
            list(files[f"optim_part{rank:05d}.pt"]["state"]))


def test_a_tensor_parallel_save_gathers_each_rank_only_its_share_at_a_time(tmp_path):
    """Each rank writes an even share of the dense tensors; the slices are gathered one at a time
    and kept only by the rank that writes them, so a rank holds its share and at most two gathered
    tensors more (the one just gathered and the one before it), not the whole model gathered
    (gpt3-2.7b with TP 2: ~15 GB more per GPU at each checkpoint). Together the ranks keep each
    gathered tensor once."""
    results = run_distributed(gathered_while_saving, 2, args=(str(tmp_path),), timeout=120)
    for _, most, kept, largest, _, _ in results:
        assert 0 < kept and most <= kept + 2 * largest, (most, kept, largest)
    assert sum(kept for _, _, kept, *_ in results) == results[0][0] == results[1][0]
    for part in (4, 5):  # the model's entries, the optimizer's: each written by one rank
        mine, theirs = (set(r[part]) for r in results)
        assert mine and theirs and not mine & theirs


# -- corruption and mismatches ---------------------------------------------------------------
def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "flipped byte": ("experts_ep001.pt", flip_byte, "experts_ep001.pt fails its sha256"),
    "deleted file": ("optim_experts_ep000.pt", Path.unlink, "optim_experts_ep000.pt .*missing"),
    "grown file": ("model_part00000.pt", lambda p: p.write_bytes(p.read_bytes() + b"x"),
                   "model_part00000.pt has .* bytes"),
    "deleted part": ("optim_part00001.pt", Path.unlink, "optim_part00001.pt .*missing"),
    "truncated manifest": ("manifest.json", lambda p: p.write_text(p.read_text()[:40]), "manifest.json is unreadable"),
    "no manifest": ("manifest.json", Path.unlink, "manifest.json is missing"),
    "edited step": ("manifest.json", lambda p: p.write_text(p.read_text().replace('"step": 2', '"step": 9')),
                    "manifest.json does not match its checksum"),
}


def test_a_manifest_from_before_the_checksum_still_loads(two_ranks, tmp_path):
    path = tmp_path / "step_2"
    shutil.copytree(latest_checkpoint(two_ranks), path)
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["sha256"]
    (path / "manifest.json").write_text(json.dumps({**manifest, "format_version": 1}))
    groups = build_moe_groups()
    model, opt = build(groups, seed=1)
    load_checkpoint(path, model, opt, groups)  # format 1: no checksum to check, loads as before
    assert verify_checkpoint(path)["step"] == 2


def test_a_checkpoint_of_one_model_file_from_before_the_parts_still_loads(two_ranks, tmp_path):
    """Format 2 held the non-expert entries in one model.pt and optim.pt (rank 0's): joined from
    the parts and listed so, with a manifest of format 2, it loads the same state."""
    path = tmp_path / "step_2"
    shutil.copytree(latest_checkpoint(two_ranks), path)
    manifest = json.loads((path / "manifest.json").read_text())
    model_parts = sorted(path.glob("model_part*.pt"))
    optim_parts = [torch.load(p, weights_only=True) for p in sorted(path.glob("optim_part*.pt"))]
    joined_model = {k: v for p in model_parts for k, v in torch.load(p, weights_only=True).items()}
    joined_optim = {"state": {k: v for part in optim_parts for k, v in part["state"].items()},
                    "param_groups": optim_parts[0]["param_groups"]}
    files = {k: v for k, v in manifest["files"].items() if "_part" not in k}
    for part in [*model_parts, *sorted(path.glob("optim_part*.pt"))]:
        part.unlink()
    files |= checkpoint._write(path, "model.pt", joined_model) | checkpoint._write(path, "optim.pt", joined_optim)
    old = {**{k: v for k, v in manifest.items() if k != "sha256"}, "format_version": 2, "files": files}
    (path / "manifest.json").write_text(json.dumps({**old, "sha256": checkpoint._content_sha256(old)}))
    groups = build_moe_groups()
    from_parts, from_parts_opt = build(groups, seed=1)
    load_checkpoint(latest_checkpoint(two_ranks), from_parts, from_parts_opt, groups)
    from_one, from_one_opt = build(groups, seed=2)
    load_checkpoint(path, from_one, from_one_opt, groups)
    assert_equal_nested(clone_state(from_one), clone_state(from_parts), "model")
    assert_equal_nested(named_optim_state(from_one, from_one_opt), named_optim_state(from_parts, from_parts_opt),
                        "optim")


def test_dense_shares_give_every_entry_to_one_rank_and_spread_the_bytes():
    sizes = {f"w{i}": size for i, size in enumerate([100, 90, 50, 40, 40, 10, 5, 5])}
    shares = checkpoint.dense_shares(sizes, 3)
    assert sorted(n for share in shares for n in share) == sorted(sizes)
    loads = [sum(sizes[n] for n in share) for share in shares]
    assert max(loads) - min(loads) <= max(sizes.values()) and max(loads) < sum(sizes.values()) / 2
    assert shares == checkpoint.dense_shares(dict(reversed(list(sizes.items()))), 3)  # same on every rank
    assert checkpoint.dense_shares(sizes, 1) == [sorted(sizes, key=lambda n: (-sizes[n], n))]


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_corruption_is_detected_before_anything_is_loaded(two_ranks, tmp_path, corruption):
    name, damage, message = CORRUPTIONS[corruption]
    path = tmp_path / "step_2"
    shutil.copytree(latest_checkpoint(two_ranks), path)
    damage(path / name)
    groups = build_moe_groups()
    model, opt = build(groups, seed=1)
    before = clone_state(model)
    with pytest.raises(CheckpointError, match=f"{path}.*{message}"):
        load_checkpoint(path, model, opt, groups)
    with pytest.raises(CheckpointError, match=f"{path}.*{message}"):
        verify_checkpoint(path)
    assert_equal_nested(clone_state(model), before, "model after a failed load")


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"dim": 48}, r"parameter tok_emb.weight has shape \(256, 32\) in the checkpoint but \(256, 48\)"),
        ({"num_experts": 8}, "blocks.0.ffn.experts has 4 experts, the model 8"),
        ({"n_layer": 3}, r"parameter names differ.*blocks\.2\."),
    ],
)
def test_a_model_of_another_shape_is_refused(one_process, overrides, message):
    groups = build_moe_groups()
    model, opt = build(groups, seed=1, **overrides)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(latest_checkpoint(one_process), model, opt, groups)


def test_a_failed_save_removes_its_partial_folder_and_says_why(tmp_path, monkeypatch):
    """A full disk mid-save (torch reports 'unexpected pos'): a clear error naming the free space and
    the latest complete checkpoint, and no partial `.step_N.tmp` left to keep the disk full."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    groups = build_moe_groups()
    save_checkpoint(tmp_path, 1, model, None, groups)
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        real_save({"partial": torch.zeros(1000)}, f)
        raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 4096 vs 4030")

    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    with pytest.raises(CheckpointError) as failed:
        save_checkpoint(tmp_path, 2, model, None, groups)
    message = str(failed.value)
    assert "unexpected pos" in message and "MiB free" in message
    assert "partial checkpoint was removed; the latest complete checkpoint is step_1" in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]
    assert latest_checkpoint(tmp_path).name == "step_1"


def test_pruning_removes_the_manifest_first(tmp_path, monkeypatch):
    """A crash while pruning leaves an old folder without its manifest: never taken for complete."""
    from weft.train import checkpoint as ckpt

    root = tmp_path / "checkpoints"
    for step in (5, 10, 15):
        (root / f"step_{step}").mkdir(parents=True)
        (root / f"step_{step}" / ckpt.MANIFEST).write_text("{}")
        (root / f"step_{step}" / "model.pt").write_bytes(b"x")

    def crash(path):
        raise OSError("killed while deleting")

    monkeypatch.setattr(ckpt.shutil, "rmtree", crash)
    with pytest.raises(OSError):
        ckpt.prune_checkpoints(tmp_path, keep_last=1)
    assert not (root / "step_5" / ckpt.MANIFEST).exists()  # the first doomed one lost its manifest first
    assert ckpt.latest_checkpoint(tmp_path) == root / "step_15"
    monkeypatch.undo()
    # The next pruning also removes what the interrupted one left.
    assert [p.name for p in ckpt.prune_checkpoints(tmp_path, keep_last=1)] == ["step_5", "step_10"]
    assert [p.name for p in root.iterdir()] == ["step_15"]
    assert ckpt.prune_checkpoints(tmp_path, keep_last=0) == []
