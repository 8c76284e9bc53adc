"""Kernel-test fixtures: random EXL3 layers and the fp64 emulation of the Triton kernels' rounding points."""

from __future__ import annotations

import pytest
import torch

from exl3local.kernels import reference
from exl3local.kernels.hadamard import hadamard_128

@pytest.fixture(scope="session")
def kernel_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="session")
def make_layer(kernel_device):
    """(size_k, size_n, bits, codebook, seed=0, experts=None) -> (trellis, suh, svh) on the kernel device."""

    def make(size_k, size_n, bits, codebook, seed=0, experts=None):
        g = torch.Generator().manual_seed(seed)
        lead = () if experts is None else (experts,)
        words = reference.words_per_tile(bits)
        trellis = torch.randint(
            -32768, 32768, (*lead, size_k // 16, size_n // 16, words), generator=g, dtype=torch.int16
        )
        suh = (torch.randn(*lead, size_k, generator=g) * 0.05).half()
        svh = (torch.randn(*lead, size_n, generator=g) * 0.05).half()
        return trellis.to(kernel_device), suh.to(kernel_device), svh.to(kernel_device)

    return make


@pytest.fixture(scope="session")
def emulate():
    """fp64 y = H(u · Ŵ) ⊙ svh + bias from the kernels' own u = fp16(H(x ⊙ suh)) (test_triton_linear checks
    u against fp64 separately): what is left is fp32 accumulation noise."""
    from exl3local.kernels.triton_hadamard import input_transform

    def run(x, trellis, suh, svh, bits, codebook, bias=None):
        u = input_transform(x.reshape(-1, x.shape[-1]), suh).double()
        z = u @ reference.decode_trellis(trellis, bits, codebook).double()
        h = hadamard_128(x.device).double()
        y = (z.reshape(z.shape[0], -1, 128) @ h).reshape(z.shape) * svh.double()
        return y if bias is None else y + bias.double()

    return run


def rel_err(y: torch.Tensor, expected: torch.Tensor) -> float:
    return ((y.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.fixture(scope="session")
def relative_error():
    return rel_err
