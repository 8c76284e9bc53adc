"""EXL3 GEMV / small-batch matmul (Triton): z = u · Ŵ with Ŵ decoded in registers, never written out.

Two kernels: `exl3_matmul_kernel` decodes Ŵ in its (row, col) layout per [BK, BN] block and feeds tl.dot
(5-16 rows, and the on-chip GEMM of triton_gemm), and `exl3_gemv_ring_kernel` (below) decodes in trellis
order with compile-time shifts and gathers activations instead (1-4 rows, and MoE units); PERF.md v2.

Layouts:
    u        fp16 (rows, k)            the input transform's output (triton_hadamard.input_transform)
    trellis  int16 (k/16, n/16, 16*bits) as stored, read as int32 words (triton_decode); MoE: (E, ...) stacked
    z        fp32 (splits, rows, n)    split-K partial sums; triton_hadamard.output_transform reduces them

exl3_matmul_kernel: one program owns BN output columns × BM (>= 16) rows × one K split. Per BK-row step it
decodes the [BK, BN] block of Ŵ (two word loads, a funnel shift and the codebook per weight; the word/bit
offsets are loop-invariant) and feeds tl.dot (fp16 operands, fp32 accumulate: DPAS on Arc, MMA on NVIDIA).

Split-K exists because decode shapes have few output columns per SM (5120x1024: 16 column blocks of 64):
splits bring the program count near SPLIT_TARGET_PROGRAMS_PER_CORE x cores.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from exl3local.kernels.triton_decode import CODEBOOK_ID, decode_block, decode_state, position_table, tile_offsets, words
from exl3local.kernels.triton_hadamard import input_transform, output_transform

# Programs per compute unit that split-K aims for: the best H200 configs ran 4-8 per SM (544-1024
# programs on 132 SMs; bench/kernels.py breakdown, PERF.md v2).
SPLIT_TARGET_PROGRAMS_PER_CORE = 4
RING_MAX_ROWS = 4  # rows served by the ring kernel; 5..16 rows go to the tiled dot kernel
TILED_GEMV_CONFIG = (16, 32, 64)  # (BM, BN, BK): best tiled config at 16 rows on the H200


@triton.jit
def exl3_matmul_kernel(u_ptr, w_ptr, tab_ptr, z_ptr, M, size_k, tiles_n, k_per_split, stride_zs,
                       W32: tl.constexpr, CODEBOOK: tl.constexpr,
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
    u_rows = u_ptr + rm.to(tl.int64)[:, None] * size_k + k_start
    step = (BK // 16) * tiles_n * W32
    mask_m = (rm < M)[:, None]
    z = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, k_per_split, BK):
        w = decode_block(w_base, off_hi, off_lo, shift, CODEBOOK)
        u = tl.load(u_rows + k0 + rk[None, :], mask=mask_m, other=0.0)
        z = tl.dot(u, w, z)
        w_base += step
    tl.store(z_ptr + pid_s * stride_zs + rm.to(tl.int64)[:, None] * size_n + rn[None, :], z, mask=mask_m)


@functools.lru_cache(maxsize=8)
def compute_units(device: torch.device) -> int:
    """Streaming multiprocessors / Xe cores: how many programs run at once, for split-K."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    if device.type == "xpu":
        props = torch.xpu.get_device_properties(device)
        return getattr(props, "gpu_subslice_count", None) or getattr(props, "max_compute_units", 32) // 8
    return 1  # the interpreter: few programs keep CI fast (tests force split-K explicitly)


def choose_splits(blocks: int, k_steps: int, device: torch.device) -> int:
    """Smallest power-of-two split of the K loop (dividing k_steps) that reaches the program target."""
    target = SPLIT_TARGET_PROGRAMS_PER_CORE * compute_units(device)
    splits = 1
    while blocks * splits < target and k_steps % (splits * 2) == 0:
        splits *= 2
    return splits


