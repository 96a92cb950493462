"""`weft` with `weft.moe.dedup.OWN_SHARE_IN_OWN_BACKWARD` set from OWN_SHARE ("own": the library's
choice, the own pairs' backward computes their share of each weight gradient; "tap": their rows
kept for the tap's one product, no weight-sized add), to time the two forms of dedup-fixed-own
against each other on GPUs:

    OWN_SHARE=tap torchrun --standalone --nproc_per_node=2 scripts/own_share_probe.py bench layer \\
        --config phi35 --capacity dropless --modes plain,dedup-fixed-own+graph,plain,dedup-fixed-own+graph

Run it under torchrun, so that every rank runs this script and gets the setting: `weft bench
layer --nproc` starts fresh processes, which would not. Both forms compute the same function
(`tests/test_moe_equivalence.py::test_own_pairs_apart_with_their_share_in_the_tap_matches_dense_reference`;
their order of work: `tests/test_moe_dedup.py`).
"""
from __future__ import annotations

import os

from weft.cli import main
from weft.moe import dedup

if __name__ == "__main__":
    choice = os.environ.get("OWN_SHARE", "own")
    if choice not in ("own", "tap"):
        raise SystemExit(f"OWN_SHARE must be 'own' or 'tap', got {choice!r}")
    dedup.OWN_SHARE_IN_OWN_BACKWARD = choice == "own"
    main()
