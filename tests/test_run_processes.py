"""`weft train` as processes: the ranks die with their launcher (kill -9 or SIGTERM, as `timeout`
and job schedulers send), and a run folder has one writer at a time (a lock naming its holder;
the lock of a dead run does not block the next one)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from weft.train.runlock import RunFolderInUse, RunLock

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and Linux signals")


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


def _wait_for(condition, timeout: float, what: str, poll: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll)


def _train_cmd(corpus: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "weft", "train", "--preset", "tiny", "--steps", "100000", "--data", str(corpus),
            "--out", str(out), "--nproc", "2", "--device", "cpu", "--sample-tokens", "0", *extra]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text("".join(f"line {i}: the quick brown fox\n" for i in range(4000)))
    return path


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_ranks_die_with_their_launcher_and_the_folder_is_locked_meanwhile(corpus, tmp_path, sig):
    out = tmp_path / "run"
    env = {**os.environ, "WEFT_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    launcher = subprocess.Popen(_train_cmd(corpus, out), env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        metrics = out / "metrics.jsonl"
        _wait_for(lambda: metrics.exists() and metrics.stat().st_size > 0 or launcher.poll() is not None, 240,
                  "the first metrics row")
        assert launcher.poll() is None, launcher.stderr.read()
        ranks = _children(launcher.pid)
        ranks = [pid for pid in ranks if "spawn_main" in (Path("/proc") / str(pid) / "cmdline").read_text()]
        assert len(ranks) >= 2, f"expected the 2 ranks among the launcher's children, found {ranks}"

        # A second run in the same folder is refused while the first one lives, naming the holder.
        second = subprocess.run(_train_cmd(corpus, out, "--resume"), env=env, capture_output=True, text=True,
                                timeout=240)
        assert second.returncode != 0
        assert "is in use by another weft train (pid" in second.stderr, second.stderr[-2000:]
        assert "Traceback" not in second.stderr, second.stderr[-2000:]

        os.kill(launcher.pid, sig)
        _wait_for(lambda: not any(_alive(pid) for pid in ranks), 30, "the ranks to exit after their launcher")
        size = metrics.stat().st_size
        time.sleep(1.0)
        assert metrics.stat().st_size == size, "metrics.jsonl still grows: a rank trains on"
        RunLock(out).acquire().release()  # the dead run's lock file does not block the next run
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)


def test_the_lock_names_its_holder_and_is_released(tmp_path):
    first = RunLock(tmp_path).acquire()
    with pytest.raises(RunFolderInUse, match=f"in use by another weft train \\(pid {os.getpid()} on "):
        # flock locks belong to the open file: a second open in this process is refused too
        RunLock(tmp_path).acquire()
    first.release()
    RunLock(tmp_path).acquire().release()
