"""Which GPU kernels `weft bench layer --breakdown` put in a stage, and through which ops: for a
Chrome trace written by `weft bench layer --trace DIR`, every kernel attributed to STAGE (forward
or backward, as `weft.bench.breakdown` attributes it), with its launching op and the autograd
node around that op, summed per (direction, node, op, kernel).
    python3 scripts/stage_kernels.py TRACE.json STAGE [STAGE ...]"""
import argparse
import json
from collections import defaultdict

from weft.bench.breakdown import BACKWARD_PREFIX, GPU_CATEGORIES, _op_contexts, kernel_label


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("stages", nargs="+")
    args = parser.parse_args()
    events = [e for e in json.load(open(args.trace)).get("traceEvents", []) if e.get("ph") == "X"]
    contexts, _ = _op_contexts(events)
    ops = {}  # External id -> (op name, innermost backward node around it)
    nodes = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e.get("tid"), e["name"])
                   for e in events if e.get("name", "").startswith(BACKWARD_PREFIX))
    for e in events:
        eid = e.get("args", {}).get("External id")
        if e.get("cat") == "cpu_op" and eid is not None:
            ts = float(e["ts"])
            around = [n for n in nodes if n[2] == e.get("tid") and n[0] <= ts < n[1]]
            ops[eid] = (e["name"], around[-1][3][len(BACKWARD_PREFIX):] if around else "-")
    total = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("cat") not in GPU_CATEGORIES:
            continue
        eid = e.get("args", {}).get("External id")
        stage, backward = contexts.get(eid, ("other", False))
        if stage in args.stages:
            op, node = ops.get(eid, ("?", "-"))
            key = (stage, "bwd" if backward else "fwd", node, op, kernel_label(e.get("name", ""), 60))
            total[key][0] += float(e.get("dur", 0)) * 1e-3
            total[key][1] += 1
    for (stage, direction, node, op, kernel), (ms, n) in sorted(total.items(), key=lambda kv: -kv[1][0]):
        print(f"{stage:10s} {direction} {ms:8.3f} ms {n:4d}x  {node:28s} {op:28s} {kernel}")


if __name__ == "__main__":
    main()
