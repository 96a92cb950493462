"""The bytes of the MoE layer's all-to-alls with a2a_algo "linear" and "dedup" (weft.moe.dedup),
counted on the CPU: each config's router (its experts and top-k, a fresh router as `weft bench
layer` uses, or routing skewed by `--skew`) on its tokens per rank, the rows every all-to-all of
a forward and backward sends recorded on gloo processes, then priced at the config's width in
bf16. Rows depend only on the routing, so the experts run at a small width here. Prints a table,
writes JSON.

    python scripts/dedup_bytes.py --ranks 2 --json dedup_bytes.json
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from weft import MoE
from weft.bench.layer import CONFIGS, zipf_shift
from weft.jsonfile import write_json
from weft.testing import run_distributed

WIDTH = 128  # the experts' width here (>= E, for the skew's shift); rows are priced at the config's dim


def count_rows(name: str, capacity: float | None, algo: str, skew: float) -> tuple[int, int]:
    """Rows this rank sends in the row all-to-alls of one forward and backward (summed): all of
    them, and those that leave the rank (the rest is a local copy)."""
    cfg = CONFIGS[name]
    rank = dist.get_rank()
    torch.manual_seed(0)
    moe = MoE(WIDTH, WIDTH, cfg.num_experts, top_k=cfg.top_k, capacity_factor=capacity, activation="relu",
              a2a_algo=algo)
    x = torch.randn(cfg.tokens_per_rank, WIDTH, generator=torch.Generator().manual_seed(rank))
    if skew:  # every input shifted so that the router prefers a fixed ranking, as `weft bench layer --skew`
        x = x + zipf_shift(moe.router.weight.detach(), skew)
    sent, away, exchange = [], [], dist.all_to_all_single

    def recording(out, inp, out_splits=None, in_splits=None, *args, **kwargs):
        if inp.is_floating_point() and inp.dim() == 2 and inp.shape[1] == WIDTH:
            sent.append(inp.shape[0])
            away.append(inp.shape[0] - (in_splits[rank] if in_splits else inp.shape[0] // dist.get_world_size()))
        return exchange(out, inp, out_splits, in_splits, *args, **kwargs)

    dist.all_to_all_single = recording
    try:
        moe(x.requires_grad_()).sum().backward()
    finally:
        dist.all_to_all_single = exchange
    return sum(sent), sum(away)


def worker(configs: list[str], skew: float, capacities: list[float | None]) -> list[dict]:
    rows = []
    for name in configs:
        for capacity in capacities:
            counts = [n for algo in ("linear", "dedup") for n in count_rows(name, capacity, algo, skew)]
            total = torch.tensor(counts, dtype=torch.float64)
            dist.all_reduce(total)
            mib = (total / dist.get_world_size() * CONFIGS[name].dim * 2 / 2**20).tolist()
            rows.append({"config": name, "capacity_factor": capacity, "skew": skew,
                         "linear_mib_per_rank": mib[0], "linear_wire_mib_per_rank": mib[1],
                         "dedup_mib_per_rank": mib[2], "dedup_wire_mib_per_rank": mib[3]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--configs", default="qwen2,phi35,mixtral")
    parser.add_argument("--skew", type=float, default=0.0, help="Zipf skew of the routing (0: a fresh router)")
    parser.add_argument("--capacity", default="1.0,dropless", help="comma-separated capacity factors, 'dropless'")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    capacities = [None if c == "dropless" else float(c) for c in args.capacity.split(",")]
    rows = run_distributed(worker, args.ranks, args=(args.configs.split(","), args.skew, capacities), timeout=1800)[0]
    print(f"all-to-all MiB per rank, one forward + backward, bf16 rows, {args.ranks} ranks, skew {args.skew}")
    print("(all: every row of the all-to-alls; wire: those that leave the rank)")
    print(f"{'config':>8} {'capacity':>9} {'linear':>9} {'dedup':>9} {'fewer':>6} {'wire lin':>9} {'wire dd':>9} "
          f"{'fewer':>6}")
    for r in rows:
        cap = "dropless" if r["capacity_factor"] is None else r["capacity_factor"]
        lin, dd = r["linear_mib_per_rank"], r["dedup_mib_per_rank"]
        wire_lin, wire_dd = r["linear_wire_mib_per_rank"], r["dedup_wire_mib_per_rank"]
        print(f"{r['config']:>8} {cap:>9} {lin:9.1f} {dd:9.1f} {lin / dd:5.2f}x {wire_lin:9.1f} {wire_dd:9.1f} "
              f"{wire_lin / wire_dd:5.2f}x")
    if args.json:
        write_json(args.json, {"ranks": args.ranks, "results": rows})


if __name__ == "__main__":
    main()
