"""How long a checkpoint holds the training thread, written in the step against in the background
(`weft.train.checkpoint.CheckpointWriter`), one process: a preset's model with AdamW state, saved
`--rounds` times each way, interleaved; prints a table (and `--json` writes it). On a GPU the state
is moved there first, so the background save's stall is the copy to host memory.

    python scripts/checkpoint_stall.py --preset gpt2-s [--device cuda] [--json stall.json]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from weft.distributed import build_moe_groups
from weft.jsonfile import write_json
from weft.models.gpt import GPT
from weft.models.presets import get_preset
from weft.train.checkpoint import CheckpointWriter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2-s")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None, help="folder for the checkpoints (default: a temporary one)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = GPT(get_preset(args.preset)).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # the moments exist, as in training
    groups = build_moe_groups()
    params = sum(p.numel() for p in model.parameters())
    root = Path(args.out or tempfile.mkdtemp(prefix="weft_stall_"))
    times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for _ in range(args.rounds):
        for background in (False, True):
            run_dir = root / f"background_{background}"
            shutil.rmtree(run_dir, ignore_errors=True)
            writer = CheckpointWriter(run_dir, background=background)
            start = time.perf_counter()
            writer.save(1, model, optimizer, groups, {})
            returned = time.perf_counter()
            writer.wait()
            times[background].append((returned - start, time.perf_counter() - start))
    size = sum(f.stat().st_size for f in (root / "background_True" / "checkpoints" / "step_1").iterdir())
    shutil.rmtree(root, ignore_errors=True)
    rows = [{"mode": "background" if background else "in the step",
             "stall_s": statistics.median(t[0] for t in times[background]),
             "written_s": statistics.median(t[1] for t in times[background]),
             "samples": times[background]} for background in (False, True)]
    print(f"{args.preset}: {params / 1e6:.0f}M parameters with AdamW state, {size / 2**30:.2f} GiB on disk, "
          f"{args.device}, medians of {args.rounds}")
    print(f"{'checkpoint':>12} {'stall s':>8} {'written s':>10}")
    for row in rows:
        print(f"{row['mode']:>12} {row['stall_s']:>8.2f} {row['written_s']:>10.2f}")
    if args.json:
        write_json(args.json, {"preset": args.preset, "device": args.device, "params": params, "bytes": size,
                               "rows": rows})


if __name__ == "__main__":
    main()
