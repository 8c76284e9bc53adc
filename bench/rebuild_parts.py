"""What the reconstruct path's pieces cost per 27B part, graph µs (issue 21 item 4's sizing): the W_r rebuild
(triton_gemm.right_reconstruct: decode + H·svh in the weight), the plain dense decode (triton_decode.decode_dense,
and beside it the session-9 kernel that stored Ŵ through ring_rows/ring_cols), the input transform and the fp16
matmul at 32 and 64 rows. Random mul1 K4 trellis.

    python3 -P bench/rebuild_parts.py [--sweep] [--hy]    # on the H200 (source bench/device-setup.sh first)

--sweep: the rebuild alone at other (tile rows per program, KT, warps) than triton_gemm.right_reconstruct's default
(32, 4, 4), bit-identical W_r checked.
--hy: the Hadamard on y instead of in the weight, y = H(u·Ŵ)⊙svh (reference.linear's own form) with Ŵ from
decode_dense, against today's u·W_r, per part at 32..4096 rows: µs and relative error vs the fp32 reference; z in
fp32 (torch.mm's out_dtype), H on the matrix units (triton_hadamard.product_output, served) or by the fp32
butterfly (output_transform, s10a's form; s10a also had an fp16 z: as fast, but it can overflow).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench's sibling modules (python -P adds no path)
from step_timing import graph_us, log  # noqa: E402

from exl3local.kernels import triton_decode, triton_gemm  # noqa: E402
from exl3local.kernels.hadamard import hadamard_rows  # noqa: E402
from exl3local.kernels.triton_decode import rate_constants, ring_operand, ring_rows, ring_tiles, words  # noqa: E402
from exl3local.kernels.triton_hadamard import input_transform, output_transform, product_output  # noqa: E402


SWEEP = [(rows, kt, warps) for rows in (16, 32, 64) for kt in (2, 4, 8) for warps in (4, 8) if rows >= 2 * kt]
HY_ROWS = (32, 64, 128, 256, 512, 1024, 4096)


@triton.jit
def _ring_store_kernel(w_ptr, out_ptr, tiles_n, KA: tl.constexpr, HALF: tl.constexpr, W32: tl.constexpr,
                       G: tl.constexpr, CODEBOOK: tl.constexpr, KT: tl.constexpr, BNT: tl.constexpr):
    """Session 9's decode_dense (the baseline of the A/B): the ring operand stored through permuted indices."""
    tile_off, s = ring_tiles(tl.program_id(0) * BNT, tiles_n, KT, BNT, W32, G)
    w = ring_operand(w_ptr + (tl.program_id(1) * KT).to(tl.int64) * tiles_n * W32, tile_off, s, KT, BNT, KA, HALF,
                     W32, G, CODEBOOK)
    rows = tl.program_id(1) * KT * 16 + ring_rows(tl.arange(0, 16 * KT))
    i = tl.arange(0, 16 * BNT)
    cols = tl.program_id(0) * BNT * 16 + (i >> 4) * 16 + ((i >> 1) & 7) + 8 * (i & 1)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * (tiles_n * 16) + cols[None, :], w)


def ring_store(trellis: torch.Tensor) -> torch.Tensor:
    tiles_k, tiles_n, _ = trellis.shape
    out = torch.empty(tiles_k * 16, tiles_n * 16, dtype=torch.float16, device=trellis.device)
    _ring_store_kernel[(tiles_n // 8, tiles_k // 4)](words(trellis), out, tiles_n, **rate_constants(4, "mul1"),
                                                    KT=4, BNT=8)
    return out


def sweep(trellis: torch.Tensor, svh: torch.Tensor, label: str) -> None:
    served = triton_gemm.right_reconstruct(trellis, svh, 4, "mul1")
    out = {}
    for rows, kt, warps in SWEEP:
        def call():
            return triton_gemm.right_reconstruct(trellis, svh, 4, "mul1", rows, kt, warps)
        same = torch.equal(call(), served)
        out[f"r{rows}_kt{kt}_w{warps}"] = f"{graph_us(call, reps=50):.1f}" + ("" if same else " DIFFERS")
    log(f"{label} rebuild sweep (tile rows, KT, warps) µs: {out}")


def hadamard_on_y(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, label: str,
                  g: torch.Generator) -> None:
    k = trellis.shape[0] * 16
    w_hat = triton_decode.decode_dense(trellis, 4, "mul1").float()  # = reference.decode_trellis (the tests pin it)
    for rows in HY_ROWS:
        x = torch.randn(rows, k, generator=g, device=trellis.device).half()
        ref = hadamard_rows(hadamard_rows(x.float() * suh.float()) @ w_hat) * svh.float()  # reference.linear's form

        def today():
            return input_transform(x, suh) @ triton_gemm.right_reconstruct(trellis, svh, 4, "mul1")

        def hy():  # the served form (triton_gemm.reconstruct_gemm below HY_MAX_ROWS)
            z = triton_gemm.fp32_product(input_transform(x, suh), triton_decode.decode_dense(trellis, 4, "mul1"))
            return product_output(z, svh, None, torch.float16)

        def hy_butterfly():  # s10a's form: the split-K output transform's fp32 butterfly
            z = triton_gemm.fp32_product(input_transform(x, suh), triton_decode.decode_dense(trellis, 4, "mul1"))
            return output_transform(z[None], svh, None, torch.float16)

        row = {}
        for name, fn in (("today", today), ("hy", hy), ("hy_butterfly", hy_butterfly)):
            if name == "hy_butterfly" and rows > 512:
                continue  # ~2 ms at 4096 rows (s10a)
            y = fn()
            rel = float((y.float() - ref).norm() / ref.norm())
            row[name] = f"{graph_us(fn, reps=20):.1f} µs rel {rel:.2e}"
        log(f"{label} M={rows} {row}")


def main() -> int:
    g = torch.Generator(device="cuda").manual_seed(1)
    for k, n in ((5120, 17408), (17408, 5120), (5120, 10240)):
        trellis = torch.randint(-32768, 32768, (k // 16, n // 16, 64), generator=g, dtype=torch.int16, device="cuda")
        svh = (torch.randn(n, generator=g, device="cuda") * 0.05).half()
        suh = (torch.randn(k, generator=g, device="cuda") * 0.05).half()
        w = triton_gemm.right_reconstruct(trellis, svh, 4, "mul1")
        dense = triton_decode.decode_dense(trellis, 4, "mul1")
        row = {"rebuild_us": graph_us(lambda: triton_gemm.right_reconstruct(trellis, svh, 4, "mul1"), reps=50),
               "decode_dense_us": graph_us(lambda: triton_decode.decode_dense(trellis, 4, "mul1"), reps=50),
               "ring_store_us": graph_us(lambda: ring_store(trellis), reps=10),
               "dense_same_bits": torch.equal(dense, ring_store(trellis))}
        for rows in (32, 64):
            x = torch.randn(rows, k, generator=g, device="cuda").half()
            u = input_transform(x, suh)
            row[f"input_{rows}_us"] = graph_us(lambda: input_transform(x, suh), reps=50)
            row[f"mm_{rows}_us"] = graph_us(lambda: u @ w, reps=50)
        log(f"{k}x{n} K4 mul1 {({a: round(b, 1) if isinstance(b, float) else b for a, b in row.items()})}")
        if "--sweep" in sys.argv:
            sweep(trellis, svh, f"{k}x{n}")
        if "--hy" in sys.argv:
            hadamard_on_y(trellis, suh, svh, f"{k}x{n}", g)
    return 0


if __name__ == "__main__":
    sys.exit(main())
