"""Test helper: run a function in N spawned gloo processes on the CPU, with a timeout.

    results = run_distributed(fn, world_size=4, args=(...,), timeout=120)

`fn(*args)` runs in every process after `torch.distributed` is initialised; it reads its rank
with `dist.get_rank()`. Results come back in rank order; the first failing rank's traceback is
re-raised as `DistributedTestError`, and a run past `timeout` is killed, so tests never hang.
"""
from weft.launch import WorkerError as DistributedTestError
from weft.launch import free_port, run_distributed

__all__ = ["run_distributed", "run_checks", "Checks", "DistributedTestError", "free_port"]


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
