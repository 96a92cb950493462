"""Random combinations of weft.MoE's options against the dense reference, on gloo ranks (CPU).

The equivalence tests (tests/test_moe_equivalence.py) run a fixed matrix: every gate, capacity
mode, k, activation and dtype, with the exchanges, degrees and router options each crossed with
part of it, at one shape (E = 8, dims 16 and 24). This script draws whole combinations at random
(model and hidden dims, 4 to 16 experts, gate, capacity factor, k in 1-4, activation, dtype, gate
normalisation, a2a_algo, overlap degree, and the router's bias, sampling temperature or skew
prior) and checks each with the tests' own `check_case`: outputs, aux and z losses, counts,
drops, capacity and every gradient. Every rank draws the same cases
(one seed). A combination the layer refuses (a ValueError at construction, e.g. dedup with an
expert-choice gate) is counted by its message, not as a failure; so is a case whose router option
happens to route like none at that seed (the check's own power test). Exits 1 on any failure.
    PYTHONPATH=src:tests python3 scripts/fuzz_equivalence.py --worlds 1 2 4 --cases 250
Pro-Prophet's balanced layer against the plain one (`balance_worker` of
tests/test_balance_equivalence.py at a drawn shape, k, activation and n):
    PYTHONPATH=src:tests python3 scripts/fuzz_equivalence.py --layer pro-prophet --worlds 2 4 --cases 150
Triton's kernels and Comet's through the interpreter (slower: 1-5 cases a second on 2 cores):
    TRITON_INTERPRET=1 PYTHONPATH=src:tests python3 scripts/fuzz_equivalence.py --kernels triton --cases 100
    TRITON_INTERPRET=1 PYTHONPATH=src:tests python3 scripts/fuzz_equivalence.py --kernels comet --algos linear 2dh
"""
from __future__ import annotations

import argparse
import random
import sys
import time
import warnings
from collections import Counter

import torch
import torch.distributed as dist

import test_balance_equivalence as be
import test_moe_equivalence as eq
from weft.testing import run_distributed

ALGOS = ("linear", "dedup", "dedup-fixed", "dedup-fixed-own", "2dh")
TOKEN_CHOICE_CAPACITIES = eq.TOKEN_CHOICE_CAPACITIES + (1.25, 0.5, -2.0)
SHAPE_DIMS = (8, 16, 24, 40, 72)  # model and hidden dims: multiples of 8, some not of 16
EXPERT_COUNTS = (4, 8, 12, 16)  # whole experts on 1, 2 and 4 ranks
# The checks' own power tests: check_case's when the case's router option changed no choice;
# balance_worker's when the planner copied nothing, or not the expert its router makes hot.
NO_POWER = ("routes like", "the test exercised nothing", "was not among the copies")


def draw(rng: random.Random, gen: torch.Generator, algos: tuple[str, ...]) -> tuple[dict, dict]:
    """One combination: the layer's shape (model dim, hidden dim, experts) and its options
    (check_case's keyword arguments)."""
    shape = dict(dim=rng.choice(SHAPE_DIMS), hidden=rng.choice(SHAPE_DIMS), experts=rng.choice(EXPERT_COUNTS))
    gate = rng.choice(eq.GATES)
    caps = eq.EXPERT_CHOICE_CAPACITIES if gate == "expert_choice" else TOKEN_CHOICE_CAPACITIES
    case = dict(gate=gate, cap=rng.choice(caps), k=rng.choice((1, 2, 3, 4)), activation=rng.choice(eq.ACTIVATIONS),
                dtype=rng.choice(eq.DTYPES), normalize=rng.random() < 0.7, a2a_algo=rng.choice(algos),
                overlap_degree=rng.choice((1, 1, 2, 4)))
    if gate in ("topk", "bpr", "cosine"):
        option = rng.random()
        if option < 0.2:  # DeepSeek-V3's selection bias, against the expert the router favours
            case["bias"] = torch.linspace(-0.4, 0.2, shape["experts"])[torch.randperm(shape["experts"], generator=gen)]
        elif option < 0.4:
            case["temperature"] = 0.7
        elif option < 0.5:
            case["skew"] = 1.5
    return shape, case


