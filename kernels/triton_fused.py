"""One launch per EXL3 projection (v4): input transform, ring-order decode matmul and output transform in a
single Triton kernel, for up to 16 rows and for MoE (token, expert) units.

Per program (16·BNT = 128 output columns = one Hadamard block, one K split):
    for each 128-wide K block of the split:  xs = fp16(x ⊙ suh)  (BM × 128)
        per K step of 16·KT rows:  u = fp16(xs · H[:, ring rows of the step] / √128)  (a dot with a
        gathered slice of the ±1 matrix, so u lands in the ring operand's k order), acc += u · Ŵ_ring
    split-K: every split stores its partial (fp32) and bumps a per-block counter; the program that
    finds itself last sums the partials in split order (deterministic) and runs the epilogue
    epilogue: y = H128(acc) ⊙ svh (+ bias), stored through ring_cols.

The epilogue needs no reordering: ring_cols permutes the bits of a column index within a 128-block, and
H128[i, j] = (-1)^popcount(i & j) is unchanged when both indices' bits are permuted alike, so H128 applied
in ring order gives the ring-ordered result. The input transform is recomputed by every column block of a
split (a 16×128×128 dot per K block on the matrix units, idle otherwise) instead of a separate launch.

Arithmetic per element is that of triton_hadamard.input_transform / output_transform (fp16 x⊙suh, fp32 dot
accumulation, fp16 u; fp32 split sums in split order and fp32 butterfly), so outputs match the three-launch
path to fp32 rounding (the butterfly's addition order differs).

Split-K handshake (CUTLASS-style semaphore): partial stores, CTA barrier, one gpu-scope acq_rel atomic on
the block's counter; the last program reads the partials (L2, .cg) and resets the counter to 0 for the next
launch. Counters and partials live in a per-stream workspace (kernels/bound.py) that starts zeroed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from exl3local.kernels.triton_decode import ring_cols, ring_operand, ring_rows, ring_tiles

FUSED_BLOCK_N_TILES = 8  # 128 output columns per program: one Hadamard block, so the epilogue is local
# Ints that change from call to call: never specialised on (a compiled kernel serves every row count).
VARYING_ARGS = ["M", "stride_xm", "stride_ym", "stride_zs"]
EPILOGUE_ROWS = tl.constexpr(4)


@triton.jit
def had128_rows(v, BM: tl.constexpr):
    """Unscaled H128 on each row of v [BM, 128] fp32: seven radix-2 butterfly stages (16 values per thread
    at 4 warps; the H16⊗H8 product form of triton_hadamard holds 128 and would spill at 16 rows)."""
    for b in tl.static_range(7):
        x = tl.permute(tl.reshape(v, (BM, 64 >> b, 2, 1 << b)), (0, 1, 3, 2))
        lo, hi = tl.split(x)
        x = tl.permute(tl.join(lo + hi, lo - hi), (0, 1, 3, 2))
        v = tl.reshape(x, (BM, 128))
    return v


@triton.jit
def _finish(z_ptr, stride_zs, splits, row0, rows, size_n, pid_n, svh_ptr, bias_ptr, y_ptr, stride_ym, n_out,
            HAS_BIAS: tl.constexpr, SCALE: tl.constexpr):
    """y rows [row0, row0 + rows) of this column block from the stored split partials, EPILOGUE_ROWS at a time
    (the butterfly on a whole 16-row tile needed ~100 registers and set the kernel's occupancy)."""
    c = tl.arange(0, 128)
    cols = pid_n * 128 + ring_cols(c)
    svh = tl.load(svh_ptr + cols).to(tl.float32)[None, :]
    if HAS_BIAS:  # the caller's bias covers the n_out columns it keeps
        bias = tl.load(bias_ptr + cols, mask=cols < n_out, other=0.0).to(tl.float32)[None, :]
    for r0 in range(row0, row0 + rows, EPILOGUE_ROWS):
        r = r0 + tl.arange(0, EPILOGUE_ROWS)
        mask = (r < row0 + rows)[:, None]
        z_offs = r.to(tl.int64)[:, None] * size_n + (pid_n * 128 + c)[None, :]
        acc = tl.load(z_ptr + z_offs, mask=mask, other=0.0, cache_modifier=".cg")
        for sp in range(1, splits):
            acc += tl.load(z_ptr + sp * stride_zs + z_offs, mask=mask, other=0.0, cache_modifier=".cg")
        y = had128_rows(acc, EPILOGUE_ROWS) * SCALE * svh
        if HAS_BIAS:
            y += bias
        tl.store(y_ptr + r.to(tl.int64)[:, None] * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=mask & (cols < n_out)[None, :])


@triton.jit(do_not_specialize=VARYING_ARGS)
def exl3_fused_kernel(x_ptr, suh_ptr, w_ptr, svh_ptr, bias_ptr, ids_ptr, had_ptr, y_ptr, z_ptr, cnt_ptr,
                      M, size_k, tiles_n, stride_xm, x_div, k_valid, stride_ym, n_out, k_blocks, blocks_per_split,
                      expert_words, stride_zs,
                      KA: tl.constexpr, HALF: tl.constexpr, W32: tl.constexpr, G: tl.constexpr,
                      CODEBOOK: tl.constexpr, HAS_IDS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                      FUSE_INPUT: tl.constexpr, SCALE: tl.constexpr, BM: tl.constexpr, KT: tl.constexpr):
    """y = H(fp16(H(x⊙suh))·Ŵ)⊙svh (+ bias) for BM rows (MoE: one unit in row 0) × 128 columns, one K split.

    x holds k_valid ≤ size_k features per row (the rest reads as the zero padding of spec §1.4); y keeps the
    first n_out ≤ size_n columns, rows stride_ym apart (a part of a fused layer writes its slice in place).
    FUSE_INPUT False: x is already u = fp16(H(x⊙suh)) (triton_hadamard.input_transform; MoE: one row per unit)."""
    BNT: tl.constexpr = 8
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    size_n = tiles_n * 16
    lane = tl.arange(0, BM)
    if HAS_IDS:  # one (token, expert) unit per program: its expert's trellis, suh, svh, bias
        e = tl.load(ids_ptr + pid_m).to(tl.int64)
        w_base = w_ptr + e * expert_words
        suh_base = suh_ptr + e * size_k
        svh_base = svh_ptr + e * size_n
        bias_base = bias_ptr + e * size_n
        rm = pid_m + lane
        mask_m = lane == 0
        row0 = pid_m
        rows = 1
    else:
        w_base = w_ptr
        suh_base = suh_ptr
        svh_base = svh_ptr
        bias_base = bias_ptr
        rm = pid_m * BM + lane
        mask_m = rm < M
        row0 = pid_m * BM
        rows = tl.minimum(M - row0, BM)
    x_rows = x_ptr + (rm // x_div).to(tl.int64)[:, None] * stride_xm
    k_idx = tl.arange(0, 128)
    h_cols = ring_rows(tl.arange(0, 16 * KT))  # natural k of each ring-operand row within a step
    tile_off, s = ring_tiles(pid_n * BNT, tiles_n, KT, BNT, W32, G)
    kb0 = pid_s * blocks_per_split
    kb1 = tl.minimum(kb0 + blocks_per_split, k_blocks)
    row_base = w_base + (kb0 * 8).to(tl.int64) * tiles_n * W32
    acc = tl.zeros((BM, 16 * BNT), dtype=tl.float32)
    for kb in range(kb0, kb1):
        kk = kb * 128 + k_idx
        if FUSE_INPUT:
            xv = tl.load(x_rows + kk[None, :], mask=mask_m[:, None] & (kk < k_valid)[None, :], other=0.0)
            xs = (xv.to(tl.float32) * tl.load(suh_base + kk).to(tl.float32)[None, :]).to(tl.float16)
        # a loop, not unrolled: the unrolled steps' ±1 slices were all held at once (~100 more registers)
        for j in range(8 // KT):
            k_step = j * 16 * KT + h_cols
            if FUSE_INPUT:
                h = tl.load(had_ptr + k_idx[:, None] * 128 + k_step[None, :])
                u = (tl.dot(xs, h) * SCALE).to(tl.float16)
            else:
                u = tl.load(x_rows + (kb * 128 + k_step)[None, :], mask=mask_m[:, None], other=0.0).to(tl.float16)
            w = ring_operand(row_base, tile_off, s, KT, BNT, KA, HALF, W32, G, CODEBOOK)
            acc = tl.dot(u, w, acc)
            row_base += KT * tiles_n * W32
    # Every split stores its partial; the last one to arrive (or the only one) finishes the block.
    z_offs = rm.to(tl.int64)[:, None] * size_n + (pid_n * 128 + k_idx)[None, :]
    tl.store(z_ptr + pid_s * stride_zs + z_offs, acc, mask=mask_m[:, None])
    tl.debug_barrier()  # every thread's partial is written before the counter says so / before the reload
    if SPLIT:
        lock = cnt_ptr + pid_m * tl.num_programs(0) + pid_n
        splits = tl.num_programs(1)
        if tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu") == splits - 1:
            tl.store(lock, 0)
            _finish(z_ptr, stride_zs, splits, row0, rows, size_n, pid_n, svh_base, bias_base, y_ptr, stride_ym, n_out,
                    HAS_BIAS, SCALE)
    else:
        _finish(z_ptr, stride_zs, 1, row0, rows, size_n, pid_n, svh_base, bias_base, y_ptr, stride_ym, n_out,
                HAS_BIAS, SCALE)
