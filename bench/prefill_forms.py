"""Prefill rows on the reconstruct path (issue 21): where a 27B part's time goes in each form, and whole 27B steps with
the form rule as served and as before, with exllamav3 1.6.5 on the same tensors in the same process.

parts: per part and row count, graph µs of the served call (ReconstructLaunch.into), W_r and the Hadamard on an fp32 z
forced, their pieces (input transform, W_r rebuild, dense decode, the fp16 matmul u·W_r and the same product with W_r
stored transposed), exllamav3's LinearEXL3.forward; each form's relative difference from the fp32-z form.
steps: whole 27B steps (bench/model_step.py's) at the prefill rows, eager ms: served, the form rule before session 14
(the Hadamard on y up to HY_MAX_ROWS whatever the depth), served again, exllamav3.
--profile: instead, one eager 27B step of each side at --step-rows under torch's profiler: device ms per kernel name
(the largest), the sum of kernel time, and the wall time of the step (where a step's time goes beyond its parts'); and
our step under cProfile: host ms per Python function (the largest), for where an eager step's host time goes.
--profile-steps N: N back-to-back steps of each side under the profiler, no sync between them (as the eager timings run
them), each side's sums divided by N: do repeated steps spend their time in kernels or between them?
Session 14 also timed a Triton GEMM with the output Hadamard in its epilogue here (commit 064c623): it lost to both
served forms at every part and row count (docs/PERF.md "Session 14") and was removed.

    python3 -P bench/prefill_forms.py --out $OUT        # on the H200 (source bench/device-setup.sh first)
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
from model_build import build  # noqa: E402
from model_step import eager_steps, patched_step, step_fns  # noqa: E402
from step_timing import graph_us, log  # noqa: E402

from exl3local.kernels import triton_decode, triton_gemm  # noqa: E402
from exl3local.kernels.bound_reconstruct import ReconstructLaunch  # noqa: E402
from exl3local.kernels.triton_hadamard import input_transform  # noqa: E402

PARTS = ((5120, 17408), (17408, 5120), (5120, 10240), (6144, 5120))
# (HY_MAX_ROWS, HY_K_PER_ROW) of each form; the fp32-z form first: the others' reference
FORMS = {"hy": (1 << 30, 1), "wr": (0, 1 << 30)}
BEFORE = (triton_gemm.HY_MAX_ROWS, 1 << 30)  # the rule before session 14: HY_MAX_ROWS whatever the depth


def with_limits(limits, fn):
    """fn with triton_gemm's form limits set while it runs (the form is chosen at call time)."""
    def run():
        old = triton_gemm.HY_MAX_ROWS, triton_gemm.HY_K_PER_ROW
        triton_gemm.HY_MAX_ROWS, triton_gemm.HY_K_PER_ROW = limits
        try:
            return fn()
        finally:
            triton_gemm.HY_MAX_ROWS, triton_gemm.HY_K_PER_ROW = old
    return run


