"""Test helper: run a function in N gloo processes on the CPU (forked from a server), with a timeout.

    results = run_distributed(fn, world_size=4, args=(...,), timeout=120)

`fn(*args)` runs in every process after `torch.distributed` is initialised; it reads its rank
with `dist.get_rank()`. Results come back in rank order; the first failing rank's traceback is
re-raised as `DistributedTestError`, and a run past `timeout` is killed, so tests never hang.
"""
import contextlib
import dataclasses
import functools
import os
import types
from multiprocessing import forkserver

import torch

from weft import launch
from weft.launch import WorkerError as DistributedTestError
from weft.launch import free_port

__all__ = ["run_distributed", "run_checks", "Checks", "DistributedTestError", "free_port"]


def run_distributed(fn, world_size: int, **kwargs):
    """`weft.launch.run_distributed` with the ranks forked from a server that imported torch (and,
    on a machine without a GPU, weft and torch._dynamo) once (`start_method="forkserver"`, unless
    given; `weft.cli` imports every layer, and `torch._dynamo` is what torch's optimizers import
    when the first one is built, about two seconds): a test suite starts hundreds of short
    worlds, and a rank that imports these itself spends more time on that than on its test.
    Triton reads its interpreter switch (TRITON_INTERPRET) when a kernel is defined, and a server
    defines weft's kernels when it starts: a call under TRITON_INTERPRET forks its ranks from a
    second server, started under that switch (`_interpreter_server`), so that they find weft's
    kernels interpreted, as a spawned rank would, without importing torch and weft again."""
    kwargs.setdefault("start_method", "forkserver")
    if kwargs["start_method"] == "forkserver" and not torch.cuda.is_available():
        # CPU machines only: where there is a GPU, a server that imported Triton and inductor's
        # modules might have initialised CUDA, which a forked rank could then not use
        kwargs.setdefault("preload", ("weft.cli", "torch._dynamo"))
    interpreted = kwargs["start_method"] == "forkserver" and os.environ.get("TRITON_INTERPRET")
    server = _interpreter_server(os.environ["TRITON_INTERPRET"], tuple(kwargs.get("preload", ()))) \
        if interpreted else None
    with _forking_from(server) if server is not None else contextlib.nullcontext():
        return launch.run_distributed(functools.partial(_with_interpreter_patches, fn), world_size, **kwargs)


@functools.cache
def _interpreter_server(switch: str, preload: tuple[str, ...]) -> forkserver.ForkServer:
    """A fork server of its own for calls under TRITON_INTERPRET=`switch` (one a process, started at
    its first fork, with the environment of that moment, the switch included: its imports define
    weft's kernels interpreted), beside multiprocessing's, which serves every other call."""
    server = forkserver.ForkServer()
    server.set_forkserver_preload(launch.server_preload(preload))
    return server


@contextlib.contextmanager
def _forking_from(server: forkserver.ForkServer):
    """Processes started with the "forkserver" method inside this block fork from `server`:
    multiprocessing (CPython 3.11) asks its module-level `connect_to_new_process` for each."""
    default = forkserver.connect_to_new_process
    forkserver.connect_to_new_process = server.connect_to_new_process
    try:
        yield
    finally:
        forkserver.connect_to_new_process = default


def _with_interpreter_patches(fn, *args):
    """`fn(*args)`, under TRITON_INTERPRET=1 with `patch_interpreter_once` and
    `skip_discarded_overflow_checks` first."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        patch_interpreter_once()
        skip_discarded_overflow_checks()
    return fn(*args)


def skip_discarded_overflow_checks() -> bool:
    """Stop Triton's CPU interpreter from computing integer-overflow checks whose verdict it throws
    away. With `sanitize_overflow` on, every 32-bit integer add, sub and mul of a kernel is done
    again in int64 and compared with int32's bounds, and the comparison goes to `device_assert`,
    which returns without asserting unless the options' `debug` is on. The interpreter (3.6) keeps
    `debug` off and offers no way to turn it on, so an overflow goes unreported either way (an int32
    sum past 2**31 wraps, as in a compiled kernel without debug). Turning `sanitize_overflow` off
    where `debug` is off changes no value and no error. Returns whether the checks are off (False: a Triton without
    these options, or with `debug` on, left as it is)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if getattr(options, "debug", True) or not hasattr(options, "sanitize_overflow"):
        return False
    if options.sanitize_overflow:
        builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True


class _NoPatch:
    def restore(self) -> None:
        pass


def patch_interpreter_once() -> bool:
    """Make Triton's CPU interpreter patch `triton.language` once per kernel launch instead of
    again at every call of a `@triton.jit` device function inside it: the interpreter (3.6)
    repeats the launch's patching there (three `inspect.getmembers` scans), about a quarter of an
    interpreted Comet kernel's time, and never undoes it before the launch's own restore. A
    device function whose module sees a language module the launch did not patch is patched as
    before. Idempotent; returns whether the interpreter is patched (False: a Triton without the
    hook, left as it is)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    if original is None:
        return False
    if getattr(original, "weft_once", False):
        return True
    launches: list[set[int]] = []  # per running launch, the language modules it patched

    def languages(fn) -> set[int]:
        return {id(value) for value in fn.__globals__.values()
                if isinstance(value, types.ModuleType) and value in (tl, tl.core)}

    def patch_lang(fn):
        langs = languages(fn)
        if launches:  # a device function called inside a launch
            if langs <= launches[-1]:
                return _NoPatch()
            launches[-1] |= langs
            return original(fn)
        scope = original(fn)
        launches.append(langs)
        restore = scope.restore

        def restore_launch() -> None:
            launches.pop()
            restore()

        scope.restore = restore_launch
        return scope

    patch_lang.weft_once = True
    interpreter._patch_lang = patch_lang
    return True


def run_checks(fn, world_size: int, **kwargs) -> list[str]:
    """Run a worker that returns a list of failure messages on every rank; all ranks' messages,
    in rank order (empty when every check passed). Keyword arguments go to `run_distributed`."""
    return [message for rank in run_distributed(fn, world_size, **kwargs) for message in rank]


class Checks:
    """The failure messages a check worker returns (see `run_checks`), each after `prefix` (e.g.
    the rank): `checks.expect(condition, what)` records `what` when the condition is false."""

    def __init__(self, prefix: str):
        self.prefix, self.failures = prefix, []

    def expect(self, condition, what: str) -> None:
        if not condition:
            self.failures.append(f"{self.prefix}: {what}")
