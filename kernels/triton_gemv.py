"""EXL3 GEMV / small-batch and on-chip-decode matmul (Triton): z = u · Ŵ with Ŵ decoded in registers,
never written out.

`exl3_ring_dot_kernel` (v3): per K step, KT×BNT tiles are decoded in ring order (triton_decode.ring_operand)
into one fp16 dot operand; activations are loaded through the same row order, results stored through the
column order. One kernel for 1..16 rows (a 16-row dot tile), MoE units (one unit per program, expert id
read on the device) and, for the prefill comparison in bench/kernels.py, 32- and 64-row tiles. The
dispatch runs its loop inside triton_fused.exl3_fused_kernel (with the output transform as epilogue);
this kernel serves the three-launch baseline (`gemv`), the bench and the ncu target.
tl.dot = MMA on NVIDIA, DPAS on Arc. `exl3_gemv_ring_kernel` (v2) multiplies each decoded weight into
each row with FMAs instead; with its epilogue (EPILOGUE) it serves one row at FMA_ONE_ROW_BITS.

Layouts:
    u        fp16 (rows, k)            the input transform's output (triton_hadamard.input_transform)
    trellis  int16 (k/16, n/16, 16*bits) as stored, read as int32 words (triton_decode); MoE: (E, ...) stacked
    z        fp32 (splits, rows, n)    split-K partial sums; triton_hadamard.output_transform reduces them

Split-K exists because decode shapes have few output columns per SM (5120x1024: 8 column blocks of 128):
splits bring the program count near SPLIT_TARGET_PROGRAMS_PER_CORE x cores.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from exl3local.kernels.triton_decode import (
    decode_state, lanes_per_superlane, rate_constants, ring_cols, ring_state, words,
)
from exl3local.kernels.triton_fused import finish_block
from exl3local.kernels.triton_hadamard import input_transform, output_transform
from exl3local.kernels.triton_ring_dot import ring_dot
from exl3local.kernels.triton_sync import cta_barrier, global_fence

# Programs per compute unit that split-K aims for: 4.5 picks the best measured split on all four 27B decode
# shapes on the H200 (docs/perf/h200-v3b-sweep.log: 8 splits at 5120x17408, 16 at 5120x5120 and 17408x5120);
# still the best of half, 2x and 4x after the coalesced loads (h200-s7-splits*.log).
SPLIT_TARGET_PROGRAMS_PER_CORE = 4.5
# On XPU (Arc review #8, unverified on Arc): an Xe2 core runs 64 hardware threads (8 vector engines × 8) and a 4-warp
# program is 4 of them (16-wide sub-groups), so 16 programs fill a core (8 once IGC recompiles with the large
# register file); 4.5 left it about a quarter occupied.
XPU_PROGRAMS_PER_CORE = 16.0
# ...but every split keeps at least this many K steps: the finishing program sums the splits' partials one load after
# another, so splits of 1-4 steps (35B-A3B's narrow groups: shared_gate_up, 8 column blocks, took 128 splits of one
# step; out_proj/o_proj 64 of 4) cost more in that serial tail than their parallelism gains. No 27B group is affected
# (its fewest steps per split are 24). H200, 35B-A3B graph step at M = 1 / 4 / 16 (h200-s13a, one partial load at a
# time): 4.51 / 6.43 / 18.60 ms without a floor, 3.84 / 5.73 / 14.92 with 8; with 4 and 16 (and SPLIT_LOADS) 4 lost
# at 16 rows and 16 at 1-4 rows (docs/PERF.md "Session 13"). Arc unmeasured.
MIN_STEPS_PER_SPLIT = 8
# Ring dot (BNT, KT, warps) per super-lane width G (1: K=4,8; 2: K=2,6; 4: K=1,3,5,7; 8: half rates): KT·BNT·32/G
# decoded weights per position must cover the threads, or the decode is replicated (G=4 at KT=1 ran 2x
# slower). Best measured at 16 rows on the H200 (h200-v3b-sweep.log); G=8 is an unmeasured extrapolation.
RING_DOT_CONFIGS = {1: (8, 1, 4), 2: (8, 1, 4), 4: (8, 2, 4), 8: (8, 4, 4)}
# At one row the FMA ring kernel (one product per weight, no operand shuffle) beat the dot kernel except at
# 2 and 4 bits (same log: e.g. 5120x17408 K8 108 vs 153 µs, K4 105 vs 67 µs).
DOT_ONE_ROW_BITS = (2, 4)
# With the output transform as its last-split epilogue (kernels/fused_launch.py) it still wins at 8 bits only
# (5120x17408 M=1: 89 µs vs 141 for the dot kernel); at 3 and 6 bits its programs span 2-4 Hadamard blocks
# and the last split's serial tail made it lose (5120x5120 K3 97 vs 27 µs; docs/PERF.md v4b).
FMA_ONE_ROW_BITS = (8,)


def ring_dot_config(bits: float) -> tuple[int, int, int]:
    """(BNT, KT, warps) of the ring dot kernel for this rate (RING_DOT_CONFIGS)."""
    return RING_DOT_CONFIGS[lanes_per_superlane(bits)]


# The tiled path (more than 16 rows, kernels/fused_launch.py; off by default: it lost to the reconstruct path at model
# level on the H200, docs/PERF.md "Session 7"): the same fused kernel with 64-row dot tiles, so each weight is decoded
# once per 64 rows instead of being rebuilt in fp16 per call. 8 warps: at 64 rows 4 warps needed 196 registers per
# thread (local sm_90 compile: 2 programs, 8 warps per SM), 8 warps 114 (K4), 128 (K2/3/6/8). KT = G tile rows per
# step, so one position's [KT, 8, 32/G] decode covers the 256 threads; half rates (G = 8) stop at KT = 4 (KT = 8
# took 254 registers, 4 takes 189: one program per SM).
# Split-K aims at one program per SM: in the H200 sweep at 64 rows (h200-s7-layers-tiled.log) that picks the best
# swept split in 6 of the 7 layers it decides among swept counts; the earlier 2 per SM picked none. 27B gate_up
# (136 blocks) loses 6 % with it (wave quantisation: 2 per SM resident, so 2 splits ran two waves).
TILE_ROWS = 64
TILED_WARPS = 8
TILED_PROGRAMS_PER_CORE = 1.0


def tiled_config(bits: float) -> tuple[int, int]:
    """(KT, warps) of the fused kernel at TILE_ROWS rows for this rate."""
    return min(lanes_per_superlane(bits), 4), TILED_WARPS


@functools.lru_cache(maxsize=8)
def compute_units(device: torch.device) -> int:
    """Streaming multiprocessors / Xe cores: how many programs run at once, for split-K."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    if device.type == "xpu":
        props = torch.xpu.get_device_properties(device)
        return getattr(props, "gpu_subslice_count", None) or getattr(props, "max_compute_units", 32) // 8
    return 1  # the interpreter: few programs keep CI fast (tests force split-K explicitly)


