"""weft.MoE equals the dense reference (tests/moe_reference.py) on 1, 2 and 4 gloo ranks:
outputs, aux/z losses, router and expert gradients, routed counts and drops, for every gate,
capacity mode, top_k in {1, 2, 4}, activation and dtype (float32, bfloat16)."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

import moe_reference as ref
from weft import MoE
from weft.moe.gates import zipf_bias
from weft.testing import run_checks, run_distributed

DIM, HIDDEN, EXPERTS = 16, 24, 8
GATES = ("topk", "bpr", "cosine", "expert_choice", "random")
TOKEN_CHOICE_CAPACITIES = (1.0, 0, -1.0, None)  # with skewed routing 1.0 and -1.0 drop slots
EXPERT_CHOICE_CAPACITIES = (1.25, 0.5)
TOP_KS = (1, 2, 4)
ACTIVATIONS = ("relu", "gelu", "silu", "swiglu")
DTYPES = (torch.float32, torch.bfloat16)
AUX_COEF, Z_COEF = 0.3, 0.05
EXPERT_BIAS = torch.tensor([-0.4, 0.1, 0.0, 0.05, -0.05, 0.2, 0.0, 0.1])


def full_parameters(gate: str, activation: str) -> dict[str, torch.Tensor]:
    """Every expert's weights (same on all ranks), with a router skewed towards expert 0."""
    gen = torch.Generator().manual_seed(7)
    p = {
        "experts.w1": torch.randn(EXPERTS, DIM, HIDDEN, generator=gen) / DIM**0.5,
        "experts.w2": torch.randn(EXPERTS, HIDDEN, DIM, generator=gen) / HIDDEN**0.5,
    }
    if activation == "swiglu":
        p["experts.w3"] = torch.randn(EXPERTS, DIM, HIDDEN, generator=gen) / DIM**0.5
    skew = torch.zeros(DIM)
    skew[0] = 2.5
    if gate == "cosine":
        p["router.proj.weight"] = torch.randn(32, DIM, generator=gen) / DIM**0.5
        p["router.weight"] = torch.randn(EXPERTS, 32, generator=gen)
        p["router.weight"][0] += 3 * p["router.proj.weight"][:, 0]
        p["router.log_scale"] = torch.tensor([1.5])
    else:
        p["router.weight"] = torch.randn(EXPERTS, DIM, generator=gen) / DIM**0.5
        p["router.weight"][0] += skew
    return p


def load_shard(moe: MoE, full: dict[str, torch.Tensor], dtype: torch.dtype, bias: torch.Tensor | None = None) -> None:
    rank, local = moe.experts.first_expert, moe.num_local_experts
    state = {} if bias is None else {"expert_bias": bias}
    for name, value in full.items():
        state[name] = value[rank : rank + local].to(dtype) if name.startswith("experts.") else value
    moe.load_state_dict(state)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().float(), expected.detach().float()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-12))