def matmul_partials(u: torch.Tensor, trellis: torch.Tensor, bits: float, codebook: str,
                    block_m: int, block_n: int, block_k: int, splits: int | None = None,
                    num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """z partials (splits, rows, n) fp32 of u · Ŵ through the tiled kernel (block_m >= 16: a tl.dot tile)."""
    rows, size_k = u.shape
    tiles_n, width = trellis.shape[-2], trellis.shape[-1]
    size_n = tiles_n * 16
    k_steps = size_k // block_k
    m_blocks = triton.cdiv(rows, block_m)
    if splits is None:
        splits = choose_splits(m_blocks * (size_n // block_n), k_steps, u.device)
    z = torch.empty(splits, rows, size_n, dtype=torch.float32, device=u.device)
    grid = (size_n // block_n, splits, m_blocks)
    exl3_matmul_kernel[grid](
        u, words(trellis), position_table(bits, u.device), z, rows, size_k, tiles_n, size_k // splits, z.stride(0),
        W32=width // 2, CODEBOOK=CODEBOOK_ID[codebook], BM=block_m, BN=block_n, BK=block_k,
        num_warps=num_warps, num_stages=num_stages,
    )
    return z


# ---- Ring-order GEMV (v2): decode positions in trellis order, gather the activations instead ----------
#
# Lane t of a tile holds ring positions 8t..8t+7 (the MMA B-fragment order, spec §4), whose codes are
# contiguous stream bits. G consecutive lanes ("a super-lane") span a whole number of 32-bit words, so
# within a super-lane every position's state sits at a compile-time word and bit offset: the kernel
# unrolls the 8·G positions with constant shifts, and each word is loaded once per super-lane instead of
# twice per weight. Position (t, j) multiplies activation row 2(t&3) + (j&1) + 8((j>>1)&1) of its tile and
# adds into output column (t>>2) + 8(j>>2); the 16 positions of each column are summed at the end.


def lanes_per_superlane(bits: float) -> int:
    """G: lanes whose 8·G·bits stream bits are a whole number of 32-bit words."""
    bits_x2 = int(round(2 * bits))  # 8 positions per lane: 4·bits_x2 bits
    g = 1
    while (4 * bits_x2 * g) % 32:
        g *= 2
    return g


@triton.jit
def _ring_word(row_base, tile_col, mask_n, s, WI: tl.constexpr, WPS: tl.constexpr, W32: tl.constexpr):
    """Word WI of super-lane s's window (word 0 is the word before the super-lane; the ring wraps)."""
    idx = s * WPS + (WI - 1)
    if WI == 0:
        idx = tl.where(idx < 0, idx + W32, idx)
    word = tl.load(row_base + tile_col[:, None] + idx[None, :], mask=mask_n[:, None], other=0)
    return word.to(tl.uint32, bitcast=True)


@triton.jit
def ring_state(row_base, tile_col, mask_n, s, g: tl.constexpr, j: tl.constexpr, KA: tl.constexpr,
               HALF: tl.constexpr, WPS: tl.constexpr, W32: tl.constexpr):
    """States [BNT, S] of position 8g+j of every super-lane s of every tile (uint32, 0..65535)."""
    # Compile-time position arithmetic: the position's state ends at stream bit `end` of its super-lane.
    p = 8 * g + j
    end = (p + 1) * KA + ((p + 1) >> 1) * HALF
    a = end + 16  # window start, counted from word 0 (the word before the super-lane)
    wi = a >> 5
    off = a & 31
    hi = _ring_word(row_base, tile_col, mask_n, s, wi, WPS, W32)
    if off <= 16:
        state = (hi >> (16 - off)) & 0xFFFF
    else:
        lo = _ring_word(row_base, tile_col, mask_n, s, wi + 1, WPS, W32)
        state = ((hi << (off - 16)) | (lo >> (48 - off))) & 0xFFFF
    return state


@triton.jit
def exl3_gemv_ring_kernel(u_ptr, w_ptr, ids_ptr, z_ptr, M, size_k, tiles_n, tk_per_split, expert_words, stride_zs,
                          KA: tl.constexpr, HALF: tl.constexpr, W32: tl.constexpr, G: tl.constexpr,
                          CODEBOOK: tl.constexpr, HAS_IDS: tl.constexpr, BM: tl.constexpr, BNT: tl.constexpr):
    S: tl.constexpr = 32 // G
    WPS: tl.constexpr = W32 // S
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    mask_m = rm < M
    tn = pid_n * BNT + tl.arange(0, BNT)
    mask_n = tn < tiles_n
    s = tl.arange(0, S)
    tile_col = tn * W32
    w_base = w_ptr
    if HAS_IDS:  # MoE: one unit per program (BM == 1), its expert's trellis
        w_base += tl.load(ids_ptr + pid_m).to(tl.int64) * expert_words
    u_rows = u_ptr + rm.to(tl.int64)[:, None] * size_k
    acc00 = tl.zeros((BM, BNT, S), dtype=tl.float32)
    acc01 = tl.zeros((BM, BNT, S), dtype=tl.float32)
    acc10 = tl.zeros((BM, BNT, S), dtype=tl.float32)
    acc11 = tl.zeros((BM, BNT, S), dtype=tl.float32)
    tk_start = pid_s * tk_per_split
    row_base = w_base + tk_start.to(tl.int64) * tiles_n * W32
    u_tile = u_rows + tk_start * 16
    for _ in range(tk_per_split):
        for g in tl.static_range(G):
            t = s * G + g
            for j in tl.static_range(8):
                state = ring_state(row_base, tile_col, mask_n, s, g, j, KA, HALF, WPS, W32)
                w = decode_state(state, CODEBOOK).to(tl.float32)
                row = 2 * (t & 3) + (j & 1) + 8 * ((j >> 1) & 1)
                uv = tl.load(u_tile + row[None, :], mask=mask_m[:, None], other=0.0).to(tl.float32)
                prod = uv[:, None, :] * w[None, :, :]
                if G == 8 and g >= 4:
                    if j < 4:
                        acc10 += prod
                    else:
                        acc11 += prod
                else:
                    if j < 4:
                        acc00 += prod
                    else:
                        acc01 += prod
        row_base += tiles_n * W32
        u_tile += 16
    # Column (t>>2) + 8(j>>2): sum each column's positions, then store [BM, BNT, 8 (c), 2 (j>>2)].
    if G == 8:  # t>>2 = 2s + (g>>2)
        lo = tl.reshape(tl.join(acc00, acc10), (BM, BNT, 8))
        hi = tl.reshape(tl.join(acc01, acc11), (BM, BNT, 8))
    elif G == 4:  # t>>2 = s
        lo = acc00
        hi = acc01
    else:  # t>>2 = (s·G)>>2: 4/G consecutive super-lanes share a column
        lo = tl.sum(tl.reshape(acc00, (BM, BNT, 8, 4 // G)), axis=3)
        hi = tl.sum(tl.reshape(acc01, (BM, BNT, 8, 4 // G)), axis=3)
    z = tl.join(lo, hi)
    c = tl.arange(0, 8)
    jh = tl.arange(0, 2)
    cols = tn[:, None, None] * 16 + c[None, :, None] + 8 * jh[None, None, :]
    offs = rm.to(tl.int64)[:, None, None, None] * (tiles_n * 16) + cols[None, :, :, :]
    tl.store(z_ptr + pid_s * stride_zs + offs, z, mask=mask_m[:, None, None, None] & mask_n[None, :, None, None])


def ring_config(rows: int, bits: float) -> tuple[int, int]:
    """(BM, BNT): rows per program (a power of two) and 16-column tiles per program, sized so one
    position's [BM, BNT, 32/G] tensor holds ~256 elements (2 per thread at 4 warps)."""
    block_m = 1
    while block_m < rows:
        block_m *= 2
    superlanes = 32 // lanes_per_superlane(bits)
    return block_m, max(1, 256 // (superlanes * block_m))


def ring_partials(u: torch.Tensor, trellis: torch.Tensor, bits: float, codebook: str, block_m: int, block_nt: int,
                  splits: int | None = None, ids: torch.Tensor | None = None, num_warps: int = 4) -> torch.Tensor:
    """z partials (splits, rows, n) fp32 of u · Ŵ through the ring-order kernel."""
    rows, size_k = u.shape
    tiles_n, width = trellis.shape[-2], trellis.shape[-1]
    tiles_k = size_k // 16
    m_blocks = triton.cdiv(rows, block_m)
    n_blocks = triton.cdiv(tiles_n, block_nt)
    if splits is None:
        splits = choose_splits(m_blocks * n_blocks, tiles_k, u.device)
    z = torch.empty(splits, rows, tiles_n * 16, dtype=torch.float32, device=u.device)
    expert_words = trellis[0].numel() // 2 if ids is not None else 0
    half = bits not in (1, 2, 3, 4, 5, 6, 7, 8)
    exl3_gemv_ring_kernel[(n_blocks, splits, m_blocks)](
        u, words(trellis), ids if ids is not None else u, z,
        rows, size_k, tiles_n, tiles_k // splits, expert_words, z.stride(0),
        KA=int(bits), HALF=half, W32=width // 2, G=lanes_per_superlane(bits), CODEBOOK=CODEBOOK_ID[codebook],
        HAS_IDS=ids is not None, BM=block_m, BNT=block_nt, num_warps=num_warps,
    )
    return z


def gemv(x2d: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, bits: float,
         codebook: str, bias: torch.Tensor | None = None, config: tuple[int, int] | None = None,
         splits: int | None = None) -> torch.Tensor:
    """y = x·W (+ bias) for few rows: input transform, decode-in-registers matmul, output transform.

    Up to RING_MAX_ROWS rows the ring kernel (FMAs per row); above, the tiled kernel's 16-row dot tile,
    which beat 8- and 16-row ring tiles on every H200 shape measured (PERF.md v2)."""
    u = input_transform(x2d, suh)
    if x2d.shape[0] <= RING_MAX_ROWS or config is not None:
        block_m, block_nt = config or ring_config(x2d.shape[0], bits)
        z = ring_partials(u, trellis, bits, codebook, block_m, block_nt, splits)
    else:
        z = matmul_partials(u, trellis, bits, codebook, *TILED_GEMV_CONFIG, splits)
    return output_transform(z, svh, bias, x2d.dtype)