def choose_splits(blocks: int, k_steps: int, device: torch.device, per_core: float | None = None) -> int:
    """Smallest power-of-two split of the K loop (dividing k_steps) that reaches per_core programs per unit
    (default: SPLIT_TARGET_PROGRAMS_PER_CORE, XPU_PROGRAMS_PER_CORE on XPU), or the largest that leaves every split
    MIN_STEPS_PER_SPLIT steps."""
    if per_core is None:
        per_core = XPU_PROGRAMS_PER_CORE if device.type == "xpu" else SPLIT_TARGET_PROGRAMS_PER_CORE
    target = per_core * compute_units(device)
    splits = 1
    while blocks * splits < target and k_steps % (splits * 2) == 0 and k_steps // (splits * 2) >= MIN_STEPS_PER_SPLIT:
        splits *= 2
    return splits


# ---- Ring-order GEMV with FMAs (v2): one product per weight and row; serves one row at rates where it won ----


@triton.jit(do_not_specialize=["M", "stride_zs", "stride_ym"])
def exl3_gemv_ring_kernel(u_ptr, w_ptr, z_ptr, M, size_k, tiles_n, tk_per_split, stride_zs,
                          svh_ptr, bias_ptr, y_ptr, cnt_ptr, stride_ym, n_out,
                          KA: tl.constexpr, HALF: tl.constexpr, W32: tl.constexpr, G: tl.constexpr,
                          CODEBOOK: tl.constexpr, BM: tl.constexpr, BNT: tl.constexpr,
                          EPILOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE: tl.constexpr):
    """z[split] = u · Ŵ over one K split; with EPILOGUE, the last split of a column block also writes
    y = H(Σ z)⊙svh (+ bias) (triton_fused.finish_block; BNT a multiple of 8, so whole Hadamard blocks)."""
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
    u_rows = u_ptr + rm.to(tl.int64)[:, None] * size_k
    acc00 = tl.zeros((BM, BNT, S), dtype=tl.float32)
    acc01 = tl.zeros((BM, BNT, S), dtype=tl.float32)
    acc10 = tl.zeros((BM, BNT, S), dtype=tl.float32)
    acc11 = tl.zeros((BM, BNT, S), dtype=tl.float32)
    tk_start = pid_s * tk_per_split
    row_base = w_ptr + tk_start.to(tl.int64) * tiles_n * W32
    u_tile = u_rows + tk_start * 16
    for _ in range(tk_per_split):
        for g in tl.static_range(G):
            t = s * G + g
            for j in tl.static_range(8):
                state = ring_state(row_base, tile_col[:, None], s[None, :], mask_n[:, None], g, j, KA, HALF, WPS, W32)
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
    if EPILOGUE:
        cta_barrier(cnt_ptr, M)  # every thread's partial is written before the counter says so (triton_sync)
        lock = cnt_ptr + pid_m * tl.num_programs(0) + pid_n
        splits = tl.num_programs(1)
        if tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu") == splits - 1:
            tl.store(lock, 0)
            global_fence(cnt_ptr, M)  # the other splits' partials, acquired by one thread, for all of them (Intel)
            row0 = pid_m * BM
            for hb in range(tl.minimum(BNT, tiles_n - pid_n * BNT) // 8):
                finish_block(z_ptr, stride_zs, splits, row0, tl.minimum(M - row0, BM), tiles_n * 16,
                             (pid_n * BNT + hb * 8) * 16, svh_ptr, bias_ptr, y_ptr, stride_ym, n_out, HAS_BIAS, SCALE,
                             False)


# ---- Ring-order decode feeding tl.dot (v3, triton_decode.ring_operand) ----------------------------------


@triton.jit
def exl3_ring_dot_kernel(u_ptr, w_ptr, ids_ptr, z_ptr, M, size_k, tiles_n, steps_per_split, expert_words, stride_zs,
                         KA: tl.constexpr, HALF: tl.constexpr, W32: tl.constexpr, G: tl.constexpr,
                         CODEBOOK: tl.constexpr, HAS_IDS: tl.constexpr,
                         BM: tl.constexpr, BNT: tl.constexpr, KT: tl.constexpr):
    """z[split] = u · Ŵ over one K split, BM rows × 16·BNT columns per program (MoE: one unit, row 0)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    w_base = w_ptr
    if HAS_IDS:  # each unit has its own expert: one unit per program, in row 0 of the dot tile
        rm = pid_m + tl.arange(0, BM)
        mask_m = tl.arange(0, BM) == 0
        w_base += tl.load(ids_ptr + pid_m).to(tl.int64) * expert_words
    else:
        rm = pid_m * BM + tl.arange(0, BM)
        mask_m = rm < M
    acc = ring_dot(u_ptr, w_base, rm, mask_m, size_k, tiles_n, pid_s * steps_per_split * KT, steps_per_split,
                   pid_n * BNT, KA, HALF, W32, G, CODEBOOK, BM, BNT, KT)
    # The operand is in ring order: results are stored through the column map.
    cols = pid_n * 16 * BNT + ring_cols(tl.arange(0, 16 * BNT))
    tl.store(z_ptr + pid_s * stride_zs + rm.to(tl.int64)[:, None] * (tiles_n * 16) + cols[None, :], acc,
             mask=mask_m[:, None])


def ring_dot_partials(u: torch.Tensor, trellis: torch.Tensor, bits: float, codebook: str, block_m: int,
                      block_nt: int, block_kt: int, splits: int | None = None, ids: torch.Tensor | None = None,
                      num_warps: int = 4, num_stages: int = 1) -> torch.Tensor:
    """z partials (splits, rows, n) fp32 of u · Ŵ through the ring-order dot kernel (block_m >= 16).

    num_stages 1 (word loads straight to registers) beat Triton's cp.async double buffer at every rate
    measured: 16 rows at 5120x17408, K4 89.7 vs 95.3 µs, K6 129 vs 153, K8 149 vs 197 (h200-v3c-bench.log)."""
    rows, size_k = u.shape
    tiles_n = trellis.shape[-2]
    tiles_k = size_k // 16
    if tiles_n % block_nt or tiles_k % block_kt:
        raise ValueError(f"ring dot blocks ({block_kt}x{block_nt} tiles) must divide the {tiles_k}x{tiles_n} tiles")
    m_blocks = rows if ids is not None else triton.cdiv(rows, block_m)
    n_blocks = tiles_n // block_nt
    if splits is None:
        splits = choose_splits(m_blocks * n_blocks, tiles_k // block_kt, u.device)
    z = torch.empty(splits, rows, tiles_n * 16, dtype=torch.float32, device=u.device)
    expert_words = trellis[0].numel() // 2 if ids is not None else 0
    exl3_ring_dot_kernel[(n_blocks, splits, m_blocks)](
        u, words(trellis), ids if ids is not None else u, z,
        rows, size_k, tiles_n, tiles_k // splits // block_kt, expert_words, z.stride(0), **rate_constants(bits, codebook),
        HAS_IDS=ids is not None, BM=block_m, BNT=block_nt, KT=block_kt,
        num_warps=num_warps, num_stages=num_stages,
    )
    return z


def ring_config(rows: int, bits: float) -> tuple[int, int]:
    """(BM, BNT): rows per program (a power of two) and 16-column tiles per program, sized so one
    position's [BM, BNT, 32/G] tensor holds ~256 elements (2 per thread at 4 warps)."""
    block_m = 1
    while block_m < rows:
        block_m *= 2
    superlanes = 32 // lanes_per_superlane(bits)
    return block_m, max(1, 256 // (superlanes * block_m))


def ring_partials(u: torch.Tensor, trellis: torch.Tensor, bits: float, codebook: str, block_m: int, block_nt: int,
                  splits: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """z partials (splits, rows, n) fp32 of u · Ŵ through the ring-order kernel."""
    rows, size_k = u.shape
    tiles_n = trellis.shape[-2]
    tiles_k = size_k // 16
    m_blocks = triton.cdiv(rows, block_m)
    n_blocks = triton.cdiv(tiles_n, block_nt)
    if splits is None:
        splits = choose_splits(m_blocks * n_blocks, tiles_k, u.device)
    z = torch.empty(splits, rows, tiles_n * 16, dtype=torch.float32, device=u.device)
    exl3_gemv_ring_kernel[(n_blocks, splits, m_blocks)](
        u, words(trellis), z, rows, size_k, tiles_n, tiles_k // splits, z.stride(0), z, z, z, z, 0, 0,
        **rate_constants(bits, codebook), BM=block_m, BNT=block_nt, EPILOGUE=False, HAS_BIAS=False, SCALE=1.0,
        num_warps=num_warps,
    )
    return z


def gemv(x2d: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, bits: float,
         codebook: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x·W (+ bias) in three launches (v3): input transform, ring-order matmul (Ŵ decoded in registers,
    never written), output transform. The dispatch uses the two-launch path of kernels/fused_launch.py instead;
    this stays as bench/kernels.py's same-run baseline and for its 32/64-row tile comparison with the
    reconstruct path. One row at rates other than DOT_ONE_ROW_BITS runs the FMA ring kernel."""
    rows = x2d.shape[0]
    u = input_transform(x2d, suh)
    if rows == 1 and bits not in DOT_ONE_ROW_BITS:
        z = ring_partials(u, trellis, bits, codebook, *ring_config(1, bits))
    else:
        block_nt, block_kt, warps = ring_dot_config(bits)
        block_m = min(64, max(16, triton.next_power_of_2(rows)))
        z = ring_dot_partials(u, trellis, bits, codebook, block_m, block_nt, block_kt, num_warps=warps)
    return output_transform(z, svh, bias, x2d.dtype)
