"""The K loop every ring dot kernel shares (triton_fused, triton_gemv): u · Ŵ over a split's K steps, Ŵ decoded in
registers per step by triton_decode in ring or fragment order, optionally with the next step's trellis words loaded
while this step decodes (PF)."""

from __future__ import annotations

import triton
import triton.language as tl

from exl3local.kernels.triton_decode import fragment_operand, ring_operand, ring_order_rows, ring_tiles, window_words


@triton.jit
def ring_dot(u_ptr, w_base, rm, mask_m, size_k, tiles_n, tk0, steps, tn0, KA: tl.constexpr, HALF: tl.constexpr,
             W32: tl.constexpr, G: tl.constexpr, CODEBOOK: tl.constexpr, BM: tl.constexpr, BNT: tl.constexpr,
             KT: tl.constexpr, FLAT: tl.constexpr = True, FRAG: tl.constexpr = 0, PF: tl.constexpr = False):
    """acc [BM, 16·BNT] fp32 = u[rm, K range] · Ŵ[K range, BNT tiles from tile column tn0], columns in ring
    order (FRAG: fragment order), over `steps` steps of KT tile rows from tile row tk0: the K loop every ring dot
    kernel shares. The operand is in ring order: the activations are loaded contiguously (coalesced: through
    ring_rows' index the compiler saw no contiguity and Triton 3.6 laid a warp's load across 16 rows, 4 of 32 bytes
    used per sector) and put in ring order in registers (ring_order_rows). FRAG (G = 1, BNT = 8): fragment_operand
    with KWIDTH = FRAG (4: rows in the ring's k order, u reordered as above; else natural rows, u as loaded).
    PF (with FRAG): each step's trellis words and activations are loaded one step ahead (window_words), the last
    step reloading its own. H200 (Triton 3.6, kWidth 4 order), against the same order without it: 27B step -1.8 %
    (M = 1) and -1.9 % (M = 4), 35B-A3B -5.5 % / -3.5 % (graph; docs/PERF.md "Session 17")."""
    tile_off, s = ring_tiles(tn0, tiles_n, KT, BNT, W32, G, FLAT or FRAG)
    row_base = w_base + tk0.to(tl.int64) * tiles_n * W32
    u_ptrs = u_ptr + rm.to(tl.int64)[:, None] * size_k + tk0 * 16 + tl.arange(0, 16 * KT)[None, :]
    acc = tl.zeros((BM, 16 * BNT), dtype=tl.float32)
    KW: tl.constexpr = 4 if FRAG == 4 else 2
    if PF and FRAG:  # the first step's words and activations, ahead of the loop
        w0, w1, w2 = window_words(row_base, tile_off, s, KT, BNT, W32)
        un = tl.load(u_ptrs, mask=mask_m[:, None], other=0.0)
    for i in range(steps):
        if PF and FRAG:
            ahead = tl.where(i + 1 < steps, 1, 0)
            n0, n1, n2 = window_words(row_base + ahead * (KT * tiles_n * W32), tile_off, s, KT, BNT, W32)
            u = un
            un = tl.load(u_ptrs + ahead * (16 * KT), mask=mask_m[:, None], other=0.0)
            w = fragment_operand(row_base, tile_off, s, KT, BNT, KA, HALF, W32, G, CODEBOOK, KW, w0, w1, w2)
            w0, w1, w2 = n0, n1, n2
        elif FRAG:
            w = fragment_operand(row_base, tile_off, s, KT, BNT, KA, HALF, W32, G, CODEBOOK, KW)
            u = tl.load(u_ptrs, mask=mask_m[:, None], other=0.0)
        else:
            w = ring_operand(row_base, tile_off, s, KT, BNT, KA, HALF, W32, G, CODEBOOK, FLAT)
            u = tl.load(u_ptrs, mask=mask_m[:, None], other=0.0)
        if KW == 4 or not FRAG:
            u = ring_order_rows(u, BM, KT)
        acc = tl.dot(u, w, acc)
        row_base += KT * tiles_n * W32
        u_ptrs += 16 * KT
    return acc
