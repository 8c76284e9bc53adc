"""Decode rows (M ≤ 16) in one launch per projection group vs two (fused_launch.ONE_LAUNCH_MAX_ROWS), and
exllamav3 1.6.5, in one process: whole model steps as bench/model_step.py builds and times them (eager, graph,
launches, host µs per step), plus how far the one-launch outputs are from the two-launch ones per linear group.
Variants: two (two launches everywhere), one (the default: one launch where a group's work is at most
fused_launch.ONE_LAUNCH_MAX_WORK, and MoE units projections up to fused_launch.ONE_LAUNCH_MAX_UNITS units), units_two
(MoE units in two launches, dense as served), one_all (one launch for every group), two_again (two, re-timed: the
run's drift).
--variants S:L[:E[:D[:F[:R[:P[:X[:G]]]]]]],..: instead of two/units_two/one_all, the served code with
triton_gemv.MIN_STEPS_PER_SPLIT = S (each split-K split keeps at least S K steps), SL = L on every launch (split
partials loaded per step of the finishing sum; 0: triton_fused.split_loads by each launch's split count, as served),
the MoE projections' splits times 2**E (the linears' 2**D), F = 0 the decode matmul's weight operand in ring order
where the fragment order serves (1: as served, fused_launch.fragment_order), R > 0 a register cap (CUDA maxnreg) on
every decode matmul launch (0: as built; -1: as built without the cap by grid size, fused_launch.WAVE_MAX_REGISTERS) and
P > 0 software-pipeline stages (Triton's cp.async of the next steps' trellis words into shared memory; 0: as built,
one), X = 1 / -1 the words loaded one K step ahead in registers or not (triton_ring_dot.ring_dot PF, fragment order
only; 0: as built), G > 0 programs per SM that the grouped launches' split-K aims for over a wave
(bound_group.GROUP_PROGRAMS_PER_CORE; 0: as served), then the served values re-timed (again); and per projection
group (every layer's calls of one name: in_proj_qkvz, ..., experts = the MoE call) graph µs of each variant and of
exllamav3, with the splits each chose.

    python3 -P bench/one_launch.py --models 27b,35b-a3b --rows 1,4,16 --out $OUT     # on the H200
    python3 -P bench/one_launch.py --variants 1:1,1:4,8:1 --rows 4,1,16 --out $OUT    # split-K A/B + groups
    python3 -P bench/one_launch.py --variants 8:0:0:0:0,8:0:0:0:1:-1 --out $OUT      # operand order, register caps
    python3 -P bench/one_launch.py --variants 8:0:0:0:1:0:2,8:0:0:0:1:0:3 --out $OUT  # words pipelined 2 / 3 stages
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench's sibling modules (python -P adds no path)
from exl3_side import Exl3Side  # noqa: E402
from model_build import build, layer_ops  # noqa: E402
from model_step import patched_step, runner, step_fns  # noqa: E402
from step_timing import graph_us, log, measure  # noqa: E402

from exl3local.kernels import bound_group, fused_launch, triton_gemv  # noqa: E402
from exl3local.kernels.launcher import DirectLaunch  # noqa: E402
from exl3local.kernels.triton_fused import exl3_fused_kernel  # noqa: E402


def two_launch(step):
    """step with every dense and MoE units projection in two launches (the input transform, then the matmul): the
    path before."""
    def swap():
        old = fused_launch.ONE_LAUNCH_MAX_ROWS, fused_launch.ONE_LAUNCH_MAX_UNITS
        fused_launch.ONE_LAUNCH_MAX_ROWS, fused_launch.ONE_LAUNCH_MAX_UNITS = 0, 0
        return lambda: (setattr(fused_launch, "ONE_LAUNCH_MAX_ROWS", old[0]),
                        setattr(fused_launch, "ONE_LAUNCH_MAX_UNITS", old[1]))
    return patched_step(step, swap)


def units_two(step):
    """step with the MoE units projections in two launches, the dense ones as served (session 11's s11c code)."""
    def swap():
        old, fused_launch.ONE_LAUNCH_MAX_UNITS = fused_launch.ONE_LAUNCH_MAX_UNITS, 0
        return lambda: setattr(fused_launch, "ONE_LAUNCH_MAX_UNITS", old)
    return patched_step(step, swap)


def one_all(step):
    """step with one launch for every dense projection group, whatever its size."""
    def swap():
        old, fused_launch.ONE_LAUNCH_MAX_WORK = fused_launch.ONE_LAUNCH_MAX_WORK, float("inf")
        return lambda: setattr(fused_launch, "ONE_LAUNCH_MAX_WORK", old)
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
            old = fused_launch.ONE_LAUNCH_MAX_ROWS, fused_launch.ONE_LAUNCH_MAX_UNITS
            fused_launch.ONE_LAUNCH_MAX_ROWS, fused_launch.ONE_LAUNCH_MAX_UNITS = 0, 0
            two = run().double()
            fused_launch.ONE_LAUNCH_MAX_ROWS, fused_launch.ONE_LAUNCH_MAX_UNITS = old
            out[name] = [round(((one - two).norm() / two.norm()).item(), 9), bool(torch.equal(one, two))]
    return out


SHIFTS = [0, 0]  # the MoE and the dense launches' split scales (powers of two) configure() set last
KNOBS = [1, 0, 0, 0, 0]  # operand order (1: as served), register cap, stages, prefetch, group split target, set last
GROUP_PER_CORE = bound_group.GROUP_PROGRAMS_PER_CORE  # as served
BUILT: dict[int, tuple] = {}  # id(launch) -> its decode matmul launches, FRAG, wave cap and PF as built


def op_launches(kind: str, obj) -> list:
    """One op's bound launches: a linear's group or parts, an MoE layer's two projections."""
    return [launch for launch, _, _ in obj.ours.launches] if kind == "linear" else obj.ours.bound


def launches_of(layers):
    """Every bound launch of the model."""
    for ops in layers:
        for kind, obj, _ in ops:
            yield from op_launches(kind, obj)


def operand(launch, frag: int, cap: int, stages: int = 0, pf: int = 0) -> None:
    """launch's decode matmul with its weight operand in ring order if frag is 0 (as built if 1; 2 / 4: the fragment
    order for that dot operand width where built in fragment order, triton_decode.FRAGMENT_KWIDTH), with the words
    loaded one K step ahead (triton_ring_dot.ring_dot's PF, fragment order only) as built if pf is 0, on if 1, off if
    -1, under a register
    cap of `cap` (CUDA maxnreg) on every grid if cap > 0, as built if 0, as built but with no cap by grid size
    (fused_launch.WAVE_MAX_REGISTERS) if -1; compiled with `stages` software-pipeline stages if > 0 (Triton's cp.async
    of the next steps' loads into shared memory; as built, 1, if 0)."""
    fused, one, frag_built, wave_cap, pf_built = BUILT.setdefault(id(launch), (
        launch.fused, launch.one, launch.fused_fixed["FRAG"], launch.wave_cap, launch.fused_fixed["PF"]))
    launch.fused_fixed["FRAG"] = (frag if frag > 1 else frag_built) if frag_built and frag else 0
    launch.fused_fixed["PF"] = launch.fused_fixed["FRAG"] > 0 and (pf > 0 if pf else pf_built)
    launch.fused, launch.one = fused, one
    launch.wave_cap = wave_cap if cap == 0 else None
    changed = dict({"maxnreg": cap} if cap > 0 else {}, **({"num_stages": stages} if stages else {}))
    if changed:
        launch.fused = DirectLaunch(exl3_fused_kernel, fused.varying, fused.hooks is None,
                                    **dict(fused.options, **changed))
        launch.one = DirectLaunch(exl3_fused_kernel, one.varying, one.hooks is None, **dict(one.options, **changed))


def configure(layers, steps: int, loads: int, moe_shift: int = 0, dense_shift: int = 0, frag: int = 1,
              cap: int = 0, stages: int = 0, pf: int = 0, group_per_core: float = 0) -> tuple[int, ...]:
    """Set triton_gemv.MIN_STEPS_PER_SPLIT and every launch's SL (partials loaded per step of the split-K sum; 0: by
    split count), scale the MoE projections' splits by 2**moe_shift and the linears' by 2**dense_shift (as far as
    the K steps divide), set the operand order, register cap and stages (operand()), and forget every launch's splits
    and plans (chosen again on the next call, outside any timing: measure and graph_us warm up first), with the grouped
    launches' split-K target group_per_core (0: as served). Returns the values it replaced."""
    old = triton_gemv.MIN_STEPS_PER_SPLIT, next(launches_of(layers)).loads or 0, *SHIFTS, *KNOBS
    triton_gemv.MIN_STEPS_PER_SPLIT = steps
    bound_group.GROUP_PROGRAMS_PER_CORE = group_per_core or GROUP_PER_CORE
    for ops in layers:
        for kind, obj, _ in ops:
            shift = moe_shift if kind == "moe" else dense_shift
            for launch in op_launches(kind, obj):
                launch.loads = loads or None
                launch.splits.clear()
                operand(launch, frag, cap, stages, pf)
                launch.replan()
                launch.__dict__.pop("split_for", None)
                if shift:
                    launch.split_for = shifted_splits(launch, shift)
    SHIFTS[:] = moe_shift, dense_shift
    KNOBS[:] = frag, cap, stages, pf, group_per_core
    return old


def shifted_splits(launch, shift: int):
    """launch's split_for with its split count times 2**shift (at least 1, dividing its K steps)."""
    def split_for(m_blocks: int) -> tuple[int, int]:
        splits = type(launch).split_for(launch, m_blocks)[0]
        splits = max(1, splits << shift if shift > 0 else splits >> -shift)
        while launch.k_steps % splits:
            splits //= 2
        return splits, launch.k_steps // splits
    return split_for


def splits_chosen(cfg, layers) -> dict:
    """{group name: {row blocks (units): splits}} of the first layer holding each name, as the last calls chose."""
    out = {}
    for i, ops in enumerate(layers):
        for (kind, obj, _), op in zip(ops, layer_ops(cfg, i)):
            out.setdefault(op[1], [{m: launch.split_for(m)[0] for m in launch.splits}
                                   for launch in op_launches(kind, obj)])
    return out


def by_group(cfg, layers, step) -> dict:
    """{group name: a runner of every layer's calls of that name}, from a step runner's ops (layer order)."""
    names = [op[1] for i in range(len(layers)) for op in layer_ops(cfg, i)]
    return {name: runner([fn for fn, n in zip(step.ops, names) if n == name]) for name in dict.fromkeys(names)}


def variants_ab(cfg, layers, rows: int, variants: list[tuple[int, ...]], exl3_ok: bool) -> dict:
    """Whole steps and per-group graph µs at each (split floor, split loads[, MoE split shift[, dense split shift[,
    operand order[, register cap[, stages]]]]]) variant, the served one first and again last; exllamav3 per group."""
    ours, theirs, _ = step_fns(cfg, layers, rows)
    served = triton_gemv.MIN_STEPS_PER_SPLIT, 0, 0, 0, 1, 0, 0, 0, 0
    row, groups, chosen = {}, {}, {}
    names = ("m{}", "_l{}", "_e{:+d}", "_d{:+d}", "_f{}", "_r{:d}", "_s{}", "_p{}", "_g{}")
    tags = [(f"served_m{served[0]}_l{served[1]}", served)] + [
        ("".join(name.format(value) for name, value in zip(names, v)), (*v, *served[len(v):])) for v in variants]
    for tag, knobs in tags + [("again", served)]:
        old = configure(layers, *knobs)
        try:
            ours()
            chosen[tag] = splits_chosen(cfg, layers)
            if tag not in (tags[0][0], "again") and knobs[1] == served[1] and knobs[4:] == served[4:] \
                    and chosen[tag] == chosen[tags[0][0]]:
                row[tag] = "the served launches"  # the same splits and loads: nothing to time
                continue
            row[tag] = measure(ours, rows, True)
            for name, fn in by_group(cfg, layers, ours).items():
                groups.setdefault(name, {})[tag] = round(graph_us(fn), 1)
        finally:
            configure(layers, *old)
    if exl3_ok:
        for name, fn in by_group(cfg, layers, theirs).items():
            groups[name]["exl3"] = round(graph_us(fn), 1)
    row["groups"], row["splits"] = groups, chosen
    return row


def report(row: dict) -> None:
    """The split-floor A/B of one (model, rows) as a table: step eager / graph ms per variant, group graph µs."""
    tags = [t for t, d in row.items() if t != "exl3" and isinstance(d, dict) and "eager_us" in d]
    exl3 = row.get("exl3", {})
    log(f"== {row['model']} M={row['rows']}: step eager / graph ms (ratio exl3/ours graph) ==")
    for tag in tags:
        d = row[tag]
        ratio = f"{exl3['graph_us'] / d['graph_us']:.3f}" if "graph_us" in exl3 and "graph_us" in d else "-"
        log(f"  {tag:12s} {d['eager_us'] / 1e3:7.2f} / {d.get('graph_us', float('nan')) / 1e3:6.2f}  ({ratio})  "
            f"launches {d.get('launches')}")
    if exl3:
        log(f"  {'exl3':12s} {exl3['eager_us'] / 1e3:7.2f} / {exl3.get('graph_us', float('nan')) / 1e3:6.2f}")
    cols = tags + (["exl3"] if any("exl3" in g for g in row["groups"].values()) else [])
    log("  group µs/step: " + " ".join(f"{c:>10s}" for c in cols))
    for name, g in row["groups"].items():
        log(f"  {name:14s} " + " ".join(f"{g.get(c, float('nan')):10.1f}" for c in cols))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="27b,35b-a3b")
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--no-exl3", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--tag", default="one_launch")
    parser.add_argument("--deadline", type=float, default=0, help="epoch seconds after which cells are skipped")
    parser.add_argument("--group-max-blocks", type=int, default=0, help="bound_group.GROUP_MAX_BLOCKS for the build "
                        "(0: as served; 512: 27B gate_up as one grid)")
    parser.add_argument("--variants", default="", help="STEPS:LOADS[:SHIFT[:DENSE[:FRAG[:CAP[:STAGES[:PF[:G]]]]]]],..:"
                        " split floors, split loads, MoE splits x 2**SHIFT, linears' splits x 2**DENSE, operand order "
                        "(0: ring, 1: served, 2/4: fragment order of that kWidth), register cap, pipeline stages, words "
                        "one step ahead (1 on, -1 off), grouped launches' programs per SM, A/B against the served "
                        "(8:4,8:0:0:0:0,8:0:0:0:1:0:2,8:0:0:0:1:0:0:-1)")
    args = parser.parse_args()
    exl3 = None if args.no_exl3 else Exl3Side()
    if args.group_max_blocks:
        bound_group.GROUP_MAX_BLOCKS = args.group_max_blocks
    results = []
    try:
        built = {name: build(name, 4, "mul1", exl3) for name in args.models.split(",")}
        for rows in [int(r) for r in args.rows.split(",")]:
            for name, (cfg, layers) in built.items():
                if args.deadline and time.time() > args.deadline:
                    log(f"(skipping {name} M={rows}: past the deadline)")
                    continue
                ours, theirs, _ = step_fns(cfg, layers, rows)
                if args.variants:
                    row = dict(model=name, rows=rows, **variants_ab(
                        cfg, layers, rows, [tuple(float(k) if "." in k else int(k) for k in v.split(":"))
                                            for v in args.variants.split(",")],
                        exl3 is not None and exl3.error is None))
                    if exl3 is not None and exl3.error is None:
                        row["exl3"] = measure(theirs, rows, True)
                    results.append(row)
                    log(json.dumps(row))
                    report(row)
                    continue
                row = dict(model=name, rows=rows, difference=difference(layers, rows))
                row["two"] = measure(two_launch(ours), rows, True)
                row["one"] = measure(ours, rows, True)
                if "experts" in cfg:
                    row["units_two"] = measure(units_two(ours), rows, True)
                if any(launch.n_blocks * launch.size_k > fused_launch.ONE_LAUNCH_MAX_WORK for ops in layers
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
