"""Host time of one Pro-Prophet plan (weft.balance.greedy_placement on a predicted load), the work
a balanced dropless call does on the host in the middle of its call. Zipf-skewed counts, nominal
cost model; prints ms per plan and the experts copied.

    python scripts/plan_time.py
"""
from __future__ import annotations

import time

import torch

from weft.balance import LoadHistory, greedy_placement
from weft.balance.balancer import ExpertBalancer, nominal_cost_model


def main() -> None:
    for experts, ranks, skew in ((64, 2, 1.2), (64, 2, 0.0), (16, 2, 1.2), (8, 2, 1.2), (64, 8, 1.2)):
        model = nominal_cost_model(2048, 1408, False, ranks)
        owners = ExpertBalancer(experts, ranks, model).owner_E
        gen = torch.Generator().manual_seed(0)
        weights = torch.arange(1, experts + 1, dtype=torch.float64) ** -skew
        history = LoadHistory()
        history.record(torch.stack([torch.multinomial(weights, 4096 * 4, replacement=True, generator=gen)
                                    .bincount(minlength=experts) for _ in range(ranks)]))
        start = time.perf_counter()
        for _ in range(20):
            plan = greedy_placement(history.predict_counts(), owners, model)
        ms = (time.perf_counter() - start) / 20 * 1e3
        print(f"E{experts} over {ranks} ranks, skew {skew}: {ms:.2f} ms per plan, copied {plan.placement.replicated}")


if __name__ == "__main__":
    main()
