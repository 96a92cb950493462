"""How a `weft` process behaves as a rank: it prints its Python stacks on SIGUSR1 (where a hung
rank waits), and a rank whose run fails says why and exits without waiting on its peers."""
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


FAILING_MAIN = ("import argparse, weft.cli as cli\n"
                "def failing_run(ns, parser):\n"
                "    raise RuntimeError({message!r})\n"
                "class Parser:\n"
                "    def parse_args(self, argv):\n"
                "        return argparse.Namespace(run=failing_run, parser=self)\n"
                "cli.build_parser = Parser\n")


def test_a_failed_rank_prints_its_error_and_exits_without_tearing_the_group_down(tmp_path):
    """A rank whose run raises inside a process group prints the traceback and exits with status 1
    at once, without `destroy_process_group` (which, with NCCL, waits for the collectives its
    peers are inside: a stand-in that never returns here) and without the interpreter's
    finalisation. Before the fix the rank waited there and the error never showed."""
    code = ("import time, torch.distributed as dist\n"
            f"dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, world_size=1)\n"
            "dist.destroy_process_group = lambda *a, **k: time.sleep(3600)\n"
            + FAILING_MAIN.format(message="CUDA out of memory (a stand-in)") + "cli.main([])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "RuntimeError: CUDA out of memory (a stand-in)" in done.stderr and "failing_run" in done.stderr, done.stderr


def test_a_failed_run_without_a_process_group_raises_as_before():
    """Without a process group (e.g. `weft plot`, or the launcher's parent process) the failure is
    an ordinary exception: nothing exits the interpreter under the caller."""
    code = (FAILING_MAIN.format(message="a plain failure")
            + "try:\n    cli.main([])\nexcept RuntimeError as e:\n    print('caught', e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "caught a plain failure", done.stderr
