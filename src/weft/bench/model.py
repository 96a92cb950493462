"""`weft bench model`: full training iterations (forward + backward + optimizer) of a GPT preset
per overlap mode, side by side (Lancet fig. 11-14, 16).

Modes: `none` (the plain model), `tutel` (every MoE layer's overlap degree tuned, Tutel 3.2-3.3),
`lancet-bw` (dW scheduling only), `lancet-fw` (partitioned forward only), `lancet` (both). Each
mode's loss and gradients are checked against `none` on the same weights and batch before
timing; the Lancet modes also report the planner's predicted forward+backward time next to the
measured one.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from weft.bench.layer import _slowest, median_ms, write_report
from weft.bench.trace import profile_decomposition
from weft.distributed import init_distributed
from weft.models import GPT, get_preset
from weft.overlap import passes
from weft.train.precision import training_autocast

MODES = ("none", "tutel", "lancet-bw", "lancet-fw", "lancet")


def _configure(mode: str, model: GPT, idx: torch.Tensor, max_partitions: int):
    """Set `model` up for `mode`; returns the Lancet plan (None for the other modes)."""
    passes.apply(model, [], None)
    for moe in model.moe_layers():
        moe.overlap_degree = "auto" if mode == "tutel" else 1
    if mode.startswith("lancet"):
        return passes.optimize(model, idx, forward=mode != "lancet-bw", backward=mode != "lancet-fw",
                               max_partitions=max_partitions)
    return None


def run(preset: str, batch_size: int, gate: str | None, capacity, modes, steps: int, warmup: int,
        json_path: str | None, max_partitions: int = 8, profile_steps: int = 3) -> dict:
    """Time `modes` on every rank of the current world; rank 0 prints the table and writes JSON."""
    ctx = init_distributed()
    device = ctx.device
    overrides = {} if gate is None else {"gate": gate}
    if capacity != "preset":
        overrides["capacity_factor"] = capacity
    cfg = get_preset(preset)
    cfg = type(cfg).from_dict({**cfg.to_dict(), **overrides})
    torch.manual_seed(0)
    model = GPT(cfg, group=dist.group.WORLD if dist.is_initialized() else None).to(device)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator(device="cpu").manual_seed(100 + ctx.rank)
    batches = [torch.randint(0, cfg.vocab_size, (batch_size, cfg.block_size + 1), generator=gen).to(device)
               for _ in range(3)]

    def loss_of(tokens):
        with training_autocast(device):
            return model(tokens[:, :-1], tokens[:, 1:])[1]

    def reference_grads():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        loss = loss_of(batches[0])
        return loss

    loss = reference_grads()
    loss.backward()
    ref_loss, ref_grads = loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters()
                                        if p.grad is not None}
    rows = []
    for mode in modes:
        model.load_state_dict(start)
        plan = _configure(mode, model, batches[0][:, :-1], max_partitions)
        loss = reference_grads()
        (plan.backward(loss) if plan else loss.backward())
        err = max([abs(loss.item() - ref_loss)] + [float((p.grad.float() - ref_grads[n]).abs().max())
                                                   for n, p in model.named_parameters() if p.grad is not None])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step(i: int, with_optimizer: bool = True) -> None:
            loss = loss_of(batches[i % len(batches)])
            plan.backward(loss) if plan else loss.backward()
            if with_optimizer:
                opt.step()
            model.zero_grad(set_to_none=True)

        row = {"mode": mode, "max_error": err, "repeat": sum(r["mode"] == mode for r in rows)}
        row["iteration_ms"] = _slowest(median_ms(step, steps, warmup, device), device)
        row["fwd_bwd_ms"] = _slowest(median_ms(lambda i: step(i, False), steps, warmup, device), device)
        if plan is not None:
            row.update(predicted_ms=plan.predicted * 1e3, baseline_predicted_ms=plan.baseline * 1e3,
                       ranges=[vars(r) for r in plan.ranges], plan=plan.summary())
            row["prediction_error"] = row["predicted_ms"] / row["fwd_bwd_ms"] - 1
        if device.type == "cuda" and profile_steps > 0:
            row["decomposition"] = profile_decomposition(lambda: step(0), profile_steps).to_dict()
        rows.append(row)
        passes.apply(model, [], None)
    base = next((r for r in rows if r["mode"] == "none"), rows[0])
    for row in rows:
        row["speedup"] = base["iteration_ms"] / row["iteration_ms"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {"meta": {"preset": preset, "gate": cfg.gate, "capacity_factor": cfg.capacity_factor, "top_k": cfg.top_k,
                       "batch_size": batch_size, "seq_len": cfg.block_size, "world_size": ctx.world_size,
                       "device": name, "torch": torch.__version__,
                       "p2p_disabled": os.environ.get("NCCL_P2P_DISABLE") == "1",
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
              "results": rows}
    if ctx.rank == 0:
        print_table(report)
        write_report(report, json_path)
    return report


def print_table(report: dict) -> None:
    meta = report["meta"]
    print(f"\nweft bench model: {meta['preset']} (gate {meta['gate']}, k{meta['top_k']}, cf {meta['capacity_factor']}), "
          f"batch {meta['batch_size']} x {meta['seq_len']} per rank, {meta['world_size']} x {meta['device']}"
          f"{', NCCL_P2P_DISABLE=1' if meta['p2p_disabled'] else ''}")
    print(f"{'mode':>10} {'iter ms':>9} {'speedup':>8} {'fwd+bwd':>9} {'predicted':>10} {'pred err':>9} "
          f"{'max err':>9} {'comm ms':>8} {'exposed':>8} {'hidden':>7}")
    for r in report["results"]:
        d = r.get("decomposition") or {}
        pred = f"{r['predicted_ms']:.2f}" if "predicted_ms" in r else ""
        perr = f"{r['prediction_error']:+.1%}" if "prediction_error" in r else ""
        hidden = "" if d.get("hidden_share") is None else f"{d['hidden_share']:.0%}"
        comm = f"{d['comm_ms']:.3f}" if d else ""
        exposed = f"{d['comm_only_ms']:.3f}" if d else ""
        print(f"{r['mode']:>10} {r['iteration_ms']:>9.2f} {r['speedup']:>7.2f}x {r['fwd_bwd_ms']:>9.2f} {pred:>10} "
              f"{perr:>9} {r['max_error']:>9.1e} {comm:>8} {exposed:>8} {hidden:>7}")
    for r in report["results"]:
        if r.get("plan"):
            print(f"\n[{r['mode']}] plan:\n{r['plan']}")