def check_case(gate, cap, k, activation, dtype, normalize=True, device="cpu", kernels="auto",
               bias=None, temperature=0.0, a2a_algo="linear", overlap_degree=1, skew=0.0) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    label = (f"W={world} rank={rank} gate={gate} cf={cap} k={k} act={activation} {dtype} norm={normalize} {kernels}"
             f" d{overlap_degree}-{a2a_algo}"
             f"{'' if bias is None else ' expert bias'}{f' temperature {temperature}' if temperature else ''}"
             f"{f' skew {skew}' if skew else ''}")
    full = full_parameters(gate, activation)
    moe = MoE(DIM, HIDDEN, EXPERTS, top_k=k, gate=gate, capacity_factor=cap, activation=activation,
              normalize_gates=normalize, cosine_proj_dim=32, device=device, kernels=kernels,
              expert_bias=bias is not None, routing_temperature=temperature, a2a_algo=a2a_algo,
              overlap_degree=overlap_degree, routing_skew=skew)
    load_shard(moe, full, dtype, None if bias is None else bias.to(device))
    # dropless allows uneven token counts (not in fixed-size exchanges, nor Comet's buffers sized by them)
    fixed_size = a2a_algo in ("dedup-fixed", "dedup-fixed-own") or kernels == "comet"
    num_tokens = 12 + 4 * rank if cap is None and not fixed_size else 16
    gen = torch.Generator().manual_seed(100 + rank)
    x = (torch.randn(num_tokens, DIM, generator=gen) + torch.eye(DIM)[0]).to(device, dtype).requires_grad_()
    dy = torch.randn(num_tokens, DIM, generator=gen)

    torch.manual_seed(1000 + rank)  # the random gate draws from torch's RNG
    y = moe(x)
    (
        (y.float() * dy.to(device)).sum() + AUX_COEF * moe.aux_loss + Z_COEF * moe.z_loss
    ).backward()

    params = {n: v.to(dtype).float().requires_grad_() if n.startswith("experts.") else v.clone().requires_grad_()
              for n, v in full.items()}
    if skew:  # the fixed prior (a buffer: no gradient)
        params["router.prior_E"] = zipf_bias(EXPERTS, skew).float()
    xr = x.detach().cpu().float().requires_grad_()
    cfg = {"gate": gate, "top_k": k, "num_experts": EXPERTS, "activation": activation, "normalize_gates": normalize}
    torch.manual_seed(1000 + rank)
    scores = torch.rand(num_tokens, EXPERTS, device=device).cpu() if gate == "random" else None
    # a sampling layer's draw, written out: Gumbel(0, T) = -T log(Exp(1))
    offsets = -temperature * torch.empty(num_tokens, EXPERTS, device=device).exponential_().log().cpu() \
        if temperature else None
    if cap is None:
        cap_ref = None
    elif gate == "expert_choice":
        cap_ref = max(1, min(num_tokens, ref.exact_ceil(k, cap, num_tokens, EXPERTS)))
    else:
        *_, experts, _, order = ref.route(xr.detach(), params, gate, k, normalize, scores, bias, offsets)
        need = torch.tensor([ref.no_drop_capacity(ref.positions(experts, order, EXPERTS)[1])])
        need = need.to(device)
        dist.all_reduce(need, op=dist.ReduceOp.MAX)
        cap_ref = ref.capacity(cap, k, num_tokens, EXPERTS, int(need))
    y_ref, aux, z, counts, dropped = ref.moe_forward(xr, params, cfg, cap_ref, scores, bias, offsets)
    loss_ref = (y_ref * dy).sum() + AUX_COEF * aux + Z_COEF * z
    names = [n for n in params if params[n].requires_grad]
    grads = dict(zip(names, torch.autograd.grad(loss_ref, [params[n] for n in names] + [xr])))

    failures = []
    if bias is not None:  # the case has power: the bias changes the reference's choices
        unbiased = ref.route(xr.detach(), params, gate, k, normalize, scores)[2]
        if torch.equal(unbiased, ref.route(xr.detach(), params, gate, k, normalize, scores, bias)[2]):
            failures.append(f"{label}: the test's bias routes like no bias")
    if skew:  # the case has power: the prior changes the reference's choices
        plain = {n: v for n, v in params.items() if n != "router.prior_E"}
        if torch.equal(ref.route(xr.detach(), plain, gate, k, normalize, scores)[2],
                       ref.route(xr.detach(), params, gate, k, normalize, scores)[2]):
            failures.append(f"{label}: the test's prior routes like no prior")
    if temperature:  # the case has power: the draw changes the reference's choices
        argmax = ref.route(xr.detach(), params, gate, k, normalize)[2]
        if torch.equal(argmax, ref.route(xr.detach(), params, gate, k, normalize, offsets=offsets)[2]):
            failures.append(f"{label}: the test's draw routes like the argmax")
    fp32 = dtype == torch.float32
    tol = 2e-5 if fp32 else 2e-2

    def expect(cond, what):
        if not cond:
            failures.append(f"{label}: {what}")

    expect(y.dtype == dtype and y.shape == x.shape, f"output dtype/shape {y.dtype} {tuple(y.shape)}")
    y = y.detach().cpu()
    expect(relative_error(y, y_ref) < tol, f"output rel err {relative_error(y, y_ref):.2e}")
    expect(abs(float(moe.aux_loss) - float(aux)) < 1e-5, f"aux {float(moe.aux_loss)} vs {float(aux)}")
    expect(abs(float(moe.z_loss) - float(z)) < 1e-4 * max(1.0, float(z)), f"z {float(moe.z_loss)} vs {float(z)}")
    expect(torch.equal(moe.stats.expert_counts.cpu(), counts.long()), f"counts {moe.stats.expert_counts} vs {counts}")
    expect(int(moe.stats.dropped) == dropped, f"dropped {int(moe.stats.dropped)} vs {dropped}")
    expect(moe.stats.capacity == cap_ref, f"capacity {moe.stats.capacity} vs {cap_ref}")
    for name, param in moe.named_parameters():
        expected = grads[name]
        if name.startswith("experts."):
            expected = expected.to(device)
            dist.all_reduce(expected)  # the owner holds every rank's contribution
            expected = expected.cpu()
            first = moe.experts.first_expert
            expected = expected[first : first + moe.num_local_experts]
        # bf16: expert outputs are rounded to 8 bits, so a gradient that sums many cancelling
        # terms (the cosine router's scalar temperature) gets an absolute floor as well.
        diff = float((param.grad.cpu().float() - expected.float()).norm())
        bound = (1e-4 if fp32 else 3e-2) * float(expected.norm()) + (0.0 if fp32 else 1e-2)
        expect(diff <= bound, f"grad {name}: |diff| {diff:.2e} > {bound:.2e} (|expected| {float(expected.norm()):.2e})")
    return failures


