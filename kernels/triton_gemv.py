"""EXL3 GEMV / small-batch matmul (Triton): z = u · Ŵ with Ŵ decoded in registers, never written out.

Layouts:
    u        fp16 (rows, k)            the input transform's output (triton_hadamard.input_transform)
    trellis  int16 (k/16, n/16, 16*bits) as stored, read as int32 words (triton_decode); MoE: (E, ...) stacked
    z        fp32 (splits, rows, n)    split-K partial sums; triton_hadamard.output_transform reduces them

One program owns BN output columns × BM rows × one K split. Per BK-row step it decodes the [BK, BN] block
of Ŵ (two word loads, a funnel shift and the codebook per weight; the word/bit offsets are loop-invariant)
and multiplies it into fp32 accumulators: tl.dot for BM >= 16 (fp16 operands, fp32 accumulate: DPAS on Arc,
MMA on NVIDIA), broadcast FMAs for a single row, where padding to 16 rows would waste the layout shuffle.

Split-K exists because decode shapes have few output columns per SM (5120x1024: 16 column blocks of 64):
splits bring the program count near SPLIT_TARGET_PROGRAMS_PER_CORE x cores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exl3local.kernels.triton_decode import CODEBOOK_ID, decode_block, position_table, tile_offsets, words
from exl3local.kernels.triton_hadamard import input_transform, output_transform

# Programs per compute unit to aim for when choosing split-K (latency hiding for the word loads).
SPLIT_TARGET_PROGRAMS_PER_CORE = 4
# Rows at or below which one launch covers all rows with BM=16 dot tiles.
GEMV_BLOCK_M = 16


@triton.jit
def exl3_matmul_kernel(u_ptr, w_ptr, tab_ptr, ids_ptr, z_ptr,
                       M, size_k, tiles_n, k_per_split, expert_words, stride_zs,
                       W32: tl.constexpr, CODEBOOK: tl.constexpr, HAS_IDS: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    size_n = tiles_n * 16
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    off_hi, off_lo, shift = tile_offsets(tab_ptr, rk, rn, tiles_n, W32)

    k_start = pid_s * k_per_split
    w_base = w_ptr + (k_start // 16).to(tl.int64) * tiles_n * W32
    if HAS_IDS:  # MoE: one unit per program (BM == 1), its expert's trellis
        w_base += tl.load(ids_ptr + pid_m).to(tl.int64) * expert_words
    u_rows = u_ptr + rm.to(tl.int64)[:, None] * size_k + k_start
    step = (BK // 16) * tiles_n * W32

    if BM == 1:
        acc = tl.zeros((BK, BN), dtype=tl.float32)
        for k0 in range(0, k_per_split, BK):
            w = decode_block(w_base, off_hi, off_lo, shift, CODEBOOK)
            u = tl.load(u_ptr + pid_m.to(tl.int64) * size_k + k_start + k0 + rk).to(tl.float32)
            acc += u[:, None] * w.to(tl.float32)
            w_base += step
        z = tl.sum(acc, axis=0)[None, :]
    else:
        mask_m = (rm < M)[:, None]
        z = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, k_per_split, BK):
            w = decode_block(w_base, off_hi, off_lo, shift, CODEBOOK)
            u = tl.load(u_rows + k0 + rk[None, :], mask=mask_m, other=0.0)
            z = tl.dot(u, w, z)
            w_base += step
    tl.store(z_ptr + pid_s * stride_zs + rm.to(tl.int64)[:, None] * size_n + rn[None, :], z,
             mask=(rm < M)[:, None])


def compute_units(device: torch.device) -> int:
    """Streaming multiprocessors / Xe cores: how many programs run at once, for split-K."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    if device.type == "xpu":
        props = torch.xpu.get_device_properties(device)
        return getattr(props, "gpu_subslice_count", None) or getattr(props, "max_compute_units", 32) // 8
    return 4  # the interpreter: any small number keeps split-K exercised in CI


def choose_splits(blocks: int, k_steps: int, device: torch.device) -> int:
    """Largest power-of-two split of the K loop that keeps programs under the target, dividing k_steps."""
    target = SPLIT_TARGET_PROGRAMS_PER_CORE * compute_units(device)
    splits = 1
    while blocks * splits * 2 <= target and k_steps % (splits * 2) == 0:
        splits *= 2
    return splits


def matmul_partials(u: torch.Tensor, trellis: torch.Tensor, bits: float, codebook: str,
                    block_m: int, block_n: int, block_k: int, splits: int | None = None,
                    ids: torch.Tensor | None = None, num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """z partials (splits, rows, n) fp32 of u · Ŵ. With ids: trellis is (E, k/16, n/16, w), one unit per row."""
    rows, size_k = u.shape
    tiles_n, width = trellis.shape[-2], trellis.shape[-1]
    size_n = tiles_n * 16
    k_steps = size_k // block_k
    m_blocks = triton.cdiv(rows, block_m)
    if splits is None:
        splits = choose_splits(m_blocks * (size_n // block_n), k_steps, u.device)
    z = torch.empty(splits, rows, size_n, dtype=torch.float32, device=u.device)
    expert_words = trellis[0].numel() // 2 if ids is not None else 0
    grid = (size_n // block_n, splits, m_blocks)
    exl3_matmul_kernel[grid](
        u, words(trellis), position_table(bits, u.device), ids if ids is not None else u, z,
        rows, size_k, tiles_n, size_k // splits, expert_words, z.stride(0),
        W32=width // 2, CODEBOOK=CODEBOOK_ID[codebook], HAS_IDS=ids is not None,
        BM=block_m, BN=block_n, BK=block_k, num_warps=num_warps, num_stages=num_stages,
    )
    return z


def gemv_config(rows: int, size_n: int) -> tuple[int, int, int]:
    """(BM, BN, BK) for the decode path. BN 64 keeps 128-column layers (and every EXL3 n) divisible."""
    block_m = 1 if rows == 1 else GEMV_BLOCK_M
    return block_m, 64, 64 if block_m == 1 else 32


def gemv(x2d: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, bits: float,
         codebook: str, bias: torch.Tensor | None = None, config: tuple[int, int, int] | None = None,
         splits: int | None = None) -> torch.Tensor:
    """y = x·W (+ bias) for few rows: input transform, decode-in-registers matmul, output transform."""
    rows = x2d.shape[0]
    block_m, block_n, block_k = config or gemv_config(rows, svh.shape[0])
    u = input_transform(x2d, suh)
    z = matmul_partials(u, trellis, bits, codebook, block_m, block_n, block_k, splits)
    return output_transform(z, svh, bias, x2d.dtype)
