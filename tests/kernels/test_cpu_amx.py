"""The CPU GEMM path on AMX (kernels/cpu/exl3_cpu_amx.h): bf16 activations times W' = diag(suh)·H·Ŵ in three bf16
planes, exact like the fp32 path (every product exact, fp32 sums); up to AMX_U_MAX_ROWS rows u = H(x ⊙ suh) in three
planes times Ŵ in two (also exact); and the fp32 path wherever AMX is not there."""

from __future__ import annotations

import pytest
import torch

from exl3local.kernel_paths import KernelPath
from exl3local.kernels import reference
from exl3local.kernels.cpu import ops
from exl3local.kernels.dispatch import CpuLinearKernel, DeviceInfo, KernelSpec
from exl3local.kernels.hadamard import hadamard_128

pytestmark = pytest.mark.skipif(not ops.amx_active(ops.library()), reason="this CPU (or OS) gives no AMX-BF16")


def _layer(size_k, size_n, bits, codebook, seed=0):
    g = torch.Generator().manual_seed(seed)
    trellis = torch.randint(-32768, 32768, (size_k // 16, size_n // 16, reference.words_per_tile(bits)),
                            generator=g, dtype=torch.int16)
    return trellis, (torch.randn(size_k, generator=g) * 0.1).half(), (torch.randn(size_n, generator=g) * 0.1).half()


def _truth(lin, x):
    """H(H(x ⊙ suh) · Ŵ) ⊙ svh in fp64, Ŵ from the (bit-exact) decoder."""
    h = hadamard_128().double()
    rows = lambda v: (v.reshape(-1, 128) @ h).reshape(v.shape)  # noqa: E731
    return rows(rows(x.double() * lin.suh.double()) @ lin.decode().double()) * lin.svh.double()


def _planes(lin, x, planes):
    y = torch.empty(x.shape[0], lin.size_n)
    lin.lib.exl3_cpu_gemm_amx(lin.trellis.data_ptr(), lin.tiles_k, lin.tiles_n, lin.bits2, lin.codebook, x.data_ptr(),
                              lin.suh.data_ptr(), lin.svh.data_ptr(), None, y.data_ptr(), 0, x.shape[0], planes, 1)
    return y


def _u_split(lin, x):
    y = torch.empty(x.shape[0], lin.size_n)
    xf = x.float().contiguous()
    lin.lib.exl3_cpu_gemm_amx_u(lin.trellis.data_ptr(), lin.tiles_k, lin.tiles_n, lin.bits2, lin.codebook,
                                xf.data_ptr(), lin.suh.data_ptr(), lin.svh.data_ptr(), None, y.data_ptr(), 0,
                                x.shape[0], 1)
    return y


@pytest.mark.parametrize("codebook,bits,rows", [("mul1", 4, 40), ("3inst", 3, 33), ("mcg", 2, 64)])
def test_amx_gemm_is_as_exact_as_the_fp32_path(codebook, bits, rows):
    """Against fp64: no worse than the fp32 path (the reference's steps); two planes (W' rounded to 16 bits) are
    measurably worse, so the third plane is what makes it exact. Row counts with and without a partial 32-row block."""
    trellis, suh, svh = _layer(384, 256, bits, codebook, seed=rows)
    lin = ops.CpuLinear(trellis, suh, svh, bits, codebook)
    x = torch.randn(rows, 384, generator=torch.Generator().manual_seed(1)).bfloat16()
    truth = _truth(lin, x)
    got = lin(x, torch.float32)
    assert torch.equal(got, _planes(lin, x, ops.AMX_PLANES))  # the bf16 GEMM path is the AMX one
    fp32_path = reference.linear(x.float(), trellis, suh, svh, bits, codebook)
    torch.testing.assert_close(got, fp32_path, rtol=1e-5, atol=1e-5)
    err = (got.double() - truth).abs().max().item()
    assert err <= 1.5 * (fp32_path.double() - truth).abs().max().item() + 1e-9
    assert (_planes(lin, x, 2).double() - truth).abs().max().item() > 4 * err


@pytest.mark.parametrize("codebook,bits,rows,dtype", [("mul1", 4, 1, torch.bfloat16), ("3inst", 3, 9, torch.bfloat16),
                                                       ("mcg", 2, 17, torch.bfloat16), ("mul1", 2.5, 32, torch.bfloat16),
                                                       ("mul1", 4, 12, torch.float16), ("3inst", 2, 32, torch.float16)])
def test_few_rows_take_the_u_split_as_exact_as_the_fp32_path(codebook, bits, rows, dtype):
    """Up to AMX_U_MAX_ROWS rows: u in three bf16 planes times Ŵ in two (no Hadamard in the pack), against fp64 no
    worse than the fp32 path; row counts with and without a partial 16-row block; fp16 x too (u is computed in fp32
    from x widened exactly, so fp16's 11 significand bits are kept)."""
    assert rows <= ops.AMX_U_MAX_ROWS and ops.CpuLinear.amx_rows(dtype, rows)
    trellis, suh, svh = _layer(384, 256, bits, codebook, seed=rows)
    lin = ops.CpuLinear(trellis, suh, svh, bits, codebook)
    x = torch.randn(rows, 384, generator=torch.Generator().manual_seed(5)).to(dtype)
    truth = _truth(lin, x)
    got = lin._gemm_amx(x, torch.float32, None, 1)
    assert torch.equal(got, _u_split(lin, x))
    fp32_path = reference.linear(x.float(), trellis, suh, svh, bits, codebook)
    torch.testing.assert_close(got, fp32_path, rtol=1e-5, atol=1e-5)
    assert (got.double() - truth).abs().max().item() <= 1.5 * (fp32_path.double() - truth).abs().max().item() + 1e-9


@pytest.mark.parametrize("bits", [1.5, 4])
def test_amx_packs_decode_mul1_with_avx512_fp16_to_the_same_planes(bits):
    """Both AMX packs (the u split's and the W' planes') decode mul1 32 weights per fp16 fma where the CPU has
    AVX512-FP16 (every AMX CPU so far): the same weights as the 32-bit decode, so the same outputs bit for bit, with
    the head group's ring wrap."""
    lib = ops.library()
    if not lib.exl3_cpu_fp16(-1):
        pytest.skip("no AVX512-FP16 on this CPU (or no compiler support)")
    trellis, suh, svh = _layer(256, 384, bits, "mul1", seed=int(4 * bits))
    lin = ops.CpuLinear(trellis, suh, svh, bits, "mul1")
    x = torch.randn(12, 256, generator=torch.Generator().manual_seed(6)).bfloat16()
    fp16 = _u_split(lin, x), _planes(lin, x, ops.AMX_PLANES)
    try:
        assert lib.exl3_cpu_fp16(0) == 0
        wide = _u_split(lin, x), _planes(lin, x, ops.AMX_PLANES)
    finally:
        assert lib.exl3_cpu_fp16(1) == 1
    want = reference.linear(x.float(), trellis, suh, svh, bits, "mul1")
    for got, before in zip(fp16, wide):
        assert torch.equal(got, before)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [9, 33])
