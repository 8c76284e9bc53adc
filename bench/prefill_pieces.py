"""Prefill pieces of the reconstruct path (issue 21, session 15), per 27B part on the H200, graph µs, one process:

input: the input transform at 4096/1024 rows with RB row blocks per program (triton_hadamard.input_row_blocks; u
    bit-equal to RB = 1 checked);
rebuild: W_r = fp16(fp16(Ŵ·Hn)⊙svh) as served (svh multiplied in fp16, triton_gemm.REBUILD_STAGES), as before
    session 15 (svh in fp32, Triton's default stages; bit-equal checked) and at 1 stage, served at 1 / 2 stages, with
    4 / 8 tile rows per program (one / two dots), two cuts that say where its time goes (no epilogue: the dot's fp16
    result stored; no dot: Ŵ decoded in ring order and stored through the ring rows) and Ŵ decoded in natural order
    times the natural ±1 matrix (its difference from served printed); beside them the dense decode;
steps: whole 27B steps (bench/model_step.py's) at --step-rows, eager ms: served, the input transform with RB = 1 and
    the rebuild at Triton's default stages (each as before session 15), W_r rebuilt in natural order (cut 3),
    exllamav3, served again, exllamav3 again.

    python3 -P bench/prefill_pieces.py --out $OUT        # on the H200 (source bench/device-setup.sh first)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench's sibling modules (python -P adds no path)
from exl3_side import Exl3Side  # noqa: E402
from model_step import eager_steps, patched_step  # noqa: E402
from step_timing import graph_us, log  # noqa: E402

from exl3local.kernels import triton_decode, triton_gemm, triton_hadamard  # noqa: E402
from exl3local.kernels.bound_reconstruct import REBUILD_VARYING  # noqa: E402
from exl3local.kernels.hadamard import HADAMARD_SCALE  # noqa: E402
from exl3local.kernels.launcher import DirectLaunch, launch_mode  # noqa: E402
from exl3local.kernels.triton_decode import (  # noqa: E402
    natural_block, rate_constants, ring_operand, ring_rows, ring_tiles, words)
from exl3local.kernels.triton_hadamard import NATURAL, RING_ROWS, hadamard_operands, load_hadamard  # noqa: E402

PARTS = ((5120, 17408), (17408, 5120), (5120, 10240), (6144, 5120))


@triton.jit
def _rebuild_cut_kernel(w_ptr, had_ptr, svh_ptr, out_ptr, tiles_n, tk_per_program, KA: tl.constexpr,
                        HALF: tl.constexpr, W32: tl.constexpr, G: tl.constexpr, CODEBOOK: tl.constexpr,
                        SCALE: tl.constexpr, KT: tl.constexpr, CUT: tl.constexpr):
    """triton_gemm._right_reconstruct_kernel with CUT 0: svh multiplied in fp32 (the form before session 15);
    1: no epilogue (fp16 of the dot stored); 2: no dot (Ŵ stored through the ring rows, columns in ring order);
    3: Ŵ decoded in natural order (triton_decode.natural_block) times the natural ±1 matrix, rows stored in order."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * 128 + tl.arange(0, 128)
    h_right = load_hadamard(had_ptr, NATURAL if CUT == 3 else RING_ROWS)
    svh = tl.load(svh_ptr + cols).to(tl.float32)[None, :]
    tile_off, s = ring_tiles(pid_n * 8, tiles_n, KT, 8, W32, G)
    tk = pid_k * tk_per_program
    row_base = w_ptr + tk.to(tl.int64) * tiles_n * W32
    rows = tl.arange(0, 16 * KT) if CUT == 3 else ring_rows(tl.arange(0, 16 * KT))
    out_rows = out_ptr + (tk * 16 + rows).to(tl.int64)[:, None] * (tiles_n * 16) + cols[None, :]
    for _ in range(0, tk_per_program, KT):
        if CUT == 3:
            w_hat = natural_block(row_base, tile_off, s, KT, 8, KA, HALF, W32, G, CODEBOOK)
        else:
            w_hat = ring_operand(row_base, tile_off, s, KT, 8, KA, HALF, W32, G, CODEBOOK)
        if CUT == 2:
            tl.store(out_rows, w_hat)
        else:
            right = (tl.dot(w_hat, h_right) * SCALE).to(tl.float16)
            if CUT == 1:
                tl.store(out_rows, right)
            else:
                tl.store(out_rows, (right.to(tl.float32) * svh).to(tl.float16))
        row_base += KT * tiles_n * W32
        out_rows += KT * 16 * tiles_n * 16


