"""Where the eager layer step's host time goes: `weft bench layer`'s step (forward, backward, SGD)
for one config and mode, run eagerly; prints the wall time per step beside the GPU's busy time
(CUDA events around the same steps), the host synchronisations one step makes (torch's sync debug
mode), and the Python functions that take the host's time (cProfile, by own time and by
cumulative time within weft).
    torchrun --standalone --nproc_per_node=1 scripts/host_profile.py --config qwen2 --modes plain comet
    torchrun --standalone --nproc_per_node=1 scripts/host_profile.py --modes plain --ab-one-pass 5
Run it where weft is importable (PYTHONPATH=src)."""
import argparse
import cProfile
import io
import pstats
import statistics
import time
import warnings

import torch

from weft.bench.layer import CONFIGS, _eager, _optimizer, _step_fn, mode_forward
from weft.distributed import init_distributed
from weft.moe import MoE


def build_step(moe: MoE, mode: str, inputs, grads, optimizer: str):
    """`weft bench layer`'s eager step for `mode`: forward, backward and the optimizer, from no gradients."""
    params = list(moe.parameters())
    opt = _optimizer(optimizer, params)
    return _step_fn(_eager(mode_forward(mode, moe)), params, inputs, grads, opt, graphed=False)


def wall_and_gpu_ms(step, steps: int, device) -> tuple[float, float]:
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for i in range(steps):
        step(i)
    end.record()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e3 / steps, start.elapsed_time(end) / steps


def gpu_busy_ms(step, steps: int) -> float:
    """The step's kernels' summed time per step (the profiler's device time), no host in it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / steps


def count_syncs(step) -> list[str]:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step(0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno} {str(w.message).splitlines()[0][:100]}" for w in caught]


def python_profile(step, steps: int, top: int, dump: str | None = None) -> str:
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    for i in range(steps):
        step(i)
    torch.cuda.synchronize()
    profiler.disable()
    if dump:
        profiler.dump_stats(dump)
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats("weft", top)
    return out.getvalue()


def host_ops_table(step, steps: int, trace: str | None = None) -> str:
    """The host's operators over `steps` steps by the torch profiler: calls and CPU time of each
    (aten ops, autograd nodes, Triton launches), most host time first; `trace`: also a Chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=80, max_name_column_width=70)


