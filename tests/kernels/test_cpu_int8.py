"""The CPU kernel's opt-in int8-activation GEMV (EXL3LOCAL_CPU_INT8, mul1 only): its arithmetic against an
emulation, where it is chosen and named, and that the self-test accepts it (and only it) at its own tolerance."""

from __future__ import annotations

import pytest
import torch

from exl3local.kernels import KernelPath, KernelSpec, reference
from exl3local.kernels.codebook import MUL1_K_BIAS, MUL1_K_INV
from exl3local.kernels.cpu import build, ops
from exl3local.kernels.dispatch import CpuLinearKernel, DeviceInfo
from exl3local.kernels.hadamard import hadamard_rows

pytestmark = pytest.mark.skipif(build.best_tier() != "avx512", reason="the int8 path is AVX-512 only")


def _layer(size_k, size_n, bits, seed=0):
    g = torch.Generator().manual_seed(seed)
    trellis = torch.randint(-32768, 32768, (size_k // 16, size_n // 16, reference.words_per_tile(bits)),
                            generator=g, dtype=torch.int16)
    return trellis, (torch.randn(size_k, generator=g) * 0.1).half(), (torch.randn(size_n, generator=g) * 0.1).half()


def _emulated(x, trellis, suh, svh, bits):
    """The int8 path's arithmetic in fp64: u (the library's own input transform) rounded to int8 per row with
    scale absmax / 127, times mul1's weights before their fp16 rounding (byte sum * K_INV + offset; the byte sum
    read back from Ŵ, whose fp16 rounding moves it by less than half a step)."""
    lib = ops.library()
    u, suh32 = torch.empty_like(x), suh.float().contiguous()
    lib.exl3_cpu_input_transform(x.data_ptr(), suh32.data_ptr(), u.data_ptr(), *x.shape, 1)
    amax = u.abs().amax(-1, keepdim=True)
    q = torch.round(u * (torch.tensor(127.0) / amax))  # fp32 like the library, ties to even like nearbyint
    w = reference.decode_trellis(trellis, bits, "mul1").double()
    sums = torch.round((w - MUL1_K_BIAS) / MUL1_K_INV - 1024)
    assert sums.min() >= 0 and sums.max() <= 1020
    z = (q.double() * (amax.double() / 127)) @ (sums * MUL1_K_INV + 1024 * MUL1_K_INV + MUL1_K_BIAS)
    return hadamard_rows(z).double() * svh.double()


@pytest.mark.parametrize("bits", [4, 2.5, 3])
def test_int8_gemv_matches_its_emulation_and_stays_near_the_reference(bits):
    trellis, suh, svh = _layer(384, 256, bits, seed=1)
    lin = ops.CpuLinear(trellis, suh, svh, bits, "mul1", int8=True)
    x = torch.randn(1, 384, generator=torch.Generator().manual_seed(1))
    got = lin(x)
    expected = _emulated(x, trellis, suh, svh, bits)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    exact = reference.linear(x, trellis, suh, svh, bits, "mul1")
    err = ((got - exact).norm() / exact.norm()).item()
    assert 1e-4 < err < 3e-2, err  # int8 rounding shows (the path ran), and stays small


def test_int8_only_for_mul1_on_avx512_and_only_at_one_row(monkeypatch):
    """int8 activations serve one row (ops.INT8_MAX_ROWS); from 2 rows an int8 layer runs the exact GEMV (its
    multi-row loop was slower than the exact one), then the GEMM path."""
    trellis, suh, svh = _layer(256, 256, 4)
    lin = ops.CpuLinear(trellis, suh, svh, 4, "mul1", int8=True)
    assert (lin.path_for(1), lin.path_for(2), lin.path_for(lin.gemv_rows + 1)) == ("gemv_int8", "gemv", "gemm")
    assert lin.gemv_rows == ops.gemv_max_rows(lin.lib)  # the exact layer's crossover
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(3))
    assert torch.equal(lin(x), ops.CpuLinear(trellis, suh, svh, 4, "mul1", int8=False)(x))
    assert ops.CpuLinear(trellis, suh, svh, 4, "mul1", int8=False).path_for(1) == "gemv"
    assert ops.CpuLinear(trellis, suh, svh, 4, "mul1", tier="portable", int8=True).path_for(1) == "gemv"
    trellis3, suh3, svh3 = _layer(256, 256, 3)
    assert ops.CpuLinear(trellis3, suh3, svh3, 3, "3inst", int8=True).path_for(1) == "gemv"

    spec = KernelSpec(256, 256, 4, "mul1", torch.bfloat16)
    monkeypatch.delenv("EXL3LOCAL_CPU_INT8", raising=False)
    assert CpuLinearKernel(spec, DeviceInfo.of(torch.device("cpu"))).path_for(1) == KernelPath.CPU_GEMV
    monkeypatch.setenv("EXL3LOCAL_CPU_INT8", "1")
    kernel = CpuLinearKernel(spec, DeviceInfo.of(torch.device("cpu")))
    assert kernel.path_for(1) == KernelPath.CPU_GEMV_INT8
    assert kernel.path_for(2) == KernelPath.CPU_GEMV
    assert kernel.path_for(kernel.gemv_rows + 1) in (KernelPath.CPU_GEMM, KernelPath.CPU_GEMM_AMX)  # exact, not int8
    x = torch.randn(ops.GEMV_MAX_ROWS + 1, 256, generator=torch.Generator().manual_seed(2))
    exact = reference.linear(x, trellis, suh, svh, 4, "mul1")
    got = kernel.apply(x.bfloat16(), trellis, suh, svh).float()
    # prefill rows stay exact (bf16 output), one decode row does not
    torch.testing.assert_close(got, exact, rtol=1e-2, atol=1e-2 * exact.abs().max().item())
    one = kernel.apply(x[:1], trellis, suh, svh)
    assert 1e-4 < ((one - exact[:1]).norm() / exact[:1].norm()).item() < 3e-2


