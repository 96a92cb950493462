"""Weight-gradient (dW) scheduling: defer dW in backward and run it while all-to-alls fly.

Lancet (sec. 4, Alg. 1) reorders the backward pass so that weight-gradient matmuls, which no
other backward op consumes, execute while an all-to-all is in flight. Here this happens eagerly:
`linear`, `bmm` and `grouped_mm` run the op on a detached weight, so autograd computes only the
input gradient (dX), and a gradient hook on the output queues the dW as an item in a
`WGradScheduler` (a hook, not a Python autograd.Function, whose host time per call is larger;
docs/benchmarks.md has the measurement). When an MoE layer's backward launches an async
all-to-all it calls
`scheduler.communicate(key, nbytes, handle)`, which runs the queued items whose profiled times
best fit the exchange's expected time and then waits; the rest run when the context exits:

    scheduler = WGradScheduler(comm_time=functools.partial(cost_model.predict, "all_to_all"))
    with scheduler.backward():
        loss.backward()

Lancet's labelling step (4.1) is free in eager mode: a queued item only reads tensors that
backward has already produced, and nothing in backward reads dW, so any queued item may overlap
any later all-to-all. Deferral keeps each item's saved input and output gradient alive until it
runs (at most until the end of backward).

Each backward records its sequence of dW items and collectives. The next backward follows Alg. 1
on that trace: walking the collectives in order, each takes by best fit from the items produced
before it and not yet taken; the items no collective takes are not deferred but run in place,
as in Lancet, where only the assigned dW instructions move, and a weight with no item taken
goes back to the plain op from the next forward on (no hook, no host cost): deferring an item
nothing hides costs host time and keeps its kernel from running while the host launches later
work (docs/benchmarks.md). The first backward, and one whose items or collectives
stop matching the trace, defers every item and places them by best fit when each collective
comes, with the rest at the end.

Deferred weights stay out of the autograd graph of these wrappers (backward reaching a weight's
AccumulateGrad node would fire its post-accumulate-grad hooks, even with no gradient, before the
deferred items ran). Instead the wrappers write `.grad` themselves, exactly as AccumulateGrad
would, and fire those hooks after the last queued item of a parameter ran, so DDP-style reducers
see the complete gradient. Outside `scheduler.backward()` they do the same at once. Hence:
`torch.autograd.grad(loss, weight)` does not see such a weight (pass scheduler=None for that);
a backward through them always fills `.grad`; a weight used by several wrapper calls whose items
drain in between (a `communicate` between their backwards) gets its hooks each time its queue
empties, so use each weight once per backward to get them once. A call whose input needs no
gradient is not deferred (its dW goes through autograd at once).
"""
from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from weft.hostcopy import offsets
from weft.kernels.grouped_mm import EXCHANGE_SM_MARGIN, leave_sms, use_grouped_mm
from weft.profiling import seconds

__all__ = ["Linear", "WGradScheduler", "WGradStats", "best_fit", "bmm", "grouped_mm", "linear", "plan_in_place"]


def best_fit(budget: float, times: Sequence[float]) -> list[int]:
    """Lancet Alg. 1 inner loop: from t_u = budget, repeatedly pick the unused item j minimising
    |t_u - times[j]| (ties: lowest index) and subtract its time, until t_u <= 0 or none remain.
    Returns the chosen indices in pick order."""
    left = list(range(len(times)))
    picked: list[int] = []
    t_u = budget
    while t_u > 0 and left:
        j = min(left, key=lambda i: abs(t_u - times[i]))  # first minimum: `left` stays sorted
        left.remove(j)
        picked.append(j)
        t_u -= times[j]
    return picked


@dataclass
class WGradStats:
    """Counters of the last `WGradScheduler.backward()`."""

    deferred: int = 0  # dW items queued
    run_under_comm: int = 0  # queued items run while a collective was in flight
    flushed: int = 0  # queued items run at the end of backward
    in_place: int = 0  # items run at once, not queued (the plan gave them no collective)
    comms: int = 0  # run_for calls (collectives with an estimate)
    comm_budget: float = 0.0  # their predicted seconds
    placed_time: float = 0.0  # profiled dW seconds placed under them


