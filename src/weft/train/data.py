"""Training data: byte tokenizer, a cached token file, and a resumable per-rank batch sampler.

Text is tokenized once into a uint16 file in a cache folder and then read through a numpy memmap,
so every data-parallel rank shares one copy through the page cache. Batches are a pure function of
(seed, step, micro_step, rank, the global batch size): a run resumed at step N sees exactly the
batches of a run that never stopped, with no sampler state to checkpoint, and the ranks split one
global batch, so the data does not depend on how many GPUs share it.
"""
from __future__ import annotations

import codecs
import hashlib
import logging
import math
import os
import socket
import sysconfig
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from tqdm import tqdm

logger = logging.getLogger(__name__)

# Bump when the cache file layout or the tokenization changes, so old caches are not reused.
_CACHE_VERSION = 2  # 2: each cache file has a .sha256 sidecar, checked on every use
_SEPARATOR = b"\n\n"
_READ_CHUNK = 16 << 20
_TOKEN_DTYPE = np.dtype("<u2")
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary of 256, nothing to train or download."""

    vocab_size: int = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int] | np.ndarray | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(np.asarray(ids, dtype=np.uint8)).decode("utf-8", errors="replace")

    @staticmethod
    def encode_bytes(data: bytes) -> np.ndarray:
        """Token ids of already UTF-8 encoded text, as the cache file stores them."""
        return np.frombuffer(data, dtype=np.uint8).astype(_TOKEN_DTYPE)


@dataclass(frozen=True)
class TokenData:
    """A token stream split into train and held-out validation (its last tokens)."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    source: str
    path: Path  # the token file both splits are views of

    @property
    def num_tokens(self) -> int:
        return len(self.train) + len(self.val)


def default_corpus_files() -> list[Path]:
    """The Python standard library's own ``.py`` sources on this machine, without tests or site-packages."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for root, dirs, names in os.walk(stdlib):
        dirs[:] = [d for d in dirs if d not in _SKIPPED_DIRS]
        files.extend(Path(root, n) for n in names if n.endswith(".py"))
    if not files:
        raise RuntimeError(
            f"no Python standard library sources found under {stdlib}; pass a text file or folder as the data source"
        )
    return sorted(files)


def prepare_data(
    source: str | Path | None,
    cache_dir: str | Path,
    val_fraction: float = 0.01,
    *,
    vocab_size: int = 256,
    lock_timeout: float = 1800.0,
) -> TokenData:
    """Token data for ``source``: None (the Python stdlib), a text file, a folder or a ``.bin`` token file.

    A folder contributes every file under it (recursively, sorted) that is UTF-8 text without NUL
    bytes; hidden files and folders and ``cache_dir`` are skipped. Text is tokenized once into
    ``cache_dir`` under a name hashing the file list with sizes and mtimes. A ``.bin`` file holds
    uint16 ids (uint32 if named ``*.u32.bin``), is used in place and must have ids < ``vocab_size``.
    Safe to call from several ranks at once: one tokenizes, the others wait up to ``lock_timeout``.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction ({val_fraction}) must be in [0, 1)")
    if source is None:
        files = default_corpus_files()
        description = f"python stdlib {sysconfig.get_paths()['stdlib']} ({len(files)} files)"
    else:
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"data source {path} does not exist")
        if path.is_file() and path.name.endswith(".bin"):
            tokens = _load_token_file(path, vocab_size)
            return _split(tokens, val_fraction, vocab_size, f"tokens {path}", path)
        files = _text_candidates(path, Path(cache_dir)) if path.is_dir() else [path]
        if not files:
            raise ValueError(f"no files found under data folder {path}")
        description = f"folder {path} ({len(files)} files)" if path.is_dir() else f"text file {path}"
    token_file = _cached_tokens(files, Path(cache_dir), lock_timeout, description)
    tokens = np.memmap(token_file, dtype=_TOKEN_DTYPE, mode="r")
    return _split(tokens, val_fraction, ByteTokenizer.vocab_size, description, token_file)


def _split(tokens: np.ndarray, val_fraction: float, vocab_size: int, source: str, path: Path) -> TokenData:
    # round first: 350 * 0.1 must give 35, not ceil(35.000000000000004) = 36
    num_val = math.ceil(round(len(tokens) * val_fraction, 6))
    cut = len(tokens) - num_val
    return TokenData(tokens[:cut], tokens[cut:], vocab_size, source, path)


