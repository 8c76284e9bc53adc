"""kernels/cpu per linear on a machine without vLLM (the H200 device's host CPU): the one-row GEMV and the 512-row GEMM
path against torch's own bf16 linear, at several thread counts.

    python3 -P bench/cpu_host.py [--threads 1,2,4,8,16] [--prefill 512] [--hint-before T0] [--out result.json]

The bf16 side is torch's F.linear (oneDNN, with AMX where the CPU has it), NOT vLLM's CPU linear (oneDNN on weights
prepacked at load, which bench/cpu_linears.py uses and which needs vLLM): at one row on Zen 4 the prepacked path was
1.2-1.8x faster than F.linear (docs/PERF.md, CPU, session 14), so these ratios flatter EXL3 by about that much.
One row, per shape: EXL3 exact (the loop this CPU serves: AVX512-FP16 where present), exact with the 32-bit loop
(exl3_cpu_fp16(0)), the int8 opt-in, and with --hint-before the same library built with the trellis prefetch into L1
(_MM_HINT_T0, the hint before aed9e6f), alternating with the shipped one. Weights are cycled through copies of more than
--cycle-mib MiB per side, past the L3. Median wall time of --reps calls. --prefill M: the GEMM path at M bf16 rows (AMX
where amx_active, and the fp32 BLAS path) against F.linear bf16 and torch.mm fp32, best wall of 3, alternating.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

SHAPES = ((2048, 2048), (2048, 11264), (5632, 2048))  # bench/cpu_decode.py's model: hidden 2048, intermediate 5632


def build_with_hint(hint: str) -> ctypes.CDLL:
    """The avx512 library from this checkout's source with the trellis prefetch hint `hint` (e.g. T0)."""
    from exl3local.kernels.cpu import build, ops

    tmp = Path(tempfile.mkdtemp(prefix="exl3cpu-hint-"))
    for f in (build.SOURCE, *(build.SOURCE.with_name(h) for h in build.HEADERS)):
        shutil.copy(f, tmp / f.name)
    header = tmp / "exl3_cpu_avx512.h"
    text = header.read_text()
    if "_MM_HINT_T1" not in text:
        raise SystemExit("exl3_cpu_avx512.h has no _MM_HINT_T1 prefetch to change")
    header.write_text(text.replace("_MM_HINT_T1", f"_MM_HINT_{hint}"))
    out = tmp / "lib.so"
    subprocess.run([build.compiler(), *build.COMMON_FLAGS, *build.TIERS["avx512"][0], str(tmp / build.SOURCE.name), "-o",
                    str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    for name, (args, res) in ops._SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


def median_call(fn, copies: int, reps: int) -> float:
    for i in range(copies):
        fn(i)
    times = []
    for r in range(reps):
        t0 = time.perf_counter()
        fn(r % copies)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def one_row(args, threads: int, before) -> list[dict]:
    import torch

    from exl3local.kernels.cpu import ops

    torch.set_num_threads(threads)
    lib = ops.library()
    rows = []
    for k, n in SHAPES:
        g = torch.Generator().manual_seed(0)
        first = torch.randint(-32768, 32768, (k // 16, n // 16, 16 * args.bits), dtype=torch.int16, generator=g)
        copies = max(2, (args.cycle_mib << 20) // first.nbytes)
        suh, svh = (torch.randn(k, generator=g) * k**-0.5).half(), torch.randn(n, generator=g).half()
        lins = [ops.CpuLinear(first if i == 0 else first.clone(), suh, svh, args.bits, "mul1", int8=False)
                for i in range(copies)]
        x = torch.randn(1, k, generator=g)
        ns = lambda s: s * 1e9 / (k * n)  # noqa: E731
        r = {"k": k, "n": n, "threads": threads, "copies": copies}

        def exact(i):
            lins[i](x)

        for rnd in range(2 if before is not None else 1):  # shipped and T0 alternate
            r["exact_ns_w"] = min(r.get("exact_ns_w", 1e9), ns(median_call(exact, copies, args.reps)))
            if before is not None:
                for lin in lins:
                    lin.lib = before
                r["before_ns_w"] = min(r.get("before_ns_w", 1e9), ns(median_call(exact, copies, args.reps)))
                for lin in lins:
                    lin.lib = lib
        if lib.exl3_cpu_fp16(-1):
            lib.exl3_cpu_fp16(0)
            try:
                r["exact_32bit_loop_ns_w"] = ns(median_call(exact, copies, args.reps))
                if before is not None:
                    before.exl3_cpu_fp16(0)
                    for lin in lins:
                        lin.lib = before
                    r["before_32bit_loop_ns_w"] = ns(median_call(exact, copies, args.reps))
                    for lin in lins:
                        lin.lib = lib
                    before.exl3_cpu_fp16(1)
            finally:
                lib.exl3_cpu_fp16(1)
        for lin in lins:
            lin.int8 = ops.int8_active("mul1", lib, True)
        r["int8_ns_w"] = ns(median_call(exact, copies, args.reps))
        del lins
        dense_copies = max(2, (args.cycle_mib << 20) // (k * n * 2))
        w0 = torch.randn(n, k, generator=g).bfloat16()
        dense = [w0 if i == 0 else w0.clone() for i in range(dense_copies)]
        xb = x.bfloat16()
        r["torch_bf16_ns_w"] = ns(median_call(lambda i: torch.nn.functional.linear(xb, dense[i]), dense_copies, args.reps))
        del dense
        r["exact_gb_s"] = k * n * args.bits / 8 / (r["exact_ns_w"] * k * n * 1e-9) / 1e9
        print(json.dumps(r), flush=True)
        rows.append(r)
    return rows


def gemm_pair(k: int, n: int, bits: int, g):
    """A random mul1 k x n CpuLinear (its GEMM path on AMX where the CPU has it) and its twin on the fp32 path (the
    library's own GEMM or decode-strip + BLAS: ops.own_gemm_serves), drawn from generator g (bench/cpu_linears.py uses
    the same pair)."""
    import torch

    from exl3local.kernels.cpu import ops

    trellis = torch.randint(-32768, 32768, (k // 16, n // 16, 16 * bits), dtype=torch.int16, generator=g)
    lin = ops.CpuLinear(trellis, (torch.randn(k, generator=g) * k**-0.5).half(), torch.randn(n, generator=g).half(),
                        bits, "mul1")
    fp32 = ops.CpuLinear(lin.trellis, lin.suh, lin.svh, bits, "mul1")
    fp32.amx = False
    return lin, fp32


def prefill(args, threads: int) -> list[dict]:
    import torch

    torch.set_num_threads(threads)
    m, rows = args.prefill, []
    for k, n in SHAPES:
        g = torch.Generator().manual_seed(1)
        lin, fp32 = gemm_pair(k, n, args.bits, g)
        x = torch.randn(m, k, generator=g).bfloat16()
        w = torch.randn(n, k, generator=g).bfloat16()
        xf, wf = x.float(), w.float().t().contiguous()
        runs = {"exl3_" + ("amx" if lin.amx else "fp32"): lambda: lin(x, torch.bfloat16),
                "exl3_fp32_blas": lambda: fp32(x, torch.bfloat16),
                "torch_bf16": lambda: torch.nn.functional.linear(x, w), "torch_fp32_mm": lambda: torch.mm(xf, wf)}
        best: dict[str, float] = {}
        for _ in range(3):
            for name, fn in runs.items():
                t0 = time.perf_counter()
                fn()
                best[name] = min(best.get(name, 1e9), time.perf_counter() - t0)
        r = {"k": k, "n": n, "rows": m, "threads": threads, **{f"{name}_ms": s * 1e3 for name, s in best.items()}}
        r.update({f"{name}_gflops": 2 * m * k * n / s / 1e9 for name, s in best.items()})
        print(json.dumps(r), flush=True)
        rows.append(r)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2,4,8,16")
    parser.add_argument("--prefill-threads", default="1,16")
    parser.add_argument("--prefill", type=int, default=0, metavar="M")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--cycle-mib", type=int, default=1024)
    parser.add_argument("--hint-before", help="also time the avx512 library with this prefetch hint (T0: before aed9e6f)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import torch

    from exl3local.kernels.cpu import build, ops

    lib = ops.library()
    info = {"tier": build.chosen_tier(), "amx_active": ops.amx_active(lib), "fp16_loop": bool(lib.exl3_cpu_fp16(-1)),
            "torch": torch.__version__, "cpus": os.cpu_count(), "mkldnn_bf16": torch.backends.mkldnn.is_available()}
    print(json.dumps(info), flush=True)
    before = build_with_hint(args.hint_before) if args.hint_before else None
    result = {"info": info, "one_row": [], "prefill": []}
    for t in (int(v) for v in args.threads.split(",") if v):
        result["one_row"] += one_row(args, t, before)
    if args.prefill:
        for t in (int(v) for v in args.prefill_threads.split(",") if v):
            result["prefill"] += prefill(args, t)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
