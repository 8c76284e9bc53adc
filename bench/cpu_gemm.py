"""kernels/cpu's fp32 GEMM path on the avx512 tier: the library's own GEMM (Ŵ decoded into its B panels,
exl3_cpu_gemm.h) against a decoded strip through torch's BLAS (the path before, still the AVX2 and portable tiers'),
alternating in one process; vLLM's bf16 linear (oneDNN, prepacked) beside them where vLLM is installed. Needs no vLLM.

    python3 -P bench/cpu_gemm.py [--rows 32,128,512] [--threads 1,16] [--dtype bf16|fp32] [--out result.json]

Per thread count, shape (mul1 K4) and row count: best of --rounds of CPU time (1 thread) or wall (more threads), ms and
GFLOP/s (2·m·k·n), and the two outputs' largest difference relative to the largest output. On an AMX CPU bf16 rows
take the AMX path in the engine; --dtype fp32 with more than ops.AMX_U_MAX_ROWS rows is what reaches this path there.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

SHAPES = ((2048, 2048), (2048, 11264), (5632, 2048))  # bench/cpu_decode.py's model: hidden 2048, intermediate 5632


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="32,128,512")
    parser.add_argument("--threads", default="1")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import torch

    from exl3local.kernels.cpu import ops

    try:
        from vllm import _custom_ops as vllm_ops
    except ImportError:
        vllm_ops = None
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    result = {"info": {"torch": torch.__version__, "cpus": os.cpu_count(), "load": os.getloadavg()}, "runs": []}
    print(json.dumps(result["info"]), flush=True)
    for threads in (int(v) for v in args.threads.split(",")):
        torch.set_num_threads(threads)
        clock = time.process_time if threads == 1 else time.perf_counter
        g = torch.Generator().manual_seed(0)
        for k, n in SHAPES:
            trellis = torch.randint(-32768, 32768, (k // 16, n // 16, 64), dtype=torch.int16, generator=g)
            lin = ops.CpuLinear(trellis, (torch.randn(k, generator=g) * k**-0.5).half(),
                                torch.randn(n, generator=g).half(), 4, "mul1", tier="avx512", int8=False)
            handler = None
            if vllm_ops is not None:
                handler = vllm_ops.create_onednn_mm(torch.randn(n, k, generator=g).bfloat16().t(), 32)
            for m in (int(v) for v in args.rows.split(",")):
                x = torch.randn(m, k, generator=g).to(dtype)

                def path(own: bool) -> torch.Tensor:
                    lin.own_gemm = own
                    return lin._gemm(x, dtype, None, threads)

                runs = {"own": lambda: path(True), "blas": lambda: path(False)}
                if handler is not None:
                    xb = x.bfloat16()
                    runs["bf16_vllm"] = lambda: vllm_ops.onednn_mm(handler, xb, None)
                own, blas = path(True).float(), path(False).float()
                best = dict.fromkeys(runs, 1e9)
                for _ in range(args.rounds):
                    for name, fn in runs.items():
                        fn()
                        t0 = clock()
                        fn()
                        best[name] = min(best[name], clock() - t0)
                flop = 2 * m * k * n / 1e9
                r = {"threads": threads, "k": k, "n": n, "rows": m, "dtype": args.dtype,
                     **{f"{name}_ms": round(s * 1e3, 3) for name, s in best.items()},
                     **{f"{name}_gflops": round(flop / s, 1) for name, s in best.items()},
                     "blas_over_own": round(best["blas"] / best["own"], 3),
                     "max_rel_diff": float((own - blas).abs().max() / blas.abs().max()), "load": os.getloadavg()[0]}
                print(json.dumps(r), flush=True)
                result["runs"].append(r)
                if args.out:  # after every row: a run cut by a timeout keeps what it measured
                    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
