"""`weft bench tp`: forward + backward of a stack of tensor-parallel dense blocks (weft.tp) per
schedule, side by side: `none` (Megatron: every all-reduce waited where it is issued), `domino`
(Domino's row split into --p1 micro-batches and column split into --p2 slices, the all-reduces
overlapped), `domino-copy` (the same with its all-reduces copied through the GPUs' peer memory,
weft.tp.collectives.copy_all_reduce_) and `no-comm` (the
all-reduces left out: the time an overlap can reach at best; not the model's function). A mode
with `+graph` (GPUs) replays its forward and backward as one CUDA graph (weft.graphs), without the
host's launch work (Domino sec. 4.3). The peers `megatron` (Megatron-Core's tensor-parallel
`TransformerBlock`) and `deepspeed` (DeepSpeed's Domino) run the same shapes
(`weft.bench.peers.build_tp_peer`; their own weights, so not checked against `none`) where they
are installed and run; elsewhere their rows say why not.

Every rank of the tensor-parallel group (the whole world) holds 1/tp of each block and gets the
same batch. `domino` and `domino-copy` are checked against `none` on the first batch
(`max_abs_error`: outputs and input gradients); the modes are then timed interleaved
(weft.bench.timing), median per mode (with `speedup` over `none` and `of_no_comm`: no-comm's
median over the mode's, graphed against graphed), and on GPUs a profiled run of each gives the
communication hidden behind compute.
"""
from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from weft.bench.breakdown import comm_cells, profile_parts
from weft.bench.peers import TP_PEERS, build_tp_peer
from weft.bench.timing import ProgressLog, Run, gpu_state, gpu_state_line, graphs_must_fit, interleaved_ms, quartiles
from weft.cliargs import DTYPES, arg, names, non_negative_int, positive_int
from weft.distributed import init_distributed
from weft.graphs import GraphedStep
from weft.jsonfile import write_json
from weft.models.gpt import Block, GPTConfig, rotary_tables
from weft.tp import TPBlock, TPStack, make_schedule


@dataclass(frozen=True)
class TPShape:
    dim: int
    n_head: int
    hidden_dim: int
    seq_len: int


# GPT-3 2.7B (Brown et al., table 2.1: 32 layers x 2560, 32 heads; MLP 4x), Domino's dense
# model; `tiny` for the CPU.
SHAPES = {"gpt3-2.7b": TPShape(2560, 32, 10240, 1024), "tiny": TPShape(64, 4, 256, 32)}
MODES = ("none", "domino", "domino-copy", "no-comm")
GRAPH_SUFFIX = "+graph"


@dataclass
class TPBenchConfig:
    """`weft bench tp`: forward + backward of tensor-parallel dense blocks per schedule, interleaved."""

    config: str = arg("gpt3-2.7b", f"block shape: {', '.join(SHAPES)}")
    layers: int = arg(4, "blocks in the stack", parse=positive_int)
    batch_size: int = arg(8, "sequences per step (the same on every rank of the group)", parse=positive_int)
    seq_len: int | None = arg(None, "tokens per sequence (default: the config's)", parse=positive_int)
    p1: int = arg(2, "domino: micro-batches the batch is split into", parse=positive_int)
    p2: int = arg(1, "domino: column slices of each sub-layer's last linear (1: none; with p1 > 1 the hybrid)",
                  parse=positive_int)
    modes: tuple[str, ...] = arg(("none", "domino", "no-comm"), "comma-separated: none, domino, domino-copy (its "
                                 "all-reduces copied through peer memory: GPUs of one node), no-comm, each "
                                 "optionally with +graph (one CUDA graph per step, GPUs), and the peers megatron "
                                 "(Megatron-Core's tensor-parallel block) and deepspeed (DeepSpeed's Domino), if "
                                 "installed; a mode listed twice is timed twice (the noise)", parse=names)
    dtype: str = arg("bf16", "parameter and input dtype (fp32 on the CPU)", choices=tuple(DTYPES))
    steps: int = arg(20, "timed rounds, the modes interleaved; median reported", parse=positive_int)
    warmup: int = arg(5, "untimed rounds first", parse=positive_int)
    profile_steps: int = arg(3, "profiled steps per mode for the communication hidden (GPU; 0: none)",
                             parse=non_negative_int)
    json: str | None = arg(None, "write the results to this JSON file")

    def validate(self) -> None:
        if self.config not in SHAPES:
            raise ValueError(f"unknown --config {self.config!r}; choose from {', '.join(SHAPES)}")
        unknown = [m for m in self.modes if m.removesuffix(GRAPH_SUFFIX) not in MODES and m not in TP_PEERS]
        if not self.modes or unknown:
            raise ValueError(f"--modes {','.join(self.modes)!r}: choose from {', '.join(MODES + TP_PEERS)}")
        if any(m.startswith("domino") for m in self.modes) and self.p1 > self.batch_size:
            raise ValueError(f"--p1 {self.p1} exceeds --batch-size {self.batch_size}: domino splits the batch")


