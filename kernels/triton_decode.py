"""Trellis decode in registers (Triton), shared by every EXL3 kernel, plus the dense-decode kernel.

Layouts (checkpoint = kernel; nothing is repacked):

    trellis  int16 (k/16, n/16, 16*bits) as stored, read as int32 (k/16, n/16, 8*bits) through a free
             `.view(torch.int32)`: word U[i] of a tile holds stream bits [32i, 32i+32) MSB-first (spec §2.2).
             MoE: stacked per expert, int16 (E, k/16, n/16, 16*bits).
    operand  fp16 [16·KT, 16·BNT] = Ŵ of KT×BNT tiles in ring order (ring_operand, ring_rows, ring_cols), or at
             4 and 8 bits in the MMA fragment's order (fragment_operand, natural rows, fragment_cols).

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
def _ring_word(row_base, tile_off, s, mask, WI: tl.constexpr, WPS: tl.constexpr, W32: tl.constexpr,
               FKT: tl.constexpr = 0, FBNT: tl.constexpr = 0):
    """Word WI of super-lane s's window (word 0 is the word before the super-lane; the ring wraps).
    tile_off and s broadcast against each other (the caller picks the shape); FKT > 0: they are flat
    (ring_tiles), tile-major, and the words come back as [FKT, FBNT, 32/G].

    Coalescing (which lanes load which words is the compiler's choice, made from what it can prove about the
    addresses): the flat index puts consecutive lanes on consecutive super-lanes of one tile whatever the
    rate (a [KT, BNT, 32/G] load at a rate whose super-lanes are more than one word apart has no contiguous
    axis, and Triton 3.6 then put the lanes across tiles); word 0 of super-lane 0 wraps to the tile's last
    word through a load of that word per tile, not a wrapped index, which hid the contiguity at 1, 2 and 4
    bits (Triton 3.6 spread a warp's load over 8 tiles: 16 of 32 bytes used per sector)."""
    idx = s * WPS + (WI - 1)
    if WI == 0:
        inside = idx >= 0
        if mask is not None:
            inside = inside & mask
        word = tl.load(row_base + tile_off + idx, mask=inside, other=0)
        if mask is None:
            last = tl.load(row_base + tile_off + (W32 - 1))
        else:
            last = tl.load(row_base + tile_off + (W32 - 1), mask=mask, other=0)
        word = tl.where(idx >= 0, word, last)
    elif mask is None:
        word = tl.load(row_base + tile_off + idx)
    else:
        word = tl.load(row_base + tile_off + idx, mask=mask, other=0)
    if FKT > 0:
        word = tl.reshape(word, (FKT, FBNT, W32 // WPS))
    return word.to(tl.uint32, bitcast=True)


@triton.jit
def ring_state(row_base, tile_off, s, mask, g: tl.constexpr, j: tl.constexpr, KA: tl.constexpr,
               HALF: tl.constexpr, WPS: tl.constexpr, W32: tl.constexpr, FKT: tl.constexpr = 0,
               FBNT: tl.constexpr = 0, W0=None, W1=None, W2=None):
    """States (uint32, 0..65535) of position 8g+j of every super-lane s of every tile (FKT: as _ring_word); with W0
    (G = 1) the window's words as window_words loaded them, no load here."""
    # Compile-time position arithmetic: the position's state ends at stream bit `end` of its super-lane.
    p = 8 * g + j
    end = (p + 1) * KA + ((p + 1) >> 1) * HALF
    a = end + 16  # window start, counted from word 0 (the word before the super-lane)
    wi = a >> 5
    off = a & 31
    if W0 is not None:
        hi = _pick(W0, W1, W2, wi)
    else:
        hi = _ring_word(row_base, tile_off, s, mask, wi, WPS, W32, FKT, FBNT)
    if off <= 16:
        state = (hi >> (16 - off)) & 0xFFFF
    else:
        if W0 is not None:
            lo = _pick(W0, W1, W2, wi + 1)
        else:
            lo = _ring_word(row_base, tile_off, s, mask, wi + 1, WPS, W32, FKT, FBNT)
        state = ((hi << (off - 16)) | (lo >> (48 - off))) & 0xFFFF
    return state


@triton.jit
def _pick(W0, W1, W2, WI: tl.constexpr):
    if WI == 0:
        return W0
    elif WI == 1:
        return W1
    else:
        return W2


@triton.jit
def window_words(row_base, tile_off, s, KT: tl.constexpr, BNT: tl.constexpr, W32: tl.constexpr):
    """At G = 1 (4 and 8 bits: one or two words per lane) the words 0..W32/32 of every lane's window (word 0 the one
    before the lane's own), flat as ring_tiles lays them out: what one K step of fragment_operand reads, loaded apart
    from its decode so that a K loop can load the next step's while it decodes this one (ring_dot's PF)."""
    WPS: tl.constexpr = W32 // 32
    w0 = _ring_word(row_base, tile_off, s, None, 0, WPS, W32, KT, BNT)
    w1 = _ring_word(row_base, tile_off, s, None, 1, WPS, W32, KT, BNT)
    if WPS == 2:
        w2 = _ring_word(row_base, tile_off, s, None, 2, WPS, W32, KT, BNT)
    else:
        w2 = w1
    return w0, w1, w2


# ---- The ring as a dot operand (v3) -----------------------------------------------------------------------
#
# The ring decode above, but the decoded positions are assembled into a dot operand instead of multiplied
# one by one. A dot sums over k in any order and writes columns in any order, so the operand keeps the
# ring's own in-tile order: k index 4(t&3) + 2·j1 + j0 is row 2(t&3) + j0 + 8·j1, and n index
# 2(t>>2) + j2 is column (t>>2) + 8·j2 (t = lane, j = 4·j2 + 2·j1 + j0). The activations are loaded
# through the same row map and the result stored through the column map, so nothing is permuted in memory.


@triton.jit
def _decoded(row_base, tile_off, s, g: tl.constexpr, j: tl.constexpr, KA: tl.constexpr, HALF: tl.constexpr,
             WPS: tl.constexpr, W32: tl.constexpr, CODEBOOK: tl.constexpr, KT: tl.constexpr, BNT: tl.constexpr,
             W0=None, W1=None, W2=None):
    """Positions 8g+j and 8g+j+4 of every super-lane, [KT, BNT, 32/G] (tile_off, s flat: ring_tiles)."""
    return (decode_half(ring_state(row_base, tile_off, s, None, g, j, KA, HALF, WPS, W32, KT, BNT, W0, W1, W2),
                        CODEBOOK),
            decode_half(ring_state(row_base, tile_off, s, None, g, j + 4, KA, HALF, WPS, W32, KT, BNT, W0, W1, W2),
                        CODEBOOK))


@triton.jit
def _lanes(row_base, tile_off, s, j: tl.constexpr, KA: tl.constexpr, HALF: tl.constexpr, WPS: tl.constexpr,
           W32: tl.constexpr, G: tl.constexpr, CODEBOOK: tl.constexpr, KT: tl.constexpr, BNT: tl.constexpr,
           W0=None, W1=None, W2=None):
    """Positions j and j+4 of every lane t = s·G + g: [..., S, then one size-2 axis per bit of g (most
    significant first), then j2]."""
    if G == 1:
        a, b = _decoded(row_base, tile_off, s, 0, j, KA, HALF, WPS, W32, CODEBOOK, KT, BNT, W0, W1, W2)
    elif G == 2:
        a0, b0 = _decoded(row_base, tile_off, s, 0, j, KA, HALF, WPS, W32, CODEBOOK, KT, BNT)
        a1, b1 = _decoded(row_base, tile_off, s, 1, j, KA, HALF, WPS, W32, CODEBOOK, KT, BNT)
        a = tl.join(a0, a1)
        b = tl.join(b0, b1)
    elif G == 4:
        a0, b0 = _decoded(row_base, tile_off, s, 0, j, KA, HALF, WPS, W32, CODEBOOK, KT, BNT)
        a1, b1 = _decoded(row_base, tile_off, s, 1, j, KA, HALF, WPS, W32, CODEBOOK, KT, BNT)
        a2, b2 = _decoded(row_base, tile_off, s, 2, j, KA, HALF, WPS, W32, CODEBOOK, KT, BNT)
        a3, b3 = _decoded(row_base, tile_off, s, 3, j, KA, HALF, WPS, W32, CODEBOOK, KT, BNT)
        a = tl.join(tl.join(a0, a2), tl.join(a1, a3))
        b = tl.join(tl.join(b0, b2), tl.join(b1, b3))
    else:
        a0, b0 = _decoded(row_base, tile_off, s, 0, j, KA, HALF, WPS, W32, CODEBOOK, KT, BNT)
        a1, b1 = _decoded(row_base, tile_off, s, 1, j, KA, HALF, WPS, W32, CODEBOOK, KT, BNT)
        a2, b2 = _decoded(row_base, tile_off, s, 2, j, KA, HALF, WPS, W32, CODEBOOK, KT, BNT)
        a3, b3 = _decoded(row_base, tile_off, s, 3, j, KA, HALF, WPS, W32, CODEBOOK, KT, BNT)
        a4, b4 = _decoded(row_base, tile_off, s, 4, j, KA, HALF, WPS, W32, CODEBOOK, KT, BNT)
        a5, b5 = _decoded(row_base, tile_off, s, 5, j, KA, HALF, WPS, W32, CODEBOOK, KT, BNT)
        a6, b6 = _decoded(row_base, tile_off, s, 6, j, KA, HALF, WPS, W32, CODEBOOK, KT, BNT)
        a7, b7 = _decoded(row_base, tile_off, s, 7, j, KA, HALF, WPS, W32, CODEBOOK, KT, BNT)
        a = tl.join(tl.join(tl.join(a0, a4), tl.join(a2, a6)), tl.join(tl.join(a1, a5), tl.join(a3, a7)))
        b = tl.join(tl.join(tl.join(b0, b4), tl.join(b2, b6)), tl.join(tl.join(b1, b5), tl.join(b3, b7)))
    return tl.join(a, b)


@triton.jit
def ring_operand(row_base, tile_off, s, KT: tl.constexpr, BNT: tl.constexpr, KA: tl.constexpr,
                 HALF: tl.constexpr, W32: tl.constexpr, G: tl.constexpr, CODEBOOK: tl.constexpr,
                 FLAT: tl.constexpr = True):
    """Ŵ of KT×BNT tiles as a [16·KT, 16·BNT] fp16 dot operand in ring order (see above).

    tile_off, s: from ring_tiles with the same FLAT (loop-invariant, so kernels make them once outside their
    K loop)."""
    # [KT, BNT, t>>2, t&3, j2, (j1, j0)] -> [KT, t&3, (j1, j0) | BNT, t>>2, j2]
    x = tl.reshape(_ring_positions(row_base, tile_off, s, KT, BNT, KA, HALF, W32, G, CODEBOOK, FLAT),
                   (KT, BNT, 8, 4, 2, 4))
    x = tl.permute(x, (0, 3, 5, 1, 2, 4))
    return tl.reshape(x, (16 * KT, 16 * BNT))


# FRAG (triton_fused) where the fragment order serves: the dot operand width (k values per lane and register pair) the
# installed Triton gives a 16-row fp16 mma v2 B operand, whose k order fragment_operand must match for its conversion
# to be a register renaming. Triton 3.6 (the H200's): kWidth 4; 3.8 and 3.9: 2; the other order costs 8 SHFL + 16 SEL
# per K step (sm_90 SASS of the 4-bit loop, bench/sass_loop.py: 3.6 163-169 vs 191-197 instructions; 3.9 162 vs
# 192-195). 3.7 and before 3.6 unmeasured. Both orders give the same sums (tests): only speed depends on the guess.
FRAGMENT_KWIDTH = 4 if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 8) else 2


@triton.jit
def fragment_operand(row_base, tile_off, s, KT: tl.constexpr, BNT: tl.constexpr, KA: tl.constexpr,
                     HALF: tl.constexpr, W32: tl.constexpr, G: tl.constexpr, CODEBOOK: tl.constexpr,
                     KWIDTH: tl.constexpr = 2, W0=None, W1=None, W2=None):
    """Ŵ of KT×8 tiles at G = 1 (4 and 8 bits) as a [16·KT, 128] fp16 dot operand indexed so that every weight
    already sits in the lane and register where the matrix unit takes it: with ring_tiles' flat layout over 4 warps (a
    tile's bits 0-1 are the warp, bit 2 a register) and a lane's positions being the mma.m16n8k16 B fragment (spec §4),
    the conversion to the dot operand is a renaming of registers, where ring_operand's order costs a shared-memory round
    trip per K step (Triton 3.9's sm_90 compile of the 4-bit kernel: 173 -> 162 loop instructions per step, 66 -> 56
    registers; bench/sass_loop.py). KWIDTH 2: rows natural (k = 16·kt + row: u needs no reordering), the fragment's
    own k order; 4: rows in the ring's k order (4(t&3) + 2·j1 + j0, u through ring_order_rows), the order of an operand
    whose lanes hold 4 consecutive k (FRAGMENT_KWIDTH). Columns in fragment order (fragment_cols). W0..W2: the words
    as window_words loaded them (else loaded here). H200 (Triton 3.6), per 27B/35B-A3B group: 1-3 % faster than the
    ring order but 27B gate_up (3-4 % slower until its grid fits one wave: fused_launch.WAVE_MAX_REGISTERS; docs/PERF.md
    "Session 16"). Intel's backend stages it through shared local memory like the ring order, less vectorized: not
    served on XPU (fused_launch.fragment_order)."""
    tl.static_assert(BNT == 8)
    x = tl.reshape(_ring_positions(row_base, tile_off, s, KT, BNT, KA, HALF, W32, G, CODEBOOK, True, W0, W1, W2),
                   (KT, 2, 4, 8, 4, 2, 2, 2))
    if KWIDTH == 4:  # [KT, tile>>2, tile&3, t>>2, t&3, j2, j1, j0] -> [KT, t&3, j1, j0 | tile>>2, j2, tile&3, t>>2]
        x = tl.permute(x, (0, 4, 6, 7, 1, 5, 2, 3))
    else:  # -> [KT, j1, t&3, j0 | tile>>2, j2, tile&3, t>>2]
        x = tl.permute(x, (0, 6, 4, 7, 1, 5, 2, 3))
    return tl.reshape(x, (16 * KT, 16 * BNT))


@triton.jit
def fragment_cols(c):
    """In-block column of fragment-operand n index c (128 per block): tile 4·(c>>6) + ((c>>3)&3), j2 = (c>>5)&1,
    t>>2 = c&7. A permutation of the index's bits, as ring_cols is, so H128 commutes with it (triton_fused)."""
    return (c >> 6) * 64 + ((c >> 3) & 3) * 16 + ((c >> 5) & 1) * 8 + (c & 7)


@triton.jit
def natural_block(row_base, tile_off, s, KT: tl.constexpr, BNT: tl.constexpr, KA: tl.constexpr,
                  HALF: tl.constexpr, W32: tl.constexpr, G: tl.constexpr, CODEBOOK: tl.constexpr):
    """Ŵ of KT×BNT tiles as [16·KT, 16·BNT] fp16 in natural (row, column) order: the ring positions put in
    place in registers (row 8·j1 + 2(t&3) + j0, column 8·j2 + (t>>2)), so a store of it runs along whole rows.
    A store through ring_rows/ring_cols instead wrote 2 bytes at a time (1300 µs for 5120x17408 on the H200)."""
    x = tl.reshape(_ring_positions(row_base, tile_off, s, KT, BNT, KA, HALF, W32, G, CODEBOOK, True),
                   (KT, BNT, 8, 4, 2, 2, 2))
    # [KT, BNT, t>>2, t&3, j2, j1, j0] -> [KT, j1, t&3, j0 | BNT, j2, t>>2]
    x = tl.permute(x, (0, 5, 3, 6, 1, 4, 2))
    return tl.reshape(x, (16 * KT, 16 * BNT))


@triton.jit
def _ring_positions(row_base, tile_off, s, KT: tl.constexpr, BNT: tl.constexpr, KA: tl.constexpr,
                    HALF: tl.constexpr, W32: tl.constexpr, G: tl.constexpr, CODEBOOK: tl.constexpr,
                    FLAT: tl.constexpr, W0=None, W1=None, W2=None):
    """Every position of KT×BNT tiles, [KT, BNT, 32 lanes, j2, (j1, j0)] (j = 4·j2 + 2·j1 + j0)."""
    WPS: tl.constexpr = W32 // (32 // G)  # words per super-lane
    FKT: tl.constexpr = KT if FLAT else 0
    # _lanes appends j2, the joins here j1 and j0.
    return tl.join(tl.join(_lanes(row_base, tile_off, s, 0, KA, HALF, WPS, W32, G, CODEBOOK, FKT, BNT, W0, W1, W2),
                           _lanes(row_base, tile_off, s, 2, KA, HALF, WPS, W32, G, CODEBOOK, FKT, BNT, W0, W1, W2)),
                   tl.join(_lanes(row_base, tile_off, s, 1, KA, HALF, WPS, W32, G, CODEBOOK, FKT, BNT, W0, W1, W2),
                           _lanes(row_base, tile_off, s, 3, KA, HALF, WPS, W32, G, CODEBOOK, FKT, BNT, W0, W1, W2)))


@triton.jit
def ring_tiles(tn0, tiles_n, KT: tl.constexpr, BNT: tl.constexpr, W32: tl.constexpr, G: tl.constexpr,
               FLAT: tl.constexpr = True):
    """(tile_off, s): the word offset of each super-lane's tile (KT tile rows × BNT tiles from tile column tn0,
    relative to the first tile row's base) and its super-lane index, as ring_operand takes them. FLAT: both
    flat over [KT, BNT, 32/G], super-lanes fastest, so every word load runs lane-linear (_ring_word); else
    tile_off [KT, BNT, 1] and s [1, 1, 32/G], laid out as the compiler sees fit. FLAT is the default: faster in 18
    of 20 27B cells on the H200 (K4, K3; M = 1, 16), slower only for K4 in_proj_qkvz's grouped launch (72 registers
    against 56: docs/PERF.md "Session 7")."""
    S: tl.constexpr = 32 // G
    if FLAT:
        f = tl.arange(0, KT * BNT * S)
        tile_off = ((f // (BNT * S)) * tiles_n + tn0 + (f // S) % BNT) * W32
        s = f % S
    else:
        tile_off = (tl.arange(0, KT)[:, None, None] * tiles_n + tn0 + tl.arange(0, BNT)[None, :, None]) * W32
        s = tl.arange(0, S)[None, None, :]
    return tile_off, s


@triton.jit
def ring_order_rows(u, BM: tl.constexpr, KT: tl.constexpr):
    """u [BM, 16·KT] with k in natural order -> the ring operand's k order (column i holds natural column
    ring_rows(i)): ring_rows maps index bits (i3 i2 i1 i0) to row bits (r3 r2 r1 r0) = (i1 i3 i2 i0), so the
    ring index's bits are (r2 r1 r3 r0): a permute of four size-2 axes."""
    x = tl.reshape(u, (BM, KT, 2, 2, 2, 2))
    return tl.reshape(tl.permute(x, (0, 1, 3, 4, 2, 5)), (BM, 16 * KT))


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
    w = natural_block(row_base, tile_off, s, KT, BNT, KA, HALF, W32, G, CODEBOOK)
    rows = pid_k * KT * 16 + tl.arange(0, 16 * KT)
    cols = pid_n * BNT * 16 + tl.arange(0, 16 * BNT)
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
