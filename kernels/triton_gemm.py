"""EXL3 prefill paths (Triton), for many rows:

GEMM (`gemm`): the GEMV kernel (triton_gemv.exl3_matmul_kernel) with large row tiles. Ŵ is decoded on chip
once per row tile and fed to tl.dot; decode work therefore grows with rows / BM.

RECONSTRUCT_GEMM (`reconstruct_gemm`): one kernel decodes Ŵ and applies both Hadamards and both scales,
writing W in the original basis (fp16, k×n); then a vendor fp16 matmul runs on the raw x. No activation
transforms, and the decode runs once per call whatever the row count: this wins once rows amortise the
k·n·2-byte write and read. (A variant that decoded Ŵ densely in ring order and ran the matmul in the
rotated basis was 2.7x slower at M=2048, PERF.md v2; not profiled, its scattered 2-byte stores are
the suspect.)

Layouts: trellis int16 (k/16, n/16, 16*bits) as stored (read as int32 words); W fp16 (k, n) row-major;
x (rows, k); y (rows, n) in x's dtype.

Reconstruct numerics follow exllamav3's get_weight_tensor order (spec §5): Hk·Ŵ accumulated in fp32 and
rounded to fp16, ⊙suh in fp16, ·Hn in fp32, rounded to fp16, ⊙svh in fp16. The ±1 Hadamard operands are
exact in fp16, so both products run as fp16 dots with fp32 accumulation (tensor cores / DPAS).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exl3local.kernels.hadamard import HADAMARD_SCALE
from exl3local.kernels.triton_decode import CODEBOOK_ID, decode_block, position_table, tile_offsets, words
from exl3local.kernels.triton_gemv import matmul_partials
from exl3local.kernels.triton_hadamard import input_transform, output_transform

GEMM_CONFIG = (64, 64, 32)  # (BM, BN, BK); re-measure per device with bench/kernels.py


@triton.jit
def _hadamard_pm1(BLOCK: tl.constexpr):
    """The unscaled 128x128 Hadamard matrix, ±1 in fp16 (exact)."""
    i = tl.arange(0, BLOCK)
    p = i[:, None] & i[None, :]
    p = p ^ (p >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    return (1 - 2 * (p & 1)).to(tl.float16)


@triton.jit
def _reconstruct_kernel(w_ptr, tab_ptr, suh_ptr, svh_ptr, out_ptr, tiles_n,
                        W32: tl.constexpr, CODEBOOK: tl.constexpr, SCALE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rk = tl.arange(0, 128)
    rn = pid_n * 128 + tl.arange(0, 128)
    off_hi, off_lo, shift = tile_offsets(tab_ptr, rk, rn, tiles_n, W32)
    w_hat = decode_block(w_ptr + (pid_k * 8).to(tl.int64) * tiles_n * W32, off_hi, off_lo, shift, CODEBOOK)
    h = _hadamard_pm1(128)
    rows = pid_k * 128 + rk
    left = (tl.dot(h, w_hat) * SCALE).to(tl.float16)
    left = (left.to(tl.float32) * tl.load(suh_ptr + rows).to(tl.float32)[:, None]).to(tl.float16)
    right = (tl.dot(left, h) * SCALE).to(tl.float16)
    w = (right.to(tl.float32) * tl.load(svh_ptr + rn).to(tl.float32)[None, :]).to(tl.float16)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * (tiles_n * 16) + rn[None, :], w)


def reconstruct(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, bits: float,
                codebook: str) -> torch.Tensor:
    """W in the original basis, fp16 (k, n): reference.reconstruct's result within fp16 rounding."""
    tiles_k, tiles_n, width = trellis.shape
    w = torch.empty(tiles_k * 16, tiles_n * 16, dtype=torch.float16, device=trellis.device)
    grid = (tiles_n // 8, tiles_k // 8)
    _reconstruct_kernel[grid](
        words(trellis), position_table(bits, trellis.device), suh, svh, w, tiles_n,
        W32=width // 2, CODEBOOK=CODEBOOK_ID[codebook], SCALE=HADAMARD_SCALE, num_warps=8,
    )
    return w


def reconstruct_gemm(x2d: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                     bits: float, codebook: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x·W (+ bias) through a dense fp16 W reconstructed for this call."""
    w = reconstruct(trellis, suh, svh, bits, codebook)
    y = x2d.to(torch.float16) @ w
    if bias is not None:
        y = y + bias.to(torch.float16)
    return y.to(x2d.dtype)


def gemm(x2d: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, bits: float,
         codebook: str, bias: torch.Tensor | None = None,
         config: tuple[int, int, int] = GEMM_CONFIG) -> torch.Tensor:
    """y = x·W (+ bias), Ŵ decoded on chip per row tile (no dense weight in memory)."""
    block_m, block_n, block_k = config
    u = input_transform(x2d, suh)
    z = matmul_partials(u, trellis, bits, codebook, block_m, block_n, block_k)
    return output_transform(z, svh, bias, x2d.dtype)
