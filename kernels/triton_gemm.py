"""EXL3 prefill paths (Triton), for many rows:

GEMM (`gemm`): the GEMV kernel (triton_gemv.exl3_ring_dot_kernel) with large row tiles. Ŵ is decoded on chip
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
exact in fp16, so both products run as fp16 dots with fp32 accumulation (tensor cores / DPAS). Ŵ is decoded
in ring order (triton_decode.ring_operand); the Hadamard operands are taken at the ring's row and column
indices (triton_hadamard.hadamard_operands, loaded from memory: computing their signs per block was two
thirds of the kernel's instructions), so the products come out in natural order with no shuffle of Ŵ.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exl3local.kernels.hadamard import HADAMARD_SCALE
from exl3local.kernels.triton_decode import CODEBOOK_ID, lanes_per_superlane, ring_operand, ring_rows, words
from exl3local.kernels.triton_gemv import ring_dot_partials
from exl3local.kernels.triton_hadamard import (
    RING_COLUMNS, RING_ROWS, hadamard_operands, input_transform, load_hadamard, output_transform,
)

GEMM_CONFIG = (64, 8, 2, 4)  # (BM, BNT, KT, warps); re-measure per device with bench/kernels.py


@triton.jit
def _reconstruct_kernel(w_ptr, had_ptr, suh_ptr, svh_ptr, out_ptr, tiles_n, KA: tl.constexpr, HALF: tl.constexpr,
                        W32: tl.constexpr, G: tl.constexpr, CODEBOOK: tl.constexpr, SCALE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    S: tl.constexpr = 32 // G
    # Ŵ of the 128x128 block in ring order (triton_decode.ring_operand); the Hadamard operands are taken at
    # the ring's indices (hadamard_operands), so the products come out in natural order.
    i = tl.arange(0, 128)
    kt = tl.arange(0, 8)
    tn = pid_n * 8 + tl.arange(0, 8)
    tile_off = (kt[:, None, None] * tiles_n + tn[None, :, None]) * W32
    row_base = w_ptr + (pid_k * 8).to(tl.int64) * tiles_n * W32
    w_hat = ring_operand(row_base, tile_off, tl.arange(0, S)[None, None, :], 8, 8, KA, HALF, W32 // S, W32, G,
                         CODEBOOK)
    rows = pid_k * 128 + i
    cols = pid_n * 128 + i
    left = (tl.dot(load_hadamard(had_ptr, RING_COLUMNS), w_hat) * SCALE).to(tl.float16)
    left = (left.to(tl.float32) * tl.load(suh_ptr + rows).to(tl.float32)[:, None]).to(tl.float16)
    right = (tl.dot(left, load_hadamard(had_ptr, RING_ROWS)) * SCALE).to(tl.float16)
    w = (right.to(tl.float32) * tl.load(svh_ptr + cols).to(tl.float32)[None, :]).to(tl.float16)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * (tiles_n * 16) + cols[None, :], w)


@triton.jit
def _right_reconstruct_kernel(w_ptr, had_ptr, svh_ptr, out_ptr, tiles_n, tk_per_program, KA: tl.constexpr,
                              HALF: tl.constexpr, W32: tl.constexpr, G: tl.constexpr, CODEBOOK: tl.constexpr,
                              SCALE: tl.constexpr, KT: tl.constexpr):
    """W_r = fp16(fp16(Ŵ·Hn)⊙svh) for 128 columns × tk_per_program tile rows, KT tile rows per dot."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    S: tl.constexpr = 32 // G
    i = tl.arange(0, 128)
    cols = pid_n * 128 + i
    h_right = load_hadamard(had_ptr, RING_ROWS)
    svh = tl.load(svh_ptr + cols).to(tl.float32)[None, :]
    kt = tl.arange(0, KT)
    tile_off = (kt[:, None, None] * tiles_n + pid_n * 8 + tl.arange(0, 8)[None, :, None]) * W32
    s = tl.arange(0, S)[None, None, :]
    tk = pid_k * tk_per_program
    row_base = w_ptr + tk.to(tl.int64) * tiles_n * W32
    out_rows = out_ptr + (tk * 16 + ring_rows(tl.arange(0, 16 * KT))).to(tl.int64)[:, None] * (tiles_n * 16) + cols[None, :]
    for _ in range(0, tk_per_program, KT):
        w_hat = ring_operand(row_base, tile_off, s, KT, 8, KA, HALF, W32 // S, W32, G, CODEBOOK)
        right = (tl.dot(w_hat, h_right) * SCALE).to(tl.float16)
        tl.store(out_rows, (right.to(tl.float32) * svh).to(tl.float16))
        row_base += KT * tiles_n * W32
        out_rows += KT * 16 * tiles_n * 16


def right_reconstruct(trellis: torch.Tensor, svh: torch.Tensor, bits: float, codebook: str,
                      tile_rows_per_program: int = 8, block_kt: int = 4, num_warps: int = 4) -> torch.Tensor:
    """W_r = Ŵ·Hn⊙svh, fp16 (k, n): the weight in the input's rotated basis, so x·W = H(x⊙suh)·W_r."""
    tiles_k, tiles_n, width = trellis.shape
    w = torch.empty(tiles_k * 16, tiles_n * 16, dtype=torch.float16, device=trellis.device)
    _right_reconstruct_kernel[(tiles_n // 8, tiles_k // tile_rows_per_program)](
        words(trellis), hadamard_operands(trellis.device), svh, w, tiles_n, tile_rows_per_program, KA=int(bits),
        HALF=bits != int(bits), W32=width // 2, G=lanes_per_superlane(bits), CODEBOOK=CODEBOOK_ID[codebook],
        SCALE=HADAMARD_SCALE, KT=block_kt, num_warps=num_warps,
    )
    return w


def right_reconstruct_gemm(x2d: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                           bits: float, codebook: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = H(x⊙suh)·W_r (+ bias): the input transform on the activations, one Hadamard in the weight."""
    y = input_transform(x2d, suh) @ right_reconstruct(trellis, svh, bits, codebook)
    if bias is not None:
        y = y + bias.to(torch.float16)
    return y.to(x2d.dtype)


def reconstruct(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, bits: float,
                codebook: str) -> torch.Tensor:
    """W in the original basis, fp16 (k, n): reference.reconstruct's result within fp16 rounding."""
    tiles_k, tiles_n, width = trellis.shape
    w = torch.empty(tiles_k * 16, tiles_n * 16, dtype=torch.float16, device=trellis.device)
    grid = (tiles_n // 8, tiles_k // 8)
    _reconstruct_kernel[grid](
        words(trellis), hadamard_operands(trellis.device), suh, svh, w, tiles_n, KA=int(bits), HALF=bits != int(bits), W32=width // 2,
        G=lanes_per_superlane(bits), CODEBOOK=CODEBOOK_ID[codebook], SCALE=HADAMARD_SCALE, num_warps=8,
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
         config: tuple[int, int, int, int] = GEMM_CONFIG) -> torch.Tensor:
    """y = x·W (+ bias), Ŵ decoded on chip per row tile (no dense weight in memory); config = (BM, BNT, KT, warps)."""
    block_m, block_nt, block_kt, warps = config
    u = input_transform(x2d, suh)
    z = ring_dot_partials(u, trellis, bits, codebook, block_m, block_nt, block_kt, num_warps=warps)
    return output_transform(z, svh, bias, x2d.dtype)
