"""Decode rows (M ≤ 16) in one launch per projection group vs two (kernels/bound.ONE_LAUNCH_MAX_ROWS), and
exllamav3 1.6.5, in one process: whole model steps as bench/model_step.py builds and times them (eager, graph,
launches, host µs per step), plus how far the one-launch outputs are from the two-launch ones per linear group.
Variants: two (two launches everywhere), one (the default: one launch where a group's work is at most
bound.ONE_LAUNCH_MAX_WORK, and MoE units projections up to bound.ONE_LAUNCH_MAX_UNITS units), units_two (MoE units
in two launches, dense as served), one_all (one launch for every group), two_again (two, re-timed: the run's drift).

    python3 -P bench/one_launch.py --models 27b,35b-a3b --rows 1,4,16 --out $OUT     # on the H200
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench's sibling modules (python -P adds no path)
from exl3_side import Exl3Side  # noqa: E402
from model_step import build, patched_step, step_fns  # noqa: E402
from step_timing import log, measure  # noqa: E402

from exl3local.kernels import bound  # noqa: E402


def two_launch(step):
    """step with every dense and MoE units projection in two launches (the input transform, then the matmul): the
    path before."""
    def swap():
        old = bound.ONE_LAUNCH_MAX_ROWS, bound.ONE_LAUNCH_MAX_UNITS
        bound.ONE_LAUNCH_MAX_ROWS, bound.ONE_LAUNCH_MAX_UNITS = 0, 0
        return lambda: (setattr(bound, "ONE_LAUNCH_MAX_ROWS", old[0]), setattr(bound, "ONE_LAUNCH_MAX_UNITS", old[1]))
    return patched_step(step, swap)


def units_two(step):
    """step with the MoE units projections in two launches, the dense ones as served (session 11's s11c code)."""
    def swap():
        old, bound.ONE_LAUNCH_MAX_UNITS = bound.ONE_LAUNCH_MAX_UNITS, 0
        return lambda: setattr(bound, "ONE_LAUNCH_MAX_UNITS", old)
    return patched_step(step, swap)


def one_all(step):
    """step with one launch for every dense projection group, whatever its size."""
    def swap():
        old, bound.ONE_LAUNCH_MAX_WORK = bound.ONE_LAUNCH_MAX_WORK, float("inf")
        return lambda: setattr(bound, "ONE_LAUNCH_MAX_WORK", old)
    return patched_step(step, swap)


def difference(layers, rows: int) -> dict:
    """Per linear group and MoE call of the first four layers: relative difference one vs two launches, bit-equal?"""
    gen = torch.Generator(device="cuda").manual_seed(5)
    out = {}
    for ops in layers[:4]:
        for kind, obj, _ in ops:
            if kind == "linear":
                x = torch.randn(rows, obj.k, generator=gen, device="cuda").half()
                run = lambda obj=obj, x=x: obj.ours(x)  # noqa: E731
                name = f"{len(obj.parts)}x{obj.k}->{sum(obj.parts)}"
            else:
                x = torch.randn(rows, obj.hidden, generator=gen, device="cuda").half()
                scores = torch.randn(rows, obj.experts, generator=gen, device="cuda")
                w, ids = torch.topk(torch.softmax(scores, -1), obj.top_k, dim=-1)
                run = lambda obj=obj, x=x, w=w, ids=ids: obj.run(x, w, ids)  # noqa: E731
                name = "moe"
            one = run().double()
            old = bound.ONE_LAUNCH_MAX_ROWS, bound.ONE_LAUNCH_MAX_UNITS
            bound.ONE_LAUNCH_MAX_ROWS, bound.ONE_LAUNCH_MAX_UNITS = 0, 0
            two = run().double()
            bound.ONE_LAUNCH_MAX_ROWS, bound.ONE_LAUNCH_MAX_UNITS = old
            out[name] = [round(((one - two).norm() / two.norm()).item(), 9), bool(torch.equal(one, two))]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="27b,35b-a3b")
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--no-exl3", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--tag", default="one_launch")
    args = parser.parse_args()
    exl3 = None if args.no_exl3 else Exl3Side()
    results = []
    try:
        built = {name: build(name, 4, "mul1", exl3) for name in args.models.split(",")}
        for rows in [int(r) for r in args.rows.split(",")]:
            for name, (cfg, layers) in built.items():
                ours, theirs, _ = step_fns(cfg, layers, rows)
                row = dict(model=name, rows=rows, difference=difference(layers, rows))
                row["two"] = measure(two_launch(ours), rows, True)
                row["one"] = measure(ours, rows, True)
                if "experts" in cfg:
                    row["units_two"] = measure(units_two(ours), rows, True)
                if any(launch.n_blocks * launch.size_k > bound.ONE_LAUNCH_MAX_WORK for ops in layers
                       for kind, obj, _ in ops if kind == "linear" for launch, _, _ in obj.ours.launches):
                    row["one_all"] = measure(one_all(ours), rows, True)  # else the same as "one"
                row["two_again"] = measure(two_launch(ours), rows, True)
                if exl3 is not None and exl3.error is None:
                    row["exl3"] = measure(theirs, rows, True)
                results.append(row)
                log(json.dumps(row))
    finally:
        with open(os.path.join(args.out, f"{args.tag}.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