def describe(case: dict) -> str:
    return " ".join(f"{k}={'expert bias' if k == 'bias' else v}" for k, v in case.items())


def worker(seed: int, cases: int, kernels: str, algos: tuple[str, ...]) -> list[tuple[str, list[str], str | None]]:
    """(case, failure messages, refusal) for each drawn case, on this rank."""
    warnings.filterwarnings("ignore")  # the checks read losses with float(): torch warns for each
    rng, gen, found = random.Random(seed), torch.Generator().manual_seed(seed), []
    for _ in range(cases):
        shape, case = draw(rng, gen, algos)
        eq.DIM, eq.HIDDEN, eq.EXPERTS = shape["dim"], shape["hidden"], shape["experts"]  # read by check_case
        label = describe({**shape, **case})
        try:
            found.append((label, eq.check_case(kernels=kernels, **case), None))
        except ValueError as e:  # the layer refuses the combination
            found.append((label, [], str(e)))
    return found


def balance_worker(seed: int, cases: int) -> list[tuple[str, list[str], str | None]]:
    """Pro-Prophet's replicated experts (`balance="pro-prophet"`): `balance_worker` of
    tests/test_balance_equivalence.py (five SGD steps of the balanced and the plain dropless
    layer under a growing skew) at a drawn shape, k, activation and n."""
    warnings.filterwarnings("ignore")
    world, rng, found = dist.get_world_size(), random.Random(seed), []
    for _ in range(cases):
        be.DIM, be.HIDDEN = rng.choice(SHAPE_DIMS), rng.choice(SHAPE_DIMS)  # read by balance_worker
        experts, activation = world * rng.choice((1, 2, 3, 4)), rng.choice(eq.ACTIVATIONS)
        be.TOP_K, n = min(rng.choice((1, 2, 3, 4)), experts), rng.randint(1, world - 1)
        label = describe(dict(dim=be.DIM, hidden=be.HIDDEN, experts=experts, k=be.TOP_K, activation=activation, n=n))
        try:
            found.append((label, be.balance_worker(experts, activation, "cpu", 1e-5, n), None))
        except ValueError as e:
            found.append((label, [], str(e)))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--cases", type=int, default=100, help="cases drawn per world size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layer", default="moe", choices=("moe", "pro-prophet"),
                        help="pro-prophet: the balanced layer against the plain one (2 or more ranks)")
    parser.add_argument("--kernels", default="auto", choices=("auto", "torch", "triton", "comet"))
    parser.add_argument("--algos", nargs="+", default=list(ALGOS), choices=ALGOS,
                        help="the a2a_algo values drawn (Comet refuses the dedup ones: --algos linear 2dh)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per world size")
    ns = parser.parse_args()
    failed = 0
    for world in ns.worlds:
        start = time.monotonic()
        if ns.layer == "pro-prophet" and world < 2:
            print(f"world {world}: skipped, one rank has nothing to copy")
            continue
        fn, args = (balance_worker, (ns.seed + world, ns.cases)) if ns.layer == "pro-prophet" else \
            (worker, (ns.seed + world, ns.cases, ns.kernels, tuple(ns.algos)))
        ranks = run_distributed(fn, world, args=args, timeout=ns.timeout)
        refusals = [refusal for _, _, refusal in ranks[0] if refusal is not None]  # every rank refuses alike
        refused, no_power = Counter(r.split(";")[0][:100] for r in refusals), 0
        for rank in ranks:
            for case, failures, _ in rank:
                real = [f for f in failures if not any(p in f for p in NO_POWER)]
                no_power += len(failures) - len(real)
                failed += len(real)
                for message in real[:3]:
                    print(f"FAIL world {world}: {case}: {message}")
        seconds = time.monotonic() - start
        print(f"world {world}: {len(ranks[0]) - len(refusals)} combinations checked on every rank, "
              f"{len(refusals)} refused, "
              f"{no_power} rank-cases without power (a router option that changed no choice, no copy); "
              f"{seconds:.0f} s "
              f"({ns.cases / seconds:.1f} cases/s)", flush=True)
        for message, count in refused.most_common():
            print(f"  refused x{count}: {message}")
    print("every checked combination matches the reference" if not failed else f"{failed} failures")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