def _load_token_file(path: Path, vocab_size: int) -> np.ndarray:
    dtype = np.dtype("<u4") if path.name.endswith(".u32.bin") else _TOKEN_DTYPE
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"token file {path} is empty")
    if size % dtype.itemsize:
        raise ValueError(
            f"token file {path} has {size} bytes, not a multiple of {dtype.itemsize} "
            f"({dtype.name}; name it *.u32.bin for uint32 ids, otherwise uint16 is assumed)"
        )
    tokens = np.memmap(path, dtype=dtype, mode="r")
    largest = int(tokens.max())
    if largest >= vocab_size:
        raise ValueError(f"token file {path} holds id {largest}, out of range for vocab_size {vocab_size}")
    return tokens


def _text_candidates(folder: Path, cache_dir: Path) -> list[Path]:
    # Hidden entries (.git, .venv) are rarely corpus text; the cache folder would feed on itself.
    cache = cache_dir.resolve()
    files = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".") and Path(root, d).resolve() != cache]
        files.extend(Path(root, n) for n in names if not n.startswith("."))
    return sorted(files)


def _cache_key(stats: list[tuple[Path, int, int]]) -> str:
    h = hashlib.sha256(f"weft-bytes-v{_CACHE_VERSION}|{_SEPARATOR!r}".encode())
    for path, size, mtime_ns in stats:
        h.update(f"\0{path.resolve()}\0{size}\0{mtime_ns}".encode())
    return h.hexdigest()[:20]


def _cached_tokens(files: list[Path], cache_dir: Path, lock_timeout: float, description: str) -> Path:
    stats = [(p, st.st_size, st.st_mtime_ns) for p, st in ((p, p.stat()) for p in files)]
    cache_dir.mkdir(parents=True, exist_ok=True)
    final = cache_dir / f"tokens-{_cache_key(stats)}.u16.bin"

    def write(out: BinaryIO) -> None:
        _tokenize_files(stats, out, description)
        out.flush()
        # The checksum is in place before the cache file is renamed into place.
        _atomic_write(_checksum_path(final), lambda f: f.write(_digest_line(Path(out.name)).encode()))

    _create_once(final, write, lock_timeout)
    _check_cache(final)
    return final


def _checksum_path(cache_file: Path) -> Path:
    return cache_file.with_name(cache_file.name + ".sha256")


def _digest_line(path: Path) -> str:
    """'<sha256> <bytes>' of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            h.update(chunk)
    return f"{h.hexdigest()} {path.stat().st_size}\n"


def _check_cache(cache_file: Path) -> None:
    """ValueError naming the cache file if it is not byte for byte what was tokenized (truncated,
    damaged, or its checksum file missing): a damaged cache would train on the wrong tokens."""
    try:
        expected = _checksum_path(cache_file).read_text().split()
    except OSError:
        expected = []
    actual = _digest_line(cache_file).split()
    if expected != actual:
        what = "has no checksum file" if not expected else (
            f"is {actual[1]} bytes, {expected[1]} were written" if actual[1] != expected[1]
            else "does not match its checksum")
        raise ValueError(f"token cache {cache_file} {what}: it is damaged; delete it (and its .sha256) and run "
                         f"again to tokenize the data anew")


def _tokenize_files(stats: list[tuple[Path, int, int]], out: BinaryIO, description: str) -> None:
    separator = ByteTokenizer.encode_bytes(_SEPARATOR).tobytes()
    show = os.environ.get("RANK", "0") == "0"
    kept = skipped = 0
    # delay: small corpora tokenize in well under a second and print nothing.
    total = sum(size for _, size, _ in stats)
    with tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", disable=not show, delay=1.0) as bar:
        for path, size, _ in stats:
            start = out.tell()
            if kept:
                out.write(separator)
            written = _write_text_tokens(path, size, out, bar)
            if not written:
                out.seek(start)
                out.truncate()
                skipped += written is None
            else:
                kept += 1
    if kept == 0:
        raise ValueError(
            f"no text found in {description}: {skipped} file(s) not UTF-8 text "
            f"(or binary, with NUL bytes), {len(stats) - skipped} empty"
        )
    logger.info("tokenized %d files (%d skipped as not UTF-8 text) into %d tokens", kept, skipped,
                out.tell() // _TOKEN_DTYPE.itemsize)


def _write_text_tokens(path: Path, size: int, out: BinaryIO, bar: tqdm) -> int | None:
    """Byte count of ``path`` written to ``out`` as tokens, or None if it is not UTF-8 text."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    done = 0
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_READ_CHUNK):
                done += len(chunk)
                bar.update(len(chunk))
                if b"\0" in chunk:
                    return None
                decoder.decode(chunk)
                out.write(ByteTokenizer.encode_bytes(chunk).tobytes())
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return None
    finally:
        bar.update(max(size - done, 0))
    return done