def flops_per_step(shape: TPShape, layers: int, batch: int, seq: int) -> float:
    """Forward + backward FLOPs of the whole (unsplit) stack: the linears (qkv, out, fc, out: 2 x
    (4 d^2 + 2 d h) per token) and causal attention's two matmuls (2 x 2 x seq x d per token, half
    of them masked), times 3 for forward + backward."""
    tokens = batch * seq
    linears = 2 * tokens * (4 * shape.dim ** 2 + 2 * shape.dim * shape.hidden_dim)
    attention = 2 * tokens * seq * shape.dim  # 4 * seq * d per token, halved by the causal mask
    return 3.0 * layers * (linears + attention)


def run(bench: TPBenchConfig) -> dict:
    bench.validate()
    ctx = init_distributed()
    device, world = ctx.device, ctx.world_size
    progress = ProgressLog("tp", ctx.rank)
    dtype = DTYPES[bench.dtype] if device.type == "cuda" else torch.float32
    shape = SHAPES[bench.config]
    seq = bench.seq_len or shape.seq_len
    group = dist.group.WORLD if dist.is_initialized() and world > 1 else None
    config = GPTConfig(n_layer=bench.layers, n_head=shape.n_head, dim=shape.dim, mlp_hidden_dim=shape.hidden_dim,
                       block_size=seq, moe_every=0)
    torch.manual_seed(0)  # the same dense weights on every rank; each keeps its shards
    blocks = []
    for _ in range(bench.layers):
        dense = Block(config, moe=False, group=None).to(device=device, dtype=dtype)
        blocks.append(TPBlock.from_dense(dense, shape.n_head, group))
        del dense
    stack = TPStack(blocks, group)
    rope = rotary_tables(seq, config.head_dim, config.rope_theta, device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(bench.batch_size, seq, shape.dim, generator=gen).to(device, dtype)
    grad = torch.randn(x.shape, generator=gen).to(device, dtype)
    if device.type != "cuda" and any(m.endswith(GRAPH_SUFFIX) for m in bench.modes):
        raise ValueError(f"--modes with {GRAPH_SUFFIX} need CUDA")

    def eager(schedule):
        def fwd_bwd(x_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out = stack(x_in, rope, schedule=schedule)
            out.backward(grad)
            return out.detach(), x_in.grad
        return fwd_bwd

    def step_of(mode: str):
        """The mode's step, x -> (output, input gradient); a graph replays it (owning the grads)."""
        fwd_bwd = eager(make_schedule(mode.removesuffix(GRAPH_SUFFIX), bench.p1, bench.p2))
        if mode.endswith(GRAPH_SUFFIX):
            graphed = GraphedStep(fwd_bwd, [x.detach().requires_grad_()], grads_of=list(stack.parameters()),
                                  accumulate=False)
            return lambda: graphed(x)

        def run_eager():
            stack.zero_grad(set_to_none=True)
            result = fwd_bwd(x.detach().requires_grad_())
            stack.zero_grad(set_to_none=True)
            return result
        return run_eager

    graphed = [m for m in bench.modes if m.endswith(GRAPH_SUFFIX)]
    # every graphed mode's graph and the gradients it owns stay alive from its capture to the end
    with graphs_must_fit(graphed, f"{bench.layers} {bench.config} blocks at batch {bench.batch_size}",
                         f"--modes with {GRAPH_SUFFIX}", device):
        steps, unavailable, descriptions = {}, {}, {}
        for mode in dict.fromkeys(bench.modes):
            if mode not in TP_PEERS:
                steps[mode] = step_of(mode)
                continue
            try:
                steps[mode], descriptions[mode] = _peer_step(mode, shape, config, bench.layers, seq, dtype, device,
                                                             world, x, grad)
            except Exception as e:  # a peer that cannot run here is reported, not fatal
                unavailable[mode] = f"{type(e).__name__}: {e}"
        reference = tuple(t.clone() for t in step_of("none")())
        errors = {}
        for mode, step in list(steps.items()):
            try:
                out, dx = step()
            except Exception as e:  # the peer's first step is where an API mismatch shows
                if mode not in TP_PEERS:
                    raise
                unavailable[mode] = f"{type(e).__name__}: {e}"
                del steps[mode]
                continue
            # no-comm is not the function; the peers have their own weights
            checked = not mode.startswith("no-comm") and mode not in TP_PEERS
            errors[mode] = max(float((out - reference[0]).abs().max()),
                               float((dx - reference[1]).abs().max())) if checked else None
        timed = [m for m in bench.modes if m in steps]
        progress.phase(f"{len(steps)} modes built and checked")
        runs = [Run(lambda: None, lambda r, s=steps[m]: s()) for m in timed]
        samples = iter(interleaved_ms(runs, bench.steps, bench.warmup, device, progress=progress.round)[:, 0]
                       if runs else [])
        gpu_after_timing = gpu_state(device)  # what the timed rounds ran at (this rank's GPU)
    flops = flops_per_step(shape, bench.layers, bench.batch_size, seq) / world
    rows = []
    for i, mode in enumerate(bench.modes):
        row = {"mode": mode, "repeat": bench.modes[:i].count(mode)}
        rows.append(row)
        if mode in unavailable:
            row.update(median_ms=None, error=unavailable[mode])
            continue
        sample = next(samples)
        q1, median, q3 = quartiles(sample)
        row.update(median_ms=median, iqr_ms=q3 - q1, min_ms=float(sample.min()), max_abs_error=errors[mode],
                   tflops_per_rank=flops / (median * 1e-3) / 1e12)
        if mode in descriptions:
            row["description"] = descriptions[mode]
        if device.type == "cuda" and bench.profile_steps > 0:
            row.update(profile_parts(steps[mode], bench.profile_steps))
    base = next((r for r in rows if r["mode"] == "none"), None) or next(
        (r for r in rows if r["median_ms"] is not None), None)
    for row in rows:
        row["speedup"] = base["median_ms"] / row["median_ms"] if base and row["median_ms"] is not None else None
        row["of_no_comm"] = _of_no_comm(row, rows)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {"meta": {"config": bench.config, **vars(shape), "seq_len": seq, "layers": bench.layers,
                       "batch_size": bench.batch_size, "p1": bench.p1, "p2": bench.p2, "tp": world, "device": name,
                       "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__,
                       "p2p_disabled": os.environ.get("NCCL_P2P_DISABLE") == "1", "timing": "interleaved",
                       "rounds": bench.steps, "warmup_rounds": bench.warmup, "gpu_after_timing": gpu_after_timing,
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
              "results": rows}
    if ctx.rank == 0:
        print_table(report)
        if bench.json:
            write_json(bench.json, report)
    return report


def _peer_step(name: str, shape: TPShape, config: GPTConfig, layers: int, seq: int, dtype: torch.dtype,
               device: torch.device, world: int, x: torch.Tensor, grad: torch.Tensor) -> tuple[Callable, str]:
    """A peer's blocks as a step like the others: x -> (output, input gradient)."""
    block, forward, description = build_tp_peer(name, shape.dim, shape.n_head, shape.hidden_dim, layers, seq,
                                                 config.norm_eps, config.rope_theta, dtype, device, world)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        x_in = x.detach().requires_grad_()
        out = forward(x_in)
        out.backward(grad)
        block.zero_grad(set_to_none=True)
        return out.detach(), x_in.grad
    return step, description


def _of_no_comm(row: dict, rows: list[dict]) -> float | None:
    """`no-comm`'s median over the row's: the share of the time with no communication at all that
    the row reaches (1.0: all of it hidden at no cost); graphed rows against `no-comm+graph`,
    eager ones against `no-comm`; None without that row or a time."""
    ref_mode = "no-comm" + (GRAPH_SUFFIX if row["mode"].endswith(GRAPH_SUFFIX) else "")
    ref = next((r for r in rows if r["mode"] == ref_mode and r["median_ms"] is not None), None)
    if ref is None or row["median_ms"] is None or row["mode"] in TP_PEERS:
        return None
    return ref["median_ms"] / row["median_ms"]


def print_table(report: dict) -> None:
    meta = report["meta"]
    print(f"\nweft bench tp: {meta['config']} ({meta['layers']} blocks of {meta['dim']} x {meta['hidden_dim']}, "
          f"{meta['n_head']} heads), batch {meta['batch_size']} x {meta['seq_len']}, TP {meta['tp']} x "
          f"{meta['device']}, {meta['dtype']}, domino p1 {meta['p1']} p2 {meta['p2']}, fwd+bwd"
          f"{', NCCL_P2P_DISABLE=1' if meta['p2p_disabled'] else ''}")
    if meta.get("gpu_after_timing"):
        print(gpu_state_line({"": meta["gpu_after_timing"]}))
    labels = [r["mode"] + (f"#{r['repeat'] + 1}" if r["repeat"] else "") for r in report["results"]]
    width = max([10, *map(len, labels)])
    print(f"{'mode':>{width}} {'median ms':>10} {'iqr':>6} {'min':>8} {'speedup':>8} {'no-comm':>8} {'max err':>9} "
          f"{'comm ms':>8} {'exposed':>8} {'hidden':>7} {'TFLOP/s':>8}")
    for label, r in zip(labels, report["results"]):
        if r["median_ms"] is None:
            print(f"{label:>{width}}  unavailable: {r['error'][:150]}")
            continue
        err = "n/a" if r["max_abs_error"] is None else f"{r['max_abs_error']:.1e}"
        share = "" if r.get("of_no_comm") is None else f"{r['of_no_comm']:.0%}"
        comm, exposed, hidden = comm_cells(r)
        print(f"{label:>{width}} {r['median_ms']:>10.3f} {r['iqr_ms']:>6.2f} {r['min_ms']:>8.3f} "
              f"{r['speedup']:>7.2f}x {share:>8} {err:>9} {comm:>8} {exposed:>8} {hidden:>7} "
              f"{r['tflops_per_rank']:>8.1f}")
