"""bench/kernels.py's sections that time our kernels alone (no exllamav3): split-K counts of the bound path, the
decode breakdown and kernel configs, the reconstruct kernel's configs, the ring dot kernel's pipelining depth."""

from __future__ import annotations

import torch
from kernels_common import RESULTS, bound_linear, late, make_layer, timed
from step_timing import DEVICE, log

from exl3local.kernels.triton_gemm import right_reconstruct
from exl3local.kernels.triton_gemv import choose_splits, ring_config, ring_dot_config, ring_dot_partials, ring_partials
from exl3local.kernels.triton_hadamard import input_transform, output_transform


def bench_splits(shapes) -> None:
    """The fused path's split-K count (graph replay, mul1 K4): the default (triton_gemv.choose_splits, tuned for
    the three-launch path) against a half and a quarter of it, since the last split's tail grows with it."""
    log("\n== fused split-K (graph µs, mul1 K4) ==")
    for k, n in shapes:
        trellis, suh, svh = make_layer(k, n, 4, "mul1", seed=4)
        bound = bound_linear(trellis, suh, svh, 4, "mul1")
        launch = bound.launches[0][0]
        default = launch.split_for(1)[0]
        for m in (1, 16):
            x = torch.randn(m, k, device=DEVICE[0]).half()
            variants = {}
            for splits in sorted({default, max(1, default // 2), max(1, default // 4)}, reverse=True):
                launch.splits[1] = (splits, launch.k_steps // splits)
                launch.replan()  # plans and direct-launch templates hold the split count they were made with
                variants[splits] = timed(lambda: bound(x), graph=True)
            launch.splits[1] = (default, launch.k_steps // default)
            launch.replan()
            RESULTS.append(dict(kind="splits", k=k, n=n, m=m, default=default, variants=variants))
            log(f"{k}x{n} M={m}: " + ", ".join(f"{sp} splits {us:.1f}" for sp, us in variants.items()))


def bench_breakdown(shapes, moe: dict, bits_list=(2, 3, 4, 6, 8)) -> None:
    """Where decode time goes: input transform, matmul kernel, output transform; matmul kernel variants
    (ring-order dot: tiles per program x K tiles per step x warps x split-K; the ring FMA kernel) timed
    as graph replays, per rate and codebook, plus the MoE units kernel."""
    log("\n== GEMV breakdown and configs (graph replay, matmul kernel alone) ==")
    configs = [(8, 1, 4), (8, 2, 4), (16, 1, 4), (4, 2, 4), (16, 2, 4), (8, 2, 8)]
    for k, n in shapes:
        for cb in ("mul1", "3inst"):
            for bits in bits_list:
                trellis, suh, svh = make_layer(k, n, bits, cb, seed=4)
                for m in (1, 16):
                    if late():
                        return
                    x = torch.randn(m, k, device=DEVICE[0]).half()
                    u = input_transform(x, suh)
                    z = ring_dot_partials(u, trellis, bits, cb, 16, 8, 2)
                    parts = dict(input_us=timed(lambda: input_transform(x, suh), graph=True),
                                 output_us=timed(lambda: output_transform(z, svh, None, x.dtype), graph=True))
                    variants = {}
                    if m == 1:
                        bm, bnt0 = ring_config(m, bits)
                        variants["fma_ring"] = timed(lambda: ring_partials(u, trellis, bits, cb, bm, bnt0), graph=True)
                    for bnt, kt, warps in configs:
                        if (n // 16) % bnt:
                            continue
                        base = choose_splits(n // 16 // bnt, k // 16 // kt, x.device)
                        for splits in sorted({base, base * 2}):
                            if (k // 16) % (splits * kt):
                                continue
                            key = f"dot_bnt{bnt}_kt{kt}_w{warps}_s{splits}"
                            variants[key] = timed(lambda: ring_dot_partials(u, trellis, bits, cb, 16, bnt, kt, splits,
                                                                            num_warps=warps), graph=True)
                    best = min(variants, key=variants.get)
                    row = dict(kind="breakdown", k=k, n=n, codebook=cb, bits=bits, m=m, **parts, variants=variants,
                               best=best)
                    RESULTS.append(row)
                    top = sorted(variants.items(), key=lambda kv: kv[1])[:6]
                    log(f"{k}x{n} {cb} K{bits} M={m}: in {parts['input_us']:.1f} out {parts['output_us']:.1f} µs | "
                        f"best {best} {variants[best]:.1f} µs ({k * n / variants[best] / 1e3:.0f} Gw/s) | "
                        + ", ".join(f"{key} {us:.1f}" for key, us in top)
                        + (f" | fma_ring {variants['fma_ring']:.1f}" if "fma_ring" in variants else ""))
    e_count, hidden, inter, top_k = moe["experts"], moe["hidden"], moe["intermediate"], moe["top_k"]
    trellis, suh, svh = make_layer(hidden, inter, 4, "mul1", seed=1, experts=e_count)
    for tokens in (1, 4):
        ids = torch.randperm(e_count, device=DEVICE[0])[:tokens * top_k].int()
        if ids.numel() < tokens * top_k:  # distinct experts per unit: a short id list would be read past its end
            raise ValueError(f"breakdown's MoE needs experts >= tokens * top_k ({tokens * top_k}), got {e_count}")
        u = torch.randn(tokens * top_k, hidden, device=DEVICE[0]).half()
        variants = {}  # the FMA kernel's MoE branch lost at T = 1 and 4 (h200-v3-bench.log) and was removed
        for bnt, kt, warps in ((4, 1, 4), (8, 1, 4), (8, 2, 4), (4, 2, 4), (16, 1, 4)):
            if (inter // 16) % bnt:
                continue
            variants[f"dot_bnt{bnt}_kt{kt}_w{warps}"] = timed(
                lambda: ring_dot_partials(u, trellis, 4, "mul1", 16, bnt, kt, ids=ids, num_warps=warps), graph=True)
        best = min(variants, key=variants.get)
        RESULTS.append(dict(kind="breakdown_moe", tokens=tokens, variants=variants, best=best))
        log(f"MoE gate units T={tokens}: best {best} {variants[best]:.1f} µs; all: "
            + ", ".join(f"{key} {us:.1f}" for key, us in sorted(variants.items(), key=lambda kv: kv[1])))


def bench_reconstruct(shapes, rows_m: int) -> None:
    """Prefill pieces at M = rows_m (mul1 K=4, eager, µs): the W_r reconstruct kernel per config (tile rows per
    program, tile rows per dot, warps) and the input transform; the vendor matmul is timed in prefill."""
    log("\n== reconstruct pieces (mul1 K=4, eager, µs; kernel alone) ==")
    for k, n in shapes:
        if late():
            return
        trellis, suh, svh = make_layer(k, n, 4, "mul1", seed=4)
        x = torch.randn(rows_m, k, device=DEVICE[0]).half()
        variants = {"input_transform": timed(lambda: input_transform(x, suh))}
        for rows, kt, warps in ((32, 4, 4), (16, 4, 4), (32, 2, 4), (32, 4, 8), (64, 4, 4)):
            if (k // 16) % rows:
                continue
            variants[f"right_r{rows}_kt{kt}_w{warps}"] = timed(
                lambda: right_reconstruct(trellis, svh, 4, "mul1", rows, kt, warps))
        RESULTS.append(dict(kind="reconstruct", k=k, n=n, variants=variants))
        log(f"{k}x{n}: " + ", ".join(f"{key} {us:.1f}" for key, us in sorted(variants.items(), key=lambda kv: kv[1])))


def bench_stages(shapes) -> None:
    """Software-pipelining depth of the ring dot kernel (num_stages 1 = loads straight to registers, as in
    the FMA kernel; 2 = the default cp.async double buffer), 16 rows, graph replay."""
    log("\n== ring dot num_stages (16 rows, graph, µs) ==")
    for k, n in shapes:
        for bits in (4, 6, 8):
            if late():
                return
            trellis, suh, svh = make_layer(k, n, bits, "mul1", seed=4)
            u = input_transform(torch.randn(16, k, device=DEVICE[0]).half(), suh)
            bnt, kt, warps = ring_dot_config(bits)
            variants = {f"stages{st}": timed(lambda: ring_dot_partials(u, trellis, bits, "mul1", 16, bnt, kt,
                                                                       num_warps=warps, num_stages=st), graph=True)
                        for st in (1, 2, 3)}
            RESULTS.append(dict(kind="stages", k=k, n=n, bits=bits, variants=variants))
            log(f"{k}x{n} mul1 K{bits}: " + ", ".join(f"{key} {us:.1f}" for key, us in variants.items()))
