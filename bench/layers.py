"""One linear layer at a time, each distinct linear group of the model-step shapes (bench/model_step.py), same
tensors on every side, µs per call (eager wall clock over back-to-back calls; CUDA-graph replay):

    tiled   more than 16 rows: the tiled path (64-row tiles decoded on chip, EXL3LOCAL_TILED_MAX_ROWS) vs the
            reconstruct path (W_r rebuilt in fp16 per call + matmul: the default above 16 rows) vs exllamav3's
            LinearEXL3 per part; at --sweep-rows every split-K count of the tiled path; agreement of the paths
    groups  one GroupLaunch per fused layer vs a launch pair per part (issue 21 item 5; M = 1, 4, 16)
    flat    the decode-in-registers path (M = 1, 16) with the trellis words loaded through flat indices (lane-linear
            at every rate, the default) vs as [KT, BNT, 32/G] tensors (the compiler's choice of lanes), graph µs
    host    above 16 rows: the reconstruct path's launches bound per part vs each part's kernel apply, host µs per
            call (GPU kept busy) and eager µs per call, per linear group of both models
    config  the decode path at M = 1, 4 per 27B linear group with other (KT, warps, register cap) than the served
            ones (issue 21 item 2: occupancy and instructions per weight), graph µs and error vs the served config

    python3 -P bench/layers.py tiled --out $OUT        # on the H200 (bench/model-step-device.sh)
    python3 -P bench/layers.py groups --out $OUT
    python3 -P bench/layers.py flat --bits 3 --out $OUT
    python3 -P bench/layers.py config --rows 1,4 --out $OUT
    python3 -P bench/layers.py host --rows 64,32 --out $OUT
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
from kernels_common import host_us  # noqa: E402
from model_build import MODELS, Linear, layer_ops, with_tiled_rows  # noqa: E402
from step_timing import DEVICE, eager_us, graph_us, log  # noqa: E402

from exl3local.kernels.bound import BoundLinear  # noqa: E402

TILED_ROWS = (32, 64, 128, 256)
SWEEP_SPLITS = (1, 2, 4, 8)


def linear_groups(models, fused_only: bool = False) -> dict[tuple[int, tuple[int, ...]], str]:
    """{(k, out features per part): 'model layer name'} over the first GDN and attention layer of each model."""
    shapes = {}
    for name in models:
        for i in (0, MODELS[name]["interval"] - 1):
            for op in layer_ops(MODELS[name], i):
                if op[0] == "linear" and (len(op[3]) > 1 or not fused_only):
                    shapes.setdefault((op[2], tuple(op[3])), f"{name} {op[1]}")
    return shapes


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return round(((a - b).norm() / b.norm()).item(), 8)


def sweep_splits(layer: BoundLinear, x: torch.Tensor) -> dict[str, float]:
    """Graph µs of the tiled layer at x's rows with each split count forced on every launch (the automatic
    choice restored afterwards)."""
    out = {}
    m_blocks = -(-x.shape[0] // 64)
    launches = [launch for launch, _, _ in layer.launches]
    for splits in SWEEP_SPLITS:
        if any(launch.tiled_fixed["k_steps"] % splits for launch in launches):
            continue
        for launch in launches:
            launch.tiled_splits[m_blocks] = (splits, launch.tiled_fixed["k_steps"] // splits)
            launch.replan()
        out[str(splits)] = graph_us(lambda: layer(x), reps=50)
    for launch in launches:
        launch.tiled_splits.pop(m_blocks)
        launch.replan()
    return out


def bench_tiled(rows_list, bits: float, codebook: str, exl3: Exl3Side | None, sweep_rows: int = 64,
                deadline: float = 0) -> list[dict]:
    gen = torch.Generator(device=DEVICE[0]).manual_seed(5)
    out = []
    for (k, parts), label in linear_groups(("27b", "35b-a3b")).items():
        if deadline and time.time() > deadline:
            log(f"(skipping {label} and later groups: past the deadline)")
            break
        lin = Linear(gen, k, list(parts), bits, codebook)
        tiled = with_tiled_rows(max(rows_list), lambda: BoundLinear(lin.ours.parts, k))
        tiled.reserve()
        theirs = exl3.bind_linear(lin, codebook) if exl3 is not None else None
        for rows in rows_list:
            x = torch.randn(rows, k, generator=gen, device=DEVICE[0]).half()
            row = dict(kind="tiled", shape=label, k=k, parts=list(parts), rows=rows,
                       splits=[launch.tiled_grid(rows)[1] for launch, _, _ in tiled.launches])
            calls = {"tiled": lambda: tiled(x), "reconstruct": lambda: lin.ours(x)}
            if theirs is not None:
                calls["exl3"] = lambda: theirs(x)
            for tag, fn in calls.items():
                row[f"{tag}_eager_us"] = eager_us(fn, min_s=0.2, max_reps=500)
                row[f"{tag}_graph_us"] = graph_us(fn, reps=50)
            y = tiled(x)
            row["rel_tiled_vs_reconstruct"] = rel(y, lin.ours(x))
            if theirs is not None:
                row["rel_tiled_vs_exl3"] = rel(y, torch.cat(theirs(x), -1))
            if rows == sweep_rows:
                row["sweep_graph_us"] = sweep_splits(tiled, x)
            out.append(row)
            log(json.dumps(row))
        del lin, tiled, theirs
    log("\nlinear group                M   tiled eager/graph µs   reconstruct eager/graph   exl3 eager/graph   "
        "exl3/tiled graph   splits")
    nan = float("nan")
    for r in out:
        log(f"{r['shape']:26s} {r['rows']:3d}   {r['tiled_eager_us']:8.1f} {r['tiled_graph_us']:8.1f}   "
            f"{r['reconstruct_eager_us']:8.1f} {r['reconstruct_graph_us']:8.1f}   "
            f"{r.get('exl3_eager_us', nan):8.1f} {r.get('exl3_graph_us', nan):8.1f}   "
            f"{r.get('exl3_graph_us', nan) / r['tiled_graph_us']:6.2f}   {r['splits']} {r.get('sweep_graph_us', '')}")
    return out


def bench_flat(rows_list, bits: float, codebook: str, deadline: float = 0) -> list[dict]:
    gen = torch.Generator(device=DEVICE[0]).manual_seed(6)
    out = []
    for (k, parts), label in linear_groups(("27b",)).items():
        if deadline and time.time() > deadline:
            break
        lin = Linear(gen, k, list(parts), bits, codebook)
        launches = [launch for launch, _, _ in lin.ours.launches]
        for rows in rows_list:
            x = torch.randn(rows, k, generator=gen, device=DEVICE[0]).half()
            row = dict(kind="flat", shape=label, k=k, parts=list(parts), rows=rows, bits=bits)
            ys = []
            for flat in (True, False):
                for launch in launches:
                    launch.fused_fixed["FLAT"] = flat
                    launch.replan()
                row[f"flat{int(flat)}_graph_us"] = graph_us(lambda: lin.ours(x), reps=100)
                ys.append(lin.ours(x))
            row["same_bits"] = bool(torch.equal(ys[0], ys[1]))
            out.append(row)
            log(json.dumps(row))
    log(f"\nlinear group (K{bits:g})            M   flat graph µs   shaped graph µs   same bits")
    for r in out:
        log(f"{r['shape']:26s} {r['rows']:3d}   {r['flat1_graph_us']:8.1f}   {r['flat0_graph_us']:8.1f}   {r['same_bits']}")
    return out


def bench_host(rows_list, bits: float, codebook: str) -> list[dict]:
    """Every linear group of both models above the bound rows: the reconstruct path with its launches bound
    (kernels/bound_reconstruct.py) vs through each part's kernel apply (BoundLinear.unfused), host µs per call
    (kernels_common.host_us) and eager µs per call (back to back, one sync)."""
    gen = torch.Generator(device=DEVICE[0]).manual_seed(10)
    out = []
    for (k, parts), label in linear_groups(("35b-a3b", "27b")).items():
        lin = Linear(gen, k, list(parts), bits, codebook)
        for rows in rows_list:
            x = torch.randn(rows, k, generator=gen, device=DEVICE[0]).half()
            row = dict(kind="host", shape=label, k=k, parts=list(parts), rows=rows)
            for tag, fn in (("bound", lambda: lin.ours(x)), ("apply", lambda: lin.ours.unfused(x))):
                row[f"{tag}_host_us"] = host_us(fn, calls=20, busy_cycles=200_000_000)  # ~0.1 s
                row[f"{tag}_eager_us"] = eager_us(fn, min_s=0.2, max_reps=500)
            row["same_bits"] = bool(torch.equal(lin.ours(x), lin.ours.unfused(x)))
            out.append(row)
            log(json.dumps(row))
    log("\nlinear group                M   bound host/eager µs   apply host/eager µs   same bits")
    for r in out:
        log(f"{r['shape']:26s} {r['rows']:3d}   {r['bound_host_us']:8.1f} {r['bound_eager_us']:8.1f}   "
            f"{r['apply_host_us']:8.1f} {r['apply_eager_us']:8.1f}   {r['same_bits']}")
    return out


# (KT, warps, maxnreg): the served config first (triton_gemv.ring_dot_config; no register cap)
CONFIGS = ((None, None, None), (None, 8, None), (2, 4, None), (2, 8, None), (None, None, 64), (None, None, 96))


def set_config(launch, kt: int, warps: int, maxnreg: int | None) -> None:
    """Rebind a FusedLaunch/GroupLaunch's decode matmul with KT tile rows per step, `warps` warps and a register
    cap (CUDA's maxnreg; None: the compiler's choice)."""
    from exl3local.kernels.fused_launch import FUSED_VARYING
    from exl3local.kernels.launcher import DirectLaunch
    from exl3local.kernels.triton_fused import exl3_fused_kernel

    options = dict(num_warps=warps, num_stages=1, **({"maxnreg": maxnreg} if maxnreg else {}))
    launch.fused = DirectLaunch(exl3_fused_kernel, FUSED_VARYING, launch.fused.hooks is None, **options)
    launch.k_steps = launch.size_k // 16 // kt
    launch.fused_fixed.update(KT=kt, k_steps=launch.k_steps)
    launch.splits.clear()
    launch.replan()


def bench_config(rows_list, bits: float, codebook: str, deadline: float = 0) -> list[dict]:
    from exl3local.kernels.triton_gemv import ring_dot_config

    _, served_kt, served_warps = ring_dot_config(bits)
    gen = torch.Generator(device=DEVICE[0]).manual_seed(8)
    out = []
    for (k, parts), label in linear_groups(("27b",)).items():
        if deadline and time.time() > deadline:
            break
        lin = Linear(gen, k, list(parts), bits, codebook)
        launches = [launch for launch, _, _ in lin.ours.launches]
        for rows in rows_list:
            x = torch.randn(rows, k, generator=gen, device=DEVICE[0]).half()
            row = dict(kind="config", shape=label, k=k, parts=list(parts), rows=rows, bits=bits)
            served = None
            for kt, warps, maxnreg in CONFIGS:
                kt, warps = kt or served_kt, warps or served_warps
                name = f"kt{kt}_w{warps}" + (f"_r{maxnreg}" if maxnreg else "")
                try:
                    for launch in launches:
                        set_config(launch, kt, warps, maxnreg)
                    row[name] = graph_us(lambda: lin.ours(x), reps=100)
                    y = lin.ours(x)
                    served = y if served is None else served
                    row[name + "_rel"] = rel(y, served)
                except Exception as exc:  # noqa: BLE001 -- a config that does not compile is a result too
                    row[name] = f"{type(exc).__name__}: {str(exc)[:120]}"
            for launch in launches:
                set_config(launch, served_kt, served_warps, None)
            out.append(row)
            log(json.dumps(row))
    return out


def bench_groups(rows_list, bits: float, codebook: str) -> list[dict]:
    """Each distinct fused linear of both models, one GroupLaunch (2 launches) vs a FusedLaunch per part
    (2 per part, the arrangement before GroupLaunch), same tensors, µs per call eager and graph."""
    from exl3local.kernels.fused_launch import FusedLaunch
    from exl3local.kernels.bound_group import GroupLaunch

    gen = torch.Generator(device=DEVICE[0]).manual_seed(3)
    out = []
    for (k, parts), label in linear_groups(("35b-a3b", "27b"), fused_only=True).items():
        lin = Linear(gen, k, list(parts), bits, codebook)
        grouped = lin.ours
        if not isinstance(grouped.launches[0][0], GroupLaunch):
            continue  # wider than bound_group.GROUP_MAX_BLOCKS: per part anyway
        split = BoundLinear(grouped.parts, k)
        split.launches, start = [], 0
        for _, t, su, sv, n in grouped.parts:
            split.launches.append((FusedLaunch(t, su, sv, bits, codebook), start, n))
            start += n
        split.reserve()
        for rows in rows_list:
            x = torch.randn(rows, k, generator=gen, device=DEVICE[0]).half()
            row = dict(kind="group", shape=label, k=k, parts=list(parts), rows=rows)
            for tag, layer in (("grouped", grouped), ("per_part", split)):
                row[f"{tag}_eager_us"] = eager_us(lambda layer=layer: layer(x), min_s=0.2, max_reps=2000)
                row[f"{tag}_graph_us"] = graph_us(lambda layer=layer: layer(x), reps=200)
            row["rel"] = rel(grouped(x), split(x))
            out.append(row)
            log(json.dumps(row))
    log("\nfused layer                 M   grouped eager/graph µs   per-part eager/graph µs")
    for r in out:
        log(f"{r['shape']:26s} {r['rows']:3d}   {r['grouped_eager_us']:8.1f} {r['grouped_graph_us']:8.1f}   "
            f"{r['per_part_eager_us']:8.1f} {r['per_part_graph_us']:8.1f}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("tiled", "groups", "flat", "config", "host"))
    parser.add_argument("--rows", default=None, help="comma-separated row counts")
    parser.add_argument("--sweep-rows", type=int, default=64)
    parser.add_argument("--bits", type=float, default=4)
    parser.add_argument("--codebook", default="mul1")
    parser.add_argument("--no-exl3", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--deadline", type=float, default=0, help="epoch seconds after which groups are skipped")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        log("bench/layers.py needs a CUDA device")
        return 2
    if args.what == "groups":
        results = bench_groups([int(r) for r in (args.rows or "1,4,16").split(",")], args.bits, args.codebook)
    elif args.what == "config":
        results = bench_config([int(r) for r in (args.rows or "1,4").split(",")], args.bits, args.codebook,
                               args.deadline)
    elif args.what == "host":
        results = bench_host([int(r) for r in (args.rows or "64,32").split(",")], args.bits, args.codebook)
    elif args.what == "flat":
        results = bench_flat([int(r) for r in (args.rows or "1,16").split(",")], args.bits, args.codebook,
                             args.deadline)
    else:
        exl3 = None if args.no_exl3 else Exl3Side()
        if exl3 is not None and exl3.error:
            log(f"exllamav3 unavailable: {exl3.error}")
            exl3 = None
        rows = [int(r) for r in args.rows.split(",")] if args.rows else list(TILED_ROWS)
        results = bench_tiled(rows, args.bits, args.codebook, exl3, args.sweep_rows, args.deadline)
    with open(os.path.join(args.out, f"layers_{args.what}_k{args.bits:g}.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