@dataclass(frozen=True)
class PlannedCollective:
    """One collective of the plan a `WGradScheduler` follows from its next backward on: its key
    and bytes, its expected seconds (the budget best fit filled; None without an estimate), and
    the items the plan gives it (how many, their profiled seconds)."""

    key: Hashable
    nbytes: int
    budget: float | None
    items: int
    item_seconds: float


def plan_line(planned: Sequence[PlannedCollective]) -> str:
    """One line on a plan: how many collectives take items, how many items, and their profiled
    time against the collectives' expected time."""
    taking = [c for c in planned if c.items]
    budget = sum(c.budget or 0.0 for c in planned)
    items = sum(c.item_seconds for c in planned)
    return (f"dW plan: {len(taking)} of {len(planned)} collectives take {sum(c.items for c in planned)} items, "
            f"{items * 1e3:.2f} ms of them (profiled) beside {budget * 1e3:.2f} ms of expected collectives")


@dataclass
class _Item:
    key: Hashable
    fn: Callable[[], None]
    param: torch.Tensor
    slot: int | None = None  # the collective (ordinal in this backward) the plan assigned it to


def plan_in_place(trace: Sequence[tuple], times: dict[Hashable, float],
                  budget: Callable[[Hashable, int], float | None]) -> list[int | None]:
    """Lancet Alg. 1 over a recorded backward: `trace` holds ("dw", key, param_id) and
    ("comm", key, nbytes) in execution order. Walking the collectives in order, each takes by
    `best_fit` against `budget(key, nbytes)` from the timed items before it not yet taken.
    Returns per item the ordinal of the collective that took it (None: run in place)."""
    slots: list[int | None] = []
    pool: list[int] = []  # ordinals of the timed items not taken yet, in order
    pool_times: list[float] = []
    comm = 0
    for kind, key, arg in trace:
        if kind == "dw":
            if key in times:
                pool.append(len(slots))
                pool_times.append(times[key])
            slots.append(None)
            continue
        seconds = budget(key, arg)
        taken = set(best_fit(seconds, pool_times)) if seconds else set()
        for j in taken:
            slots[pool[j]] = comm
        pool = [i for j, i in enumerate(pool) if j not in taken]
        pool_times = [t for j, t in enumerate(pool_times) if j not in taken]
        comm += 1
    return slots


def _signature(event: tuple) -> tuple:
    """What a later backward must repeat for a plan to apply: each item's kind and parameter
    (not its shape: dropless row counts change), each collective's key."""
    kind, key, arg = event
    return (kind, key[0] if isinstance(key, tuple) else key, arg) if kind == "dw" else (kind, key)


