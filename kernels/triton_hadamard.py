"""The activation-side transforms of an EXL3 linear (Triton), spec §5:

    input:   u = fp16( H128(x ⊙ suh) )          x (rows, k) any float dtype -> u (rows, k) fp16
    output:  y = H128(Σ_s z_s) ⊙ svh (+ bias)   z (splits, rows, n) split-K partials (fp32, or fp16 from a
                                                 vendor matmul) -> y (rows, n)

H128 runs in fp32 as the Kronecker product H16 ⊗ H8 (index i = 8·i1 + i0, so (-1)^popcount(i&j) factors):
24 adds per element instead of 128, with ±1 entries and the 1/√128 scale applied once at the end.

MoE (grouped units): with `ids` given, row r of u/z/y is unit r, whose expert is ids[r] (read on the device)
and whose activation row is x[r // x_div]; suh/svh/bias are then stacked per expert, (E, k) / (E, n).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exl3local.kernels.hadamard import HADAMARD_SCALE

ROWS_PER_PROGRAM = 4  # the two Kronecker stages hold BM*16*16*8 fp32 products: 32 registers/thread at 4 warps


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
def _input_kernel(x_ptr, suh_ptr, ids_ptr, u_ptr, M, size_k, stride_xm, x_div,
                  HAS_IDS: tl.constexpr, SCALE: tl.constexpr, BM: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rk = tl.program_id(1) * 128 + tl.arange(0, 128)
    mask = (rm < M)[:, None]
    xrow = (rm // x_div).to(tl.int64)
    x = tl.load(x_ptr + xrow[:, None] * stride_xm + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_IDS:
        e = tl.load(ids_ptr + rm, mask=rm < M, other=0).to(tl.int64)
        s = tl.load(suh_ptr + e[:, None] * size_k + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        s = tl.load(suh_ptr + rk).to(tl.float32)[None, :]
    u = (had128(x * s, BM) * SCALE).to(tl.float16)
    tl.store(u_ptr + rm.to(tl.int64)[:, None] * size_k + rk[None, :], u, mask=mask)


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


def input_transform(x: torch.Tensor, suh: torch.Tensor, ids: torch.Tensor | None = None, x_div: int = 1,
                    rows: int | None = None) -> torch.Tensor:
    """u = fp16(H128(x ⊙ suh)) for each row (each unit, with ids); x is (rows_x, k) with unit stride in k."""
    size_k = x.shape[-1]
    rows = x.shape[0] if rows is None else rows
    u = torch.empty(rows, size_k, dtype=torch.float16, device=x.device)
    grid = (triton.cdiv(rows, ROWS_PER_PROGRAM), size_k // 128)
    _input_kernel[grid](
        x, suh, ids if ids is not None else suh, u, rows, size_k, x.stride(0), x_div,
        HAS_IDS=ids is not None, SCALE=HADAMARD_SCALE, BM=ROWS_PER_PROGRAM,
    )
    return u


def output_transform(z: torch.Tensor, svh: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                     ids: torch.Tensor | None = None) -> torch.Tensor:
    """y = H128(Σ_s z[s]) ⊙ svh (+ bias) in `dtype`; z is (splits, rows, n), contiguous."""
    splits, rows, size_n = z.shape
    y = torch.empty(rows, size_n, dtype=dtype, device=z.device)
    grid = (triton.cdiv(rows, ROWS_PER_PROGRAM), size_n // 128)
    _output_kernel[grid](
        z, svh, bias if bias is not None else svh, ids if ids is not None else svh, y,
        rows, size_n, splits, z.stride(0),
        HAS_IDS=ids is not None, HAS_BIAS=bias is not None, SCALE=HADAMARD_SCALE, BM=ROWS_PER_PROGRAM,
    )
    return y