def parts(exl3: Exl3Side | None, rows_list: list[int], deadline: float) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(1)
    results = []
    for k, n in PARTS:
        trellis = torch.randint(-32768, 32768, (k // 16, n // 16, 64), generator=g, dtype=torch.int16, device="cuda")
        svh = (torch.randn(n, generator=g, device="cuda") * 0.05).half()
        suh = (torch.randn(k, generator=g, device="cuda") * 0.05).half()
        theirs = exl3.linear(trellis, suh, svh, "mul1") if exl3 is not None else None
        launch = ReconstructLaunch(trellis, suh, svh, 4, "mul1", k)
        w_r = triton_gemm.right_reconstruct(trellis, svh, 4, "mul1")
        w_t = w_r.t().contiguous()
        for rows in rows_list:
            if deadline and time.time() > deadline:
                log(f"(skipping {k}x{n} M={rows}: past the deadline)")
                continue
            x = torch.randn(rows, k, generator=g, device="cuda").half()
            u = input_transform(x, suh)
            y = torch.empty(rows, n, dtype=torch.float16, device="cuda")
            row = dict(part=f"{k}x{n}", rows=rows, served_form="hy" if triton_gemm.hadamard_on_y(rows, k, x.device)
                       else "wr")
            ref = None
            for name, limits in FORMS.items():
                fn = with_limits(limits, lambda: launch.into(x, y, 0, n))
                fn()
                ref = y.float() if ref is None else ref
                row[name] = [round(graph_us(fn, reps=20), 1), f"{float((y.float() - ref).norm() / ref.norm()):.2e}"]
            pieces = {"input": lambda: input_transform(x, suh),
                      "rebuild": lambda: triton_gemm.right_reconstruct(trellis, svh, 4, "mul1"),
                      "decode": lambda: triton_decode.decode_dense(trellis, 4, "mul1"),
                      "mm_nn": lambda: torch.mm(u, w_r), "mm_nt": lambda: torch.mm(u, w_t.t()),
                      "mm_fp32_out": lambda: triton_gemm.fp32_product(u, w_r)}
            for name, fn in pieces.items():
                row[name] = round(graph_us(fn, reps=20), 1)
            if theirs is not None:
                out = theirs.forward(x, {})
                row["exl3"] = [round(graph_us(lambda: theirs.forward(x, {}), reps=20), 1),
                               f"{float((out.float() - ref).norm() / ref.norm()):.2e}"]
            log(json.dumps(row))
            results.append(row)
    return results


def steps(exl3: Exl3Side | None, rows_list: list[int], deadline: float) -> list[dict]:
    def variants(ours, theirs, layers, row):
        def swap():
            old = triton_gemm.HY_MAX_ROWS, triton_gemm.HY_K_PER_ROW
            triton_gemm.HY_MAX_ROWS, triton_gemm.HY_K_PER_ROW = BEFORE
            return lambda: (setattr(triton_gemm, "HY_MAX_ROWS", old[0]), setattr(triton_gemm, "HY_K_PER_ROW", old[1]))

        return ("served", ours), ("rule_before", patched_step(ours, swap)), ("again", ours), ("exl3", theirs)

    return eager_steps(exl3, rows_list, deadline, variants)


def profile(exl3: Exl3Side | None, rows_list: list[int], steps: int = 1) -> list[dict]:
    cfg, layers = build("27b", 4, "mul1", exl3)
    results = []
    for rows in rows_list:
        ours, theirs, _ = step_fns(cfg, layers, rows)
        for side, fn in (("ours", ours), ("exl3", theirs if exl3 is not None else None)):
            if fn is None:
                continue
            fn()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                start = time.perf_counter()
                for _ in range(steps):
                    fn()
                torch.cuda.synchronize()
                wall = time.perf_counter() - start
            kernels: dict[str, float] = {}
            for event in prof.events():
                if event.device_type == torch.autograd.DeviceType.CUDA:
                    name = event.name[:90]
                    kernels[name] = kernels.get(name, 0.0) + event.time_range.elapsed_us() / 1e3 / steps
            top = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:14])
            row = dict(model="27b", rows=rows, side=side, steps=steps, wall_ms=round(wall * 1e3 / steps, 2),
                       kernel_ms=round(sum(kernels.values()), 2), top_ms={k: round(v, 2) for k, v in top.items()})
            if side == "ours" and steps == 1:
                row["host_top_ms"] = host_profile(fn)
            log(json.dumps(row))
            results.append(row)
    return results


def host_profile(fn) -> dict:
    """{function: own host ms} of one call of fn under cProfile, the largest."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:15]
    return {f"{Path(f).name}:{line}:{name} x{calls}": round(own * 1e3, 2)
            for (f, line, name), (_, calls, own, _, _) in top}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="4096,2048")
    parser.add_argument("--step-rows", default="4096,2048,512")
    parser.add_argument("--parts-only", action="store_true")
    parser.add_argument("--steps-only", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-steps", type=int, default=1)
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
        if args.profile:
            results["profile"] = profile(exl3, [int(r) for r in args.step_rows.split(",")], args.profile_steps)
        elif not args.steps_only:
            results["parts"] = parts(exl3, [int(r) for r in args.rows.split(",")], args.deadline)
        if not args.parts_only and not args.profile:
            results["steps"] = steps(exl3, [int(r) for r in args.step_rows.split(",")], args.deadline)
    finally:
        with open(os.path.join(args.out, "prefill_forms.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