class WGradScheduler:
    """Queue of deferred dW items, run under collectives by best fit (Lancet Alg. 1).

    `comm_time(nbytes)` predicts the seconds of an all-to-all moving `nbytes` from this rank
    (e.g. `functools.partial(cost_model.predict, "all_to_all")`); without it each
    collective key's time is measured the first time `communicate` sees it. `times` maps an
    item key to its profiled seconds (the first run of each key is timed, on CUDA by events
    around its kernels, `weft.profiling.seconds`: what it takes of a collective's time on the GPU,
    without the launches' host cost, which a replayed CUDA graph does not pay); items whose key
    was never timed are not placed under collectives but run (and get timed) in the flush.
    `in_place` (default): from the second backward on, items that the previous backward's plan
    gives no collective run where they are produced, and a weight none of whose items any
    collective takes goes back to plain autograd from the next forward on
    (`through_autograd(weight)`; the plan is static while the model and the times are). False defers
    every item (what no collective takes runs at the end). On CUDA the items run under a
    collective leave it `EXCHANGE_SM_MARGIN` SMs (`weft.kernels.grouped_mm.leave_sms`): the
    collective's kernel is launched first but would start only after a persistent GEMM that took
    every SM.
    """

    def __init__(self, comm_time: Callable[[int], float] | None = None, in_place: bool = True):
        self.comm_time = comm_time
        self.in_place = in_place
        self.active = False
        self.times: dict[Hashable, float] = {}
        self.comm_times: dict[Hashable, float] = {}
        self.stats = WGradStats()
        self._queue: list[_Item] = []
        self._pending: dict[int, int] = {}  # id(param) -> queued items
        self._trace: list[tuple] = []  # this backward's ("dw", key, id(param)) / ("comm", key, nbytes)
        self._plan: list[int | None] | None = None  # per item: its collective's ordinal, None = in place
        self._next: tuple[list[int | None], list[tuple]] | None = None  # (plan, signature) for the next
        self.planned: list[PlannedCollective] = []  # that plan, per collective
        self._expected: list[tuple] = []  # the plan's signature, which this backward must repeat
        self._items = self._comms = 0  # ordinals of the next item and collective in this backward
        # Parameters that no collective takes any item of (id -> weak reference): their wrappers
        # run the plain op. The reference guards against a freed parameter's reused id.
        self._autograd: dict[int, weakref.ref] = {}
        self._params: dict[int, weakref.ref] = {}  # this backward's deferring parameters

    @contextlib.contextmanager
    def backward(self) -> Iterator[WGradScheduler]:
        """Defer dW inside the block; flush on normal exit, drop the queue on an exception.
        With `in_place` (default), follow the plan made from the previous backward."""
        if self.active:
            raise RuntimeError("WGradScheduler.backward() is already active; it does not nest")
        self.stats = WGradStats()
        planned = self.in_place and self._next
        self._plan, self._expected = (list(self._next[0]), self._next[1]) if planned else (None, [])
        self._trace, self._items, self._comms = [], 0, 0
        self._params = {}
        self.active = True
        try:
            yield self
            self.flush()
            if self.in_place:
                self._replan()
        except BaseException:
            self._queue.clear()
            self._pending.clear()
            raise
        finally:
            self.active = False
            self._trace, self._params = [], {}

    def _replan(self) -> None:
        """Plan the next backward on this one's trace (`plan_in_place`). A parameter none of
        whose items a collective takes goes `through_autograd`: from the next forward on its
        wrappers run the plain op, so its dW runs in place inside autograd at no extra host
        cost, and its items leave the trace (which does not change the other assignments:
        best fit never picked them)."""
        slots = iter(plan_in_place(self._trace, self.times, self._estimate))
        planned = [(event, next(slots) if event[0] == "dw" else None) for event in self._trace]
        taken = {event[2] for event, slot in planned if slot is not None}
        for event, _ in planned:
            if event[0] == "dw" and event[2] not in taken:
                self._autograd[event[2]] = self._params[event[2]]
        kept = [(event, slot) for event, slot in planned if event[0] != "dw" or event[2] not in self._autograd]
        self._next = ([slot for event, slot in kept if event[0] == "dw"], [_signature(event) for event, _ in kept])
        comms = [event for event in self._trace if event[0] == "comm"]
        given = [[0, 0.0] for _ in comms]
        for event, slot in planned:
            if slot is not None:
                given[slot][0] += 1
                given[slot][1] += self.times.get(event[1], 0.0)
        self.planned = [PlannedCollective(key, nbytes, self._estimate(key, nbytes), n, item_s)
                        for (_, key, nbytes), (n, item_s) in zip(comms, given)]

    def forget(self) -> None:
        """Plan afresh, as before the first backward: every weight sent back to plain autograd
        defers again from the next forward on, and the next backward defers every item and
        places them by best fit as each collective comes, its trace the plan after it. For a
        change of the step's configuration (e.g. the MoE layers' pipelining degree: other
        collectives, other budgets): sending a weight to autograd is final while the plan holds,
        so without this each configuration's plan would keep only weights every earlier plan had
        kept (graphed gpt2-s-moe, after the degrees 1, 2, 4 and 8 were timed: 5 items under 3 of
        6 collectives; docs/benchmarks.md)."""
        if self.active:
            raise RuntimeError("WGradScheduler.forget() inside backward(); call it between steps")
        self._autograd.clear()
        self._next = None
        self.planned = []

    def through_autograd(self, param: torch.Tensor) -> bool:
        """Whether the plan sends `param`'s dW back to plain autograd (no item of it under a collective)."""
        ref = self._autograd.get(id(param))
        return ref is not None and ref() is param

    def _follow(self, event: tuple) -> bool:
        """Record `event`; whether the plan still applies (this backward repeats the trace)."""
        self._trace.append(event)
        position = len(self._trace) - 1
        if self._plan is not None and (position >= len(self._expected)
                                       or self._expected[position] != _signature(event)):
            self._plan = None  # a different backward: defer everything from here on
        return self._plan is not None

    def defer(self, key: Hashable, fn: Callable[[], None], param: torch.Tensor) -> None:
        """Queue `fn`, which computes one dW contribution and accumulates it into `param.grad`;
        `key` names its shape and kind for the time cache. If the plan gives the item no
        collective, run it now instead."""
        self.defer_all(param, [(key, fn)])

    def defer_all(self, param: torch.Tensor, items: Sequence[tuple[Hashable, Callable[[], None]]]) -> None:
        """`defer` for several (key, fn) items of one parameter, produced together: its hooks
        fire once, after the last of them ran, even if some run in place."""
        if not self.active:
            raise RuntimeError("defer() needs an active `with scheduler.backward():`")
        self._pending[id(param)] = self._pending.get(id(param), 0) + len(items)
        if id(param) not in self._params:
            self._params[id(param)] = weakref.ref(param)
        for key, fn in items:
            item = _Item(key, fn, param)
            if self._follow(("dw", key, id(param))):
                item.slot = self._plan[self._items]
            self._items += 1
            if self._plan is not None and item.slot is None:
                self.stats.in_place += 1
                with torch.no_grad():
                    self._run(item)
            else:
                self._queue.append(item)
                self.stats.deferred += 1

    def run_for(self, budget: float) -> int:
        """Run now the timed queued items that best fit `budget` seconds; returns how many ran."""
        timed = [i for i, item in enumerate(self._queue) if item.key in self.times]
        picks = best_fit(budget, [self.times[self._queue[i].key] for i in timed])
        return self._run_under(sorted(timed[j] for j in picks), budget)  # queue order: deterministic sums

    def _run_under(self, chosen: list[int], budget: float) -> int:
        """Run the queued items at indices `chosen` (ascending) under a collective of `budget` s."""
        items = [self._queue[i] for i in chosen]
        chosen_set = set(chosen)
        self._queue = [item for i, item in enumerate(self._queue) if i not in chosen_set]
        self.stats.comms += 1
        self.stats.comm_budget += budget
        self.stats.placed_time += sum(self.times.get(item.key, 0.0) for item in items)
        self.stats.run_under_comm += len(items)
        with torch.no_grad(), beside_collective(bool(items) and items[0].param.is_cuda):
            for item in items:
                self._run(item)
        return len(items)

    def predict_comm(self, key: Hashable, nbytes: int) -> float:
        """Expected seconds of collective `key` moving `nbytes`; 0.0 while unknown."""
        estimate = self._estimate(key, nbytes)
        return 0.0 if estimate is None else estimate

    def communicate(self, key: Hashable, nbytes: int, handle, device: torch.device | None = None) -> None:
        """Call right after launching an async collective: run the items that fit its expected
        time, then `handle.wait()` (None: already complete). Without an estimate (no comm_time,
        `key` unseen) run nothing and record the time from this call until the collective ends;
        pass `device` when it runs on CUDA so that end is a synchronisation, not a launch.
        Outside `backward()` this only waits."""
        if not self.active:
            _wait(handle)
            return
        if self.run_under(key, nbytes) is None:
            # A synchronize first would wait for the collective itself, so time from here; this
            # also counts GPU work queued before the launch, so it may overestimate (a cost
            # model is more accurate).
            start = time.perf_counter()
            _wait(handle)
            _sync(device)
            self.comm_times[key] = time.perf_counter() - start
            return
        _wait(handle)

    def run_under(self, key: Hashable, nbytes: int) -> float | None:
        """Call right after launching an async collective that is waited for elsewhere (e.g. a
        partitioned forward's exchange in backward): record it in this backward's trace, as
        `communicate` does, so the next backward's plan can give it items, and run the items the
        plan gives it (or, off the plan, those that fit its expected time). Nothing runs without an
        estimate; nothing at all outside `backward()`. Returns the collective's expected seconds
        (None: no estimate, or outside `backward()`)."""
        if not self.active:
            return None
        budget = self._estimate(key, nbytes)
        following = self._follow(("comm", key, nbytes))
        ordinal, self._comms = self._comms, self._comms + 1
        if budget is None:
            return None
        if following:  # the items the plan assigned to this collective
            self._run_under([i for i, item in enumerate(self._queue) if item.slot == ordinal], budget)
        else:
            self.run_for(budget)
        return budget

    def flush(self) -> None:
        """Run every queued item in queue order."""
        items, self._queue = self._queue, []
        self.stats.flushed += len(items)
        with torch.no_grad():
            for item in items:
                self._run(item)

    def _estimate(self, key: Hashable, nbytes: int) -> float | None:
        if self.comm_time is not None:
            return self.comm_time(nbytes)
        return self.comm_times.get(key)

    def _run(self, item: _Item) -> None:
        """Run one item (under no_grad, set by the callers once for all their items)."""
        if item.key in self.times:
            item.fn()
        else:  # first run of this key: profile it (later runs skip the synchronisations)
            self.times[item.key] = seconds(item.fn, item.param.device)  # on CUDA its kernels' time
        pid = id(item.param)
        self._pending[pid] -= 1
        if self._pending[pid] == 0:
            del self._pending[pid]
            _post_accumulate(item.param)


