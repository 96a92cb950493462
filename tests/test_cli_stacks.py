"""`weft`'s processes print their Python stacks on SIGUSR1 (where a hung rank waits)."""
from __future__ import annotations

import subprocess
import sys


def test_sigusr1_prints_every_threads_stack_and_the_run_goes_on():
    """A hung rank can be asked where it waits: after `main` set it up, SIGUSR1 prints the Python
    stacks to stderr and does not stop the process."""
    code = ("import os, signal\n"
            "from weft.cli import dump_stacks_on_sigusr1\n"
            "assert dump_stacks_on_sigusr1()\n"
            "def waiting_here():\n"
            "    os.kill(os.getpid(), signal.SIGUSR1)\n"
            "waiting_here()\n"
            "print('still running')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "still running", done.stderr
    assert "waiting_here" in done.stderr and "File" in done.stderr, done.stderr
