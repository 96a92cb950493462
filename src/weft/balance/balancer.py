"""One MoE layer's Pro-Prophet planning across calls: the loads of the earlier calls predict the
next (locality, sec. II), the greedy search (Alg. 1) turns the prediction into the experts to
copy for this call, and this call's load, every rank's counts as the dropless call read them to
the host for its all-to-allv, joins the history. Every rank records the same counts and plans on
the host from them, so every rank copies the same experts."""
from __future__ import annotations

from collections.abc import Sequence

from weft.balance.load import LoadHistory
from weft.balance.planner import LayerCostModel, Plan, greedy_placement

# Nominal constants for the default cost model, H200-class, until they are fitted on the machine
# (`weft bench comm`, the layer profile): all-to-all bandwidth per rank over NVLink and a bf16
# grouped GEMM's throughput.
NOMINAL_BANDWIDTH = 100e9  # bytes/s
NOMINAL_FLOPS = 600e12  # FLOP/s


def nominal_cost_model(dim: int, hidden_dim: int, gated: bool, ep_size: int, bytes_per_value: int = 2,
                       ) -> LayerCostModel:
    """The cost model of a layer with these shapes on nominal constants (see NOMINAL_*)."""
    matrices = 3 if gated else 2
    expert_bytes = matrices * dim * hidden_dim * bytes_per_value
    return LayerCostModel(num_devices=ep_size, bandwidth=NOMINAL_BANDWIDTH,
                          throughput=NOMINAL_FLOPS / (2 * matrices * dim * hidden_dim),
                          row_bytes=dim * bytes_per_value, expert_param_bytes=expert_bytes,
                          expert_grad_bytes=expert_bytes)


class ExpertBalancer:
    """Plans each call's copied experts for one layer of `num_experts` experts over an
    expert-parallel group of `ep_size` ranks (expert e owned by rank e // (E / W)); each copied
    expert goes to the W - n ranks sending it the most rows (Pro-Prophet's n, counting the owner:
    1, the default, copies to every rank); `rounds`: the times the search may take one rank
    (`greedy_placement`; 1, the paper's)."""

    def __init__(self, num_experts: int, ep_size: int, model: LayerCostModel, window: int = 1, alpha: float = 1.0,
                 n: int = 1, rounds: int = 1):
        if num_experts % ep_size:
            raise ValueError(f"balancing needs whole experts per rank: {num_experts} experts over {ep_size} ranks")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= max(1, ep_size - 1):
            raise ValueError(f"balance n must be in [1, {max(1, ep_size - 1)}] for {ep_size} ranks (the ranks, owner "
                             f"included, that get no copy of a copied expert), got {n!r}")
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"balance rounds must be a positive int (the times Alg. 1 may take a rank), "
                             f"got {rounds!r}")
        local = num_experts // ep_size
        self.ep_size, self.n, self.rounds = ep_size, n, rounds
        self.owner_E = tuple(e // local for e in range(num_experts))
        self.model, self.alpha = model, alpha
        self.history = LoadHistory(window)
        self.last_plan: Plan | None = None  # the plan of the latest call (None before the second)
        # The plans made from the loads recorded so far, by `scheduled` (a new load clears them).
        self._plans: dict[bool, Plan] = {}

    @property
    def last_copied(self) -> list[int]:
        """The experts the latest call copied (none before the second call, or when the plain
        placement was best)."""
        return [] if self.last_plan is None else self.last_plan.placement.replicated

    def next_copies(self, scheduled: bool = True) -> dict[int, frozenset[int]]:
        """The next call's copies, expert -> the ranks that get one, planned from the loads of the
        earlier calls (none before the first load arrives); the same until the next `record`, so
        the plan can be made ahead of the call (Alg. 2: under the preceding block) and the call
        still agree with it. `scheduled`: the copies are launched ahead (Alg. 2, eq. 8), or the call
        copies them itself and waits (eq. 6). Host arithmetic only (the recorded counts are on the
        host)."""
        if self.ep_size == 1 or not len(self.history):  # one rank holds every expert; no load yet
            return {}
        self.plan_ahead(scheduled)
        self.last_plan = self._plans[scheduled]
        return {e: devices for e, devices in self.last_plan.placement.copies.items() if devices}

    def plan_ahead(self, scheduled: bool = True) -> None:
        """Make the plan `next_copies(scheduled)` will return now, from the loads recorded so far
        (nothing where there is none to make, or it is made already): a layer calls this once its
        call's work is launched, so the host plans while the GPU computes (Alg. 2, Plan under the
        all-to-all) and the next call finds the plan made."""
        if self.ep_size == 1 or not len(self.history) or scheduled in self._plans:
            return
        self._plans[scheduled] = greedy_placement(self.history.predict_counts(), self.owner_E, self.model,
                                                  n=self.n, alpha=self.alpha, scheduled=scheduled, rounds=self.rounds)

    def record(self, counts_WE: Sequence[Sequence[int]]) -> None:
        """This call's slot counts, `counts_WE[r][e]` of every rank r of the expert-parallel group
        (on the host: what the dropless call read for its all-to-allv), join the history that the
        next plan predicts from."""
        if self.ep_size == 1:
            return
        if len(counts_WE) != self.ep_size:
            raise ValueError(f"expected the counts of all {self.ep_size} expert-parallel ranks, got {len(counts_WE)}")
        self.history.record(counts_WE)
        self._plans.clear()
