"""EXL3 decode matmul with the output transform as a last-split epilogue (v4): one launch after the input
transform, for up to 16 rows and for MoE (token, expert) units; with IN_X the program computes the input transform
of its own rows (units) and K range first, so a projection (a grouped layer, an MoE projection) is one launch.

Per program (16·BNT = 128 output columns = one Hadamard block, one K split of steps_per_split steps of
16·KT rows, split as triton_gemv.choose_splits splits the three-launch path): the ring-order decode matmul
of triton_gemv.exl3_ring_dot_kernel (triton_ring_dot.ring_dot) on u = fp16(H(x⊙suh))
(triton_hadamard.input_transform); then every split stores its partial (fp32) and bumps a per-block counter, and the
program that finds itself last sums the partials in split order (deterministic) and writes y = H128(Σ) ⊙ svh (+ bias) through ring_cols,
EPILOGUE_ROWS rows at a time.

The epilogue needs no reordering: ring_cols permutes the bits of a column index within a 128-block, and
H128[i, j] = (-1)^popcount(i & j) is unchanged when both indices' bits are permuted alike, so H128 applied
in ring order gives the ring-ordered result. Arithmetic matches triton_hadamard.output_transform (fp32
split sums in split order, fp32 butterfly; only the butterfly's addition order differs).

Split-K handshake (CUTLASS-style semaphore): partial stores, CTA barrier, one gpu-scope acq_rel atomic on
the block's counter; the last program reads the partials from L2 (.cg) and resets the counter to 0 for the
next launch. Counters and partials live in a per-stream workspace (kernels/launcher.py) that starts zeroed.
Every barrier that hands global memory (u, partials) between a program's threads is triton_sync's: under Intel's
backend tl.debug_barrier() alone orders local memory only.

Measured and dropped (docs/PERF.md v4a): the input transform inside this kernel (a 16×128×16KT dot with a
gathered slice of the ±1 matrix per K step, recomputed by every column block) made it 1-wide launch but
ran 4-10x slower (5120x17408 mul1 K4, 16 rows: 618 vs 105 µs). IN_X differs: u is computed once per program
(not per K step) by an fp32 butterfly (no ±1 matrix loaded), stored to the workspace and read back by the K loop.
It serves small groups only (fused_launch.ONE_LAUNCH_MAX_WORK): on the H200 it won every 35B-A3B decode step and lost
every 27B one (docs/PERF.md "Session 11"). Measured and dropped there: the transform a Hadamard block at a time inside
the K loop (a branch and a barrier per block in the loop): 27B 1.6-2.2x slower per step.
"""

from __future__ import annotations

import triton
import triton.language as tl

from exl3local.kernels.triton_decode import fragment_cols, ring_cols
from exl3local.kernels.triton_hadamard import unit_expert
from exl3local.kernels.triton_ring_dot import ring_dot
from exl3local.kernels.triton_sync import cta_barrier, global_fence

FUSED_BLOCK_N_TILES = 8  # 128 output columns per program: one Hadamard block, so the epilogue is local
# Ints that change from call to call: never specialised on (a compiled kernel serves every row count).
VARYING_ARGS = ["M", "stride_ym", "stride_zs"]
EPILOGUE_ROWS = tl.constexpr(4)
# Split partials the finishing program loads before it adds them (in split order, so the sum's bits do not change):
# one at a time, each load waited for its L2 round trip before the next was issued, a serial tail of `splits` round
# trips per 4 rows at the end of every split-K launch. H200 graph steps, 4 vs 1 (h200-s13a, docs/PERF.md "Session
# 13"): 27B (its splits unchanged) 17.51 -> 17.30 / 17.86 -> 17.68 / 20.41 -> 19.80 ms at M = 1 / 4 / 16; 35B-A3B
# with the split floor 3.84 -> 3.49 / 5.73 -> 5.42 / 14.92 -> 13.74. Eight everywhere (h200-s13c): the 27B's 16-split
# groups 9-10 % faster, the 35B-A3B's 4-8-split launches 0.9-2 % slower: so eight from MANY_SPLITS splits on.
# Arc unmeasured (its split target, 16 programs per Xe core, gives more launches eight).
SPLIT_LOADS = 4
MANY_SPLITS = 16
MANY_SPLIT_LOADS = 8