def beside_collective(on_cuda: bool):
    """How the scheduler runs its items under a collective launched just before them: on CUDA
    their matmuls leave the collective `EXCHANGE_SM_MARGIN` SMs (`WGradScheduler`'s docstring),
    elsewhere nothing changes. `weft.overlap.profile` measures the dW items' overlap the same way."""
    return leave_sms(EXCHANGE_SM_MARGIN if on_cuda else 0)


def _post_accumulate(param: torch.Tensor) -> None:
    """Fire the hooks of `param.register_post_accumulate_grad_hook`, as AccumulateGrad does."""
    for hook in list((param._post_accumulate_grad_hooks or {}).values()):
        hook(param)


def _wait(handle) -> None:
    if handle is not None:
        handle.wait()


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def _no_autocast(device_type: str, dtype: torch.dtype | None = None):
    """Operands are cast explicitly; autocast must not recast them (nor reach into backward).
    Operands already in the autocast dtype (`dtype`) are left alone by autocast: no context."""
    autocast_dtype = _autocast_dtype(device_type)
    if autocast_dtype is not None and autocast_dtype != dtype:
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _accumulate(param: torch.Tensor, dw: torch.Tensor, index: int | None = None) -> None:
    """Add `dw` into `param.grad` (or its slice `index`) in param's dtype, like AccumulateGrad."""
    if param.grad is None and index is None:
        param.grad = dw.to(param.dtype, memory_format=torch.contiguous_format)
        return
    if param.grad is None:
        param.grad = torch.zeros_like(param, memory_format=torch.contiguous_format)
    target = param.grad if index is None else param.grad[index]
    target.add_(dw.to(param.dtype))


