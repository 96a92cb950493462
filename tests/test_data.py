"""Specification of weft.train.data: tokenizer, cached token files, resumable per-rank batches."""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from weft.train import data as data_mod
from weft.train.data import BatchSampler, ByteTokenizer, TokenData, default_corpus_files, prepare_data

SEP = list(b"\n\n")


def tokens(d: TokenData) -> list[int]:
    return np.concatenate([d.train, d.val]).tolist()


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


def cache_files(cache: Path) -> list[Path]:
    return sorted(cache.glob("tokens-*.u16.bin"))


# Tokenizer


@pytest.mark.parametrize("text", ["", "hello world", "naïve café — 東京 🚀\n"])
def test_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids, dtype=torch.long)) == text


def test_tokenizer_decodes_broken_utf8_with_replacement():
    assert ByteTokenizer().decode([104, 0xE2, 0x82]) == "h\ufffd"


# Default corpus


def test_default_corpus_is_stdlib_without_tests():
    files = default_corpus_files()
    assert files and files == sorted(files) and all(f.suffix == ".py" for f in files)
    assert any(f.name == "os.py" for f in files)
    for f in files:
        assert not {"site-packages", "test", "tests", "idle_test"} & set(f.parts), f


def test_default_corpus_missing_raises(monkeypatch, tmp_path):
    monkeypatch.setattr(data_mod.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    with pytest.raises(RuntimeError, match=str(tmp_path)):
        default_corpus_files()


def test_prepare_default_corpus(tmp_path):
    d = prepare_data(None, tmp_path)
    assert d.vocab_size == 256 and d.num_tokens > 1_000_000
    assert len(d.val) == -(-d.num_tokens // 100)
    assert b"def " in d.train[:100_000].astype(np.uint8).tobytes()


# prepare_data on text


def test_prepare_text_file(tmp_path):
    src = write(tmp_path / "a.txt", "héllo\n" * 50)
    d = prepare_data(src, tmp_path / "cache", val_fraction=0.1)
    assert tokens(d) == list(("héllo\n" * 50).encode())
    assert d.num_tokens == 350 and len(d.val) == 35
    assert isinstance(d.train, np.memmap) and d.train.dtype == np.uint16
    assert str(src) in d.source


def test_prepare_folder_recursive_sorted_skips_binary(tmp_path):
    src = tmp_path / "corpus"
    write(src / "b.txt", "second")
    write(src / "a.txt", "first")
    write(src / "sub" / "c.md", "third ✓")
    write(src / "image.bin.dat", b"\x89PNG\0\0\x01")  # NUL bytes: binary
    write(src / "latin1.txt", "caf\xe9".encode("latin-1"))  # not UTF-8
    write(src / "empty.txt", "")
    write(src / ".git" / "HEAD", "ref: refs/heads/main")
    d = prepare_data(src, tmp_path / "cache", val_fraction=0.0)
    assert tokens(d) == list(b"first") + SEP + list(b"second") + SEP + list("third ✓".encode())
    assert len(d.val) == 0


def test_cache_dir_inside_source_folder_is_ignored(tmp_path):
    write(tmp_path / "a.txt", "abc")
    first = prepare_data(tmp_path, tmp_path / "cache")
    second = prepare_data(tmp_path, tmp_path / "cache")
    assert first.path == second.path and tokens(second) == list(b"abc")


# prepare_data on pre-tokenized .bin


def test_prepare_u16_bin_in_place(tmp_path):
    ids = np.arange(1000, dtype=np.uint16) % 300
    ids.tofile(tmp_path / "toks.bin")
    d = prepare_data(tmp_path / "toks.bin", tmp_path / "cache", val_fraction=0.1, vocab_size=300)
    assert d.path == tmp_path / "toks.bin" and d.vocab_size == 300
    assert tokens(d) == ids.tolist() and len(d.val) == 100
    assert isinstance(d.train, np.memmap) and Path(d.train.filename) == tmp_path / "toks.bin"
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_prepare_u32_bin(tmp_path):
    ids = np.array([0, 70_000, 100_000, 5] * 10, dtype=np.uint32)
    ids.tofile(tmp_path / "toks.u32.bin")
    d = prepare_data(tmp_path / "toks.u32.bin", tmp_path / "cache", vocab_size=100_001)
    assert d.train.dtype == np.uint32 and tokens(d) == ids.tolist()


# Cache


def test_cache_reused_then_invalidated_on_change(tmp_path, monkeypatch):
    src = write(tmp_path / "corpus" / "a.txt", "one")
    cache = tmp_path / "cache"
    first = prepare_data(src.parent, cache)

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("re-tokenized although the corpus did not change")

    with monkeypatch.context() as m:
        m.setattr(data_mod, "_tokenize_files", no_tokenizing)
        again = prepare_data(src.parent, cache)
    assert again.path == first.path and tokens(again) == list(b"one")

    write(src, "one, changed")
    changed = prepare_data(src.parent, cache)
    assert changed.path != first.path and tokens(changed) == list(b"one, changed")
    write(src.parent / "new.txt", "two")
    added = prepare_data(src.parent, cache)
    assert tokens(added) == list(b"one, changed") + SEP + list(b"two")
    assert len(cache_files(cache)) == 3 and not list(cache.glob("*.tmp")) and not list(cache.glob("*.lock"))


# Errors


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        prepare_data(tmp_path / "nope", tmp_path / "cache")


def test_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no files found under data folder .*empty"):
        prepare_data(tmp_path / "empty", tmp_path / "cache")


@pytest.mark.parametrize("content", [b"", b"\0\1\2", "caf\xe9".encode("latin-1")], ids=["empty", "binary", "latin1"])
def test_no_text(tmp_path, content):
    src = write(tmp_path / "corpus" / "f.txt", content)
    with pytest.raises(ValueError, match="no text found in .*corpus"):
        prepare_data(src.parent, tmp_path / "cache")
    assert not cache_files(tmp_path / "cache")


@pytest.mark.parametrize("name,nbytes", [("odd.bin", 7), ("odd.u32.bin", 10), ("empty.bin", 0)])
def test_bad_bin_size(tmp_path, name, nbytes):
    write(tmp_path / name, b"\1" * nbytes)
    with pytest.raises(ValueError, match=name):
        prepare_data(tmp_path / name, tmp_path / "cache")


def test_bin_ids_out_of_range(tmp_path):
    np.array([1, 2, 256, 3], dtype=np.uint16).tofile(tmp_path / "toks.bin")
    with pytest.raises(ValueError, match="256.*vocab_size 256"):
        prepare_data(tmp_path / "toks.bin", tmp_path / "cache")


def test_bad_val_fraction(tmp_path):
    with pytest.raises(ValueError, match="val_fraction"):
        prepare_data(tmp_path, tmp_path / "cache", val_fraction=1.0)


# Sampler


def test_sampler_batch_shape_and_shift():
    data = np.arange(10_000, dtype=np.uint16)
    x, y = BatchSampler(data, batch_size=4, block_size=16).get(0)
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y, x + 1)  # consecutive data: every window is contiguous


def test_sampler_is_pure_function_of_seed_step_micro_step_rank():
    data = np.random.default_rng(0).integers(0, 256, 50_000).astype(np.uint16)
    a = BatchSampler(data, 8, 32, rank=1, world_size=2, seed=3)
    resumed = BatchSampler(data, 8, 32, rank=1, world_size=2, seed=3)
    for step, micro in [(0, 0), (7, 1), (123, 0)]:
        assert all(torch.equal(u, v) for u, v in zip(a.get(step, micro), resumed.get(step, micro)))
    base = a.get(5, 0)[0]
    other_rank = BatchSampler(data, 8, 32, rank=0, world_size=2, seed=3)
    other_seed = BatchSampler(data, 8, 32, rank=1, world_size=2, seed=4)
    for x, _ in [a.get(6, 0), a.get(5, 1), other_rank.get(5, 0), other_seed.get(5, 0)]:
        assert not torch.equal(base, x)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ranks_split_one_global_batch_drawn_from_all_the_data(world_size):
    """W ranks of batch B read the windows of one rank of batch W * B, each rank its own slice, and
    every rank draws from the whole data (not a shard of it)."""
    data = np.arange(1003, dtype=np.int64)
    whole = BatchSampler(data, 4 * world_size, 8, seed=5)
    ranks = [BatchSampler(data, 4, 8, rank, world_size, seed=5) for rank in range(world_size)]
    lows, highs = [], []
    for step, micro in [(0, 0), (3, 1), (40, 0)]:
        parts = [r.get(step, micro) for r in ranks]
        want_x, want_y = whole.get(step, micro)
        assert torch.equal(torch.cat([x for x, _ in parts]), want_x)
        assert torch.equal(torch.cat([y for _, y in parts]), want_y)
    for r in ranks:
        xs = torch.cat([r.get(step)[0] for step in range(50)])
        lows.append(int(xs.min()))
        highs.append(int(xs.max()))
    assert max(lows) < 100 and min(highs) > 900  # every rank reaches both ends of the data


def test_sampler_too_small_data():
    with pytest.raises(ValueError, match="too small: 32 tokens"):
        BatchSampler(np.arange(32), 2, 32, rank=0, world_size=4)
    BatchSampler(np.arange(33), 2, 32, rank=3, world_size=4)  # exactly block_size + 1 tokens is enough


def test_eval_batches_fixed_and_split_like_training():
    data = np.arange(5000, dtype=np.uint16)
    ranks = [BatchSampler(data, 4, 10, rank=r, world_size=2) for r in range(2)]
    first, second = list(ranks[1].eval_batches(3)), list(ranks[1].eval_batches(3))
    assert len(first) == 3 and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, second))
    whole = list(BatchSampler(data, 8, 10).eval_batches(3))
    for i, (x, _) in enumerate(whole):  # the ranks' parts of each global batch, in rank order
        assert torch.equal(torch.cat([list(r.eval_batches(3))[i][0] for r in ranks]), x)
    xs = torch.cat([x for x, _ in whole])
    assert xs.min() == 0 and xs.max() + 1 == 4999  # evenly spread from the data's start to its end


