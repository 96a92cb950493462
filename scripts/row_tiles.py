"""GPU timing of the row kernels of dispatch and combine (weft.kernels.rows) at several program
tiles (BLOCK_R, BLOCK_D), for the layer configs' shapes: the dispatch's gather (slot rows by
token), the combine's gate-weighted sum (also keeping the rows it reads), the combine backward's
scaled gather and gate-gradient dots, and the dispatch backward's plain sum. Each call is timed by
`triton.testing.do_bench` (median, L2 flushed between calls), the tiles interleaved and the whole
round run twice (the noise; --rounds). Every tile's output is checked equal to the first tile's
(the dots' to rounding). Prints a table of microseconds and GB/s and writes rows to
$OUT/row_tiles.json when OUT is set.
    python3 scripts/row_tiles.py [--tiles 1,512 4,512 ...]
"""
from __future__ import annotations

import argparse
import os

import torch
import triton.testing

from weft.jsonfile import write_json
from weft.kernels import rows as R

# (T tokens per GPU, D, k): the slot rows are T * k at capacity factor 1.0
SHAPES = {"qwen2": (4096, 2048, 4), "phi35": (4096, 4096, 2), "mixtral": (4096, 4096, 2),
          "gpt2-s-moe": (8192, 768, 1), "gpt2-l-moe": (8192, 1024, 1)}  # the presets at batch 8
DEFAULT_TILES = ("1,512", "2,512", "4,512", "8,512", "2,1024", "4,1024", "8,256", "16,256")


def cases(T: int, D: int, k: int, gen: torch.Generator) -> dict:
    """The six calls of one layer's dispatch and combine, each a (bytes moved, fn(tile)) pair."""
    dev, bf16 = "cuda", torch.bfloat16
    x_TD = torch.randn(T, D, device=dev, dtype=bf16, generator=gen)
    slot_of_row_R = torch.randperm(T * k, device=dev, generator=gen)  # the experts' rows in slot order
    slot_of_row_R[torch.rand(T * k, device=dev, generator=gen) < 0.05] = -1  # 5% empty rows
    rows_TK = torch.full((T * k,), -1, dtype=torch.long, device=dev)
    used = slot_of_row_R >= 0
    rows_TK[slot_of_row_R[used]] = torch.arange(T * k, device=dev)[used]
    rows_TK = rows_TK.view(T, k)
    out_RD = torch.randn(T * k, D, device=dev, dtype=bf16, generator=gen)
    kept_RD = torch.empty_like(out_RD)
    gates_TK = torch.rand(T, k, device=dev, generator=gen)
    row_bytes, slots = D * 2, T * k
    return {
        "dispatch gather": (2 * slots * row_bytes,
                            lambda tile: R.gather_rows(x_TD, slot_of_row_R, divisor=k, tile=tile)),
        "combine sum": (slots * row_bytes + T * row_bytes,
                        lambda tile: R.weighted_row_sum(out_RD, rows_TK, gates_TK, bf16, tile=tile)),
        "combine sum, keeping": (2 * slots * row_bytes + T * row_bytes,
                                 lambda tile: R.weighted_row_sum(out_RD, rows_TK, gates_TK, bf16, kept_RD, tile=tile)),
        "combine bwd gather": (2 * slots * row_bytes,
                               lambda tile: R.gather_rows(x_TD, slot_of_row_R, gates_TK.view(-1), bf16, divisor=k,
                                                          tile=tile)),
        "combine bwd dots": (slots * row_bytes + T * row_bytes,
                             lambda tile: R.row_dots(x_TD, out_RD, rows_TK, tile=tile)),
        "dispatch bwd sum": (slots * row_bytes + T * row_bytes,
                             lambda tile: R.weighted_row_sum(out_RD, rows_TK, None, bf16, tile=tile)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiles", nargs="+", default=list(DEFAULT_TILES), help="BLOCK_R,BLOCK_D pairs")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES)[:3], choices=list(SHAPES))
    parser.add_argument("--calls", nargs="+", help="only these calls (names as printed)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (two or more: the noise)")
    args = parser.parse_args()
    tiles = [tuple(int(v) for v in t.split(",")) for t in args.tiles]
    results = []
    for name in args.shapes:
        T, D, k = SHAPES[name]
        gen = torch.Generator("cuda").manual_seed(0)
        for call, (moved, fn) in cases(T, D, k, gen).items():
            if args.calls and call not in args.calls:
                continue
            first = fn(tiles[0])
            for tile in tiles:  # the dots' sums over column blocks depend on BLOCK_D: equal to rounding
                got = fn(tile)
                if not (torch.equal(got, first) or call.endswith("dots") and torch.allclose(got, first, 1e-4, 1e-3)):
                    raise SystemExit(f"{name} {call}: tile {tile} differs from tile {tiles[0]}")
            default = R.row_tile(D, triton.next_power_of_2(k) if call.endswith("dots") else 1)
            times = {tile: [] for tile in tiles}
            for _ in range(args.rounds):  # interleaved rounds: the later ones measure the noise
                for tile in tiles:
                    times[tile].append(triton.testing.do_bench(lambda: fn(tile), return_mode="median") * 1e3)
            for tile in tiles:
                us = times[tile]
                results.append(dict(shape=name, T=T, D=D, k=k, call=call, tile=list(tile), default=tile == default,
                                    us=us, gbps=moved / (min(us) * 1e-6) / 1e9))
                print(f"| {name} | {call} | {tile[0]}x{tile[1]}{' (default)' if tile == default else ''} | "
                      f"{' / '.join(f'{u:.1f}' for u in us)} | {results[-1]['gbps']:.0f} |", flush=True)
    if os.environ.get("OUT"):
        write_json(os.path.join(os.environ["OUT"], "row_tiles.json"), results)


if __name__ == "__main__":
    main()
