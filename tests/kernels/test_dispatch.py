"""Kernel choice: refusals that explain, forced backends, the disabled list, and the reference kernel."""

from __future__ import annotations

import pytest
import torch

from exl3local.errors import NoKernelError
from exl3local.kernels import KernelPath, KernelSpec, choose_kernel, linear, prepare, reference
from exl3local.kernels.dispatch import CpuLinearKernel, DeviceInfo, TorchReferenceKernel, TritonLinearKernel

CPU = DeviceInfo("cpu", triton_interpret=False)
CUDA = DeviceInfo("cuda")


def _layer(size_k=128, size_n=256, bits=3, codebook="3inst", seed=0):
    g = torch.Generator().manual_seed(seed)
    words = reference.words_per_tile(bits)
    trellis = torch.randint(-32768, 32768, (size_k // 16, size_n // 16, words), generator=g, dtype=torch.int16)
    suh = (torch.randn(size_k, generator=g) * 0.1).half()
    svh = (torch.randn(size_n, generator=g) * 0.1).half()
    return trellis, suh, svh


def test_cpu_chooses_the_cpu_kernel_then_the_reference():
    spec = KernelSpec(128, 256, 4, "mul1")
    assert choose_kernel(spec, CPU) is CpuLinearKernel
    assert choose_kernel(spec, CPU, disabled={"CpuLinearKernel"}) is TorchReferenceKernel
    assert CpuLinearKernel.refuse(spec, CUDA) == "runs on CPU tensors only, not 'cuda'"


def test_forced_triton_on_plain_cpu_lists_every_refusal():
    spec = KernelSpec(128, 256, 4, "mul1")
    with pytest.raises(NoKernelError) as info:
        choose_kernel(spec, CPU, backend="triton")
    reasons = info.value.reasons
    assert len(reasons) == 3
    assert any(r.startswith("TorchReferenceKernel: backend 'triton'") for r in reasons)
    assert any(r.startswith("TritonLinearKernel:") and "TRITON_INTERPRET" in r for r in reasons)
    assert "EXL3 128x256 bits=4 mul1" in str(info.value)


def test_disabled_kernel_falls_through_then_refuses():
    spec = KernelSpec(128, 256, 4, "mul1")
    with pytest.raises(NoKernelError) as info:
        choose_kernel(spec, CPU, disabled={"CpuLinearKernel", "TorchReferenceKernel"})
    assert "TorchReferenceKernel: disabled" in info.value.reasons


def test_format_violations_are_refused_by_every_kernel():
    for spec, words in (
        (KernelSpec(128, 256, 2.5, "3inst"), "mul1"),
        (KernelSpec(128, 200, 4, "mul1"), "multiples of 128"),
        (KernelSpec(128, 256, 9, "mul1"), "1..8"),
    ):
        with pytest.raises(NoKernelError) as info:
            choose_kernel(spec, CUDA)
        assert all(words in r for r in info.value.reasons), info.value.reasons


def test_env_disables_kernels(monkeypatch):
    monkeypatch.setenv("EXL3LOCAL_DISABLED_KERNELS", "CpuLinearKernel, TorchReferenceKernel, Other")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(NoKernelError):
        prepare(KernelSpec(128, 256, 4, "mul1"), "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter makes Triton the CPU fallback
    assert isinstance(prepare(KernelSpec(128, 256, 4, "mul1"), "cpu"), TritonLinearKernel)


def test_bad_backend_name_is_a_value_error():
    with pytest.raises(ValueError, match="backend"):
        choose_kernel(KernelSpec(128, 256, 4, "mul1"), CPU, backend="cuda")


def test_reference_kernel_serves_linear_with_bias():
    trellis, suh, svh = _layer()
    x = torch.randn(3, 128)
    bias = torch.randn(256)
    kernel = prepare(KernelSpec(128, 256, 3, "3inst", torch.float32, has_bias=True), "cpu", backend="reference")
    assert kernel.path_for(3) is KernelPath.REFERENCE
    expected = reference.linear(x, trellis, suh, svh, 3, "3inst", bias)
    assert torch.equal(kernel.apply(x, trellis, suh, svh, bias), expected)
    # The default CPU choice is the C++ kernel: same math, another summation order.
    torch.testing.assert_close(linear(x, trellis, suh, svh, 3, "3inst", bias), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(linear(x, trellis, suh, svh, 3, "3inst", bias, backend="reference"), expected)


def test_kernel_path_is_closed_and_named():
    assert {p.value for p in KernelPath} == {
        "gemv", "reconstruct_gemm", "moe_decode", "moe_verify", "moe_grouped", "moe_batched", "cpu_gemv", "cpu_gemm",
        "cpu_gemv_int8", "cpu_gemm_amx", "reference",
    }
    assert TritonLinearKernel.backend == "triton"