def test_sampler_on_prepared_data(tmp_path):
    d = prepare_data(write(tmp_path / "a.txt", "abcdefgh" * 100), tmp_path / "cache", val_fraction=0.1)
    x, y = BatchSampler(d.train, 2, 8).get(0)
    assert ByteTokenizer().decode(x[0]) in "abcdefgh" * 3
    assert len(list(BatchSampler(d.val, 2, 8).eval_batches(2))) == 2


# Concurrency


def _prepare_in_child(src: str, cache: str, rank: int, barrier, queue) -> None:
    os.environ["RANK"] = str(rank)
    barrier.wait(timeout=60)  # start together, past the slow interpreter start-up
    d = prepare_data(src, cache)
    queue.put((str(d.path), tokens(d)))


def test_concurrent_prepare_from_two_processes(tmp_path):
    src = tmp_path / "corpus"
    for i in range(20):
        write(src / f"f{i:02d}.txt", f"file {i} " * 20_000)
    cache = tmp_path / "cache"
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_prepare_in_child, args=(str(src), str(cache), r, barrier, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    expected = prepare_data(src, tmp_path / "fresh_cache")
    assert results[0] == results[1] == (str(cache_files(cache)[0]), tokens(expected))
    assert len(cache_files(cache)) == 1 and not list(cache.glob("*.tmp")) and not list(cache.glob("*.lock"))


def test_waiter_takes_over_from_dead_lock_owner(tmp_path):
    src = write(tmp_path / "a.txt", "abc")
    cache = tmp_path / "cache"
    first = prepare_data(src, cache)
    first.path.unlink()
    # A lock left by a process that no longer exists (pid far above any live one on this host).
    Path(str(first.path) + ".lock").write_text(f"{data_mod.socket.gethostname()} 999999999")
    d = prepare_data(src, cache, lock_timeout=30)
    assert d.path == first.path and tokens(d) == list(b"abc")


def test_waiter_uses_the_file_the_lock_owner_writes(tmp_path):
    src = write(tmp_path / "a.txt", "abc")
    cache = tmp_path / "cache"
    final = prepare_data(src, cache).path
    final.unlink()
    lock = Path(str(final) + ".lock")
    lock.write_text(f"{data_mod.socket.gethostname()} {os.getpid()}")  # a live owner

    def owner_finishes():  # as the real writer does: the checksum first, then the cache file
        time.sleep(0.3)
        content = np.array([7, 8, 9], np.uint16).tobytes()
        digest = f"{hashlib.sha256(content).hexdigest()} {len(content)}\n"
        data_mod._atomic_write(data_mod._checksum_path(final), lambda out: out.write(digest.encode()))
        data_mod._atomic_write(final, lambda out: out.write(content))
        lock.unlink()

    thread = threading.Thread(target=owner_finishes)
    thread.start()
    d = prepare_data(src, cache, lock_timeout=30)
    thread.join()
    assert tokens(d) == [7, 8, 9]  # the owner's file, not a second tokenization


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_checksum"])
def test_a_damaged_token_cache_is_refused_with_its_name(tmp_path, damage):
    src = tmp_path / "a.txt"
    src.write_text("hello world, " * 500)
    data = prepare_data(src, tmp_path / "cache")
    cache_file = data.path
    assert cache_file.parent == tmp_path / "cache" and len(data.train) + len(data.val) == 13 * 500
    del data  # drop the memmap before changing the file
    raw = bytearray(cache_file.read_bytes())
    if damage == "truncate":
        cache_file.write_bytes(raw[: len(raw) // 3])
    elif damage == "flip":
        raw[100] ^= 0xFF
        cache_file.write_bytes(raw)
    else:
        cache_file.with_name(cache_file.name + ".sha256").unlink()
    with pytest.raises(ValueError, match=f"token cache {cache_file} .*damaged; delete it"):
        prepare_data(src, tmp_path / "cache")
