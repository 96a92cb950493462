"""Pro-Prophet's copies in replica slots on Comet's dropless path (`weft.moe.exchange.replica_slots`,
`weft.kernels.replica`): nothing read on the host, so a CUDA graph holds the call.

- Trans and Agg's kernels (the owners' `stage_copies`, `add_grads`; the holders' `pull_copies`,
  `push_grads`) and the slot rows' writes (`write_rows`) in Triton's CPU interpreter against
  their PyTorch references, every rank's buffers in one process.
- `SlotRows` against a loop over the dispatched rows.
- `weft.MoE(kernels="comet", balance="pro-prophet")` against the plain layer on 2 and 4 gloo
  processes sharing their buffers through files in shared memory, over SGD steps whose growing
  skew changes the copies: outputs, input gradients, every parameter's gradient (the holders'
  shares added into the owners') and the routed counts; through the kernels' references and
  through the Triton kernels (interpreter).
- `graph_placement="updated"`, every call taken for a graph's replay (the slot path on every
  rank, the copies by the link kernels, the placement written in place by `update_placement()`
  after each), against the plain layer likewise.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from test_balance_equivalence import copies_pay, step_and_compare
from test_moe_exchange import _count_reads
from weft import MoE
from weft.testing import Checks, run_checks, run_distributed

DIM, HIDDEN, TOP_K, TOKENS = 16, 32, 2, 24


class _TwoRanks:
    """Rank 0 of 2 for `ReplicaSlots`' placement arithmetic (no buffer is allocated)."""

    world, rank = 2, 0


