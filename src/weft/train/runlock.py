"""One writer per run folder: `weft train` holds an exclusive lock on `<run>/.weft.lock` for as
long as it runs there.

The lock is `fcntl.flock` on an open file, so the kernel drops it when the holder exits or is
killed: a lock file left by a dead run is stale by construction and the next run takes it. The
file records the holder's pid and host, which the refusal names. (On network file systems
without flock support the lock is advisory at best; keep run folders on local or
flock-capable storage.)
"""
from __future__ import annotations

import os
import socket
from pathlib import Path

from weft.launch import ReportedError

try:
    import fcntl
except ImportError:  # not POSIX: no lock (weft's multi-process runs need Linux anyway)
    fcntl = None

LOCK_NAME = ".weft.lock"


class RunFolderInUse(ReportedError):
    """Another live `weft train` holds the run folder's lock."""


def in_use(run_dir: str | Path) -> RunFolderInUse:
    """The refusal for a locked run folder, naming the holder the lock file records."""
    try:
        holder = (Path(run_dir) / LOCK_NAME).read_text().strip()
    except OSError:
        holder = ""
    return RunFolderInUse(f"{run_dir} is in use by another weft train ({holder or 'holder unknown'}); stop it "
                          f"first, or use another --out")


class RunLock:
    """The run folder's lock, held from `acquire` until `release` (or the process's end)."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_NAME
        self._file = None

    def acquire(self) -> RunLock:
        """Take the lock or raise RunFolderInUse naming the holder; returns self."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = self.path.open("a+")
        if fcntl is not None:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                raise in_use(self.path.parent) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
        self._file = handle
        return self

    def release(self) -> None:
        if self._file is not None:
            if fcntl is not None:
                fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None