def test_amx_bf16_output_is_the_fp32_sums_rounded_once_with_bias(rows):
    trellis, suh, svh = _layer(256, 384, 4, "mul1")
    lin = ops.CpuLinear(trellis, suh, svh, 4, "mul1")
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    bias = torch.randn(384).half()
    want = lin(x, torch.float32, bias)
    assert torch.equal(lin(x, torch.bfloat16, bias), want.bfloat16())
    torch.testing.assert_close(want, reference.linear(x.float(), trellis, suh, svh, 4, "mul1", bias), rtol=1e-5,
                               atol=1e-5)


def test_without_amx_bf16_goes_through_the_fp32_path(monkeypatch):
    trellis, suh, svh = _layer(256, 256, 4, "mul1")
    lin = ops.CpuLinear(trellis, suh, svh, 4, "mul1")
    x = torch.randn(12, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    amx = lin(x, torch.float32)
    lin.amx = False
    monkeypatch.setattr(lin.lib, "exl3_cpu_gemm_amx", None)  # calling it now would fail the test
    torch.testing.assert_close(lin(x, torch.float32), amx, rtol=1e-5, atol=1e-5)


_U, _W = "exl3_cpu_gemm_amx_u", "exl3_cpu_gemm_amx"


@pytest.mark.parametrize("dtype,served", [(torch.bfloat16, [_U, _U, _W]), (torch.float32, [_U, _U, None]),
                                          (torch.float16, [_U, _U, None])])
def test_dispatch_names_the_gemm_engine_that_serves_the_call(monkeypatch, dtype, served):
    """The trace and the dashboard say which engine ran a prefill: AMX for bf16 rows (few through the u split, more
    through the W' planes) and for fp32 and fp16 rows up to AMX_U_MAX_ROWS (the u split; fp32: the MoE path's busier
    experts), fp32 BLAS otherwise. Rows: GEMV_MAX_ROWS + 1, AMX_U_MAX_ROWS, AMX_U_MAX_ROWS + 1."""
    trellis, suh, svh = _layer(256, 256, 4, "mul1")
    kernel = CpuLinearKernel(KernelSpec(256, 256, 4, "mul1", dtype), DeviceInfo.of(torch.device("cpu")))
    lib = ops.library()
    calls = []
    for name in (_W, _U):
        monkeypatch.setattr(lib, name, lambda *args, fn=getattr(lib, name), name=name: calls.append(name) or fn(*args))
    x = torch.randn(ops.AMX_U_MAX_ROWS + 1, 256, generator=torch.Generator().manual_seed(4)).to(dtype)
    assert kernel.path_for(1) is KernelPath.CPU_GEMV
    for rows, entry in zip((ops.GEMV_MAX_ROWS + 1, ops.AMX_U_MAX_ROWS, ops.AMX_U_MAX_ROWS + 1), served):
        calls.clear()
        path = KernelPath.CPU_GEMM_AMX if entry else KernelPath.CPU_GEMM
        assert kernel.path_for(rows) is path
        y = kernel.apply(x[:rows], trellis, suh, svh)
        assert calls == ([entry] if entry else [])
        want = reference.linear(x[:rows].float(), trellis, suh, svh, 4, "mul1")
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16/fp16 outputs: the fp32 sums rounded once
        torch.testing.assert_close(y.float(), want.to(dtype).float(), rtol=tol, atol=tol)