def equivalence_worker(gate: str, dtypes=DTYPES, device: str = "cpu", kernels: str = "auto",
                       activations=ACTIVATIONS, a2a_algo: str = "linear", overlap_degree: int = 1) -> list[str]:
    caps = EXPERT_CHOICE_CAPACITIES if gate == "expert_choice" else TOKEN_CHOICE_CAPACITIES
    if overlap_degree > 1 and a2a_algo == "dedup":  # dedup's own pairs computed last: padded modes
        caps = tuple(cap for cap in caps if cap is not None)
    if a2a_algo in ("dedup-fixed", "dedup-fixed-own"):  # its own path dropless; padded it is dedup (one checks that)
        caps = (None, 1.0) if overlap_degree == 1 else (None,)  # pipelined: dropless
    failures = []
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    interpreted = kernels == "triton" and device == "cpu"
    if interpreted:
        # Through Triton's interpreter (slow: CI time) the kernels run on the layouts they have code
        # for: padded with drops (capacity 1.0: kept and dropped slots) and dropless. Capacities 0 and
        # -1.0 only choose C on the host, and the router's options (below) only change the scores the
        # kernels are given; the torch path runs every combination.
        caps = tuple(cap for cap in caps if cap in (1.0, None)) or caps[:1]
    case = dict(device=device, kernels=kernels, a2a_algo=a2a_algo, overlap_degree=overlap_degree)
    for cap, k, activation, dtype in itertools.product(caps, TOP_KS, activations, dtypes):
        # Through the interpreter the kernels' other dtypes (their casts) run at k = 2 only; every k
        # runs in the first dtype.
        if interpreted and dtype != dtypes[0] and k != 2:
            continue
        failures += check_case(gate, cap, k, activation, dtype, **case)
    if interpreted:
        return failures
    if gate in ("topk", "bpr"):
        for cap in caps:
            failures += check_case(gate, cap, 2, "gelu", dtypes[0], normalize=False, **case)
    if gate in ("topk", "bpr", "cosine"):  # DeepSeek-V3's selection bias, against expert 0 the router favours
        for cap, k in itertools.product(caps, (1, 2)):
            failures += check_case(gate, cap, k, "gelu", dtypes[0], bias=EXPERT_BIAS, **case)
        for cap, k in itertools.product(caps, (1, 2)):  # experts sampled in training
            failures += check_case(gate, cap, k, "gelu", dtypes[0], temperature=0.7, **case)
        for cap in caps:  # routing_skew's fixed prior on the logits
            failures += check_case(gate, cap, 2, "gelu", dtypes[0], skew=1.5, **case)
    return failures


def drops_worker() -> int:
    """Total slots dropped on this rank over the skewed capacity-1.0 cases (must be > 0)."""
    rank = dist.get_rank()
    moe = MoE(DIM, HIDDEN, EXPERTS, top_k=2, capacity_factor=1.0)
    load_shard(moe, full_parameters("topk", "gelu"), torch.float32)
    x = torch.randn(16, DIM, generator=torch.Generator().manual_seed(100 + rank)) + torch.eye(DIM)[0]
    moe(x)
    return int(moe.stats.dropped)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("gate", GATES)
def test_matches_dense_reference(world_size, gate):
    flat = run_checks(equivalence_worker, world_size, args=(gate,), timeout=600)
    assert not flat, f"{len(flat)} mismatches, first ones:\n" + "\n".join(flat[:15])


@pytest.mark.parametrize("world_size, gate", [(1, "topk"), (2, "topk"), (4, "topk"), (2, "bpr"), (2, "cosine"),
                                              (2, "random")])
def test_triton_kernels_match_dense_reference(world_size, gate, triton_interpreter):
    """kernels="triton" (dispatch and combine by weft.kernels.rows, in Triton's CPU interpreter,
    whose switch the ranks' fork server was started under: `weft.testing.run_distributed`), float32 and
    bfloat16, on the layouts the kernels have code for (capacity 1.0 and dropless; see
    `equivalence_worker`). The kernels act on each rank's own rows, so every world size runs with
    one gate and the other gates on two ranks (the interpreter is slow: this keeps CI short)."""
    flat = run_checks(equivalence_worker, world_size, args=(gate, DTYPES, "cpu", "triton", ("swiglu",)),
                      timeout=600)
    assert not flat, f"{len(flat)} mismatches, first ones:\n" + "\n".join(flat[:15])


