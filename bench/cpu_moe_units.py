"""kernels/cpu MoE, grouped step: experts packed as units up to N rows (two library calls for all of them) against
units up to 8 rows with the busier experts one at a time through CpuLinear (its GEMV up to the tier's crossover).

    .venv/bin/python -P bench/cpu_moe_units.py [--shape E,hidden,inter,top_k ...] [--tokens 16 32 64 128]
        [--threads 1] [--reps 9] [--clock cpu|wall]

Synthetic mul1 K4 experts, routing uniform at random (seeded; real routers are skewed, which puts more rows on the
popular experts). Per shape and token count: ms (--clock: CPU time or wall) of CpuExperts.grouped with unit_rows = 8
and with the library's default (ops.gemv_max_rows: 24 on the AVX-512 and AVX2 tiers without AMX), median of --reps
calls, best of three rounds alternating the two; how many experts had 9-24 rows; whether the outputs agree bit for bit.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

DEFAULT_SHAPES = ["16,256,128,4", "128,2048,768,8"]  # the Qwen3.5-MoE fixtures' experts; a Qwen3-30B-A3B-sized layer


def experts_for(E: int, hidden: int, inter: int, g: torch.Generator):
    from exl3local.kernels import reference
    from exl3local.kernels.cpu.moe import CpuExperts

    class Proj:  # the fields CpuExperts reads from plugin.moe.Projection
        def __init__(self, k, n):
            self.size_k, self.size_n, self.bits, self.codebook = k, n, 4, "mul1"
            self.trellis_shape = (k // 16, n // 16, reference.words_per_tile(4))

    w13 = torch.randint(-32768, 32768, (E, 2, hidden // 16, inter // 16, 64), generator=g, dtype=torch.int16)
    w2 = torch.randint(-32768, 32768, (E, inter // 16, hidden // 16, 64), generator=g, dtype=torch.int16)
    shapes = ((E, 2, hidden), (E, 2, inter), (E, inter), (E, hidden))
    scales = [(torch.randn(*s, generator=g) * 0.1).half() for s in shapes]
    proj = {"gate": Proj(hidden, inter), "up": Proj(hidden, inter), "down": Proj(inter, hidden)}
    return CpuExperts(w13, scales[0], scales[1], w2, scales[2], scales[3], proj)


def median(fn, reps: int, clock) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return sorted(times)[reps // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs="+", default=DEFAULT_SHAPES, help="E,hidden,inter,top_k")
    parser.add_argument("--tokens", nargs="+", type=int, default=[16, 32, 64, 128])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="cpu: this process's CPU time (steadier on a shared box; all its threads summed)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"threads {args.threads}, {args.clock} ms, load {os.getloadavg()}", flush=True)
    for shape in args.shape:
        E, hidden, inter, top_k = (int(v) for v in shape.split(","))
        g = torch.Generator().manual_seed(0)
        experts = experts_for(E, hidden, inter, g)
        default = experts.unit_rows
        for tokens in args.tokens:
            x = torch.randn(tokens, hidden, generator=g)
            ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(tokens)])
            weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1)
            counts = torch.bincount(ids.reshape(-1), minlength=E)
            mid = int(((counts > 8) & (counts <= default)).sum())
            best, outs = {}, {}
            for _ in range(3):
                for cap in (8, default):
                    experts.unit_rows = cap
                    outs[cap] = experts.grouped(x, weights, ids)
                    took = median(lambda: experts.grouped(x, weights, ids), args.reps, clock)
                    best[cap] = min(best.get(cap, 1e9), took)
            experts.unit_rows = default
            same = torch.equal(outs[8], outs[default])
            print(f"E={E} hidden={hidden} inter={inter} top{top_k} tokens={tokens}: "
                  f"experts with 9-{default} rows {mid}"
                  f" (most rows {int(counts.max())}); units<=8 {best[8] * 1e3:.2f} ms, units<={default}"
                  f" {best[default] * 1e3:.2f} ms ({best[8] / best[default]:.2f}x); bit-identical {same}", flush=True)
    print(f"load after {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
