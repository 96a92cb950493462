"""The multi-process test helper reports failures and never hangs."""
from __future__ import annotations

import dataclasses
import errno
import os
import socket
import sys
import time

import pytest
import torch
import torch.distributed as dist

from weft.testing import DistributedTestError, run_distributed


def rank_and_sum() -> tuple[int, float]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), float(t)


def rank_one_fails() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 would wait here forever without the helper


def rank_one_hangs() -> None:
    if dist.get_rank() == 1:
        time.sleep(600)


def listening_socket_inodes(port: int) -> set[str]:
    """Inodes of the sockets listening on `port` (Linux /proc/net/tcp and tcp6; state 0A = LISTEN)."""
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
            with open(table) as f:
                rows += [line.split() for line in f.readlines()[1:]]
    return {row[9] for row in rows if int(row[1].rsplit(":", 1)[1], 16) == port and row[3] == "0A"}


def own_socket_inodes() -> set[str]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # the descriptor listdir itself had open
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    return inodes


def who_holds_the_rendezvous_port() -> tuple[int, bool]:
    """(errno of binding MASTER_PORT here, whether some socket listens on it, whether this rank's own
    socket does)."""
    port = int(os.environ["MASTER_PORT"])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
            code = 0
        except OSError as e:
            code = e.errno
    listening = listening_socket_inodes(port)
    return code, bool(listening), bool(listening & own_socket_inodes())


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's socket table")
def test_the_launcher_holds_the_rendezvous_port_so_no_process_can_take_it_first():
    # A port chosen free and released before rank 0 bound it was once taken meanwhile (a CI run
    # failed with EADDRINUSE). The launcher now keeps it bound from the moment it is chosen.
    assert run_distributed(who_holds_the_rendezvous_port, 2) == [(errno.EADDRINUSE, True, False)] * 2


def test_results_in_rank_order():
    assert run_distributed(rank_and_sum, 3) == [(0, 6.0), (1, 6.0), (2, 6.0)]


def test_first_failure_is_reported_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match="rank 1 of 2 failed(.|\n)*boom on rank one"):
        run_distributed(rank_one_fails, 2, timeout=60)
    assert time.monotonic() - start < 50


def test_timeout_kills_a_hanging_rank():
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"timed out after 8s; ranks without a result: \[(0, )?1\]"):
        run_distributed(rank_one_hangs, 2, timeout=8)
    assert time.monotonic() - start < 30


def rank_one_crashes_natively() -> None:
    if dist.get_rank() == 1:
        os._exit(7)  # no Python exception: what a native crash looks like to the launcher
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 then fails inside gloo ("Connection reset by peer" or similar)


def test_a_rank_dying_without_an_exception_is_named_first():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(rank_one_crashes_natively, 2, timeout=60)
    message = str(info.value)
    assert message.startswith("rank 1 died with exit code 7 without a Python exception"), message[:300]


def environment_and_parent() -> tuple[str | None, int]:
    return os.environ.get("WEFT_TEST_MARK"), os.getppid()


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_ranks_take_the_callers_environment_at_the_call(monkeypatch, start_method):
    """Forked ranks come from a server started at an earlier call, with its environment then: each
    rank takes the caller's environment as it is now, as a spawned rank does."""
    run_distributed(rank_and_sum, 1, start_method=start_method)  # the server (if any) starts without the mark
    for mark in ("one", "two"):
        monkeypatch.setenv("WEFT_TEST_MARK", mark)
        results = run_distributed(environment_and_parent, 2, start_method=start_method)
        assert [value for value, _ in results] == [mark, mark]
        forked = all(parent != os.getpid() for _, parent in results)
        assert forked == (start_method == "forkserver"), results


def preloaded() -> list[bool]:
    return [name in sys.modules for name in ("weft.cli", "torch._dynamo")]  # this module imports neither


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_forked_ranks_start_with_weft_imported(start_method):
    """On a machine without a GPU, a forked rank finds weft (its entry point, which imports every
    layer) and torch._dynamo (which the first optimizer imports) imported by the fork server, so it
    does not import them itself; a spawned rank imports what its function needs."""
    forked = start_method == "forkserver" and not torch.cuda.is_available()  # CPU machines: see run_distributed
    assert run_distributed(preloaded, 2, start_method=start_method) == [[forked, forked]] * 2


def kernel_kind_and_parent() -> tuple[str, int, bool]:
    from weft.kernels import adamw  # a kernel module weft.cli imports

    return type(adamw._adamw_kernel).__name__, os.getppid(), "weft.cli" in sys.modules


