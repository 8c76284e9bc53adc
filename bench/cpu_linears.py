"""EXL3 linears on the CPU without an engine, against the bf16 engine's linear on weights of the same shapes (split
from bench/cpu_decode.py, which runs the engines and calls `linears` for its per-linear part).

    python -P bench/cpu_linears.py [--step | --prefill 512] [--repeat 3] [--threads N] [--tier avx2vnni] ...

The bf16 side is vLLM's own CPU linear (oneDNN on weights prepacked at load: dispatch_cpu_unquantized_gemm), what
the bf16 engine runs; up to session 13 the default mode used torch's F.linear, 20-30 % slower at one row on Zen 4
(still printed beside it). Default: per linear shape (one row, weights cycled through copies larger than the L3
cache) ns per weight and GB/s of weight bytes read, as wall time and as CPU time of all threads, next to this
machine's read bandwidth (a 1 GiB sum). --step: one decoded token's linears for every layer through the plugin's
BoundLinear, with one library call per fused layer (the default) and with one per part, against the bf16 linear,
alternating in one process. --prefill M: per linear shape at M bf16 rows as served (the GEMV up to ops.gemv_max_rows,
then the GEMM path: AMX where the CPU has it, and fp32 BLAS) against the bf16 linear. --tier forces an ISA tier
(EXL3LOCAL_CPU_TIER), e.g. the AVX2 laptop tiers on an AVX-512 machine.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def linear_speeds(cfg: dict, bits: int) -> list[dict]:
    """Per linear shape: kernels/cpu (one row) vs the bf16 engine's linear (vLLM's oneDNN, one row; torch's F.linear
    beside it), ns per weight and GB/s of weights read."""
    import torch
    from vllm import _custom_ops as vllm_ops

    from exl3local.kernels.cpu import ops

    def best(fn, copies: int, reps: int = 40) -> tuple[float, float]:
        """(median wall seconds, mean CPU seconds of all threads) per call: on a shared machine the CPU time
        is the steadier of the two (memory stalls count in it; waiting for a core does not)."""
        for i in range(copies):
            fn(i)
        times = []
        cpu0 = time.process_time()
        for r in range(reps):
            t0 = time.perf_counter()
            fn(r % copies)
            times.append(time.perf_counter() - t0)
        cpu = (time.process_time() - cpu0) / reps
        times.sort()
        return times[len(times) // 2], cpu

    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    rows = []
    for k, n in ((hidden, hidden), (hidden, 2 * inter), (inter, hidden)):
        copies = max(2, (256 << 20) // (k * n * 2))  # bf16 copies over 256 MiB: past the 105 MiB L3
        g = torch.Generator().manual_seed(0)
        lins = [ops.CpuLinear(torch.randint(-32768, 32768, (k // 16, n // 16, 16 * bits), dtype=torch.int16,
                                            generator=g), torch.randn(k).half(), torch.randn(n).half(), bits, "mul1")
                for _ in range(copies)]
        x = torch.randn(1, k)
        exl3, exl3_cpu = best(lambda i: lins[i](x), copies)
        for lin in lins:  # the same trellises through the opt-in int8 path (mul1 on AVX-512; else exact again)
            lin.int8 = ops.int8_active("mul1", lin.lib, True)
        int8, int8_cpu = best(lambda i: lins[i](x), copies)
        del lins
        dense = [torch.randn(n, k, generator=g).bfloat16() for _ in range(copies)]
        xb = x.bfloat16()
        torch_bf16, torch_cpu = best(lambda i: torch.nn.functional.linear(xb, dense[i]), copies)
        # What the bf16 engine runs (vllm's dispatch_cpu_unquantized_gemm): oneDNN on weights prepacked at load.
        handlers = [vllm_ops.create_onednn_mm(w.t(), 32) for w in dense]
        del dense
        bf16, bf16_cpu = best(lambda i: vllm_ops.onednn_mm(handlers[i], xb, None), copies)
        rows.append({"k": k, "n": n, "threads": torch.get_num_threads(), "exl3_us": exl3 * 1e6, "bf16_us": bf16 * 1e6,
                     "exl3_ns_per_weight": exl3 * 1e9 / (k * n), "bf16_ns_per_weight": bf16 * 1e9 / (k * n),
                     "exl3_cpu_ns_per_weight": exl3_cpu * 1e9 / (k * n), "bf16_cpu_ns_per_weight": bf16_cpu * 1e9 / (k * n),
                     "torch_bf16_ns_per_weight": torch_bf16 * 1e9 / (k * n),
                     "int8_ns_per_weight": int8 * 1e9 / (k * n), "int8_cpu_ns_per_weight": int8_cpu * 1e9 / (k * n),
                     "exl3_gb_s": k * n * bits / 8 / exl3 / 1e9, "bf16_gb_s": k * n * 2 / bf16 / 1e9})
        del handlers
    return rows


def linear_step(args, cfg: dict) -> None:
    """Every layer's linears for one decoded token, without vLLM: EXL3 through the plugin's BoundLinear (the
    parts vLLM fuses: qkv, o, gate_up, down) against the bf16 engine's linear (vLLM's oneDNN, prepacked) on weights
    of the same shapes."""
    import torch
    from vllm import _custom_ops as vllm_ops

    from exl3local.kernels import KernelSpec, prepare
    from exl3local.kernels.bound import BoundLinear
    from exl3local.kernels.cpu import build

    if args.threads:
        torch.set_num_threads(args.threads)
    hidden, inter, head_dim = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = ((hidden, (q, kv, kv)), (q, (hidden,)), (hidden, (inter, inter)), (inter, (hidden,)))
    g = torch.Generator().manual_seed(0)

    def part(k: int, n: int):
        kernel = prepare(KernelSpec(k, n, args.bits, "mul1", torch.bfloat16), "cpu")
        trellis = torch.randint(-32768, 32768, (k // 16, n // 16, 16 * args.bits), dtype=torch.int16, generator=g)
        return kernel, trellis, (torch.randn(k, generator=g) * k**-0.5).half(), torch.randn(n, generator=g).half(), n

    layers = [[BoundLinear([part(k, n) for n in ns], k) for k, ns in shapes] for _ in range(cfg["num_hidden_layers"])]
    dense = [[(k, vllm_ops.create_onednn_mm(torch.randn(sum(ns), k, generator=g).bfloat16().t(), 32)) for k, ns in shapes]
             for _ in layers]
    xs = {k: torch.randn(1, k, generator=g).bfloat16() for k, _ in shapes}
    bounds = [bound for layer in layers for bound in layer]
    whole = [bound.whole for bound in bounds]

    def exl3(fused: bool) -> None:
        for bound, one in zip(bounds, whole):
            bound.whole = one if fused else None  # None: each part its own library call (before session 8)
            bound(xs[bound.in_features])

    def bf16() -> None:
        for layer in dense:
            for k, handler in layer:
                vllm_ops.onednn_mm(handler, xs[k], None)

    cpu: dict[str, list[float]] = {}
    runs = (("exl3, one call per layer", lambda: exl3(True)), ("exl3, one call per part", lambda: exl3(False)),
            ("bf16", bf16))
    for _ in range(args.repeat):  # alternating, in one process: a change in the machine's load hits all three
        for name, fn in runs:
            fn()
            cpu0, t0 = time.process_time(), time.perf_counter()
            for _ in range(5):
                fn()
            wall_ms, cpu_ms = (time.perf_counter() - t0) / 5e-3, (time.process_time() - cpu0) / 5e-3
            cpu.setdefault(name, []).append(cpu_ms)
            print(f"{name} ({torch.get_num_threads()} threads, {build.chosen_tier()} tier): one step's linears "
                  f"{wall_ms:.1f} ms wall, {cpu_ms:.1f} ms CPU", flush=True)
    best = {name: min(values) for name, values in cpu.items()}
    print("best CPU ms per step: " + ", ".join(f"{name} {ms:.1f}" for name, ms in best.items())
          + f"; bf16/exl3 {best['bf16'] / best['exl3, one call per layer']:.2f}x (per part "
          f"{best['bf16'] / best['exl3, one call per part']:.2f}x); load {os.getloadavg()[0]:.1f}")


def linear_prefill(args, cfg: dict) -> None:
    """Per linear shape, M bf16 rows (a prefill, or a batched decode step): kernels/cpu as served (the GEMV up to
    ops.gemv_max_rows rows; past that the GEMM path on AMX where the CPU has it, and on fp32 BLAS, the path before and
    elsewhere) against vLLM's own bf16 linear (oneDNN on prepacked weights, what the bf16 engine runs), alternating in
    one process; best CPU ms of --repeat."""
    import torch
    from cpu_host import gemm_pair  # noqa: PLC0415  (the sibling bench: the same random pair)
    from vllm import _custom_ops as vllm_ops

    from exl3local.kernels.cpu import ops

    if args.threads:
        torch.set_num_threads(args.threads)
    hidden, inter, m = cfg["hidden_size"], cfg["intermediate_size"], args.prefill
    gemv = m <= ops.gemv_max_rows(ops.library())
    fp32_form = "own" if ops.own_gemm_serves(ops.library()) else "BLAS"
    served = "GEMV" if gemv else "GEMM " + ("AMX" if ops.amx_active(ops.library()) else f"fp32 {fp32_form} (no AMX)")
    g = torch.Generator().manual_seed(0)
    for k, n in ((hidden, hidden), (hidden, 2 * inter), (inter, hidden)):
        lin, fp32 = gemm_pair(k, n, args.bits, g)
        x = torch.randn(m, k, generator=g).bfloat16()
        handler = vllm_ops.create_onednn_mm(torch.randn(n, k, generator=g).bfloat16().t(), 32)
        runs = {"bf16 (vLLM oneDNN)": lambda: vllm_ops.onednn_mm(handler, x, None),
                f"exl3 {served}": lambda: lin(x, torch.bfloat16)}
        if not gemv:
            runs[f"exl3 GEMM fp32 {fp32_form}"] = lambda: fp32(x, torch.bfloat16)
        best: dict[str, float] = {}
        for _ in range(args.repeat):
            for name, fn in runs.items():
                cpu0 = time.process_time()
                fn()
                best[name] = min(best.get(name, 1e9), (time.process_time() - cpu0) * 1e3)
        bf16 = best["bf16 (vLLM oneDNN)"]
        print(f"{m} rows, {k}x{n} ({torch.get_num_threads()} threads), best CPU ms of {args.repeat}: "
              + ", ".join(f"{name} {ms:.1f} ({bf16 / ms:.2f}x)" for name, ms in best.items())
              + f"; load {os.getloadavg()[0]:.1f}", flush=True)


def read_bandwidth() -> float:
    import torch

    a = torch.ones(256 << 20)  # 1 GiB fp32
    a.sum()
    t0 = time.perf_counter()
    for _ in range(3):
        a.sum()
    return 3 * a.numel() * 4 / (time.perf_counter() - t0) / 1e9


def linears(args, cfg: dict, results: dict) -> None:
    """The per-linear part, into `results`."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    results["read_gb_s"] = read_bandwidth()
    print(f"memory read bandwidth (1 GiB sum): {results['read_gb_s']:.1f} GB/s")
    results["linears"] = linear_speeds(cfg, args.bits)
    for r in results["linears"]:
        print(f"linear {r['k']}x{r['n']} ({r['threads']} threads): EXL3 {r['exl3_us']:.0f} us ({r['exl3_ns_per_weight']:.3f} "
              f"ns/w, {r['exl3_gb_s']:.2f} GB/s trellis, CPU {r['exl3_cpu_ns_per_weight']:.3f} ns/w) vs bf16 "
              f"(vLLM oneDNN) {r['bf16_us']:.0f} us ({r['bf16_ns_per_weight']:.3f} ns/w, {r['bf16_gb_s']:.2f} GB/s, CPU "
              f"{r['bf16_cpu_ns_per_weight']:.3f} ns/w; torch F.linear {r['torch_bf16_ns_per_weight']:.3f} ns/w); EXL3 int8 opt-in {r['int8_ns_per_weight']:.3f} ns/w, CPU "
              f"{r['int8_cpu_ns_per_weight']:.3f} ns/w")


def main() -> None:
    from cpu_decode import add_model_arguments, model_config  # noqa: PLC0415  (the sibling bench: the same model shapes)

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--step", action="store_true", help="one decode step's linears instead of per linear")
    parser.add_argument("--repeat", type=int, default=3, help="--step: alternate the variants this many times")
    parser.add_argument("--tier", help="force this ISA tier (sets EXL3LOCAL_CPU_TIER)")
    parser.add_argument("--prefill", type=int, metavar="M", help="M rows as served instead (the GEMV, then the GEMM "
                        "path: AMX, fp32)")
    args = parser.parse_args()
    if args.tier:
        os.environ["EXL3LOCAL_CPU_TIER"] = args.tier
    cfg = model_config(args)
    if args.step or args.prefill:
        (linear_prefill if args.prefill else linear_step)(args, cfg)
        return
    results: dict = {}
    linears(args, cfg, results)
    print(json.dumps(results))


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling bench (python -P adds no path)
    main()
