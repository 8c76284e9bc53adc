"""Trellis decode in registers (Triton), shared by every EXL3 kernel, plus the dense-decode kernel.

Layouts (checkpoint = kernel; nothing is repacked):

    trellis  int16 (k/16, n/16, 16*bits) as stored, read as int32 (k/16, n/16, 8*bits) through a free
             `.view(torch.int32)`: word U[i] of a tile holds stream bits [32i, 32i+32) MSB-first (spec §2.2).
             MoE: stacked per expert, int16 (E, k/16, n/16, 16*bits).
    operand  fp16 [16·KT, 16·BNT] = Ŵ of KT×BNT tiles in ring order (ring_operand, ring_rows, ring_cols).

Each weight's 16-bit state is the 16 stream bits that end its code (spec §2.3/§2.4), inside its own tile
(tail-biting). Decoding in ring (trellis) order makes every word and bit offset a compile-time constant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exl3local.kernels.codebook import CODEBOOKS

# Codebook ids as the kernels see them (a tl.constexpr each, so every kernel specialises per codebook).
CODEBOOK_ID = {name: i for i, name in enumerate(CODEBOOKS)}  # 3inst 0, mcg 1, mul1 2


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
def decode_half(s, CODEBOOK: tl.constexpr):
    """uint32 states (0..65535) -> fp16 weights, bit-exact with decode_state, in fp16 arithmetic: the
    last step runs as exllamav3's own fp16 op (mul1 __hfma, 3inst/mcg __hadd), which the compiler can
    issue on packed pairs (HFMA2/HADD2) once the weights sit two to a register for the dot operand."""
    if CODEBOOK == 2:  # mul1: fp16 bits 0x6400 + bytesum(s*M) = 1024 + bytesum, then one fp16 fma
        x = s * 0x83DCD12D
        # x - 255·(bytes 1 and 3) = (b0+b1) | (b2+b3) << 16: one multiply-add instead of a mask and an add
        t = x - 255 * ((x >> 8) & 0x00FF00FF)
        # t·0x10001 puts (b0+b1) + (b2+b3) in the high half (one multiply-add with 0x6400 << 16)
        h = ((t * 0x10001 + 0x64000000) >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
        w = tl.fma(h, tl.full((), 0.0067672729492187500, tl.float16), tl.full((), -10.3828125, tl.float16))
    else:  # 3inst / mcg: LCG step, LOP3, fp16 sum of the two halves
        if CODEBOOK == 0:
            x = s * 0x05517C72 + 0x03D45AA4
        else:
            x = s * 0xCBAC1FED
        y = (x & 0x8FFF8FFF) ^ 0x3B603B60
        w = y.to(tl.uint16).to(tl.float16, bitcast=True) + (y >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    return w


# ---- Ring-order decode: positions in trellis order with compile-time shifts ---------------------------
#
# Lane t of a tile holds ring positions 8t..8t+7 (the MMA B-fragment order, spec §4), whose codes are
# contiguous stream bits. G consecutive lanes ("a super-lane") span a whole number of 32-bit words, so
# within a super-lane every position's state sits at a compile-time word and bit offset: the kernel
# unrolls the 8·G positions with constant shifts, and each word is loaded once per super-lane instead of
# twice per weight. Position (t, j) sits at row 2(t&3) + (j&1) + 8((j>>1)&1), column (t>>2) + 8(j>>2) of
# its tile (spec §4).


def lanes_per_superlane(bits: float) -> int:
    """G: lanes whose 8·G·bits stream bits are a whole number of 32-bit words."""
    bits_x2 = int(round(2 * bits))  # 8 positions per lane: 4·bits_x2 bits
    g = 1
    while (4 * bits_x2 * g) % 32:
        g *= 2
    return g


@triton.jit
def _ring_word(row_base, tile_off, s, mask, WI: tl.constexpr, WPS: tl.constexpr, W32: tl.constexpr):
    """Word WI of super-lane s's window (word 0 is the word before the super-lane; the ring wraps).
    tile_off and s broadcast against each other (the caller picks the shape)."""
    idx = s * WPS + (WI - 1)
    if WI == 0:
        idx = tl.where(idx < 0, idx + W32, idx)
    if mask is None:
        word = tl.load(row_base + tile_off + idx)
    else:
        word = tl.load(row_base + tile_off + idx, mask=mask, other=0)
    return word.to(tl.uint32, bitcast=True)


@triton.jit
def ring_state(row_base, tile_off, s, mask, g: tl.constexpr, j: tl.constexpr, KA: tl.constexpr,
               HALF: tl.constexpr, WPS: tl.constexpr, W32: tl.constexpr):
    """States (uint32, 0..65535) of position 8g+j of every super-lane s of every tile."""
    # Compile-time position arithmetic: the position's state ends at stream bit `end` of its super-lane.
    p = 8 * g + j
    end = (p + 1) * KA + ((p + 1) >> 1) * HALF
    a = end + 16  # window start, counted from word 0 (the word before the super-lane)
    wi = a >> 5
    off = a & 31
    hi = _ring_word(row_base, tile_off, s, mask, wi, WPS, W32)
    if off <= 16:
        state = (hi >> (16 - off)) & 0xFFFF
    else:
        lo = _ring_word(row_base, tile_off, s, mask, wi + 1, WPS, W32)
        state = ((hi << (off - 16)) | (lo >> (48 - off))) & 0xFFFF
    return state


# ---- The ring as a dot operand (v3) -----------------------------------------------------------------------
#
# The ring decode above, but the decoded positions are assembled into a dot operand instead of multiplied
# one by one. A dot sums over k in any order and writes columns in any order, so the operand keeps the
# ring's own in-tile order: k index 4(t&3) + 2·j1 + j0 is row 2(t&3) + j0 + 8·j1, and n index
# 2(t>>2) + j2 is column (t>>2) + 8·j2 (t = lane, j = 4·j2 + 2·j1 + j0). The activations are loaded
# through the same row map and the result stored through the column map, so nothing is permuted in memory.


@triton.jit
def _decoded(row_base, tile_off, s, g: tl.constexpr, j: tl.constexpr, KA: tl.constexpr, HALF: tl.constexpr,
             WPS: tl.constexpr, W32: tl.constexpr, CODEBOOK: tl.constexpr):
    """Positions 8g+j and 8g+j+4 of every super-lane."""
    return (decode_half(ring_state(row_base, tile_off, s, None, g, j, KA, HALF, WPS, W32), CODEBOOK),
            decode_half(ring_state(row_base, tile_off, s, None, g, j + 4, KA, HALF, WPS, W32), CODEBOOK))


@triton.jit
def _lanes(row_base, tile_off, s, j: tl.constexpr, KA: tl.constexpr, HALF: tl.constexpr, WPS: tl.constexpr,
           W32: tl.constexpr, G: tl.constexpr, CODEBOOK: tl.constexpr):
    """Positions j and j+4 of every lane t = s·G + g: [..., S, then one size-2 axis per bit of g (most
    significant first), then j2]."""
    if G == 1:
        a, b = _decoded(row_base, tile_off, s, 0, j, KA, HALF, WPS, W32, CODEBOOK)
    elif G == 2:
        a0, b0 = _decoded(row_base, tile_off, s, 0, j, KA, HALF, WPS, W32, CODEBOOK)
        a1, b1 = _decoded(row_base, tile_off, s, 1, j, KA, HALF, WPS, W32, CODEBOOK)
        a = tl.join(a0, a1)
        b = tl.join(b0, b1)
    elif G == 4:
        a0, b0 = _decoded(row_base, tile_off, s, 0, j, KA, HALF, WPS, W32, CODEBOOK)
        a1, b1 = _decoded(row_base, tile_off, s, 1, j, KA, HALF, WPS, W32, CODEBOOK)
        a2, b2 = _decoded(row_base, tile_off, s, 2, j, KA, HALF, WPS, W32, CODEBOOK)
        a3, b3 = _decoded(row_base, tile_off, s, 3, j, KA, HALF, WPS, W32, CODEBOOK)
        a = tl.join(tl.join(a0, a2), tl.join(a1, a3))
        b = tl.join(tl.join(b0, b2), tl.join(b1, b3))
    else:
        a0, b0 = _decoded(row_base, tile_off, s, 0, j, KA, HALF, WPS, W32, CODEBOOK)
        a1, b1 = _decoded(row_base, tile_off, s, 1, j, KA, HALF, WPS, W32, CODEBOOK)
        a2, b2 = _decoded(row_base, tile_off, s, 2, j, KA, HALF, WPS, W32, CODEBOOK)
        a3, b3 = _decoded(row_base, tile_off, s, 3, j, KA, HALF, WPS, W32, CODEBOOK)
        a4, b4 = _decoded(row_base, tile_off, s, 4, j, KA, HALF, WPS, W32, CODEBOOK)
        a5, b5 = _decoded(row_base, tile_off, s, 5, j, KA, HALF, WPS, W32, CODEBOOK)
        a6, b6 = _decoded(row_base, tile_off, s, 6, j, KA, HALF, WPS, W32, CODEBOOK)
        a7, b7 = _decoded(row_base, tile_off, s, 7, j, KA, HALF, WPS, W32, CODEBOOK)
        a = tl.join(tl.join(tl.join(a0, a4), tl.join(a2, a6)), tl.join(tl.join(a1, a5), tl.join(a3, a7)))
        b = tl.join(tl.join(tl.join(b0, b4), tl.join(b2, b6)), tl.join(tl.join(b1, b5), tl.join(b3, b7)))
    return tl.join(a, b)


@triton.jit
def ring_operand(row_base, tile_off, s, KT: tl.constexpr, BNT: tl.constexpr, KA: tl.constexpr,
                 HALF: tl.constexpr, W32: tl.constexpr, G: tl.constexpr, CODEBOOK: tl.constexpr):
    """Ŵ of KT×BNT tiles as a [16·KT, 16·BNT] fp16 dot operand in ring order (see above).

    tile_off, s: from ring_tiles (loop-invariant, so kernels make them once outside their K loop)."""
    WPS: tl.constexpr = W32 // (32 // G)  # words per super-lane
    # j = 4·j2 + 2·j1 + j0; _lanes appends j2, the joins here j1 and j0.
    x = tl.join(tl.join(_lanes(row_base, tile_off, s, 0, KA, HALF, WPS, W32, G, CODEBOOK),
                        _lanes(row_base, tile_off, s, 2, KA, HALF, WPS, W32, G, CODEBOOK)),
                tl.join(_lanes(row_base, tile_off, s, 1, KA, HALF, WPS, W32, G, CODEBOOK),
                        _lanes(row_base, tile_off, s, 3, KA, HALF, WPS, W32, G, CODEBOOK)))
    # [KT, BNT, t>>2, t&3, j2, (j1, j0)] -> [KT, t&3, (j1, j0) | BNT, t>>2, j2]
    x = tl.reshape(x, (KT, BNT, 8, 4, 2, 4))
    x = tl.permute(x, (0, 3, 5, 1, 2, 4))
    return tl.reshape(x, (16 * KT, 16 * BNT))


@triton.jit
def ring_tiles(tn0, tiles_n, KT: tl.constexpr, BNT: tl.constexpr, W32: tl.constexpr, G: tl.constexpr):
    """(tile_off [KT, BNT, 1], s [1, 1, 32/G]): word offsets of KT tile rows × BNT tiles from tile column tn0,
    relative to the first tile row's base, and the super-lane indices, as ring_operand takes them."""
    kt = tl.arange(0, KT)
    tn = tn0 + tl.arange(0, BNT)
    tile_off = (kt[:, None, None] * tiles_n + tn[None, :, None]) * W32
    return tile_off, tl.arange(0, 32 // G)[None, None, :]


@triton.jit
def ring_dot(u_ptr, w_base, rm, mask_m, size_k, tiles_n, tk0, steps, tn0, KA: tl.constexpr, HALF: tl.constexpr,
             W32: tl.constexpr, G: tl.constexpr, CODEBOOK: tl.constexpr, BM: tl.constexpr, BNT: tl.constexpr,
             KT: tl.constexpr):
    """acc [BM, 16·BNT] fp32 = u[rm, K range] · Ŵ[K range, BNT tiles from tile column tn0], columns in ring
    order, over `steps` steps of KT tile rows from tile row tk0: the K loop every ring dot kernel shares.
    The operand is in ring order, so the activations are loaded through ring_rows."""
    tile_off, s = ring_tiles(tn0, tiles_n, KT, BNT, W32, G)
    row_base = w_base + tk0.to(tl.int64) * tiles_n * W32
    u_ptrs = u_ptr + rm.to(tl.int64)[:, None] * size_k + tk0 * 16 + ring_rows(tl.arange(0, 16 * KT))[None, :]
    acc = tl.zeros((BM, 16 * BNT), dtype=tl.float32)
    for _ in range(steps):
        w = ring_operand(row_base, tile_off, s, KT, BNT, KA, HALF, W32, G, CODEBOOK)
        u = tl.load(u_ptrs, mask=mask_m[:, None], other=0.0)
        acc = tl.dot(u, w, acc)
        row_base += KT * tiles_n * W32
        u_ptrs += 16 * KT
    return acc


@triton.jit
def ring_rows(i):
    """In-tile-block row of ring-operand k index i (16 per tile row)."""
    return (i >> 4) * 16 + 2 * ((i >> 2) & 3) + (i & 1) + 8 * ((i >> 1) & 1)


@triton.jit
def ring_cols(c):
    """In-block column of ring-operand n index c (16 per tile column)."""
    return (c >> 4) * 16 + ((c >> 1) & 7) + 8 * (c & 1)


@triton.jit
def _decode_dense_kernel(w_ptr, out_ptr, tiles_n, KA: tl.constexpr, HALF: tl.constexpr, W32: tl.constexpr,
                         G: tl.constexpr, CODEBOOK: tl.constexpr, KT: tl.constexpr, BNT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    tile_off, s = ring_tiles(pid_n * BNT, tiles_n, KT, BNT, W32, G)
    row_base = w_ptr + (pid_k * KT).to(tl.int64) * tiles_n * W32
    w = ring_operand(row_base, tile_off, s, KT, BNT, KA, HALF, W32, G, CODEBOOK)
    rows = pid_k * KT * 16 + ring_rows(tl.arange(0, 16 * KT))
    cols = pid_n * BNT * 16 + ring_cols(tl.arange(0, 16 * BNT))
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * (tiles_n * 16) + cols[None, :], w)


def rate_constants(bits: float, codebook: str) -> dict:
    """The compile-time constants every ring kernel specialises on: KA (integer bits), HALF (a .5 rate),
    W32 (int32 words per tile), G (lanes per super-lane), CODEBOOK (id)."""
    return dict(KA=int(bits), HALF=bits != int(bits), W32=round(8 * bits), G=lanes_per_superlane(bits),
                CODEBOOK=CODEBOOK_ID[codebook])


def words(trellis: torch.Tensor) -> torch.Tensor:
    """The trellis as int32 words (no copy): (..., 16*bits) int16 -> (..., 8*bits) int32."""
    return trellis.contiguous().view(torch.int32)


def decode_dense(trellis: torch.Tensor, bits: float, codebook: str) -> torch.Tensor:
    """Ŵ, fp16 (k, n), bit-identical to reference.decode_trellis: the ring decode every kernel uses, written
    out densely so tests and bench/kernels.py can compare it bit for bit at full shapes."""
    tiles_k, tiles_n, _ = trellis.shape
    out = torch.empty(tiles_k * 16, tiles_n * 16, dtype=torch.float16, device=trellis.device)
    kt, bnt = 4, 8  # EXL3 dims are multiples of 128: 8 tiles
    _decode_dense_kernel[(tiles_n // bnt, tiles_k // kt)](
        words(trellis), out, tiles_n, **rate_constants(bits, codebook), KT=kt, BNT=bnt,
    )
    return out
