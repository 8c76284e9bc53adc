"""Reference decoder throughput on this machine (weights per second), per codebook and bit width.

    .venv/bin/python -P bench/reference_speed.py [--size 4096] [--device cpu]
"""

from __future__ import annotations

import argparse
import time

import torch

from exl3local.kernels import reference


def best_of(fn, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096, help="k = n of the test matrix")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    size, device = args.size, torch.device(args.device)
    suh = torch.ones(size, dtype=torch.float16, device=device)
    x = torch.randn(1, size, dtype=torch.float16, device=device)
    print(f"reference decoder, {size}x{size}, {device}, torch threads {torch.get_num_threads()}")
    print(f"{'codebook':>8} {'bits':>5} {'decode Mw/s':>12} {'reconstruct Mw/s':>17} {'linear M=1 ms':>14}")
    for codebook, bits in (("mul1", 2), ("mul1", 2.5), ("mul1", 4), ("mcg", 4), ("3inst", 4), ("mul1", 8)):
        trellis = torch.randint(-32768, 32768, (size // 16, size // 16, reference.words_per_tile(bits)),
                                dtype=torch.int16, device=device)  # fmt: skip
        decode = best_of(lambda: reference.decode_trellis(trellis, bits, codebook))
        recon = best_of(lambda: reference.reconstruct(trellis, suh, suh, bits, codebook))
        lin = best_of(lambda: reference.linear(x, trellis, suh, suh, bits, codebook))
        weights = size * size / 1e6
        print(f"{codebook:>8} {bits:>5} {weights / decode:>12.1f} {weights / recon:>17.1f} {lin * 1e3:>14.1f}")


if __name__ == "__main__":
    main()
