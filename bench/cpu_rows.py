"""kernels/cpu at few rows, per tier: the one-pass GEMV against the GEMM path the library would take instead, where
the two cross (ops.gemv_max_rows), and torch's bf16 linear beside them. Needs no vLLM (runs on the H200's host).

    python3 -P bench/cpu_rows.py [--tiers avx512,avx2vnni] [--rows 2,4,8,12,16,24,32] [--threads 1,16] [--int8]
                                 [--no-amx] [--out result.json]

Per tier, thread count, shape and row count m (mul1 K4, bf16 rows as the engine sends them):
- gemv: the library's exl3_cpu_gemv called at m rows whatever the tier's crossover says (exact; the call the engine
  makes up to gemv_max_rows);
- gemm: CpuLinear._gemm, the path past the crossover (on an AMX CPU's avx512 tier the AMX u split up to 32 rows and
  the W' planes past it, or with --no-amx the fp32 path as on an AVX-512 CPU without AMX; elsewhere the fp32 path: the
  library's own GEMM on the avx512 tier, decode-strip + fp32 BLAS on the others);
- int8 (--int8, avx512 tier): the opt-in's GEMV, at one row (it serves no more since session 17: ops.INT8_MAX_ROWS);
- torch_bf16: F.linear on a bf16 weight (oneDNN; not vLLM's prepacked linear), once per thread count and shape.
Median of --reps calls, best of two rounds alternating the paths; ms of wall. Weights are not cycled: from 2 rows on
the GEMV is compute-bound (the trellis is read once per call for all rows).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

SHAPES = ((2048, 2048), (2048, 11264), (5632, 2048))  # bench/cpu_decode.py's model: hidden 2048, intermediate 5632


def median(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[reps // 2]


def one_shape(tier: str, threads: int, k: int, n: int, rows: list[int], args, bf16: dict) -> dict:
    import torch

    from exl3local.kernels.cpu import ops

    g = torch.Generator().manual_seed(0)
    trellis = torch.randint(-32768, 32768, (k // 16, n // 16, 16 * args.bits), dtype=torch.int16, generator=g)
    lin = ops.CpuLinear(trellis, (torch.randn(k, generator=g) * k**-0.5).half(), torch.randn(n, generator=g).half(),
                        args.bits, "mul1", tier=tier, int8=False)
    if args.no_amx:  # an AVX-512 CPU without AMX, emulated: the fp32 GEMM path past the crossover
        lin.amx = False
    int8 = args.int8 and ops.int8_active("mul1", lin.lib, True)
    w = torch.randn(n, k, generator=g).bfloat16()
    r = {"tier": tier, "threads": threads, "k": k, "n": n, "gemv_max_rows": lin.gemv_rows, "amx": lin.amx, "rows": {}}
    for m in rows:
        x = torch.randn(m, k, generator=g).bfloat16()
        xf = x.float()

        def gemv(flag=0):
            y, u = torch.empty(m, n), torch.empty(m, k)
            lin.lib.exl3_cpu_gemv(lin.trellis.data_ptr(), lin.tiles_k, lin.tiles_n, lin.bits2, lin.codebook,
                                  lin.lut_ptr, xf.data_ptr(), lin.suh.data_ptr(), lin.svh.data_ptr(), u.data_ptr(),
                                  y.data_ptr(), m, threads, flag)
            return y.bfloat16()

        runs = {"gemv": gemv, "gemm": lambda: lin._gemm(x, torch.bfloat16, None, threads)}
        if int8 and m <= ops.INT8_MAX_ROWS:
            runs["int8"] = lambda: gemv(1)
        key = (threads, k, n, m)
        if key not in bf16:
            runs["torch_bf16"] = lambda: torch.nn.functional.linear(x, w)
        best: dict[str, float] = {}
        for _ in range(2):
            for name, fn in runs.items():
                best[name] = min(best.get(name, 1e9), median(fn, args.reps))
        if "torch_bf16" in best:
            bf16[key] = best["torch_bf16"]
        cell = {f"{name}_ms": round(s * 1e3, 3) for name, s in best.items() if name != "torch_bf16"}
        cell["torch_bf16_ms"] = round(bf16[key] * 1e3, 3)
        cell["gemm_over_gemv"] = round(best["gemm"] / best["gemv"], 2)
        r["rows"][m] = cell
    return r


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiers", help="comma-separated (default: every tier this CPU runs)")
    parser.add_argument("--rows", default="2,4,8,12,16,20,24,32,40")
    parser.add_argument("--threads", default="1,16")
    parser.add_argument("--shapes", help="KxN,... (default: 2048x2048,2048x11264,5632x2048)")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--int8", action="store_true", help="also the int8 opt-in's GEMV (avx512 tier)")
    parser.add_argument("--no-amx", action="store_true", help="the GEMM side on the fp32 path even on an AMX CPU")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import torch

    from exl3local.kernels.cpu import build

    tiers = args.tiers.split(",") if args.tiers else build.runnable_tiers()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    rows = [int(v) for v in args.rows.split(",")]
    info = {"tiers": tiers, "torch": torch.__version__, "cpus": os.cpu_count(), "load": os.getloadavg()}
    print(json.dumps(info), flush=True)
    result, bf16 = {"info": info, "runs": []}, {}
    for threads in (int(v) for v in args.threads.split(",")):
        torch.set_num_threads(threads)
        for tier in tiers:
            for k, n in shapes:
                r = one_shape(tier, threads, k, n, rows, args, bf16)
                print(json.dumps(r), flush=True)
                result["runs"].append(r)
                result["info"]["load_after"] = os.getloadavg()
                if args.out:  # after every shape: a run cut by a timeout keeps what it measured
                    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