@pytest.mark.parametrize("world_size, gate, activations", [
    (1, "topk", ACTIVATIONS), (2, "topk", ACTIVATIONS), (4, "topk", ACTIVATIONS),
    (2, "bpr", ("gelu", "swiglu")), (2, "cosine", ("gelu", "swiglu")), (4, "random", ("gelu", "swiglu"))])
def test_dedup_exchange_matches_dense_reference(world_size, gate, activations):
    """a2a_algo="dedup" (each token sent to a rank once, its outputs summed there) against the
    dense reference: every token-choice capacity mode, k 1, 2 and 4, float32 and bfloat16."""
    flat = run_checks(equivalence_worker, world_size, args=(gate, DTYPES, "cpu", "auto", activations, "dedup"),
                      timeout=600)
    assert not flat, f"{len(flat)} mismatches, first ones:\n" + "\n".join(flat[:15])


@pytest.mark.parametrize("world_size, gate", [(1, "topk"), (2, "topk"), (4, "topk"), (2, "bpr"), (4, "cosine")])
def test_dedup_with_its_own_pairs_last_matches_dense_reference(world_size, gate):
    """a2a_algo="dedup", overlap_degree=2 (a rank's own pairs computed while the others' rows
    travel in): the padded capacity modes, k 1, 2 and 4, float32 and bfloat16."""
    flat = run_checks(equivalence_worker, world_size,
                      args=(gate, DTYPES, "cpu", "auto", ("gelu", "swiglu"), "dedup", 2), timeout=600)
    assert not flat, f"{len(flat)} mismatches, first ones:\n" + "\n".join(flat[:15])


@pytest.mark.parametrize("degree", [1, 2])
def test_dedup_exchange_with_triton_kernels_matches_dense_reference(triton_interpreter, degree):
    """The same through the row kernels in Triton's CPU interpreter, on 2 ranks (degree 2: the
    own pairs computed last, padded modes, in the first dtype: the kernels' casts run at degree 1;
    the interpreter is slow, CI time)."""
    dtypes = DTYPES if degree == 1 else DTYPES[:1]
    flat = run_checks(equivalence_worker, 2, args=("topk", dtypes, "cpu", "triton", ("swiglu",), "dedup", degree),
                      timeout=600)
    assert not flat, f"{len(flat)} mismatches, first ones:\n" + "\n".join(flat[:15])


@pytest.mark.parametrize("world_size, gate", [(1, "topk"), (2, "topk"), (4, "topk"), (2, "bpr"), (4, "random")])
def test_dedup_in_fixed_size_exchanges_matches_dense_reference(world_size, gate):
    """a2a_algo="dedup-fixed" (dropless: each token to a rank once in exchanges of T rows per rank,
    the records sorted by expert on the device, grouped GEMM over a fixed buffer): dropless and
    capacity 1.0, k 1, 2 and 4, float32 and bfloat16."""
    flat = run_checks(equivalence_worker, world_size,
                      args=(gate, DTYPES, "cpu", "auto", ("gelu", "swiglu"), "dedup-fixed"), timeout=600)
    assert not flat, f"{len(flat)} mismatches, first ones:\n" + "\n".join(flat[:15])


@pytest.mark.parametrize("world_size, degree", [(1, 3), (2, 2), (4, 3)])
def test_pipelined_dedup_in_fixed_size_exchanges_matches_dense_reference(world_size, degree):
    """a2a_algo="dedup-fixed" with overlap_degree > 1 on dropless calls: the tokens in `degree`
    chunks (3: uneven), each chunk's fixed-size exchange pipelined with its experts, one weight
    gradient per weight over all chunks (`GroupedWeightGradParts`); k 1, 2 and 4, float32 and
    bfloat16, against the dense reference."""
    flat = run_checks(equivalence_worker, world_size,
                      args=("topk", DTYPES, "cpu", "auto", ("relu", "swiglu"), "dedup-fixed", degree), timeout=600)
    assert not flat, f"{len(flat)} mismatches, first ones:\n" + "\n".join(flat[:15])


