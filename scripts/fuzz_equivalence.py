"""Random combinations of weft.MoE's options against the dense reference, on gloo ranks (CPU).

The equivalence tests (tests/test_moe_equivalence.py) run a fixed matrix: every gate, capacity
mode, k, activation and dtype, with the exchanges, degrees and router options each crossed with
part of it, at one shape (E = 8, dims 16 and 24). This script draws whole combinations at random
(model and hidden dims, 4 to 16 experts, gate, capacity factor, k in 1-4, activation, dtype, gate
normalisation, a2a_algo, overlap degree, and the router's bias, sampling temperature or skew
prior) and checks each with the tests' own `check_case`: outputs, aux and z losses, counts,
drops, capacity and every gradient. Every rank draws the same cases
(one seed). A combination the layer refuses (its one-line ValueError, e.g. dedup with an
expert-choice gate) is counted by its message, not as a failure; so is a case whose router option
happens to route like none at that seed (the check's own power test). Exits 1 on any failure.
    PYTHONPATH=src:tests python3 scripts/fuzz_equivalence.py --worlds 1 2 4 --cases 250
Pro-Prophet's balanced layer against the plain one (`balance_worker` of
tests/test_balance_equivalence.py at a drawn shape, k, activation and n):
    PYTHONPATH=src:tests python3 scripts/fuzz_equivalence.py --layer pro-prophet --worlds 2 4 --cases 150
Tutel's switchable parallelism (`parallel="adaptive"`, `check_parallel_case` of
tests/test_moe_adaptive.py): every r and overlap degree the layer offers against a one-rank layer
holding the whole experts, at drawn experts per rank (fewer experts than ranks included: each
expert's hidden dimension sliced over W / E ranks), gate, capacity, k, activation, dtype and
exchange; a call the layer refuses (e.g. a dedup exchange at r = 0) is counted apart:
    PYTHONPATH=src:tests python3 scripts/fuzz_equivalence.py --layer adaptive --worlds 1 2 4 --cases 150
Triton's kernels and Comet's through the interpreter (slower: 1-5 cases a second on 2 cores):
    TRITON_INTERPRET=1 PYTHONPATH=src:tests python3 scripts/fuzz_equivalence.py --kernels triton --cases 100
    TRITON_INTERPRET=1 PYTHONPATH=src:tests python3 scripts/fuzz_equivalence.py --kernels comet --algos linear 2dh
Lancet's two passes on a drawn GPT (blocks, MoE placement, the router's options, every MoE
layer's partitioned range, the overlap degree and the dW budget) against the plain model, three
SGD steps (`check_lancet_case` of tests/test_overlap_passes.py):
    PYTHONPATH=src:tests python3 scripts/fuzz_equivalence.py --layer lancet --worlds 1 2 4 --cases 60
The compiled kernels on GPUs (`--device cuda`: one rank a GPU over NCCL, so world sizes up to the
GPU count):
    PYTHONPATH=src:tests python3 scripts/fuzz_equivalence.py --device cuda --worlds 1 --kernels triton
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
import test_moe_adaptive as ad
import test_moe_equivalence as eq
import test_overlap_passes as lp
from weft.distributed import build_moe_groups
from weft.models import GPTConfig
from weft.moe.routing import Router
from weft.overlap.forward import Range
from weft.testing import run_distributed

ALGOS = ("linear", "dedup", "dedup-fixed", "dedup-fixed-own", "2dh")
TOKEN_CHOICE_CAPACITIES = eq.TOKEN_CHOICE_CAPACITIES + (1.25, 0.5, -2.0)
SHAPE_DIMS = (8, 16, 24, 40, 72)  # model and hidden dims: multiples of 8, some not of 16
EXPERT_COUNTS = (4, 8, 12, 16)  # whole experts on 1, 2 and 4 ranks
# The checks' own power tests: check_case's when the case's router option changed no choice;
# balance_worker's when the planner copied nothing, or not the expert its router makes hot.
NO_POWER = ("routes like", "the test exercised nothing", "was not among the copies")


def draw_router(rng: random.Random, experts: int) -> dict:
    """The gate and the options every layer form takes: capacity factor, k, activation, dtype and
    normalisation."""
    gate = rng.choice(eq.GATES)
    caps = eq.EXPERT_CHOICE_CAPACITIES if gate == "expert_choice" else TOKEN_CHOICE_CAPACITIES
    return dict(gate=gate, cap=rng.choice(caps), k=min(experts, rng.choice((1, 2, 3, 4))),
                activation=rng.choice(eq.ACTIVATIONS), dtype=rng.choice(eq.DTYPES), normalize=rng.random() < 0.7)


def draw(rng: random.Random, gen: torch.Generator, algos: tuple[str, ...]) -> tuple[dict, dict]:
    """One combination: the layer's shape (model dim, hidden dim, experts) and its options
    (check_case's keyword arguments)."""
    shape = dict(dim=rng.choice(SHAPE_DIMS), hidden=rng.choice(SHAPE_DIMS), experts=rng.choice(EXPERT_COUNTS))
    case = dict(draw_router(rng, shape["experts"]), a2a_algo=rng.choice(algos),
                overlap_degree=rng.choice((1, 1, 2, 4)))
    if case["gate"] in ("topk", "bpr", "cosine"):
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


# What each worker returns for each drawn case, on its rank: (case, failure messages, the
# messages of the calls the layer refused, the calls checked).
Found = list[tuple[str, list[str], list[str], int]]


def worker(seed: int, cases: int, kernels: str, algos: tuple[str, ...], device: str) -> Found:
    """weft.MoE (`check_case` of tests/test_moe_equivalence.py) at drawn combinations."""
    warnings.filterwarnings("ignore")  # the checks read losses with float(): torch warns for each
    rng, gen, found = random.Random(seed), torch.Generator().manual_seed(seed), []
    for _ in range(cases):
        shape, case = draw(rng, gen, algos)
        eq.DIM, eq.HIDDEN, eq.EXPERTS = shape["dim"], shape["hidden"], shape["experts"]  # read by check_case
        label = describe({**shape, **case})
        try:
            found.append((label, eq.check_case(kernels=kernels, device=device, **case), [], 1))
        except ValueError as e:  # the layer refuses the combination
            found.append((label, [], [str(e)], 0))
    return found


def adaptive_worker(seed: int, cases: int, kernels: str, algos: tuple[str, ...], device: str) -> Found:
    """parallel="adaptive" (`check_parallel_case` of tests/test_moe_adaptive.py) at drawn
    experts per rank: 1/4, 1/2, 1, 2 or 3 (fewer than one: ranks share each expert's slices)."""
    warnings.filterwarnings("ignore")
    world, rng, found = dist.get_world_size(), random.Random(seed), []
    solo = dist.new_subgroups(group_size=1)[0]  # the oracle's one-rank group
    for _ in range(cases):
        ad.DIM, ad.HIDDEN = rng.choice(SHAPE_DIMS), rng.choice(SHAPE_DIMS)  # read by check_parallel_case
        experts = rng.choice(sorted({max(1, world // 4), max(1, world // 2), world, 2 * world, 3 * world}))
        case = dict(draw_router(rng, experts), a2a_algo=rng.choice(algos))
        label = describe(dict(dim=ad.DIM, hidden=ad.HIDDEN, experts=experts, **case))
        case["top_k"] = case.pop("k")
        try:
            found.append((label, *ad.check_parallel_case(solo, experts, kernels=kernels, device=device, **case)))
        except ValueError as e:  # the layer refuses the combination
            found.append((label, [], [str(e)], 0))
    return found


def balance_worker(seed: int, cases: int, kernels: str, algos: tuple[str, ...], device: str) -> Found:
    """Pro-Prophet's replicated experts (`balance="pro-prophet"`): `balance_worker` of
    tests/test_balance_equivalence.py (five SGD steps of the balanced and the plain dropless
    layer under a growing skew) at a drawn shape, k, activation and n (`kernels` and `algos`
    unused: the balanced layer runs its own exchange)."""
    warnings.filterwarnings("ignore")
    world, rng, found = dist.get_world_size(), random.Random(seed), []
    for _ in range(cases):
        be.DIM, be.HIDDEN = rng.choice(SHAPE_DIMS), rng.choice(SHAPE_DIMS)  # read by balance_worker
        experts, activation = world * rng.choice((1, 2, 3, 4)), rng.choice(eq.ACTIVATIONS)
        be.TOP_K, n = min(rng.choice((1, 2, 3, 4)), experts), rng.randint(1, world - 1)
        label = describe(dict(dim=be.DIM, hidden=be.HIDDEN, experts=experts, k=be.TOP_K, activation=activation, n=n))
        try:
            found.append((label, be.balance_worker(experts, activation, device, 1e-5 if device == "cpu" else 1e-4, n),
                          [], 1))
        except ValueError as e:
            found.append((label, [], [str(e)], 0))
    return found


def draw_ranges(rng: random.Random, config: GPTConfig) -> list[Range]:
    """A range for most MoE units of `config`'s model (unit 2i: block i's attention, 2i + 1 its
    FFN): its start drawn from the units after the MoE unit before it (the MoE unit itself where its
    gate cannot route a partition alone), its end from the units before the next, 1-4 partitions."""
    routable = Router(config.gate, config.num_experts, True, None).can_route_in_parts(config.top_k,
                                                                                      config.capacity_factor)
    moe_units = [2 * i + 1 for i in range(config.n_layer) if config.is_moe_block(i)]
    ranges, after = [], 0  # the first unit the next range may hold
    for j, m in enumerate(moe_units):
        end = rng.randint(m, moe_units[j + 1] - 1 if j + 1 < len(moe_units) else 2 * config.n_layer - 1)
        if rng.random() < 0.85:
            ranges.append(Range(rng.randint(after, m) if routable else m, end, rng.randint(1, 4), m))
            after = end + 1
        else:
            after = m + 1
    return ranges


def distinct_starts(idx_BS: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """`idx_BS` with a different first token in every sequence and a second token unlike the
    first. Two tokens with the same prefix (two sequences' first tokens) have equal rows, and a
    run of one token at a sequence's start rows a few ulps apart (attention over equal values):
    a tie or near-tie in every gate that ranks tokens (batch priority, expert choice), which the
    plain model breaks by token order or by those ulps. Rows computed in other batch parts or
    chunks (Lancet's partitions, Tutel's overlap_degree > 1) round apart in their last bits and
    may break it the other way, routing the other of two equal tokens: a rounding difference
    (the ties come from this fuzz's tiny vocabulary), not a fault of the transform."""
    idx_BS[:, 0] = torch.randperm(64, generator=gen)[:idx_BS.shape[0]]
    idx_BS[:, 1] = torch.where(idx_BS[:, 1] == idx_BS[:, 0], (idx_BS[:, 1] + 1) % 64, idx_BS[:, 1])
    return idx_BS


def lancet_worker(seed: int, cases: int, kernels: str, algos: tuple[str, ...], device: str) -> Found:
    """Lancet's two passes (`check_lancet_case` of tests/test_overlap_passes.py) on a drawn GPT
    (1-5 blocks, an MoE block every 1-3, 4 or 8 experts, gate, k, capacity, activation, z loss),
    with drawn ranges (`draw_ranges`), overlap degree, dW budget and batch size, both models on
    `kernels` (`algos` unused: the model's layers keep the linear exchange)."""
    warnings.filterwarnings("ignore")
    rank, rng, found = dist.get_rank(), random.Random(seed), []
    device = f"cuda:{torch.cuda.current_device()}" if device == "cuda" else device
    gen, groups = torch.Generator().manual_seed(seed + rank), build_moe_groups()
    for _ in range(cases):
        n_layer = rng.randint(1, 5)
        experts = rng.choice((4, 8))
        router = draw_router(rng, experts)
        config = GPTConfig(vocab_size=64, block_size=8, n_layer=n_layer, n_head=2, dim=rng.choice((16, 32)),
                           moe_every=rng.randint(1, min(3, n_layer)), num_experts=experts, top_k=router["k"],
                           gate=router["gate"], capacity_factor=router["cap"], activation=router["activation"],
                           aux_loss_coef=0.1, z_loss_coef=rng.choice((0.0, 0.01)))
        degree, budget, batch = rng.choice((1, 1, 2, 4)), rng.choice((1.0, 1e-7)), rng.randint(2, 8)
        batches = [distinct_starts(torch.randint(0, 64, (batch, 9), generator=gen), gen).to(device) for _ in range(3)]
        label = describe(dict(layers=n_layer, moe_every=config.moe_every, experts=experts, gate=config.gate,
                              cap=config.capacity_factor, k=config.top_k, activation=config.activation,
                              z_loss=config.z_loss_coef, degree=degree, budget=budget, batch=batch))
        try:
            ranges = draw_ranges(rng, config)
            label += f" ranges={[(r.start, r.end, r.partitions, r.moe) for r in ranges]}"
            failures = lp.check_lancet_case(config, ranges, budget, batches, groups, degree, device, kernels)[0]
            found.append((label, failures, [], 1))
        except ValueError as e:  # the layer refuses the combination
            found.append((label, [], [str(e)], 0))
    return found


WORKERS = {"moe": worker, "adaptive": adaptive_worker, "pro-prophet": balance_worker, "lancet": lancet_worker}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--cases", type=int, default=100, help="cases drawn per world size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layer", default="moe", choices=tuple(WORKERS),
                        help="adaptive: parallel='adaptive' at every r against whole experts on one rank; "
                             "pro-prophet: the balanced layer against the plain one (2 or more ranks); "
                             "lancet: Lancet's two passes on a GPT against the plain model")
    parser.add_argument("--kernels", default="auto", choices=("auto", "torch", "triton", "comet"))
    parser.add_argument("--algos", nargs="+", default=list(ALGOS), choices=ALGOS,
                        help="the a2a_algo values drawn (Comet refuses the dedup ones: --algos linear 2dh)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: one rank a GPU over NCCL (world sizes up to the GPU count)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per world size")
    ns = parser.parse_args()
    if ns.device == "cuda" and max(ns.worlds) > torch.cuda.device_count():
        parser.error(f"--device cuda runs one rank a GPU: world {max(ns.worlds)} on {torch.cuda.device_count()} GPUs")
    failed = 0
    for world in ns.worlds:
        start = time.monotonic()
        if ns.layer == "pro-prophet" and world < 2:
            print(f"world {world}: skipped, one rank has nothing to copy")
            continue
        ranks = run_distributed(WORKERS[ns.layer], world, args=(ns.seed + world, ns.cases, ns.kernels,
                                                                 tuple(ns.algos), ns.device),
                                backend="nccl" if ns.device == "cuda" else "gloo", timeout=ns.timeout)
        refused = Counter(message.split(";")[0][:100] for _, _, messages, _ in ranks[0] for message in messages)
        whole = sum(1 for *_, calls in ranks[0] if not calls)  # every rank refuses alike
        no_power = 0
        for rank in ranks:
            for case, failures, _, _ in rank:
                real = [f for f in failures if not any(p in f for p in NO_POWER)]
                no_power += len(failures) - len(real)
                failed += len(real)
                for message in real[:3]:
                    print(f"FAIL world {world}: {case}: {message}")
        seconds = time.monotonic() - start
        print(f"world {world}: {len(ranks[0]) - whole} combinations checked on every rank "
              f"({sum(calls for *_, calls in ranks[0])} calls), {whole} refused, "
              f"{sum(refused.values()) - whole} more calls refused; "
              f"{no_power} rank-cases without power (a router option that changed no choice, no copy); "
              f"{seconds:.0f} s ({ns.cases / seconds:.1f} cases/s)", flush=True)
        for message, count in refused.most_common():
            print(f"  refused x{count}: {message}")
    print("every checked combination matches the reference" if not failed else f"{failed} failures")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