def test_selftest_accepts_the_int8_path_at_its_tolerance_only(monkeypatch):
    from exl3local.kernels import selftest_checks, selftest_compare

    monkeypatch.setenv("EXL3LOCAL_CPU_INT8", "1")
    results = selftest_checks.run_kernel(CpuLinearKernel, 4, "mul1", torch.device("cpu"), dtype=torch.bfloat16)
    by_path = {r.path: r for r in results}
    int8 = by_path.pop("cpu_gemv_int8")
    # the exact paths past one row (the GEMV, then the GEMM path: AMX where the CPU has it), however they are named
    assert int8.ok and by_path and all(r.ok for r in by_path.values()), results
    # int8's error would fail the exact paths' bound: the looser one is the path's, not the kernel's
    assert int8.error > selftest_compare.TOLERANCE
    assert all(r.error < selftest_compare.tolerance(torch.bfloat16) for r in by_path.values()), results


def test_fused_layer_in_int8_mode_equals_its_parts():
    """The fused-layer call (ops.CpuFusedLinear) quantizes each part's u as the one-part call does: the same outputs,
    bit for bit; and it is the int8 arithmetic (not the exact one) at one row, the exact one from two."""
    parts = [ops.CpuLinear(*_layer(256, n, bits, seed=n), bits, "mul1", int8=True) for n, bits in ((256, 4), (128, 2.5))]
    fused = ops.CpuFusedLinear.make(parts, [256, 128], 256)
    assert fused is not None and fused.int8
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(6))
    got = fused(x[:1])
    assert torch.equal(got, torch.cat([p(x[:1]) for p in parts], -1))
    exact = [ops.CpuLinear(p.trellis, p.suh, p.svh, p.bits, "mul1", int8=False) for p in parts]
    assert not torch.equal(got, torch.cat([p(x[:1]) for p in exact], -1))
    assert torch.equal(fused(x), torch.cat([p(x) for p in exact], -1))  # from 2 rows the exact GEMV
    assert ops.CpuFusedLinear.make([parts[0], exact[1]], [256, 128], 256) is None  # int8 and exact parts: no one call