def _create_once(final: Path, write: Callable[[BinaryIO], None], timeout: float) -> None:
    """Create ``final`` with ``write`` unless it exists; one process writes, concurrent callers wait.

    Correctness rests on the atomic rename alone; the lock only saves the other ranks the work.
    A caller that finds the lock stale (owner dead) or times out writes its own copy.
    """
    if final.exists():
        return
    lock = final.with_name(final.name + ".lock")
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        if not _wait_for(final, lock, timeout):
            _atomic_write(final, write)
            # Safe even if the lock was re-taken meanwhile: its holder re-checks `final` first.
            lock.unlink(missing_ok=True)
        return
    try:
        os.write(fd, f"{socket.gethostname()} {os.getpid()}".encode())
        if not final.exists():  # finished between our check and taking the lock
            _atomic_write(final, write)
    finally:
        os.close(fd)
        lock.unlink(missing_ok=True)


def _wait_for(final: Path, lock: Path, timeout: float) -> bool:
    """True once ``final`` exists; False if the lock owner is gone without creating it, or on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if final.exists():
            return True
        if not lock.exists() or _lock_is_stale(lock):
            return final.exists()
        time.sleep(0.05)
    logger.warning("waited %.0f s for %s; writing it in this process instead", timeout, final)
    return False


def _lock_is_stale(lock: Path) -> bool:
    try:
        host, pid = lock.read_text().split()
    except (OSError, ValueError):
        return False  # just created and not written yet, or removed: not known to be stale
    if host != socket.gethostname():
        return False  # cannot tell on another machine; the timeout covers it
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _atomic_write(final: Path, write: Callable[[BinaryIO], None]) -> None:
    tmp = final.with_name(f".{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


class BatchSampler:
    """Random (x, y) windows of ``data``; y is x shifted by one. Each (step, micro-step) draws one
    global batch of ``batch_size * world_size`` windows from the whole of ``data``, and rank r
    takes windows ``[r * batch_size, (r + 1) * batch_size)`` of it (Megatron's global batch split
    over the data-parallel ranks).

    ``get(step, micro_step)`` depends only on (seed, step, micro_step) and the global batch size,
    so resuming needs no sampler state, and W ranks of batch B read exactly the windows one rank
    of batch W * B reads: a run's data does not change with the number of GPUs, and every rank
    samples the whole corpus.
    """

    def __init__(
        self, data: np.ndarray, batch_size: int, block_size: int, rank: int = 0, world_size: int = 1, seed: int = 0
    ) -> None:
        if batch_size < 1 or block_size < 1:
            raise ValueError(f"batch_size ({batch_size}) and block_size ({block_size}) must be positive")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank ({rank}) must be in [0, world_size={world_size})")
        if len(data) < block_size + 1:
            raise ValueError(
                f"dataset too small: {len(data)} tokens, fewer than block_size + 1 = {block_size + 1}; use more "
                f"data (or a larger val_fraction for validation) or a smaller block_size"
            )
        self.batch_size, self.block_size = batch_size, block_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.data = data

    def _mine(self, global_starts: np.ndarray) -> np.ndarray:
        """This rank's part of a global batch's window starts."""
        return global_starts[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]

    def get(self, step: int, micro_step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The (batch_size, block_size) int64 batch for this step and micro-step."""
        if step < 0 or micro_step < 0:
            raise ValueError(f"step ({step}) and micro_step ({micro_step}) must be non-negative")
        rng = np.random.default_rng([self.seed, step, micro_step])
        starts = rng.integers(0, len(self.data) - self.block_size, size=self.batch_size * self.world_size)
        return self._windows(self._mine(starts))

    def eval_batches(self, n: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``n`` fixed batches, the same every call: ``n`` global batches spread evenly over the
        data, this rank's part of each."""
        last_start = len(self.data) - self.block_size - 1
        per_batch = self.batch_size * self.world_size
        starts = np.linspace(0, last_start, n * per_batch).round().astype(np.int64)
        for i in range(n):
            yield self._windows(self._mine(starts[i * per_batch : (i + 1) * per_batch]))

    def _windows(self, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = np.arange(self.block_size + 1)
        windows = torch.from_numpy(self.data[starts[:, None] + offsets].astype(np.int64))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