def _linear_dw(weight: torch.Tensor, x2: torch.Tensor, dy2: torch.Tensor) -> None:
    with _no_autocast(x2.device.type):
        _accumulate(weight, dy2.t() @ x2)


def _group_dw(weight: torch.Tensor, g: int, x: torch.Tensor, dy: torch.Tensor) -> None:
    with _no_autocast(x.device.type):
        _accumulate(weight, x.t() @ dy, g)


def _bmm_dw(weight: torch.Tensor, x: torch.Tensor, dy: torch.Tensor) -> None:
    with _no_autocast(x.device.type):
        _accumulate(weight, torch.bmm(x.transpose(1, 2), dy))


def _zero_dw(weight: torch.Tensor) -> None:
    _accumulate(weight, torch.zeros_like(weight))


def _deferring(scheduler: WGradScheduler | None, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Defer when a scheduler is set, the weight is a leaf that wants a gradient, autograd
    will reach the output through x (an output that needs no grad gets no gradient hook) and the
    scheduler's plan gives some item of the weight a collective."""
    return (scheduler is not None and weight.is_leaf and weight.requires_grad and torch.is_grad_enabled()
            and x.requires_grad and not scheduler.through_autograd(weight))


def _deliver(scheduler: WGradScheduler, param: torch.Tensor, items: list[tuple[Hashable, Callable[[], None]]]) -> None:
    """Queue the dW items while the scheduler is active; outside `scheduler.backward()` run them
    now and fire the hooks, as AccumulateGrad would."""
    if scheduler.active:
        scheduler.defer_all(param, items)
        return
    with torch.no_grad():
        for _, fn in items:
            fn()
        _post_accumulate(param)


def _on_grad(y: torch.Tensor, queue: Callable[[torch.Tensor], None]) -> torch.Tensor:
    """Call `queue(dy)` when autograd computes y's gradient (before y's own backward node runs,
    which computes dX). A hook on the output costs far less host time than a Python
    autograd.Function, and the dX matmul stays in autograd's C++ engine."""
    y.register_hook(queue)  # returns None: the gradient passes unchanged
    return y


def _queue_linear(scheduler: WGradScheduler, weight: torch.Tensor, x: torch.Tensor, dy: torch.Tensor) -> None:
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    key = ("linear", x2.shape[0], x2.shape[1], dy2.shape[1], x2.dtype)
    _deliver(scheduler, weight, [(key, functools.partial(_linear_dw, weight, x2, dy2))])


def linear(x: torch.Tensor, weight: torch.Tensor, scheduler: WGradScheduler | None) -> torch.Tensor:
    """`F.linear(x, weight)` (no bias) whose dW is deferred to `scheduler` while it is active.

    Under autocast x and weight are cast to the autocast dtype, as autocast's F.linear does; dW
    is computed in that dtype and accumulated in weight's. Without a scheduler, for a weight
    that is not a leaf requiring grad (e.g. gathered), with grad disabled or for an x that needs
    no gradient: plain `F.linear` (dW through autograd, not deferred).
    """
    if not _deferring(scheduler, x, weight):
        return F.linear(x, weight)
    dtype = _autocast_dtype(x.device.type)
    # Detached: autograd computes only dX; dW comes from the hook on the output.
    x_c, w_c = (x, weight.detach()) if dtype is None else (x.to(dtype), weight.detach().to(dtype))
    return _on_grad(F.linear(x_c, w_c), functools.partial(_queue_linear, scheduler, weight, x_c))


def _queue_bmm(scheduler: WGradScheduler, weight: torch.Tensor, x: torch.Tensor, dy: torch.Tensor) -> None:
    # One item for all G experts: one batched matmul. Per-expert items would give the best fit
    # finer grains, but G small matmuls and G Python items per weight cost more than they hide.
    key = ("bmm", *x.shape, dy.shape[2], x.dtype)
    _deliver(scheduler, weight, [(key, functools.partial(_bmm_dw, weight, x, dy))])


def bmm(x: torch.Tensor, weight: torch.Tensor, scheduler: WGradScheduler | None) -> torch.Tensor:
    """`torch.bmm(x, weight.to(x.dtype))` for x (G, M, K), weight (G, K, N), computed in x.dtype
    (the caller casts x to the compute dtype); dW of all G experts is deferred as one item.
    Without a scheduler, for a weight that is not a leaf requiring grad or an x that needs no
    gradient, a plain bmm."""
    deferring = _deferring(scheduler, x, weight)
    w_c = (weight.detach() if deferring else weight).to(x.dtype)
    with _no_autocast(x.device.type, x.dtype):
        y = torch.bmm(x, w_c)
    return _on_grad(y, functools.partial(_queue_bmm, scheduler, weight, x)) if deferring else y


def _grouped_forward(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    if use_grouped_mm(x, w, w):
        return torch._grouped_mm(x, w, offs=offsets(counts, x.device))
    return torch.cat([rows @ w[g] for g, rows in enumerate(torch.split(x, counts))])


def _bucket(rows: int) -> int:
    """Dropless counts change every step; timing keys by the next power of two bounds the
    number of keys, hence of profiling synchronisations."""
    return 1 << (rows - 1).bit_length()


def _queue_grouped(scheduler: WGradScheduler, weight: torch.Tensor, x: torch.Tensor, counts: list[int],
                   dy: torch.Tensor) -> None:
    items = []
    for g, (xg, dyg) in enumerate(zip(torch.split(x, counts), torch.split(dy, counts))):
        if counts[g] > 0:
            key = ("grouped_mm", _bucket(counts[g]), x.shape[1], dy.shape[1], x.dtype)
            items.append((key, functools.partial(_group_dw, weight, g, xg, dyg)))
    if not items:  # autograd gives a weight whose groups are all empty a zero gradient
        items.append((("zeros", tuple(weight.shape), weight.dtype), functools.partial(_zero_dw, weight)))
    _deliver(scheduler, weight, items)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: list[int],
               scheduler: WGradScheduler | None) -> torch.Tensor:
    """Rows of x (M, K) sorted by group, `counts[g]` rows for group g: out rows of group g are
    x_g @ weight[g] for weight (G, K, N), computed in x.dtype (the caller casts x). dW is
    deferred as one item per non-empty group. Uses torch._grouped_mm where
    `weft.kernels.grouped_mm.use_grouped_mm` allows, else a per-group loop. Without a scheduler,
    for a weight that is not a leaf requiring grad or an x that needs no gradient, the same
    computation through plain autograd."""
    if len(counts) != weight.shape[0] or sum(counts) != x.shape[0]:
        raise ValueError(f"counts ({len(counts)} groups, {sum(counts)} rows) must match weight "
                         f"({weight.shape[0]} groups) and x ({x.shape[0]} rows)")
    deferring = _deferring(scheduler, x, weight)
    w_c = (weight.detach() if deferring else weight).to(x.dtype)
    with _no_autocast(x.device.type, x.dtype):
        y = _grouped_forward(x, w_c, counts)
    return _on_grad(y, functools.partial(_queue_grouped, scheduler, weight, x, counts)) if deferring else y


class Linear(nn.Linear):
    """`nn.Linear` whose weight gradient a `WGradScheduler` may defer: set `wgrad_scheduler`
    (weft.overlap.optimize does) and the backward queues dW instead of computing it. Same
    parameters and state dict as `nn.Linear`; no scheduler: exactly `nn.Linear`."""

    wgrad_scheduler: WGradScheduler | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wgrad_scheduler is None or self.bias is not None:
            return super().forward(x)
        return linear(x, self.weight, self.wgrad_scheduler)
