"""The activation-side transforms of an EXL3 linear (Triton), spec §5:

    input:   u = fp16( H128(fp16(x ⊙ suh)) )    x (rows, k) any float dtype -> u (rows, k) fp16
    output:  y = H128(Σ_s z_s) ⊙ svh (+ bias)   z (splits, rows, n) split-K partials (fp32) -> y (rows, n)

Input: x ⊙ suh is rounded to fp16 (as exllamav3's had_hf does) and multiplied by the fp16 ±1 matrix on
tensor cores / DPAS (fp32 accumulation, the 1/√128 scale once at the end). The fp32 butterfly it replaced
ran at 32 Gelements/s (332 µs at 2048×5120 on the H200, now 24 µs).
Output: the split-K sums stay fp32 through an fp32 butterfly (H128 = H16 ⊗ H8: 24 multiply-adds per
element), so the transform adds no fp16 overflow or rounding of its own. It serves at most 64 rows. An fp32
"ieee" dot in its place cost ~80 µs per call on the H200 (docs/perf/h200-v3c-bench.log).

The ±1 operands (natural order, and with rows in the ring order of triton_decode.ring_operand for the
reconstruct kernel) are made once per device and loaded from memory (hadamard_operands).

MoE (grouped units): with `ids` given, row r of u/z/y is unit r, whose expert is ids[r] (read on the device)
and whose activation row is x[r // x_div]; suh/svh/bias are then stacked per expert, (E, k) / (E, n).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from exl3local.kernels.hadamard import HADAMARD_SCALE
from exl3local.kernels.triton_decode import ring_cols

NATURAL, RING_ROWS = tl.constexpr(0), tl.constexpr(1)  # the operands of hadamard_operands (jit-visible)
# The output butterfly holds BM*16*16*8 fp32 products: 32 registers/thread at 4 warps
OUTPUT_ROWS_PER_PROGRAM = 4


@triton.jit
def _hadamard_operands_kernel(out_ptr):
    i = tl.arange(0, 128)
    for which in tl.static_range(2):
        if which == NATURAL:
            p = i[:, None] & i[None, :]
        else:
            p = ring_cols(i)[:, None] & i[None, :]
        p = p ^ (p >> 4)
        p = p ^ (p >> 2)
        p = p ^ (p >> 1)
        tl.store(out_ptr + which * 128 * 128 + i[:, None] * 128 + i[None, :], (1 - 2 * (p & 1)).to(tl.float16))


@functools.lru_cache(maxsize=8)
def hadamard_operands(device: torch.device) -> torch.Tensor:
    """(2, 128, 128) fp16 ±1, unscaled: [NATURAL] = H; [RING_ROWS] = H[ring_cols, :], which applies Hn
    from the right to a block whose columns are in ring order (triton_gemm)."""
    out = torch.empty(2, 128, 128, dtype=torch.float16, device=device)
    _hadamard_operands_kernel[(1,)](out)
    return out


@triton.jit
def load_hadamard(had_ptr, WHICH: tl.constexpr):
    i = tl.arange(0, 128)
    return tl.load(had_ptr + WHICH * 128 * 128 + i[:, None] * 128 + i[None, :])


@triton.jit
def _parity_sign(a, b):
    """(-1)^popcount(a & b) as fp32, for indices below 16."""
    p = a & b
    p = p ^ (p >> 1)
    p = p ^ (p >> 2)
    return 1.0 - 2.0 * (p & 1).to(tl.float32)


@triton.jit
def had128(v, BM: tl.constexpr):
    """Unscaled H128 applied to each row of v [BM, 128] fp32 (fp32 result)."""
    i8 = tl.arange(0, 8)
    i16 = tl.arange(0, 16)
    h8 = _parity_sign(i8[:, None], i8[None, :])  # [i0, j0]
    h16 = _parity_sign(i16[:, None], i16[None, :])  # [i1, j1]
    v3 = tl.reshape(v, (BM, 16, 8))
    t = tl.sum(v3[:, :, :, None] * h8[None, None, :, :], axis=2)  # [m, i1, j0]
    o = tl.sum(t[:, :, None, :] * h16[None, :, :, None], axis=1)  # [m, j1, j0]
    return tl.reshape(o, (BM, 128))


@triton.jit
def unit_expert(ids_ptr, unit, mask, PAIRS: tl.constexpr):
    """The expert row of a MoE unit: ids[unit] (a negative id, another rank's expert, reads as 0: its output is
    weighted 0 by the caller); with PAIRS, units come in (gate, up) pairs of the stacked w13 arena, so unit u
    is row 2·ids[u // 2] + u % 2."""
    if PAIRS:
        e = tl.maximum(tl.load(ids_ptr + unit // 2, mask=mask, other=0).to(tl.int64), 0)
        return 2 * e + unit % 2
    return tl.maximum(tl.load(ids_ptr + unit, mask=mask, other=0).to(tl.int64), 0)


@triton.jit(do_not_specialize=["M", "stride_xm"])  # one compiled kernel for every row count (kernels/fused_launch.py)
def _input_kernel(x_ptr, suh_ptr, ids_ptr, had_ptr, u_ptr, M, size_k, stride_xm, x_div, k_valid,
                  HAS_IDS: tl.constexpr, SCALE: tl.constexpr, BM: tl.constexpr, PAIRS: tl.constexpr = False,
                  GLU: tl.constexpr = False, RB: tl.constexpr = 1, PARTS: tl.constexpr = 1):
    """x has k_valid <= size_k features per row; the rest reads as the zero padding of spec §1.4.
    GLU: x row r is silu(x[2r]) ⊙ x[2r + 1] (an MoE unit's gate and up outputs, fp32), the down projection's
    input computed here instead of in a separate launch. RB: row blocks per program, which load the ±1 operand
    (32 KB, twice a 64-row block of x) once for all of them (input_row_blocks). PARTS > 1 (not HAS_IDS): the parts
    of a fused layer (suh stacked (PARTS, size_k)), each x block read once for all of them; part p's u is rows
    p·M .. p·M + M - 1 of u, each the same bits as a launch of its own."""
    rk = tl.program_id(1) * 128 + tl.arange(0, 128)
    h = load_hadamard(had_ptr, NATURAL)
    if PARTS == 1:  # (one constexpr per `if`: Triton takes `a and b` for a runtime condition)
        if not HAS_IDS:
            suh = tl.load(suh_ptr + rk).to(tl.float32)[None, :]
    for b in range(RB):
        rm = (tl.program_id(0) * RB + b) * BM + tl.arange(0, BM)
        mask = (rm < M)[:, None]
        xrow = (rm // x_div).to(tl.int64)
        xmask = mask & (rk < k_valid)[None, :]
        if GLU:
            g = tl.load(x_ptr + (2 * xrow)[:, None] * stride_xm + rk[None, :], mask=xmask, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + (2 * xrow + 1)[:, None] * stride_xm + rk[None, :], mask=xmask,
                         other=0.0).to(tl.float32)
            x = g / (1.0 + tl.exp(-g)) * up
        elif PARTS > 1:  # kept in its own dtype across the parts (its fp32 value is exact)
            x = tl.load(x_ptr + xrow[:, None] * stride_xm + rk[None, :], mask=xmask, other=0.0)
        else:
            x = tl.load(x_ptr + xrow[:, None] * stride_xm + rk[None, :], mask=xmask, other=0.0).to(tl.float32)
        if PARTS > 1:
            for p in tl.static_range(PARTS):
                s = tl.load(suh_ptr + p * size_k + rk).to(tl.float32)[None, :]
                u = tl.dot((x.to(tl.float32) * s).to(tl.float16), h) * SCALE
                tl.store(u_ptr + (rm + p * M).to(tl.int64)[:, None] * size_k + rk[None, :], u.to(tl.float16),
                         mask=mask)
        else:
            if HAS_IDS:
                e = unit_expert(ids_ptr, rm, rm < M, PAIRS)
                s = tl.load(suh_ptr + e[:, None] * size_k + rk[None, :], mask=mask, other=0.0).to(tl.float32)
            else:
                s = suh
            u = tl.dot((x * s).to(tl.float16), h) * SCALE
            tl.store(u_ptr + rm.to(tl.int64)[:, None] * size_k + rk[None, :], u.to(tl.float16), mask=mask)


@triton.jit
def _output_kernel(z_ptr, svh_ptr, bias_ptr, ids_ptr, y_ptr, M, size_n, splits, stride_zs,
                   HAS_IDS: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE: tl.constexpr, BM: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * 128 + tl.arange(0, 128)
    mask = (rm < M)[:, None]
    offs = rm.to(tl.int64)[:, None] * size_n + rn[None, :]
    z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for s in range(1, splits):
        z += tl.load(z_ptr + s * stride_zs + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_IDS:
        e = tl.load(ids_ptr + rm, mask=rm < M, other=0).to(tl.int64)
        vec = e[:, None] * size_n + rn[None, :]
        y = had128(z, BM) * SCALE * tl.load(svh_ptr + vec, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(bias_ptr + vec, mask=mask, other=0.0).to(tl.float32)
    else:
        y = had128(z, BM) * SCALE * tl.load(svh_ptr + rn).to(tl.float32)[None, :]
        if HAS_BIAS:
            y += tl.load(bias_ptr + rn).to(tl.float32)[None, :]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])  # bound launches reuse one compiled kernel for every row count
def _product_output_kernel(z_ptr, svh_ptr, bias_ptr, had_ptr, y_ptr, M, size_n, stride_ym, n_valid,
                           HAS_BIAS: tl.constexpr, SCALE: tl.constexpr, BM: tl.constexpr):
    """y = H128(z)⊙svh (+ bias) for one fp32 product z (rows, n) (triton_gemm's Hadamard on y) on the matrix units,
    near fp32: each row scaled by the power of two that puts its largest |z| in [1, 2) (exact, and no fp16
    overflow), split into fp16 hi + lo (22 significant bits), both multiplied by the ±1 matrix with fp32
    accumulation, and scaled back. The butterfly of _output_kernel took ~270 µs at 512x17408 on the H200.
    y's rows are stride_ym apart and only its first n_valid columns are written: a part of a fused layer writes its
    columns of the layer's output in place (a copy per part cost 5.4 ms of host time per 27B 64-row eager step)."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * 128 + tl.arange(0, 128)
    mask = (rm < M)[:, None]
    offs = rm.to(tl.int64)[:, None] * size_n + rn[None, :]
    z = tl.load(z_ptr + offs, mask=mask, other=0.0)
    # the biased exponent of each row's largest |z|, at least 1 (a zero row stays zero)
    e = tl.maximum((tl.max(tl.abs(z), axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF, 1)
    zs = z * ((254 - e) << 23).to(tl.float32, bitcast=True)[:, None]
    hi = zs.to(tl.float16)
    h = load_hadamard(had_ptr, NATURAL)
    t = tl.dot((zs - hi.to(tl.float32)).to(tl.float16), h, tl.dot(hi, h))
    y = t * (e << 23).to(tl.float32, bitcast=True)[:, None] * SCALE * tl.load(svh_ptr + rn).to(tl.float32)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn).to(tl.float32)[None, :]
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], y.to(y_ptr.dtype.element_ty),
             mask=mask & (rn < n_valid)[None, :])


def product_output(z: torch.Tensor, svh: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """y = H128(z) ⊙ svh (+ bias) in `dtype`; z is one fp32 product (rows, n), contiguous."""
    rows, size_n = z.shape
    y = torch.empty(rows, size_n, dtype=dtype, device=z.device)
    block_m = rows_per_program(rows)
    _product_output_kernel[(triton.cdiv(rows, block_m), size_n // 128)](
        z, svh, bias if bias is not None else svh, hadamard_operands(z.device), y, rows, size_n, size_n, size_n,
        HAS_BIAS=bias is not None, SCALE=HADAMARD_SCALE, BM=block_m,
    )
    return y


def rows_per_program(rows: int) -> int:
    """A dot tile of 16 rows for decode batches, 64 for prefill."""
    return 16 if rows <= 16 else 64


# Rows per program of the input transform from this many rows on (64-row blocks, INPUT_ROW_BLOCKS of them). H200
# (s15a), µs at 4096 rows, RB 1 / 4: k 17408 114.2 / 104.3, 6144 43.6 / 39.3, 5120 37.6 / 36.8; at 1024 rows RB 4
# lost (5120: 11.4 / 15.2: too few programs).
INPUT_BLOCKS_MIN_ROWS = 4096
INPUT_ROW_BLOCKS = 4


def input_row_blocks(rows: int) -> int:
    """RB of _input_kernel for `rows` rows: one block below INPUT_BLOCKS_MIN_ROWS (decode and verify rows keep every
    program), INPUT_ROW_BLOCKS from there. Each row's u is the same whatever RB (the same dot per block)."""
    return INPUT_ROW_BLOCKS if rows >= INPUT_BLOCKS_MIN_ROWS else 1


def input_transform(x: torch.Tensor, suh: torch.Tensor, ids: torch.Tensor | None = None, x_div: int = 1,
                    rows: int | None = None) -> torch.Tensor:
    """u = fp16(H128(x ⊙ suh)) for each row (each unit, with ids); x is (rows_x, k) with unit stride in k."""
    size_k = x.shape[-1]
    rows = x.shape[0] if rows is None else rows
    u = torch.empty(rows, size_k, dtype=torch.float16, device=x.device)
    block_m, blocks = rows_per_program(rows), input_row_blocks(rows)
    _input_kernel[(triton.cdiv(rows, block_m * blocks), size_k // 128)](
        x, suh, ids if ids is not None else suh, hadamard_operands(x.device), u, rows, size_k, x.stride(0), x_div, size_k,
        HAS_IDS=ids is not None, SCALE=HADAMARD_SCALE, BM=block_m, RB=blocks,
    )
    return u


def output_transform(z: torch.Tensor, svh: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                     ids: torch.Tensor | None = None) -> torch.Tensor:
    """y = H128(Σ_s z[s]) ⊙ svh (+ bias) in `dtype`; z is (splits, rows, n), contiguous."""
    splits, rows, size_n = z.shape
    y = torch.empty(rows, size_n, dtype=dtype, device=z.device)
    _output_kernel[(triton.cdiv(rows, OUTPUT_ROWS_PER_PROGRAM), size_n // 128)](
        z, svh, bias if bias is not None else svh, ids if ids is not None else svh, y,
        rows, size_n, splits, z.stride(0),
        HAS_IDS=ids is not None, HAS_BIAS=bias is not None, SCALE=HADAMARD_SCALE, BM=OUTPUT_ROWS_PER_PROGRAM,
    )
    return y