def rebuild(trellis, svh, kernel, stages=None, per_program=None, warps=4, kt=4, **extra):
    tiles_k, tiles_n, _ = trellis.shape
    per_program = per_program or next(rows for rows in (32, 16, 8) if tiles_k % rows == 0)
    w = torch.empty(tiles_k * 16, tiles_n * 16, dtype=torch.float16, device=trellis.device)
    options = dict(num_warps=warps) if stages is None else dict(num_warps=warps, num_stages=stages)
    kernel[(tiles_n // 8, tiles_k // per_program)](words(trellis), hadamard_operands(trellis.device), svh, w, tiles_n,
                                                   per_program, **rate_constants(4, "mul1"), SCALE=HADAMARD_SCALE, KT=kt,
                                                   **extra, **options)
    return w


SWEEP = [(rows, kt, warps) for rows in (8, 16, 32, 64) for kt in (2, 4, 8) for warps in (4, 8) if rows % kt == 0]


def sweep(deadline: float) -> dict:
    """The served rebuild at REBUILD_STAGES per (tile rows per program, KT, warps), graph µs per part; best first."""
    g = torch.Generator(device="cuda").manual_seed(2)
    times: dict = {}
    for k, n in ((5120, 17408), (6144, 5120)):
        trellis = torch.randint(-32768, 32768, (k // 16, n // 16, 64), generator=g, dtype=torch.int16, device="cuda")
        svh = (torch.randn(n, generator=g, device="cuda") * 0.05).half()
        served = triton_gemm.right_reconstruct(trellis, svh, 4, "mul1")
        for rows, kt, warps in SWEEP:
            if deadline and time.time() > deadline:
                break
            fn = lambda: rebuild(trellis, svh, triton_gemm._right_reconstruct_kernel,  # noqa: E731
                                 triton_gemm.REBUILD_STAGES, rows, warps, kt)
            same = torch.equal(fn(), served)
            times.setdefault(f"{rows}:{kt}:{warps}", []).append(round(graph_us(fn, reps=20), 1) if same else None)
    best = sorted((v[0], key) for key, v in times.items() if v and v[0] is not None)
    log(json.dumps(dict(sweep=times, best=best[:3])))
    return dict(times=times, best=best[0][1] if best else None)


def input_rb(x, suh, blocks):
    rows, size_k = x.shape
    u = torch.empty(rows, size_k, dtype=torch.float16, device=x.device)
    triton_hadamard._input_kernel[(triton.cdiv(rows, 64 * blocks), size_k // 128)](
        x, suh, suh, hadamard_operands(x.device), u, rows, size_k, x.stride(0), 1, size_k, HAS_IDS=False,
        SCALE=HADAMARD_SCALE, BM=64, RB=blocks)
    return u


def pieces(rows_list: list[int], deadline: float) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(1)
    results = []
    for k, n in PARTS:
        if deadline and time.time() > deadline:
            break
        trellis = torch.randint(-32768, 32768, (k // 16, n // 16, 64), generator=g, dtype=torch.int16, device="cuda")
        svh = (torch.randn(n, generator=g, device="cuda") * 0.05).half()
        suh = (torch.randn(k, generator=g, device="cuda") * 0.05).half()
        served = triton_gemm.right_reconstruct(trellis, svh, 4, "mul1")
        before = rebuild(trellis, svh, _rebuild_cut_kernel, CUT=0)
        natural = rebuild(trellis, svh, _rebuild_cut_kernel, CUT=3)
        row = dict(part=f"{k}x{n}", rebuild_same_bits=bool(torch.equal(served, before)),
                   natural_rel=f"{float((natural.float() - served.float()).norm() / served.float().norm()):.2e}")
        fns = {"served": lambda: triton_gemm.right_reconstruct(trellis, svh, 4, "mul1"),
               "before": lambda: rebuild(trellis, svh, _rebuild_cut_kernel, CUT=0),
               "stages1": lambda: rebuild(trellis, svh, triton_gemm._right_reconstruct_kernel, stages=1),
               "stages2": lambda: rebuild(trellis, svh, triton_gemm._right_reconstruct_kernel, stages=2),
               "tiles4": lambda: rebuild(trellis, svh, triton_gemm._right_reconstruct_kernel, per_program=4),
               "tiles8": lambda: rebuild(trellis, svh, triton_gemm._right_reconstruct_kernel, per_program=8),
               "no_epilogue": lambda: rebuild(trellis, svh, _rebuild_cut_kernel, CUT=1),
               "no_dot": lambda: rebuild(trellis, svh, _rebuild_cut_kernel, CUT=2),
               "natural": lambda: rebuild(trellis, svh, _rebuild_cut_kernel, CUT=3),
               "natural_stages1": lambda: rebuild(trellis, svh, _rebuild_cut_kernel, stages=1, CUT=3),
               "before_stages1": lambda: rebuild(trellis, svh, _rebuild_cut_kernel, stages=1, CUT=0),
               "decode": lambda: triton_decode.decode_dense(trellis, 4, "mul1")}
        row["rebuild_us"] = {name: round(graph_us(fn, reps=20), 1) for name, fn in fns.items()}
        for rows in rows_list:
            x = torch.randn(rows, k, generator=g, device="cuda").half()
            first = input_rb(x, suh, 1)
            same = all(torch.equal(first, input_rb(x, suh, b)) for b in (2, 4, 8, 16))
            row[f"input_{rows}_same_bits"] = same
            row[f"input_{rows}_us"] = {b: round(graph_us(lambda b=b: input_rb(x, suh, b), reps=20), 1)
                                       for b in (1, 2, 4, 8, 16)}
        log(json.dumps(row))
        results.append(row)
    return results


def rebuild_swap(layers, kernel, stages: int, config: str | None = None, **extra):
    """A swap (bench/model_step.patched_step) that sends every bound layer's W_r rebuild through `kernel` (extra: its
    constants beside the served ones) at num_stages `stages`, each part with a direct launch of its own; config
    "rows:KT:warps" (sweep's) changes its tile rows per program, KT and warps where the part's k allows."""
    launches: dict[int, tuple] = {}

    def swap():
        parts = [r for ops in layers for kind, obj, _ in ops if kind == "linear" for r in (obj.ours.rebuilds or ())]
        saved = [(r, r.rebuild, r.rebuild_fixed, r.rebuild_grid) for r in parts]
        for r in parts:
            if id(r) not in launches:
                plain = launch_mode(kernel, torch.device("cuda"))[0]
                fixed, grid, warps = dict(r.rebuild_fixed, **extra), r.rebuild_grid, 4
                if config:
                    rows, kt, warps = map(int, config.split(":"))
                    if (r.size_k // 16) % rows == 0:
                        fixed.update(tk_per_program=rows, KT=kt)
                        grid = (r.size_n // 128, r.size_k // 16 // rows, 1)
                    else:
                        warps = 4
                launches[id(r)] = (DirectLaunch(kernel, REBUILD_VARYING, plain, num_warps=warps, num_stages=stages),
                                   fixed, grid)
            r.rebuild, r.rebuild_fixed, r.rebuild_grid = launches[id(r)]

        def undo():
            for r, launch, fixed, grid in saved:
                r.rebuild, r.rebuild_fixed, r.rebuild_grid = launch, fixed, grid
        return undo
    return swap


def steps(exl3: Exl3Side | None, rows_list: list[int], deadline: float, best: str | None = None) -> list[dict]:
    def variants(ours, theirs, layers, row):
        def swap():
            old, triton_hadamard.INPUT_ROW_BLOCKS = triton_hadamard.INPUT_ROW_BLOCKS, 1
            return lambda: setattr(triton_hadamard, "INPUT_ROW_BLOCKS", old)

        row["input_row_blocks"] = triton_hadamard.input_row_blocks(row["rows"])
        kernel = triton_gemm._right_reconstruct_kernel
        last = (f"rebuild_{best}", rebuild_swap(layers, kernel, triton_gemm.REBUILD_STAGES, best)) if best else \
            ("natural_rebuild", rebuild_swap(layers, _rebuild_cut_kernel, 1, CUT=3))
        # exllamav3 twice, around our last timing: the spread of repeated timings on one side (s14: 5 %)
        return (("served", ours), ("input_rb1", patched_step(ours, swap)),
                ("rebuild_stages3", patched_step(ours, rebuild_swap(layers, kernel, 3))),
                (last[0], patched_step(ours, last[1])), ("exl3", theirs), ("again", ours), ("exl3_again", theirs))

    return eager_steps(exl3, rows_list, deadline, variants)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="4096,1024")
    parser.add_argument("--step-rows", default="4096,2048")
    parser.add_argument("--no-steps", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="only the rebuild's configs, then steps with the best")
    parser.add_argument("--no-exl3", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--deadline", type=float, default=0, help="epoch seconds after which cells are skipped")
    args = parser.parse_args()
    exl3 = None if args.no_exl3 or args.no_steps else Exl3Side()
    if exl3 is not None and exl3.error:
        log(f"exllamav3 unavailable: {exl3.error}")
        exl3 = None
    results = {}
    try:
        if args.sweep:
            results["sweep"] = sweep(args.deadline)
        else:
            results["pieces"] = pieces([int(r) for r in args.rows.split(",")], args.deadline)
        if not args.no_steps:
            results["steps"] = steps(exl3, [int(r) for r in args.step_rows.split(",")], args.deadline,
                                     results.get("sweep", {}).get("best"))
    finally:
        with open(os.path.join(args.out, "prefill_pieces.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