def split_loads(splits: int) -> int:
    """SL (split partials loaded per step of the finishing sum) for a launch of `splits` K splits."""
    return MANY_SPLIT_LOADS if splits >= MANY_SPLITS else SPLIT_LOADS


@triton.jit
def had128_rows(v, BM: tl.constexpr):
    """Unscaled H128 on each row of v [BM, 128] fp32 as seven radix-2 butterfly stages: 128·BM/threads values
    per thread (triton_hadamard.had128's H16⊗H8 products hold 8x that, which doubled this kernel's registers)."""
    for b in tl.static_range(7):
        x = tl.permute(tl.reshape(v, (BM, 64 >> b, 2, 1 << b)), (0, 1, 3, 2))
        lo, hi = tl.split(x)
        x = tl.permute(tl.join(lo + hi, lo - hi), (0, 1, 3, 2))
        v = tl.reshape(x, (BM, 128))
    return v


@triton.jit
def finish_block(z_ptr, stride_zs, splits, row0, rows, size_n, col0, svh_ptr, bias_ptr, y_ptr, stride_ym, n_out,
                 HAS_BIAS: tl.constexpr, SCALE: tl.constexpr, RING: tl.constexpr, map_ptr=None, map_mul=1, map_add=0,
                 ROWMAP: tl.constexpr = False, SL: tl.constexpr = SPLIT_LOADS, FRAG: tl.constexpr = False):
    """y rows [row0, row0 + rows) of the 128-column block at col0 from the stored split partials (columns in
    ring order if RING, fragment order if RING and FRAG, else natural), EPILOGUE_ROWS at a time (a whole 16-row
    tile at once needed ~100 registers and set the kernel's occupancy), SL splits' partials loaded per step of the sum. ROWMAP: the rows are
    positions into map_ptr, and position r's partials and output are at row map[r]·map_mul + map_add (a grouped MoE
    tile's expert-sorted units)."""
    c = tl.arange(0, 128)
    if RING and FRAG:
        cols = col0 + fragment_cols(c)
    elif RING:
        cols = col0 + ring_cols(c)
    else:
        cols = col0 + c
    svh = tl.load(svh_ptr + cols).to(tl.float32)[None, :]
    if HAS_BIAS:  # the caller's bias covers the n_out columns it keeps
        bias = tl.load(bias_ptr + cols, mask=cols < n_out, other=0.0).to(tl.float32)[None, :]
    for r0 in range(row0, row0 + rows, EPILOGUE_ROWS):
        r = r0 + tl.arange(0, EPILOGUE_ROWS)
        mask = (r < row0 + rows)[:, None]
        if ROWMAP:
            r = tl.load(map_ptr + r, mask=r < row0 + rows, other=0).to(tl.int64) * map_mul + map_add
        z_offs = r.to(tl.int64)[:, None] * size_n + (col0 + c)[None, :]
        acc = tl.load(z_ptr + z_offs, mask=mask, other=0.0, cache_modifier=".cg")
        for sp0 in range(1, splits, SL):
            for i in tl.static_range(SL):  # unrolled: the SL loads are independent, so they are in flight together
                sp = sp0 + i
                # per row, not a scalar: the interpreter refuses a scalar bool and'ed into a block mask
                live = (tl.arange(0, EPILOGUE_ROWS) * 0 + sp < splits)[:, None]
                z = tl.load(z_ptr + sp * stride_zs + z_offs, mask=mask & live, other=0.0, cache_modifier=".cg")
                acc = tl.where(live, acc + z, acc)
        y = had128_rows(acc, EPILOGUE_ROWS) * SCALE * svh
        if HAS_BIAS:
            y += bias
        tl.store(y_ptr + r.to(tl.int64)[:, None] * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=mask & (cols < n_out)[None, :])


