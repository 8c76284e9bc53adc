"""EXL3 prefill (Triton + the vendor matmul), for many rows: RECONSTRUCT_GEMM.

One kernel decodes Ŵ and applies the output-side Hadamard and scale, writing W_r = fp16(fp16(Ŵ·Hn)⊙svh)
(fp16, k×n) once per call whatever the row count; then the input transform u = fp16(H(fp16(x⊙suh))) and a
vendor fp16 matmul y = u·W_r. Putting the input-side Hadamard on the activations instead of in the weight
halves the kernel's tensor work and skips a 128x128 operand shuffle per block: 147 vs 264 µs at 5120x17408
on the H200 (docs/perf/h200-v3b-sweep.log).

Ŵ is decoded in ring order (triton_decode.ring_operand); the Hadamard operand is taken at the ring's
column indices (triton_hadamard.hadamard_operands, loaded from memory: computing its signs per block was
two thirds of the earlier kernel's instructions) and rows are stored through ring_rows, so W_r lands in
natural order with no shuffle of Ŵ. The dispatch sends every call of more than GEMV_MAX_ROWS rows here:
row tiles decoded on chip (triton_gemv with 32/64-row tiles) lost to this path at every M >= 32 measured.

Up to HY_MAX_ROWS rows (deeper parts further: HY_K_PER_ROW) the Hadamard goes on the product instead
(reference.linear's own form): Ŵ decoded plainly (triton_decode.decode_dense, at its memory floor), z = u·Ŵ in fp32
from the vendor matmul, y = H(z)⊙svh (+ bias) by the output transform. No 128-wide dot per weight: 120 / 225 / 378
vs 208 / 291 / 420 µs per 5120x17408 part at 64 / 512 / 1024 rows on the H200, and a smaller error; at 4096 rows the
fp32 z's traffic costs more than that saves (1226 vs 1125; docs/dev/perf/h200-s10b-rebuild-hy.log). z stays fp32 (an fp16 z holds y/svh, which
can overflow where svh is small), so the path needs a matmul with fp32 output from fp16 operands (fp32_product);
where torch has none, the W_r path serves.

Layouts: trellis int16 (k/16, n/16, 16*bits) as stored (read as int32 words); W_r fp16 (k, n) row-major;
x (rows, k); y (rows, n) in x's dtype.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from exl3local.kernels.hadamard import HADAMARD_SCALE
from exl3local.kernels.triton_decode import decode_dense, rate_constants, ring_operand, ring_rows, ring_tiles, words
from exl3local.kernels.triton_hadamard import (RING_ROWS, hadamard_operands, input_transform, load_hadamard,
                                               product_output)

HY_MAX_ROWS = 1024  # faster per 27B part at 32..1024 rows on the H200, slower at 4096 in 2 of 3 parts (module doc)
# ...and above it while rows <= k / HY_K_PER_ROW: W_r's extra cost (the Hadamard per weight) grows with k·n, z's trip
# through memory with rows·n, so deep parts keep this form longer. H200, per part at 4096 rows (h200-s14a): 17408x5120
# 1169 vs 1195 µs with W_r; 5120x17408 1229 vs 1127, 5120x10240 756 vs 705, 6144x5120 463 vs 436. Arc unmeasured.
HY_K_PER_ROW = 4
# The W_r rebuild unpipelined: per 27B part on the H200 (s15a) 103 / 102 / 71 / 47 µs against 151 / 151 / 99 / 60 with
# Triton's default stages (3) and 155 / 157 / 105 / 70 with 2 (5120x17408, 17408x5120, 5120x10240, 6144x5120).
REBUILD_STAGES = 1
REBUILD_TILE_ROWS = 16


def rebuild_tile_rows(tiles_k: int) -> int:
    """Tile rows per program of the W_r rebuild for a weight of tiles_k tile rows (right_reconstruct's doc)."""
    return REBUILD_TILE_ROWS if tiles_k % REBUILD_TILE_ROWS == 0 else 8


@triton.jit
def _right_reconstruct_kernel(w_ptr, had_ptr, svh_ptr, out_ptr, tiles_n, tk_per_program, KA: tl.constexpr,
                              HALF: tl.constexpr, W32: tl.constexpr, G: tl.constexpr, CODEBOOK: tl.constexpr,
                              SCALE: tl.constexpr, KT: tl.constexpr):
    """W_r = fp16(fp16(Ŵ·Hn)⊙svh) for 128 columns × tk_per_program tile rows, KT tile rows per dot."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    i = tl.arange(0, 128)
    cols = pid_n * 128 + i
    h_right = load_hadamard(had_ptr, RING_ROWS)
    # W_r = fp16(right ⊙ svh) as one fp16 multiply: the product of two fp16 numbers is exact in fp32, so rounding it
    # once to fp16 is the same bits as fp16(fp32(right)·fp32(svh)), without two conversions per weight
    svh = tl.load(svh_ptr + cols)[None, :]
    tile_off, s = ring_tiles(pid_n * 8, tiles_n, KT, 8, W32, G)
    tk = pid_k * tk_per_program
    row_base = w_ptr + tk.to(tl.int64) * tiles_n * W32
    out_rows = out_ptr + (tk * 16 + ring_rows(tl.arange(0, 16 * KT))).to(tl.int64)[:, None] * (tiles_n * 16) + cols[None, :]
    for _ in range(0, tk_per_program, KT):
        w_hat = ring_operand(row_base, tile_off, s, KT, 8, KA, HALF, W32, G, CODEBOOK)
        right = (tl.dot(w_hat, h_right) * SCALE).to(tl.float16)
        tl.store(out_rows, right * svh)
        row_base += KT * tiles_n * W32
        out_rows += KT * 16 * tiles_n * 16


def right_reconstruct(trellis: torch.Tensor, svh: torch.Tensor, bits: float, codebook: str,
                      tile_rows_per_program: int | None = None, block_kt: int = 4, num_warps: int = 4) -> torch.Tensor:
    """W_r = Ŵ·Hn⊙svh, fp16 (k, n): the weight in the input's rotated basis, so x·W = H(x⊙suh)·W_r.

    REBUILD_TILE_ROWS per program (4 per dot, 4 warps) ran best at REBUILD_STAGES on the H200 (s15d, 24 configs: 101.1
    µs at 5120x17408 vs 102.4 with 32, 41.8 vs 47.4 at 6144x5120; KT 2 or 8 and 8 warps 25-110 % slower); 8 serves k
    not divisible by 256."""
    tiles_k, tiles_n, _ = trellis.shape
    if tile_rows_per_program is None:
        tile_rows_per_program = rebuild_tile_rows(tiles_k)
    w = torch.empty(tiles_k * 16, tiles_n * 16, dtype=torch.float16, device=trellis.device)
    _right_reconstruct_kernel[(tiles_n // 8, tiles_k // tile_rows_per_program)](
        words(trellis), hadamard_operands(trellis.device), svh, w, tiles_n, tile_rows_per_program,
        **rate_constants(bits, codebook), SCALE=HADAMARD_SCALE, KT=block_kt, num_warps=num_warps,
        num_stages=REBUILD_STAGES,
    )
    return w


@functools.lru_cache(maxsize=8)
def has_fp32_product(device: torch.device) -> bool:
    """Whether fp32_product runs on this device: torch.mm's out_dtype (cuBLAS has it; torch's CPU build raises,
    and the CPU takes fp32 operands instead, exact there too); elsewhere asked once."""
    if device.type == "cpu":
        return True
    a = torch.zeros(1, 16, dtype=torch.float16, device=device)
    try:
        torch.mm(a, a.t(), out_dtype=torch.float32)
    except (RuntimeError, TypeError):  # NotImplementedError is a RuntimeError; an older torch: no out_dtype
        return False
    return True


def fp32_product(u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """u·w (fp16 operands) with fp32 accumulation and output."""
    if u.device.type == "cpu":
        return u.float() @ w.float()
    return torch.mm(u, w, out_dtype=torch.float32)


def hadamard_on_y(rows: int, size_k: int, device: torch.device) -> bool:
    """Whether a call of `rows` rows through a size_k-deep weight puts the Hadamard on the product (module doc)."""
    return rows <= max(HY_MAX_ROWS, size_k // HY_K_PER_ROW) and has_fp32_product(device)


def reconstruct_gemm(x2d: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                     bits: float, codebook: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x·W (+ bias) in the form that serves `x2d`'s row count here (hadamard_on_y)."""
    hy = hadamard_on_y(x2d.shape[0], trellis.shape[0] * 16, x2d.device)
    form = product_form_gemm if hy else weight_form_gemm
    return form(x2d, trellis, suh, svh, bits, codebook, bias)


def product_form_gemm(x2d: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                      bits: float, codebook: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = H(H(x⊙suh)·Ŵ)⊙svh (+ bias): the Hadamard on the product (needs has_fp32_product)."""
    z = fp32_product(input_transform(x2d, suh), decode_dense(trellis, bits, codebook))
    return product_output(z, svh, bias, x2d.dtype)


def weight_form_gemm(x2d: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                     bits: float, codebook: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = H(x⊙suh)·W_r (+ bias): the input transform on the activations, one Hadamard in the weight."""
    y = input_transform(x2d, suh) @ right_reconstruct(trellis, svh, bits, codebook)
    if bias is not None:
        y = y + bias.to(torch.float16)
    return y.to(x2d.dtype)
