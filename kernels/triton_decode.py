"""Trellis decode in registers (Triton), shared by the GEMV/GEMM/MoE kernels, plus the dense-decode kernel.

Layouts (checkpoint = kernel; nothing is repacked):

    trellis  int16 (k/16, n/16, 16*bits) as stored, read as int32 (k/16, n/16, 8*bits) through a free
             `.view(torch.int32)`: word U[i] of a tile holds stream bits [32i, 32i+32) MSB-first (spec §2.2).
             MoE: stacked per expert, int16 (E, k/16, n/16, 16*bits).
    Ŵ block  fp16 [BK, BN], rows = input channels, element (r, c) of tile (tk, tn) = Ŵ[16tk+r, 16tn+c].

Each Ŵ element decodes independently: its 16-bit state is the 16 stream bits that end its code (spec
§2.3/§2.4), read from two words of its own tile (tail-biting: they wrap inside the tile). Which two words
and which bit offset depend only on (r, c) and bits, so `position_table` computes them once on the host
(from reference.py's own gather) and the kernels keep them in registers for the whole K loop.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from exl3local.kernels import reference
from exl3local.kernels.codebook import CODEBOOKS

# Codebook ids as the kernels see them (a tl.constexpr each, so every kernel specialises per codebook).
CODEBOOK_ID = {name: i for i, name in enumerate(CODEBOOKS)}  # 3inst 0, mcg 1, mul1 2


@functools.lru_cache(maxsize=64)
def position_table(bits: float, device: torch.device) -> torch.Tensor:
    """int32 [256] in in-tile row-major order (r*16 + c): first word | second word << 8 | bit offset << 16.

    The state is bits [offset, offset+16) of the 64-bit big-endian pair (U[first], U[second]).
    """
    first, second, offset = reference._state_gather(bits)
    by_position = first | (second << 8) | (offset << 16)
    table = torch.empty(reference.TILE_POSITIONS, dtype=torch.int64)
    table[reference._tile_placement()] = by_position  # ring position p sits at row*16+col
    return table.to(torch.int32).to(device)


@triton.jit
def decode_state(s, CODEBOOK: tl.constexpr):
    """uint32 states (0..65535) -> fp16 weights, bit-exact with codebook.decode_states (spec §3)."""
    if CODEBOOK == 2:  # mul1: fp16((1024 + bytesum(s*M)) * k_inv + k_bias), exact in fp32
        x = s * 0x83DCD12D
        t = (x & 0x00FF00FF) + ((x >> 8) & 0x00FF00FF)  # two 16-bit lanes of pairwise byte sums
        bsum = (t + (t >> 16)) & 0x3FF
        # 2^23 + bsum as fp32 bits (an int -> float without a conversion instruction); one fma with
        # k_inv = 887/2^17 and (1024·k_inv + k_bias) - 2^23·k_inv = -56771.453125 rounds once, and the
        # exact result is an fp32 number, so w = fp32((1024 + bsum)·k_inv + k_bias) exactly.
        f = (bsum | 0x4B000000).to(tl.float32, bitcast=True)
        w = tl.fma(f, 0.0067672729492187500, -56771.453125).to(tl.float16)
    else:  # 3inst / mcg: LCG step, LOP3, sum of the two fp16 halves (exact in fp32)
        if CODEBOOK == 0:
            x = s * 0x05517C72 + 0x03D45AA4
        else:
            x = s * 0xCBAC1FED
        y = (x & 0x8FFF8FFF) ^ 0x3B603B60
        lo = (y & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
        hi = (y >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
        w = (lo.to(tl.float32) + hi.to(tl.float32)).to(tl.float16)
    return w


@triton.jit
def tile_offsets(tab_ptr, rk, rn, tiles_n, W32: tl.constexpr):
    """Loop-invariant per-element word offsets (relative to the block's first tile) and bit offsets.

    rk: [BK] row indices relative to the block start (a multiple of 16); rn: [BN] absolute columns.
    """
    tab = tl.load(tab_ptr + (rk % 16)[:, None] * 16 + (rn % 16)[None, :])
    tile = ((rk // 16)[:, None] * tiles_n + (rn // 16)[None, :]) * W32
    off_hi = tile + (tab & 0xFF)
    off_lo = tile + ((tab >> 8) & 0xFF)
    shift = ((tab >> 16) & 31).to(tl.uint32)
    return off_hi, off_lo, shift


@triton.jit
def decode_block(w_ptr, off_hi, off_lo, shift, CODEBOOK: tl.constexpr):
    """Decode one Ŵ block: w_ptr points at the block's first tile (int32 words)."""
    hi = tl.load(w_ptr + off_hi).to(tl.uint32, bitcast=True)
    lo = tl.load(w_ptr + off_lo).to(tl.uint32, bitcast=True)
    # 32 bits starting at `shift` of hi:lo; (lo >> 1) >> (31 - shift) avoids a shift by 32 at shift 0.
    state = ((hi << shift) | ((lo >> 1) >> (31 - shift))) >> 16
    return decode_state(state, CODEBOOK)


@triton.jit
def _decode_dense_kernel(w_ptr, tab_ptr, out_ptr, tiles_n, size_n,
                         W32: tl.constexpr, CODEBOOK: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rk = tl.arange(0, BK)
    rn = pid_n * BN + tl.arange(0, BN)
    off_hi, off_lo, shift = tile_offsets(tab_ptr, rk, rn, tiles_n, W32)
    base = w_ptr + (pid_k * (BK // 16)).to(tl.int64) * tiles_n * W32
    w = decode_block(base, off_hi, off_lo, shift, CODEBOOK)
    rows = (pid_k * BK + rk).to(tl.int64)
    tl.store(out_ptr + rows[:, None] * size_n + rn[None, :], w)


def words(trellis: torch.Tensor) -> torch.Tensor:
    """The trellis as int32 words (no copy): (..., 16*bits) int16 -> (..., 8*bits) int32."""
    return trellis.contiguous().view(torch.int32)


def decode_dense(trellis: torch.Tensor, bits: float, codebook: str) -> torch.Tensor:
    """Ŵ, fp16 (k, n), bit-identical to reference.decode_trellis (the RECONSTRUCT_GEMM path's first step)."""
    tiles_k, tiles_n, width = trellis.shape
    size_k, size_n = tiles_k * 16, tiles_n * 16
    out = torch.empty(size_k, size_n, dtype=torch.float16, device=trellis.device)
    bk, bn = 64, 128  # EXL3 dims are multiples of 128
    grid = (size_n // bn, size_k // bk)
    _decode_dense_kernel[grid](
        words(trellis), position_table(bits, trellis.device), out, tiles_n, size_n,
        W32=width // 2, CODEBOOK=CODEBOOK_ID[codebook], BK=bk, BN=bn,
    )
    return out
