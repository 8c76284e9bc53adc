"""Prefill rows on the reconstruct path (issue 21, session 14): the GEMM with the output Hadamard in its epilogue
(triton_gemm.EPILOGUE_MIN_ROWS) against the served forms, per 27B part and per whole step, with exllamav3 1.6.5 on
the same tensors in the same process.

parts: per part and row count, graph µs of W_r (u·W_r), the Hadamard on an fp32 z, the epilogue GEMM at each tile
(BM, BK, GROUP_M, warps, stages) of TILES, and exllamav3's LinearEXL3.forward; each form's relative difference from
the fp32-z form (the most exact: fp16 u, exact Ŵ, fp32 product).
steps: whole 27B steps (bench/model_step.py's) at the prefill rows, eager ms, ours as served, ours with the epilogue
GEMM from --epilogue rows, as served again, exllamav3.

    python3 -P bench/product_gemm.py --out $OUT [--parts-only | --steps-only]        # on the H200
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
from model_step import build, patched_step, step_fns  # noqa: E402
from step_timing import eager_us, graph_us, log  # noqa: E402

from exl3local.kernels import triton_gemm  # noqa: E402
from exl3local.kernels.bound_reconstruct import ReconstructLaunch  # noqa: E402

PARTS = ((5120, 17408), (17408, 5120), (5120, 10240), (6144, 5120))
TILES = ((128, 64, 8, 8, 3), (128, 64, 8, 4, 4), (64, 64, 8, 4, 4), (128, 128, 8, 8, 3), (256, 64, 8, 8, 3),
         (128, 64, 16, 8, 4))


# each form's (HY_MAX_ROWS, EPILOGUE_MIN_ROWS) and epilogue tile; the fp32-z form first: the others' reference
FORMS = {"hy": ((1 << 30, 0), None), "wr": ((0, 0), None),
         **{"ep_" + "_".join(map(str, tile)): ((0, 1), tile) for tile in TILES}}


def with_limits(limits, fn):
    """fn with triton_gemm's form limits set while it runs (the form is chosen at call time)."""
    def run():
        old = triton_gemm.HY_MAX_ROWS, triton_gemm.EPILOGUE_MIN_ROWS
        triton_gemm.HY_MAX_ROWS, triton_gemm.EPILOGUE_MIN_ROWS = limits
        try:
            return fn()
        finally:
            triton_gemm.HY_MAX_ROWS, triton_gemm.EPILOGUE_MIN_ROWS = old
    return run


def bound_part(trellis, suh, svh, k: int, tile):
    """A ReconstructLaunch bound with the epilogue GEMM's tile `tile` (its constants are read at binding)."""
    old = dict(triton_gemm.PRODUCT_GEMM_TILE), dict(triton_gemm.PRODUCT_GEMM_LAUNCH)
    if tile is not None:
        bm, bk, group_m, warps, stages = tile
        triton_gemm.PRODUCT_GEMM_TILE.update(BM=bm, BK=bk, GROUP_M=group_m)
        triton_gemm.PRODUCT_GEMM_LAUNCH.update(num_warps=warps, num_stages=stages)
    try:
        return ReconstructLaunch(trellis, suh, svh, 4, "mul1", k)
    finally:
        triton_gemm.PRODUCT_GEMM_TILE.update(old[0])
        triton_gemm.PRODUCT_GEMM_LAUNCH.update(old[1])


def parts(exl3: Exl3Side | None, rows_list: list[int], deadline: float) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(1)
    results = []
    for k, n in PARTS:
        trellis = torch.randint(-32768, 32768, (k // 16, n // 16, 64), generator=g, dtype=torch.int16, device="cuda")
        svh = (torch.randn(n, generator=g, device="cuda") * 0.05).half()
        suh = (torch.randn(k, generator=g, device="cuda") * 0.05).half()
        theirs = exl3.linear(trellis, suh, svh, "mul1") if exl3 is not None else None
        for rows in rows_list:
            if deadline and time.time() > deadline:
                log(f"(skipping {k}x{n} M={rows}: past the deadline)")
                continue
            x = torch.randn(rows, k, generator=g, device="cuda").half()
            row = dict(part=f"{k}x{n}", rows=rows)
            ref = None
            for name, (limits, tile) in FORMS.items():
                launch = bound_part(trellis, suh, svh, k, tile)
                y = torch.empty(rows, n, dtype=torch.float16, device="cuda")
                fn = with_limits(limits, lambda launch=launch, y=y: launch.into(x, y, 0, n))
                try:
                    fn()
                    out = y.float()
                    ref = out if name == "hy" else ref
                    diff = float((out - ref).norm() / ref.norm())
                    row[name] = [round(graph_us(fn, reps=20), 1), f"{diff:.2e}"]
                except Exception as exc:  # noqa: BLE001 -- a tile that does not compile or fit is a result too
                    row[name] = f"{type(exc).__name__}: {str(exc)[:120]}"
            if theirs is not None:
                y = theirs.forward(x, {})
                row["exl3"] = [round(graph_us(lambda: theirs.forward(x, {}), reps=20), 1),
                               f"{float((y.float() - ref).norm() / ref.norm()):.2e}"]
            log(json.dumps(row))
            results.append(row)
    return results


def steps(exl3: Exl3Side | None, rows_list: list[int], epilogue: int, deadline: float) -> list[dict]:
    cfg, layers = build("27b", 4, "mul1", exl3)
    results = []
    for rows in rows_list:
        if deadline and time.time() > deadline:
            log(f"(skipping 27b M={rows}: past the deadline)")
            continue
        ours, theirs, _ = step_fns(cfg, layers, rows)

        def swap():
            old, triton_gemm.EPILOGUE_MIN_ROWS = triton_gemm.EPILOGUE_MIN_ROWS, epilogue
            return lambda: setattr(triton_gemm, "EPILOGUE_MIN_ROWS", old)

        row = dict(model="27b", rows=rows, served_epilogue_min_rows=triton_gemm.EPILOGUE_MIN_ROWS)
        for tag, fn in (("served", ours), (f"epilogue_from_{epilogue}", patched_step(ours, swap)), ("again", ours),
                        ("exl3", theirs if exl3 is not None else None)):
            if fn is not None:
                row[tag] = round(eager_us(fn, min_s=1.0, max_reps=5 if rows > 1024 else 20) / 1e3, 2)
        log(json.dumps(row))
        results.append(row)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="4096,512,1024")
    parser.add_argument("--step-rows", default="4096,512")
    parser.add_argument("--epilogue", type=int, default=512, help="EPILOGUE_MIN_ROWS of the steps' variant")
    parser.add_argument("--parts-only", action="store_true")
    parser.add_argument("--steps-only", action="store_true")
    parser.add_argument("--no-exl3", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--deadline", type=float, default=0, help="epoch seconds after which cells are skipped")
    args = parser.parse_args()
    exl3 = None if args.no_exl3 else Exl3Side()
    if exl3 is not None and exl3.error:
        log(f"exllamav3 unavailable: {exl3.error}")
        exl3 = None
    results = {}
    try:
        if not args.steps_only:
            results["parts"] = parts(exl3, [int(r) for r in args.rows.split(",")], args.deadline)
        if not args.parts_only:
            results["steps"] = steps(exl3, [int(r) for r in args.step_rows.split(",")], args.epilogue, args.deadline)
    finally:
        with open(os.path.join(args.out, "product_gemm.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