@triton.jit
def input_rows(x_ptr, stride_xm, suh_ptr, u_ptr, size_k, k_valid, k0, k_len, row0, rows, u_mul, u_add,
               SCALE: tl.constexpr, x_div=1, GLU: tl.constexpr = False):
    """u = fp16(H128(fp16(x ⊙ suh))) (triton_hadamard._input_kernel's rounding points, the sum an fp32 butterfly
    instead of a dot with the ±1 matrix) for x rows [row0, row0 + rows) over the K range [k0, k0 + k_len), stored
    as u row r·u_mul + u_add (a grouped part's rows). The whole 128-blocks covering the range are transformed; only
    the range is stored. Programs of other column blocks store the same bits to the same places. MoE units: x row
    r // x_div, and with GLU silu(x[2·that]) ⊙ x[2·that + 1], as the input kernel reads them."""
    c = tl.arange(0, 128)
    for kb in range((k0 // 128) * 128, k0 + k_len, 128):
        k = kb + c
        s = tl.load(suh_ptr + k).to(tl.float32)[None, :]
        keep = ((k >= k0) & (k < k0 + k_len))[None, :]
        for r0 in range(row0, row0 + rows, EPILOGUE_ROWS):
            r = r0 + tl.arange(0, EPILOGUE_ROWS)
            mask = (r < row0 + rows)[:, None]
            xrow = (r // x_div).to(tl.int64)[:, None]
            xmask = mask & (k < k_valid)[None, :]
            if GLU:
                g = tl.load(x_ptr + 2 * xrow * stride_xm + k[None, :], mask=xmask, other=0.0).to(tl.float32)
                up = tl.load(x_ptr + (2 * xrow + 1) * stride_xm + k[None, :], mask=xmask, other=0.0).to(tl.float32)
                x = g / (1.0 + tl.exp(-g)) * up
            else:
                x = tl.load(x_ptr + xrow * stride_xm + k[None, :], mask=xmask, other=0.0).to(tl.float32)
            u = had128_rows((x * s).to(tl.float16).to(tl.float32), EPILOGUE_ROWS) * SCALE
            ur = (r * u_mul + u_add).to(tl.int64)
            tl.store(u_ptr + ur[:, None] * size_k + k[None, :], u.to(tl.float16), mask=mask & keep)


@triton.jit(do_not_specialize=VARYING_ARGS)
def exl3_fused_kernel(u_ptr, w_ptr, svh_ptr, bias_ptr, ids_ptr, y_ptr, z_ptr, cnt_ptr, parts_ptr,
                      M, tiles_n, stride_ym, n_out, k_steps, steps_per_split, expert_words, stride_zs,
                      x_ptr, suh_ptr, stride_xm, k_valid, x_div,
                      KA: tl.constexpr, HALF: tl.constexpr, W32: tl.constexpr, G: tl.constexpr,
                      CODEBOOK: tl.constexpr, HAS_IDS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                      SCALE: tl.constexpr, BM: tl.constexpr, KT: tl.constexpr, PARTS: tl.constexpr = 0,
                      PAIRS: tl.constexpr = False, FLAT: tl.constexpr = True, GROUPED: tl.constexpr = False,
                      IN_X: tl.constexpr = False, GLU: tl.constexpr = False, SL: tl.constexpr = SPLIT_LOADS,
                      FRAG: tl.constexpr = False, PF: tl.constexpr = False):
    """y = H(u·Ŵ)⊙svh (+ bias) for BM rows of u (MoE: one unit in row 0) × 128 columns, one K split.
    u is (M, k) fp16, contiguous; y keeps the first n_out columns, rows stride_ym apart (a part of a fused
    layer writes its slice of the layer's output in place).

    PARTS > 0: one grid over every part of a fused layer (q/k/v, gate/up; same rate and k). Column block b
    belongs to the part that parts_ptr's row b names (int64: trellis word offset from w_ptr, padded column
    start = svh offset, output column start, kept columns, tiles_n, part index, first block); u holds each
    row's parts side by side (row m of part p is u row m·PARTS + p: bound_group.GroupLaunch's input transform),
    tiles_n is the layer's total and n_out unused.

    GROUPED (MoE, T > 4 tokens): one program per tile of up to BM units of one expert, so each weight is decoded
    once per tile instead of once per unit. ids_ptr holds triton_moe.expert_tiles' int32 table: the units sorted
    by expert (order), their sorted expert ids (skey), then each tile's first sorted position (starts; empty tiles
    hold the unit count and do nothing). With PAIRS (gate/up of the stacked w13 arena, M = 2·units) program row
    pid_m is tile pid_m // 2's part pid_m % 2: unit rows 2·order + part through expert row 2·e + part.

    FLAT: the trellis words loaded through flat indices (triton_decode.ring_tiles), lane-linear whatever the rate.
    FRAG (4 and 8 bits): the decoded operand in the matrix unit's fragment order (triton_decode.fragment_operand), no
    shared-memory round trip of the weights; the columns come out in fragment order (finish_block maps them).
    FRAG = 4: the rows in the k order of a dot operand of kWidth 4 (what Triton 3.6 gives an fp16 mma v2 operand), else
    of kWidth 2 (Triton 3.8, 3.9): fused_launch.fragment_order. PF (with FRAG): the K loop loads each step's words one
    step ahead (triton_ring_dot.ring_dot).

    IN_X (dense rows and MoE units, not GROUPED): the program computes u for its own rows and K range from x (k_valid
    features, rows stride_xm apart; suh_ptr the part's suh, with PARTS the parts' stacked suh, with HAS_IDS the
    experts' stacked suh; a unit's x row, x_div and GLU as the input kernel takes them) into u_ptr before its K loop
    (input_rows), so the projection is one launch; else u is the input transform's output."""
    BNT: tl.constexpr = 8
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    size_n = tiles_n * 16
    size_k = k_steps * 16 * KT
    lane = tl.arange(0, BM)
    if PARTS > 0:
        row = parts_ptr + pid_n * 8
        # Offsets read from memory carry no alignment facts: state them (whole tiles of 8·bits words, whole
        # 128-column blocks), or the trellis loads lose their vector width.
        part_cols = tl.multiple_of(tl.load(row + 1), 128)
        part_n = tl.multiple_of(tl.load(row + 4), 8)
        local_n = pid_n - tl.load(row + 6)
        rm = pid_m * BM + lane
        mask_m = rm < M
        if IN_X:
            input_rows(x_ptr, stride_xm, suh_ptr + tl.load(row + 5) * size_k, u_ptr, size_k, k_valid,
                       pid_s * steps_per_split * KT * 16, steps_per_split * KT * 16, pid_m * BM,
                       tl.minimum(M - pid_m * BM, BM), PARTS, tl.load(row + 5), SCALE)
            cta_barrier(cnt_ptr, M)  # this program's u stores are visible to all its threads before the K loop
        acc = ring_dot(u_ptr, w_ptr + tl.multiple_of(tl.load(row), 16), rm * PARTS + tl.load(row + 5), mask_m, size_k,
                       part_n, pid_s * steps_per_split * KT, steps_per_split, local_n * BNT, KA, HALF, W32, G, CODEBOOK,
                       BM, BNT, KT, FLAT, FRAG, PF)
        c = tl.arange(0, 128)
        z_offs = rm.to(tl.int64)[:, None] * size_n + (pid_n * 128 + c)[None, :]
        tl.store(z_ptr + pid_s * stride_zs + z_offs, acc, mask=mask_m[:, None])
        cta_barrier(cnt_ptr, M)
        # The epilogue sees the part alone: z, svh, bias and y shifted to the part's first column.
        y_col = tl.load(row + 2)
        finish = True
        splits = 1
        if SPLIT:
            lock = cnt_ptr + pid_m * tl.num_programs(0) + pid_n
            splits = tl.num_programs(1)
            finish = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu") == splits - 1
            if finish:
                tl.store(lock, 0)
                global_fence(cnt_ptr, M)  # the other splits' partials, acquired by one thread, for all of them (Intel)
        if finish:
            finish_block(z_ptr + part_cols, stride_zs, splits, pid_m * BM, tl.minimum(M - pid_m * BM, BM), size_n,
                         local_n * 128, svh_ptr + part_cols, bias_ptr + y_col, y_ptr + y_col, stride_ym,
                         tl.load(row + 3), HAS_BIAS, SCALE, True, SL=SL, FRAG=FRAG)
        return
    steps = steps_per_split
    part = 0
    if GROUPED:
        units = M // 2 if PAIRS else M
        if PAIRS:
            part = pid_m % 2
        p0 = tl.load(ids_ptr + 2 * units + (pid_m // 2 if PAIRS else pid_m))
        e = tl.load(ids_ptr + units + tl.minimum(p0, units - 1))
        p = p0 + lane
        # a tile ends where its expert's run does (the next tile starts there) or after BM units
        mask_m = (p < units) & (tl.load(ids_ptr + units + p, mask=p < units, other=-1) == e)
        rm = tl.load(ids_ptr + p, mask=mask_m, other=0) * (2 if PAIRS else 1) + part
        e = e.to(tl.int64) * (2 if PAIRS else 1) + part
        w_base = w_ptr + e * expert_words
        svh_base = svh_ptr + e * size_n
        bias_base = bias_ptr + e * size_n
        row0 = p0
        rows = tl.sum(mask_m.to(tl.int32), axis=0)
        steps = tl.where(rows > 0, steps_per_split, 0)  # empty tiles (the grid's upper bound) skip the K loop
    elif HAS_IDS:  # one (token, expert) unit per program: its expert's trellis, svh, bias
        e = unit_expert(ids_ptr, pid_m, True, PAIRS)
        w_base = w_ptr + e * expert_words
        svh_base = svh_ptr + e * size_n
        bias_base = bias_ptr + e * size_n
        rm = pid_m + lane
        mask_m = lane == 0
        row0 = pid_m
        rows = 1
        if IN_X:
            input_rows(x_ptr, stride_xm, suh_ptr + e * size_k, u_ptr, size_k, k_valid,
                       pid_s * steps_per_split * KT * 16, steps_per_split * KT * 16, row0, 1, 1, 0, SCALE, x_div, GLU)
            cta_barrier(cnt_ptr, M)  # as above
    else:
        w_base = w_ptr
        svh_base = svh_ptr
        bias_base = bias_ptr
        rm = pid_m * BM + lane
        mask_m = rm < M
        row0 = pid_m * BM
        rows = tl.minimum(M - row0, BM)
        if IN_X:
            input_rows(x_ptr, stride_xm, suh_ptr, u_ptr, size_k, k_valid, pid_s * steps_per_split * KT * 16,
                       steps_per_split * KT * 16, row0, rows, 1, 0, SCALE)
            cta_barrier(cnt_ptr, M)  # as above
    acc = ring_dot(u_ptr, w_base, rm, mask_m, size_k, tiles_n, pid_s * steps_per_split * KT, steps,
                   pid_n * BNT, KA, HALF, W32, G, CODEBOOK, BM, BNT, KT, FLAT, FRAG, PF)
    # Every split stores its partial; the last one to arrive (or the only one) finishes the block.
    c = tl.arange(0, 128)
    z_offs = rm.to(tl.int64)[:, None] * size_n + (pid_n * 128 + c)[None, :]
    tl.store(z_ptr + pid_s * stride_zs + z_offs, acc, mask=mask_m[:, None])
    cta_barrier(cnt_ptr, M)  # every thread's partial is written before the counter says so / before the reload
    if SPLIT:
        lock = cnt_ptr + pid_m * tl.num_programs(0) + pid_n
        splits = tl.num_programs(1)
        if tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu") == splits - 1:
            tl.store(lock, 0)
            global_fence(cnt_ptr, M)  # as above
            finish_block(z_ptr, stride_zs, splits, row0, rows, size_n, pid_n * 128, svh_base, bias_base, y_ptr,
                         stride_ym, n_out, HAS_BIAS, SCALE, True, ids_ptr, 2 if PAIRS else 1, part, GROUPED, SL,
                         FRAG)
    else:
        finish_block(z_ptr, stride_zs, 1, row0, rows, size_n, pid_n * 128, svh_base, bias_base, y_ptr, stride_ym,
                     n_out, HAS_BIAS, SCALE, True, ids_ptr, 2 if PAIRS else 1, part, GROUPED, SL, FRAG)