def test_ranks_under_the_interpreter_switch_fork_with_interpreted_kernels(monkeypatch):
    """A call under TRITON_INTERPRET=1 forks its ranks from a server started under the switch:
    they find weft's kernels interpreted, as spawned ranks would, and imported before the fork
    (on a machine without a GPU); a call without the switch, before and after, still forks from a
    server whose kernels are compiled ones."""
    pytest.importorskip("triton", reason="Triton is in the test extra")
    weft_preloaded = not torch.cuda.is_available()
    for switch in (None, "1", None, "1"):
        if switch is None:
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        else:
            monkeypatch.setenv("TRITON_INTERPRET", switch)
        results = run_distributed(kernel_kind_and_parent, 2)
        kind = "InterpretedFunction" if switch else "JITFunction"
        assert [r[0] for r in results] == [kind, kind], (switch, results)
        assert all(parent != os.getpid() for _, parent, _ in results), results  # forked from a server
        assert [r[2] for r in results] == [weft_preloaded, weft_preloaded], results


def test_an_unknown_start_method_is_refused():
    with pytest.raises(ValueError, match="start_method must be 'spawn' or 'forkserver', got 'fork'"):
        run_distributed(rank_and_sum, 1, start_method="fork")


def interpreter_worker() -> list[str]:
    """Two launches of a kernel whose 3 programs each call a device function twice: the language
    is patched once a launch (the interpreter's own patching would run 1 + 6 times a launch),
    the result is the kernel's, and the language is restored after each launch."""
    import triton.language as tl
    from triton.runtime import interpreter

    from interpreted_kernel import four_x_plus_one_kernel

    failures = []
    if not getattr(interpreter._patch_lang, "weft_once", False):
        failures.append("run_distributed's rank did not patch the interpreter (TRITON_INTERPRET=1)")
    patched = []
    scan = interpreter._patch_builtin

    def counting_scan(pkg, *args):  # the last of each patching's scans
        patched.append(pkg is tl.core.tensor_descriptor_base)
        return scan(pkg, *args)

    interpreter._patch_builtin = counting_scan
    load = tl.load
    src = torch.arange(12, dtype=torch.float32)
    for launch in range(2):
        out = torch.zeros(12)
        four_x_plus_one_kernel[(3,)](src, out, BLOCK=4)
        if not torch.equal(out, 4 * src + 1):
            failures.append(f"launch {launch}: {out.tolist()}")
        if tl.load is not load:
            failures.append(f"launch {launch}: triton.language.load left patched after the launch")
    if sum(patched) != 2:
        failures.append(f"the language was patched {sum(patched)} times in 2 launches")
    return failures


def test_interpreted_ranks_patch_the_language_once_a_launch(triton_interpreter):
    failures = run_distributed(interpreter_worker, 1, timeout=120)[0]
    assert not failures, "\n".join(failures)


def overflow_checks_worker() -> list[str]:
    """An int32 kernel that overflows, with the interpreter's overflow checks skipped (as
    `run_distributed` leaves a rank) and computed again: the same wrapped values, no error either
    way, and `device_assert` reached only when they are computed (so the skip is what saves it)."""
    from triton.language import semantic
    from triton.runtime import interpreter

    from interpreted_kernel import wrapping_int32_kernel

    failures = []
    builder = interpreter.interpreter_builder
    if builder.options.sanitize_overflow:
        failures.append("run_distributed's rank computes the interpreter's overflow checks (TRITON_INTERPRET=1)")
    asserts = []
    device_assert = semantic.TritonSemantic.device_assert

    def counting_assert(self, *args):
        asserts.append(1)
        return device_assert(self, *args)

    src = torch.arange(40_000, 40_012, dtype=torch.int32)
    wrapped = ((src.long() * 65536 + torch.arange(12) + 2**31) % 2**32 - 2**31).int()
    semantic.TritonSemantic.device_assert = counting_assert
    skipped = builder.options
    computed = dataclasses.replace(skipped, sanitize_overflow=True)
    try:
        for label, options in (("skipped", skipped), ("computed", computed)):
            builder.options = options
            asserts.clear()
            out = torch.zeros(12, dtype=torch.int32)
            wrapping_int32_kernel[(3,)](src, out, BLOCK=4)
            if not torch.equal(out, wrapped):
                failures.append(f"checks {label}: {out.tolist()}, expected {wrapped.tolist()}")
            if bool(asserts) != (label == "computed"):
                failures.append(f"checks {label}: device_assert reached {len(asserts)} times")
    finally:
        semantic.TritonSemantic.device_assert = device_assert
        builder.options = skipped
    return failures


def test_interpreted_ranks_skip_the_overflow_checks_whose_verdict_is_dropped(triton_interpreter):
    failures = run_distributed(overflow_checks_worker, 1, timeout=120)[0]
    assert not failures, "\n".join(failures)