def replica_kernels_worker(world: int, dtype: torch.dtype) -> list[str]:
    """Trans: every owner stages exactly its copied experts at their entries of its box (the other
    entries keep their values), so that every holder, reading each slot's expert at the entry
    `entries` gives (the copy engine's way) or by `pull_copies` (the device's placement), finds
    that expert's weight; empty slots keep theirs. Agg: the holders' gradients land at their
    entries (`push_grads`), and each owner adds its box's gradients of each of its experts into its
    rows, in slot order in float32 (boxes of `dtype`, gradients float32), leaving the other rows
    alone. Every rank's buffers in one process; the Triton kernels bitwise as the references."""
    from weft.kernels import replica

    replica.BLOCK, replica.OWNER_PROGRAMS = 64, 2  # an owner's programs take several chunks in turn
    replica.LINK_PROGRAMS, replica.LINK_BLOCK = 2, 64  # and the link's programs take several chunks in turn
    failures = []
    gen = torch.Generator().manual_seed(world)
    local, per_rank, shape = 3, world - 1, (5, 37)
    expert_WR = torch.full((world, per_rank), -1, dtype=torch.int64)
    for h in range(world):  # a copy of one expert of each of the other ranks
        for j, owner in enumerate(r for r in range(world) if r != h):
            expert_WR[h, j] = owner * local + (h + j) % local
    if world > 2:  # an empty slot; two holders of one expert (ranks 2's and 3's slot 0 hold rank 0's)
        expert_WR[1, per_rank - 1] = -1
        expert_WR[2, 0] = expert_WR[3, 0] = 1
    entry = replica.entries(expert_WR, local)
    weights = [torch.randn(local, *shape, generator=gen).to(dtype) for _ in range(world)]
    boxes = [torch.randn(per_rank, *shape, generator=gen).to(dtype) for _ in range(world)]
    for rank in range(world):  # Trans, the owners' part
        expected = boxes[rank].clone()
        replica.stage_copies_reference(weights[rank], expected, expert_WR, rank)
        replica.stage_copies(weights[rank], boxes[rank], expert_WR, rank)
        if not torch.equal(boxes[rank], expected):
            failures.append(f"rank {rank}: staging differs from its reference")
    for slot, e in enumerate(expert_WR.flatten().tolist()):  # the holders' reads by the copy engine's entries
        if e >= 0 and not torch.equal(boxes[e // local][entry[slot]], weights[e // local][e % local]):
            failures.append(f"slot {slot} would not read expert {e} from its owner's box")
    table = torch.tensor([b.data_ptr() for b in boxes], dtype=torch.int64)
    for rank in range(world):  # the holders' reads by the link kernel (placed on the device)
        slots = torch.randn(per_rank, *shape, generator=gen).to(dtype)
        expected = slots.clone()
        replica.link_reference(expected, boxes, expert_WR, rank, local, pull=True)
        replica.pull_copies(slots, table, boxes, expert_WR, rank, local)
        if not torch.equal(slots, expected):
            failures.append(f"rank {rank}: pull_copies differs from its reference")
        failures += [f"rank {rank}'s slot {j} does not hold expert {e}" for j, e in enumerate(expert_WR[rank].tolist())
                     if e >= 0 and not torch.equal(slots[j], weights[e // local][e % local])]
    grads = torch.randn(world * per_rank, *shape, generator=gen).to(dtype)  # the slots' dtype
    expected_boxes = [b.clone() for b in boxes]
    for rank in range(world):  # the holders' writes: the link kernel, and the copy engine's entries
        mine = grads[rank * per_rank:(rank + 1) * per_rank]
        replica.link_reference(mine, expected_boxes, expert_WR, rank, local, pull=False)
        replica.push_grads(mine, table, boxes, expert_WR, rank, local)
    for slot, e in enumerate(expert_WR.flatten().tolist()):
        if e >= 0 and not torch.equal(boxes[e // local][entry[slot]], grads[slot]):
            failures.append(f"slot {slot}'s gradient is not at its entry of its owner's box")
    failures += [f"rank {o}'s box differs from the reference after the holders' gradients" for o in range(world)
                 if not torch.equal(boxes[o], expected_boxes[o])]
    for rank in range(world):  # Agg, the owners' part
        grad = torch.randn(local, *shape, generator=gen)  # float32: the interpreter truncates bf16 stores
        before, expected_grad = grad.clone(), grad.clone()
        replica.add_grads_reference(expected_grad, boxes[rank], expert_WR, rank)
        replica.add_grads(grad, boxes[rank], expert_WR, rank)
        if not torch.equal(grad, expected_grad):
            failures.append(f"rank {rank}: Agg differs from its reference")
        mine = {int(e) - rank * local for e in expert_WR.flatten() if e >= 0 and e // local == rank}
        if not mine:
            failures.append(f"rank {rank} owns no copied expert: the case tests little")
        for i in range(local):
            sent = [grads[f] for f, e in enumerate(expert_WR.flatten().tolist()) if e == rank * local + i]
            want = before[i] + sum(g.float() for g in sent) if sent else before[i]
            if not torch.allclose(grad[i], want, rtol=1e-5, atol=1e-5):
                failures.append(f"rank {rank}: expert {i}'s rows are not its own plus {len(sent)} copies' gradients")
    return failures


def write_rows_worker() -> list[str]:
    """The holder's slot rows written among its dispatched rows by the Triton kernel (the used
    rows only) and by the PyTorch path (every row, padding writing its target's own value back):
    both exactly the loop's result; gathered by `read_rows`, the used rows as `index_select`'s;
    with 3 programs down the rows (each looping over its rows), and with nothing placed (nothing
    written)."""
    from weft.kernels import replica
    from weft.moe.exchange import replica_slots

    replica.ROW_PROGRAMS = 3  # (a spawned worker: its modules die with it)
    gen = torch.Generator().manual_seed(3)
    counts_WE = torch.randint(0, 6, (2, 6), generator=gen)
    slots = replica_slots.ReplicaSlots(_TwoRanks(), "0", 6, torch.device("cpu"), rounds=2)
    slots.place({4: {0}, 5: {0}})
    rows = slots.slot_rows(counts_WE, int(counts_WE[0].sum()))
    into = torch.randn(int(counts_WE[0].sum()), 40, generator=gen)
    values = torch.randn(rows.idx_M.shape[0], 40, generator=gen).to(torch.bfloat16)
    used = int(rows.ends_R[-1])
    expected = into.clone()
    expected[rows.idx_M[:used]] = values[:used].float()
    failures = [] if used and used < rows.idx_M.shape[0] else [f"{used} used rows: the case tests little"]
    got = into.clone()
    replica.write_rows(got, values, rows.idx_M, rows.ends_R)
    if not torch.equal(got, expected):
        failures.append("write_rows differs from the loop")
    gathered = replica.read_rows(into, rows.idx_M, rows.ends_R)
    if gathered.shape != values.shape or not torch.equal(gathered[:used], into.index_select(0, rows.idx_M[:used])):
        failures.append("read_rows differs from index_select on the used rows")
    strided = into.t().contiguous().t()  # the same values, a column stride of rows
    if not torch.equal(replica.read_rows(strided, rows.idx_M, rows.ends_R)[:used], gathered[:used]):
        failures.append("read_rows of a column-strided source differs")
    try:
        replica.write_rows(strided, values, rows.idx_M, rows.ends_R)
        failures.append("write_rows wrote into a column-strided tensor")
    except ValueError as e:
        if "unit column stride" not in str(e):
            failures.append(f"write_rows' error says {e}")
    slots.place({})
    empty = slots.slot_rows(counts_WE, int(counts_WE[0].sum()))
    untouched = into.clone()
    replica.write_rows(untouched, values, empty.idx_M, empty.ends_R)
    if int(empty.ends_R[-1]) != 0 or not torch.equal(untouched, into):
        failures.append("write_rows wrote rows with nothing placed")
    torch_path = into.clone()
    replica_slots.triton_usable = lambda x: False
    replica_slots._write_rows(torch_path, values, rows)
    if not torch.equal(torch_path, expected):
        failures.append("the PyTorch path differs from the loop")
    if not torch.equal(replica_slots._read_rows(into, rows), into.index_select(0, rows.idx_M)):
        failures.append("the PyTorch gather differs from index_select")
    return failures


def activate_rows_worker() -> list[str]:
    """The slot rows' activation by the Triton kernel (`activate_rows`) against `activate` and its
    autograd, on the rows below the slots' last end, every activation, float32, with 3 programs
    looping down the rows and two column blocks; with nothing below the end it runs (nothing to
    compare: the rows are padding)."""
    from weft.kernels import replica
    from weft.kernels.activation import ACTIVATIONS, activate

    replica.ROW_PROGRAMS = 3  # (a spawned worker: its modules die with it)
    failures = []
    gen = torch.Generator().manual_seed(5)
    ends_R = torch.tensor([3, 7], dtype=torch.int32)
    for activation in ACTIVATIONS:
        h1 = torch.randn(10, 700, generator=gen)
        h3 = torch.randn(10, 700, generator=gen) if activation == "swiglu" else None
        grad = torch.randn(10, 700, generator=gen)
        inputs = [t.clone().requires_grad_() for t in (h1, h3) if t is not None]
        got = replica.activate_rows(activation, *inputs, ends_R) if h3 is not None else \
            replica.activate_rows(activation, inputs[0], None, ends_R)
        got.backward(grad)
        refs = [t.clone().requires_grad_() for t in (h1, h3) if t is not None]
        want = activate(activation, *refs)
        want.backward(grad)
        pairs = [(got, want)] + [(a.grad, b.grad) for a, b in zip(inputs, refs)]
        for i, (a, b) in enumerate(pairs):
            if not torch.allclose(a[:7], b[:7], rtol=1e-6, atol=1e-6):
                failures.append(f"{activation}: tensor {i} differs on the used rows "
                                f"(max {float((a[:7] - b[:7]).abs().max()):.2e})")
        none = replica.activate_rows(activation, h1.clone().requires_grad_(), None if h3 is None else h3.clone(),
                                     torch.zeros(2, dtype=torch.int32))
        if none.shape != h1.shape:
            failures.append(f"{activation}: shape {tuple(none.shape)} with nothing used")
    return failures


def slot_rows_worker() -> list[str]:
    """`slot_rows` by its Triton kernel, bitwise as its reference, over placements with empty
    slots, a held expert with no rows here, nothing held, every expert held (no free row), a
    bound past the rows and one that cuts them, expert counts not a power of 2, and several
    programs down the rows."""
    from weft.kernels import replica

    replica.SLOT_ROWS_BLOCK = 8  # several programs (a spawned worker: its modules die with it)
    checks = Checks("slot_rows")
    gen = torch.Generator().manual_seed(5)
    for experts, slots in [(6, 2), (5, 3), (8, 1), (12, 6), (3, 4)]:
        for trial in range(6):
            counts_E = torch.randint(0, 7, (experts,), generator=gen)
            if trial == 1:
                counts_E[::2] = 0  # held experts with no rows
            expert_R = torch.randperm(experts, generator=gen)[:slots]
            expert_R = torch.cat([expert_R, torch.full((max(0, slots - experts),), -1)])[:slots]
            if trial == 2:
                expert_R[:] = -1  # nothing held
            elif trial == 3:
                expert_R[slots // 2:] = -1  # empty slots after held ones
            elif trial == 4 and slots >= experts:
                expert_R[:experts] = torch.arange(experts)  # every expert held: no free row
            total = int(counts_E.sum())
            for bound in {total, total + 5, max(1, total // 2), 3 * slots * 4}:
                got = replica.slot_rows(counts_E, expert_R, bound)
                want = replica.slot_rows_reference(counts_E, expert_R, bound)
                for name, a, b in zip(("idx", "ends", "used", "write"), got, want):
                    checks.expect(a.dtype == b.dtype and torch.equal(a, b),
                                  f"E {experts} R {slots} counts {counts_E.tolist()} slots {expert_R.tolist()} "
                                  f"bound {bound}: {name} {a.tolist()} against {b.tolist()}")
    return checks.failures


def test_the_slot_rows_kernel_matches_its_reference(triton_interpreter):
    failures = run_distributed(slot_rows_worker, 1, timeout=300)[0]
    assert not failures, "\n".join(failures[:5])


@pytest.mark.parametrize("worker", [write_rows_worker, activate_rows_worker], ids=["written-and-read", "activated"])
def test_the_slot_rows_kernels_match_their_references(worker, triton_interpreter):
    # write_rows / read_rows against the loop, index_select and the PyTorch path; activate_rows
    # against activate and its autograd
    failures = run_distributed(worker, 1, timeout=300)[0]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replica_kernels_match_their_references(world, dtype, triton_interpreter):
    failures = run_distributed(replica_kernels_worker, 1, args=(world, dtype), timeout=300)[0]
    assert not failures, "\n".join(failures)


def test_slot_rows_follow_the_placement():
    """Slot j's rows are the rank's dispatched rows of the expert it holds, in order; every other
    row is left to Comet; rows past the slots' are padding."""
    from weft.comm.peers import LocalPeers
    from weft.moe.exchange.replica_slots import ReplicaSlots

    class RankTwoOfFour(LocalPeers):  # the placement's arithmetic only: no buffer is allocated
        def __init__(self):
            super().__init__(None, torch.device("cpu"))
            self.world, self.rank = 4, 2

    slots = ReplicaSlots(RankTwoOfFour(), "0", 8, torch.device("cpu"))
    before = slots.expert_WR
    slots.place({1: {2, 3}, 6: {2}, 7: {0}})
    # a new tensor: a graph captured with the earlier placement keeps reading its own
    assert (before == -1).all() and slots.expert_WR is not before
    assert slots.expert_WR.tolist() == [[7, -1, -1], [-1, -1, -1], [1, 6, -1], [1, -1, -1]]
    counts_WE = torch.randint(0, 5, (4, 8), generator=torch.Generator().manual_seed(0))
    counts_WE[2, 6] = 0  # a slot whose expert has no rows here
    rows = int(counts_WE[2].sum())
    assert not _count_reads(lambda: slots.slot_rows(counts_WE, rows)), "slot_rows read the device on the host"
    got = slots.slot_rows(counts_WE, rows)
    starts = torch.cumsum(counts_WE[2], 0) - counts_WE[2]
    expected = [int(starts[1]) + i for i in range(int(counts_WE[2, 1]))]
    total = len(expected)
    assert got.idx_M[:total].tolist() == expected and not got.idx_M[total:].any()
    assert got.used_M.tolist() == [True] * total + [False] * (rows - total)
    assert got.ends_R.tolist() == [total, total, total]
    free = int(got.write_M[-1])  # padding's target: a row of an expert no slot holds
    assert got.write_M.tolist() == expected + [free] * (rows - total) and free not in expected
    assert counts_WE[2, 0] == 0 or free == 0
    assert slots.served_WE().nonzero().tolist() == [[0, 7], [2, 1], [2, 6], [3, 1]]
    with pytest.raises(ValueError, match="replica slots"):
        slots.place({0: {2}, 1: {2}, 3: {2}, 7: {2}})
    with pytest.raises(ValueError, match="copied to rank 0"):
        slots.place({1: {0}})
    with pytest.raises(ValueError, match="entries of its box"):  # rank 0's experts: 4 copies, 3 entries
        slots.place({0: {1, 2, 3}, 1: {1}})


def slots_worker(num_experts: int, activation: str, triton: bool, steps: int = 5, device: str = "cpu",
                 dim: int = DIM, tolerance: float = 1e-5, rounds: int = 1) -> list[str]:
    """The balanced Comet layer against the plain one over `steps` SGD steps (see the module
    docstring); every rank routes TOKENS tokens (Comet's dropless path sizes its buffers by it).
    `rounds` > 1: experts 0 and 1 (both rank 0's) hot, so that rank 0 gives away both."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    checks = Checks(f"rank {rank}")
    expect = checks.expect
    layers = []
    for kernels, balance in (("torch", None), ("comet", "pro-prophet")):
        torch.manual_seed(0)
        layers.append(MoE(dim, 2 * dim, num_experts, TOP_K, capacity_factor=None, activation=activation,
                          kernels=kernels, balance=balance, balance_model=copies_pay(world), device=device,
                          balance_rounds=rounds))
    for layer in layers:
        with torch.no_grad():
            layer.router.weight[1, 0] += 10.0  # expert 1 (on rank 0) hot, through x[:, 0]
            if rounds > 1:
                layer.router.weight[0, 0] += 9.0
    plain, balanced = layers
    expect(balanced.copies_in_slots(), "the balanced Comet layer does not place its copies in slots")
    optimizers = [torch.optim.SGD(layer.parameters(), lr=0.05) for layer in layers]
    copied = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + 10 * step + rank)
        x = torch.randn(TOKENS, dim, generator=gen)
        x[:, 0] += 1.0 + 0.5 * step  # the skew grows: the plans differ from step to step
        grad_out = torch.randn(x.shape, generator=gen)
        step_and_compare(layers, optimizers, x.to(device), grad_out.to(device), f"step {step}", tolerance, expect)
        copied.append(tuple(balanced._replica_slots.copied))
    expect(copied[0] == (), f"the first call has no history to plan from, yet copied {copied[0]}")
    expect(any(copied), f"no expert was ever copied ({copied}): the test exercised nothing")
    expect(all(1 in c for c in copied if c), f"the hot expert 1 was not among the copies: {copied}")
    if rounds > 1:
        expect(any({0, 1} <= set(c) for c in copied), f"rank 0 never gave away both hot experts: {copied}")
    if triton:  # the call went through the Triton kernels (interpreter)
        from weft.kernels.rows import triton_usable
        expect(triton_usable(torch.zeros(1)), "TRITON_INTERPRET did not reach the worker")
    return checks.failures


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_copies_in_slots_compute_the_plain_layer(world_size, activation):
    flat = run_checks(slots_worker, world_size, args=(2 * world_size, activation, False), timeout=300)
    assert not flat, "\n".join(flat[:15])


def test_several_copies_from_one_rank_compute_the_plain_layer():
    """balance_rounds=2 on 2 ranks: rank 0 gives away both of its hot experts (two slots a rank)."""
    flat = run_checks(slots_worker, 2, args=(4, "gelu", False, 5, "cpu", DIM, 1e-5, 2), timeout=300)
    assert not flat, "\n".join(flat[:15])


@pytest.mark.parametrize("world_size", [2, 4])
def test_copies_in_slots_through_the_triton_kernels(world_size, triton_interpreter):
    flat = run_checks(slots_worker, world_size, args=(2 * world_size, "relu", True, 3), timeout=600)
    assert not flat, "\n".join(flat[:15])


def slots_updated_worker(num_experts: int, triton: bool, steps: int = 7) -> list[str]:
    """`graph_placement="updated"` as a CUDA graph runs it, on the CPU: after one eager call (which
    makes the buffers), every call is taken for a capture's replay (`_capturing` true: the layer
    places nothing itself, every rank runs the slot path, the copies read the placement on the
    device) and `update_placement()` between the steps plans from the loads a replay behind and
    writes the placement in place. Outputs, gradients and counts equal the plain layer's at every
    step, while the copies change, including steps where a rank holds nothing; and every rank
    takes the slot path at every such step, copies or none (a graph captured with none placed
    must still replay the placements written after it)."""
    import weft.moe.exchange.comet as comet_module
    import weft.moe.layer as layer_module

    rank, world = dist.get_rank(), dist.get_world_size()
    checks = Checks(f"rank {rank}")
    layers = []
    for kernels, balance, extra in (("torch", None, {}), ("comet", "pro-prophet", {"graph_placement": "updated"})):
        torch.manual_seed(0)
        layers.append(MoE(DIM, 2 * DIM, num_experts, TOP_K, capacity_factor=None, activation="relu", kernels=kernels,
                          balance=balance, balance_model=copies_pay(world), **extra))
    for layer in layers:
        with torch.no_grad():
            layer.router.weight[1, 0] += 10.0  # expert 1 (on rank 0) hot
    plain, balanced = layers
    optimizers = [torch.optim.SGD(layer.parameters(), lr=0.05) for layer in layers]
    placements, slots_WR, slot_calls = [], None, []
    run_slots = comet_module.slot_experts

    def counted(*args, **kwargs):
        slot_calls[-1] += 1
        return run_slots(*args, **kwargs)

    comet_module.slot_experts = counted  # (a spawned worker: its modules die with it)
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + 10 * step + rank)
        x = torch.randn(TOKENS, DIM, generator=gen)
        x[:, 0] += 1.0 + 0.5 * step
        slot_calls.append(0)
        step_and_compare(layers, optimizers, x, torch.randn(x.shape, generator=gen), f"step {step}", 1e-5,
                         checks.expect)
        if step > 0:
            checks.expect(slot_calls[-1] == 1, f"step {step} (placement {placements[-1]}) ran the slot path "
                                               f"{slot_calls[-1]} times, not once")
        if step == 0:  # from here on, the calls are a graph's replays
            layer_module._capturing = lambda x: True
            slots_WR = balanced._replica_slots.expert_WR
        else:
            balanced.update_placement()
        placements.append(balanced._replica_slots.expert_WR.tolist())
    checks.expect(balanced._replica_slots.expert_WR is slots_WR, "a placement was not written where the graph reads it")
    copied = [p for p in placements if any(e >= 0 for row in p for e in row)]
    checks.expect(len(copied) >= 2, f"too few steps with copies to test anything: {placements}")
    checks.expect(len({str(p) for p in placements}) >= 2, f"the placement never changed: {placements}")
    checks.expect(any(e == 1 for p in placements for row in p for e in row), f"hot expert 1 never copied: {placements}")
    if triton:
        from weft.kernels.rows import triton_usable
        checks.expect(triton_usable(torch.zeros(1)), "TRITON_INTERPRET did not reach the worker")
    with pytest.raises(RuntimeError, match="graph_placement='updated'"):
        plain.update_placement()
    return checks.failures


@pytest.mark.parametrize("world_size", [2, 4])
def test_updated_placements_compute_the_plain_layer(world_size):
    flat = run_checks(slots_updated_worker, world_size, args=(2 * world_size, False), timeout=300)
    assert not flat, "\n".join(flat[:15])


def test_updated_placements_through_the_triton_kernels(triton_interpreter):
    flat = run_checks(slots_updated_worker, 2, args=(4, True), timeout=600)
    assert not flat, "\n".join(flat[:15])


def _graph_layer(calls: int, **settings) -> tuple[MoE, list, list]:
    """On this rank's GPU, bf16: a balanced Comet layer (`settings` added) whose expert 1 (rank
    0's) is hot, and `calls` inputs and output gradients."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{torch.cuda.current_device()}"
    torch.manual_seed(0)
    moe = MoE(256, 512, 4 * world, TOP_K, capacity_factor=None, activation="gelu", dtype=torch.bfloat16,
              device=device, kernels="comet", balance="pro-prophet", balance_model=copies_pay(world), **settings)
    with torch.no_grad():
        moe.router.weight[1, 0] += 10.0
    gen = torch.Generator(device=device).manual_seed(10 + rank)
    xs = [torch.randn(1024, 256, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(calls)]
    dys = [torch.randn(1024, 256, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(calls)]
    for x in xs:
        x[:, 0] += 2.0
    return moe, xs, dys


def slots_graph_worker(device: str = "cuda") -> list[str]:
    """On GPUs, bf16: a balanced Comet layer's step with copies in its slots, captured as one CUDA
    graph (its placement as the capture found it), replays the eager step's outputs, input
    gradient and parameter gradients bitwise on new inputs (Comet's, the slots' and Agg's kernels
    are deterministic)."""
    checks = Checks(f"rank {dist.get_rank()}")
    moe, xs, dys = _graph_layer(4)
    params = list(moe.parameters())

    def fwd_bwd(x, dy):
        y = moe(x)
        y.backward(dy)
        return y.detach()

    graphed = _capture(moe, fwd_bwd, xs, dys)
    checks.expect(bool(moe._replica_slots.copied), "the warm-up calls placed no copy: the graph tests nothing")
    for x, dy in zip(xs[2:], dys[2:]):
        _replay_as_eager(checks, graphed, fwd_bwd, params, x, dy, "")
    return checks.failures


def slots_updated_graph_worker(capture_copies: dict | None = None) -> list[str]:
    """On GPUs, bf16: a balanced Comet layer built with `graph_placement="updated"`, its step
    captured once as a CUDA graph (with the planner's copies in place, or `capture_copies`, e.g.
    none), replays with the placements `update_placement(copies=...)` writes after each replay (a
    copy to every other rank, none, copies both ways): each replay bitwise as the eager step with
    the same copies (`moe(x, copies=...)`), outputs, input gradient and parameter gradients."""
    world = dist.get_world_size()
    checks = Checks(f"rank {dist.get_rank()}")
    moe, xs, dys = _graph_layer(5, graph_placement="updated")
    params, experts = list(moe.parameters()), moe.num_experts

    def fwd_bwd(x, dy, copies=None):
        y = moe(x, copies=copies)
        y.backward(dy)
        return y.detach()

    graphed = _capture(moe, functools.partial(fwd_bwd, copies=capture_copies), xs, dys)
    graphed(xs[1], dys[1])  # a first replay (its placement: the warm-up's plan), after which it updates
    others = set(range(1, world))
    placements = [{1: others}, {}, {1: others, experts - 1: {0}}]
    for x, dy, copies in zip(xs[2:], dys[2:], placements):
        moe.update_placement(copies)
        _replay_as_eager(checks, graphed, functools.partial(fwd_bwd, copies=copies), params, x, dy,
                         f"copies {copies}: ")
    return checks.failures


def _capture(moe: MoE, fwd_bwd, xs: list, dys: list):
    """Two eager calls (a load to plan from, then a call with the copies placed), then `fwd_bwd`
    captured (`weft.graphs.GraphedStep`, owning the gradients)."""
    from weft.graphs import GraphedStep

    for x, dy in zip(xs[:2], dys[:2]):
        fwd_bwd(x.clone().requires_grad_(), dy)
    params = list(moe.parameters())
    for p in params:
        p.grad = None
    moe.record(None)  # the last call's aux loss keeps its autograd graph alive (see weft.graphs)
    return GraphedStep(fwd_bwd, [xs[0].clone().requires_grad_(), dys[0]], grads_of=params, accumulate=False)


def _replay_as_eager(checks: Checks, graphed, fwd_bwd, params: list, x: torch.Tensor, dy: torch.Tensor,
                     label: str) -> None:
    """A replay on (x, dy) against the eager step: output, input gradient and every parameter's
    gradient bitwise equal (the graph's gradients put back after)."""
    y = graphed(x, dy)
    replayed = [y.clone(), graphed.inputs[0].grad.clone()] + [p.grad.clone() for p in params]
    kept = [p.grad for p in params]
    for p in params:
        p.grad = None
    xi = x.clone().requires_grad_()
    eager = [fwd_bwd(xi, dy), xi.grad] + [p.grad.clone() for p in params]
    for p, grad in zip(params, kept):
        p.grad = grad
    for i, (a, b) in enumerate(zip(replayed, eager)):
        checks.expect(torch.equal(a, b), f"{label}tensor {i} of the replay differs from the eager step "
                                         f"(max {float((a.float() - b.float()).abs().max()):.2e})")


def test_copies_apply_to_the_replica_slots_only():
    """`copies=` places a call's copies in replica slots; a call off Comet's path (here one rank,
    where nothing is copied) refuses it with a one-line error instead of ignoring it."""
    moe = MoE(DIM, HIDDEN, 4, TOP_K, capacity_factor=None, balance="pro-prophet")
    with pytest.raises(ValueError, match="copies= applies to a balanced layer's dropless calls on Comet's path"):
        moe(torch.randn(8, DIM), copies={0: {1}})