@pytest.mark.parametrize("world_size, gate", [(1, "topk"), (2, "topk"), (4, "topk"), (4, "bpr")])
def test_dedup_in_fixed_size_exchanges_with_the_own_pairs_apart_matches_dense_reference(world_size, gate):
    """a2a_algo="dedup-fixed-own": the rank's own pairs out of the fixed-size exchanges (static
    splits), computed while the others' sums return, each weight's gradient the sum of the own
    share (computed in the own pairs' backward) and the others' (the tap's); dropless and capacity
    1.0 (dedup there), k 1, 2 and 4, float32 and bfloat16."""
    flat = run_checks(equivalence_worker, world_size,
                      args=(gate, DTYPES, "cpu", "auto", ("relu", "swiglu"), "dedup-fixed-own"), timeout=600)
    assert not flat, f"{len(flat)} mismatches, first ones:\n" + "\n".join(flat[:15])


@pytest.mark.parametrize("world_size, degree", [(1, 2), (2, 2), (4, 3)])
def test_pipelined_dedup_with_the_own_pairs_apart_matches_dense_reference(world_size, degree):
    """a2a_algo="dedup-fixed-own" at overlap_degree > 1: the others' pairs in `degree` chunks of
    tokens (3: uneven), pipelined with their experts, the own pairs of every chunk in one call;
    dropless, k 1, 2 and 4, float32 and bfloat16."""
    flat = run_checks(equivalence_worker, world_size,
                      args=("topk", DTYPES, "cpu", "auto", ("relu", "swiglu"), "dedup-fixed-own", degree), timeout=600)
    assert not flat, f"{len(flat)} mismatches, first ones:\n" + "\n".join(flat[:15])


def test_dedup_in_fixed_size_exchanges_with_triton_kernels_matches_dense_reference(triton_interpreter):
    """The same through the row kernels in Triton's CPU interpreter, on 2 ranks."""
    flat = run_checks(equivalence_worker, 2, args=("topk", DTYPES, "cpu", "triton", ("swiglu",), "dedup-fixed"),
                      timeout=600)
    assert not flat, f"{len(flat)} mismatches, first ones:\n" + "\n".join(flat[:15])


@pytest.mark.parametrize("world_size, degree", [(2, 1), (4, 1), (2, 2)])
def test_own_pairs_apart_with_triton_kernels_matches_dense_reference(triton_interpreter, world_size, degree):
    """a2a_algo="dedup-fixed-own" through the Triton kernels in the CPU interpreter: each weight's
    gradient is the tap's product added into the own pairs' share in the product's epilogue
    (`weft.kernels.grouped_wgrad`; degree 2: the chunks' rows taken by expert first), not a
    separate add. (One rank has no own pairs apart: the plain path, tested above.)"""
    flat = run_checks(equivalence_worker, world_size,
                      args=("topk", DTYPES, "cpu", "triton", ("swiglu",), "dedup-fixed-own", degree), timeout=600)
    assert not flat, f"{len(flat)} mismatches, first ones:\n" + "\n".join(flat[:15])


def capacity_above_the_tokens_worker() -> list[str]:
    """Capacity factors whose ceil(k * cf * T / E) is T or more (docs/moe.md: C is at most T),
    through the plain exchange, its pipelined chunks and the deduplicating one."""
    failures = []
    for (k, cf), gate, (a2a_algo, degree) in itertools.product(
            [(4, 2.5), (2, 4.0), (1, 8.0)], ("topk", "bpr", "cosine", "random"),
            [("linear", 1), ("linear", 2), ("dedup", 1), ("dedup", 2)]):
        failures += check_case(gate, cf, k, "gelu", torch.float32, a2a_algo=a2a_algo, overlap_degree=degree)
    return failures + check_case("topk", 2.5, 4, "swiglu", torch.bfloat16)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_a_capacity_above_the_tokens_is_cut_to_them(world_size):
    """No case of the matrix above reaches k * cf >= E, and the reference did not cut C at T
    until a random search of the options (scripts/fuzz_equivalence.py) drew one. The cases have
    power: for the padded calls' 16 tokens the formula reaches T for every (k, cf) here, and
    passes it for one."""
    formula = [ref.exact_ceil(k, cf, 16, EXPERTS) for k, cf in [(4, 2.5), (2, 4.0), (1, 8.0)]]
    assert min(formula) >= 16 and max(formula) > 16, formula
    flat = run_checks(capacity_above_the_tokens_worker, world_size, timeout=600)
    assert not flat, f"{len(flat)} mismatches, first ones:\n" + "\n".join(flat[:15])


@pytest.mark.parametrize("world_size", [1, 4])
def test_skewed_routing_forces_drops(world_size):
    assert all(d > 0 for d in run_distributed(drops_worker, world_size))