def host_split(step, steps: int) -> list[tuple[str, float, int]]:
    """The host's milliseconds a step inside each of the layer step's parts (inclusive: a part's
    time holds the parts it calls), by wall-clock timers wrapped around them; no profiler in the
    way, and the step issues no synchronisation, so each is the host's own time. (name, ms a step,
    calls a step), slowest first."""
    import torch.autograd
    import torch.optim

    from weft.kernels.token_choice import _RouteTopk
    from weft.moe import dispatch, experts, gates, layer, routing
    from weft.moe.exchange.base import Exchange

    parts = [(layer.MoE, "forward"), (layer.MoE, "route"), (gates.LinearRouter, "forward"),
             (routing.Router, "route"), (layer.MoE, "exchange_for"), (layer.MoE, "_exchange_rows"),
             (layer, "dispatch_rows"), (Exchange, "__call__"), (experts.Experts, "forward"),
             (experts.Experts, "forward_by_source"), (layer, "combine_rows"), (torch.autograd, "backward"),
             (_RouteTopk, "forward"), (_RouteTopk, "backward"), (dispatch._CombineRows, "backward"),
             (dispatch._DispatchRows, "backward"), (torch.optim.SGD, "step")]
    totals: dict[str, list[float]] = {}
    saved = []

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                entry = totals.setdefault(name, [0.0, 0])
                entry[0] += time.perf_counter() - t0
                entry[1] += 1
        return wrapper

    for owner, attr in parts:
        raw = owner.__dict__[attr]
        name = f"{getattr(owner, '__name__', owner)}.{attr}".replace("weft.moe.", "")
        fn = raw.__func__ if isinstance(raw, staticmethod) else raw
        wrapped = timed(name, fn)
        setattr(owner, attr, staticmethod(wrapped) if isinstance(raw, staticmethod) else wrapped)
        saved.append((owner, attr, raw))
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(steps):
            step(i)
        wall = time.perf_counter() - t0
        torch.cuda.synchronize()
    finally:
        for owner, attr, raw in saved:
            setattr(owner, attr, raw)
    rows = [(name, total * 1e3 / steps, calls // steps) for name, (total, calls) in totals.items()]
    return [("step (wall)", wall * 1e3 / steps, 1)] + sorted(rows, key=lambda r: -r[1])


def ab_one_pass(moe: MoE, args, inputs, grads, ctx) -> None:
    """Wall ms a step with the routing composition and with the one-pass kernels, alternating in
    one process (the host's speed moves between processes more than the difference)."""
    import weft.moe.routing as routing

    one_pass_gates = routing.ONE_PASS_GATES
    for mode in args.modes:
        step = build_step(moe, mode, inputs, grads, args.optimizer)
        walls = {"composition": [], "one pass": []}
        for _ in range(args.ab_one_pass):
            for variant, gates in (("composition", ()), ("one pass", one_pass_gates)):
                routing.ONE_PASS_GATES = gates
                for i in range(3):
                    step(i)
                walls[variant].append(wall_and_gpu_ms(step, args.steps, ctx.device)[0])
        routing.ONE_PASS_GATES = one_pass_gates
        if ctx.rank == 0:
            old, new = (statistics.median(walls[v]) for v in ("composition", "one pass"))
            print(f"== {args.config} {mode} cf {args.capacity}: wall ms a step, composition "
                  f"{', '.join(f'{x:.3f}' for x in walls['composition'])}; one pass "
                  f"{', '.join(f'{x:.3f}' for x in walls['one pass'])}; medians' ratio {new / old:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="qwen2", choices=sorted(CONFIGS))
    parser.add_argument("--modes", nargs="+", default=["plain"])
    parser.add_argument("--capacity", default="1.0", help="a capacity factor or 'dropless'")
    parser.add_argument("--activation", default="relu")
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--split", action="store_true",
                        help="also print the host's ms a step inside each part of the step (wall-clock timers)")
    parser.add_argument("--dump", default=None, metavar="DIR",
                        help="also write DIR/<config>-<mode>.pstats (cProfile), .ops.txt (the host's operators "
                             "by the torch profiler) and .trace.json (two steps)")
    parser.add_argument("--ab-one-pass", type=int, default=0, metavar="ROUNDS",
                        help="instead of profiling: ROUNDS rounds alternating the routing composition "
                             "(weft.moe.routing.ONE_PASS_GATES emptied) and the one-pass kernels, wall ms a step")
    args = parser.parse_args()
    ctx = init_distributed()
    cfg = CONFIGS[args.config]
    cf = None if args.capacity == "dropless" else float(args.capacity)
    torch.manual_seed(0)
    moe = MoE(cfg.dim, cfg.hidden_dim, cfg.num_experts, cfg.top_k, capacity_factor=cf, activation=args.activation,
              device=ctx.device, dtype=torch.bfloat16, parallel="adaptive", a2a_algo="auto")
    gen = torch.Generator(device=ctx.device).manual_seed(1000 + ctx.rank)
    shape = (cfg.tokens_per_rank, cfg.dim)
    inputs = [torch.randn(shape, device=ctx.device, dtype=torch.bfloat16, generator=gen) for _ in range(4)]
    grads = [torch.randn(shape, device=ctx.device, dtype=torch.bfloat16, generator=gen) for _ in range(4)]
    if args.ab_one_pass:
        ab_one_pass(moe, args, inputs, grads, ctx)
        return
    for mode in args.modes:
        step = build_step(moe, mode, inputs, grads, args.optimizer)
        for i in range(5):
            step(i)
        wall, gpu = wall_and_gpu_ms(step, args.steps, ctx.device)
        wall2, gpu2 = wall_and_gpu_ms(step, args.steps, ctx.device)
        busy = gpu_busy_ms(step, 5)
        syncs = count_syncs(step)
        if ctx.rank == 0:
            print(f"== {args.config} {mode} cf {args.capacity} {args.activation}: wall {wall:.3f} / {wall2:.3f} ms a "
                  f"step, GPU (events) {gpu:.3f} / {gpu2:.3f}, kernels busy {busy:.3f}; "
                  f"{len(syncs)} host synchronisations a step")
            for message in syncs:
                print("   sync:", message)
            if args.split:
                for name, ms, calls in host_split(step, args.steps):
                    print(f"   host {name:34s} {ms:7.3f} ms a step ({calls} calls)")
            stem = None if args.dump is None else f"{args.dump}/{args.config}-{mode}"
            print(python_profile(step, args.steps, args.top, stem and stem + ".pstats"))
            if stem:
                with open(stem + ".ops.txt", "w") as f:
                    f.write(host_ops_table(step, args.steps))
                host_ops_table(step, 2, stem + ".trace.json")


if __name__ == "__main__":
    main()
