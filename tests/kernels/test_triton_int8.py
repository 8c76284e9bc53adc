"""The int8-activation mul1 study (kernels/triton_int8.py): the kernel's integer sums exact, its fp32 output held to the
fp64 emulation of exllamav3's int8 numerics, and the emulation held to the fp64 x·W within the int8 path's error."""

from __future__ import annotations

import os

import pytest
import torch

from exl3local.kernels import reference, triton_int8
from exl3local.kernels.codebook import decode_states
from exl3local.kernels.hadamard import hadamard_128
from exl3local.kernels.triton_hadamard import input_transform

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton on CPU needs TRITON_INTERPRET=1 (scripts/test sets it)",
)
SIZE_K, SIZE_N = 512, 256  # two 256-input slices, two 128-column blocks


def _rows(rows: int, seed: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, SIZE_K, generator=g) * 2).half().to(device)


def _had(v: torch.Tensor) -> torch.Tensor:
    """H128 per 128-block of the last dimension, in fp64."""
    return (v.double().reshape(-1, 128) @ hadamard_128().double()).reshape(v.shape)


def test_byte_sums_read_back_from_every_decoded_state():
    states = torch.arange(65536, dtype=torch.int64)
    p = (states * 0x83DCD12D) & 0xFFFFFFFF
    direct = sum((p >> (8 * i)) & 0xFF for i in range(4))
    assert torch.equal(triton_int8.byte_sums(decode_states(states, "mul1")), direct)


def test_quantize_rounds_to_nearest_even_and_clamps_per_slice():
    u = torch.zeros(1, 512)
    u[0, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])  # q = 1: ties go to even
    u[0, 256:258] = torch.tensor([-254.0, 3.0])  # q = 2: 1.5 -> 2
    v, q = triton_int8.quantize(u.half())
    assert q.tolist() == [[1.0, 2.0]]
    assert v[0, :4].tolist() == [127, 0, 2, -2] and v[0, 256:258].tolist() == [-127, 2]
    v, q = triton_int8.quantize(torch.zeros(1, 256).half())  # an all-zero slice: no inf, no NaN
    assert q.tolist() == [[0.0]] and not v.any()


@pytest.mark.parametrize("rows,splits,bits", [(1, 1, 4), (2, 2, 4), (2, 1, 8)])
def test_kernel_integer_sums_are_exact(make_layer, kernel_device, rows, splits, bits):
    # unit scales: z = Σ v·(bsum - 512), integers far below 2^24, so fp32 holds every partial sum exactly
    trellis, _, _ = make_layer(SIZE_K, SIZE_N, bits, "mul1", seed=rows + splits)
    u = _rows(rows, seed=7, device=kernel_device)
    v, q = triton_int8.quantize(u)
    z = triton_int8.mul1_int8_z(u, trellis, bits, splits=splits, scale=torch.ones_like(q))
    signed = triton_int8.byte_sums(reference.decode_trellis(trellis, bits, "mul1")) - 512
    assert torch.equal(z.cpu().double(), (v.cpu().long() @ signed.cpu()).double())


@pytest.mark.parametrize("rows,kt,bnt,kwidth", [(1, 2, 8, 4), (2, 1, 16, 8)])  # both operand orders
def test_kernel_matches_the_fp64_emulation(make_layer, kernel_device, relative_error, rows, kt, bnt, kwidth):
    trellis, _, _ = make_layer(SIZE_K, SIZE_N, 4, "mul1", seed=3)
    u = _rows(rows, seed=rows, device=kernel_device)
    z = triton_int8.mul1_int8_z(u, trellis, 4, kt=kt, bnt=bnt, splits=2, kwidth=kwidth)
    expected = triton_int8.emulate_z(u.cpu(), reference.decode_trellis(trellis, 4, "mul1").cpu())
    assert relative_error(z.cpu(), expected) < 1e-6


def test_emulation_error_is_the_int8_paths(make_layer, kernel_device, relative_error):
    # exllamav3's int8 GEMV: 0.6-0.9 % from fp64 x·W (spec §5); above 1e-3 shows the activations really are int8
    trellis, suh, svh = make_layer(SIZE_K, SIZE_N, 4, "mul1", seed=11)
    x = _rows(2, seed=5, device=kernel_device)
    u = input_transform(x, suh)
    z = triton_int8.emulate_z(u.cpu(), reference.decode_trellis(trellis, 4, "mul1").cpu())
    y = _had(z) * svh.cpu().double()
    exact = _had(_had(x.cpu().double() * suh.cpu().double())
                 @ reference.decode_trellis(trellis, 4, "mul1").cpu().double()) * svh.cpu().double()
    assert 1e-3 < relative_error(y, exact) < 2e-2


def test_emulation_reproduces_exllamav3s_int8_gemv(fixtures_dir):
    # public_28 (mul1, K = 2, 512x256, m = 1) is the one fixture exllamav3 ran through its int8 GEMV (spec §5/§11):
    # 256-input slices and had_fh (fp32 H128, rounded to fp16, then ⊙svh in fp16) give its y_m1 bit for bit
    from safetensors.torch import load_file

    t = load_file(fixtures_dir / "exl3" / "tensors_public.safetensors")
    x, suh, svh, trellis, y_m1 = (t[f"public_28_mul1_K2_512x256.{k}"] for k in ("x", "suh", "svh", "trellis", "y_m1"))
    z = triton_int8.emulate_z(input_transform(x[:1].contiguous(), suh), reference.decode_trellis(trellis, 2, "mul1"))
    y = _had(z).float().half() * svh
    assert torch.equal(y.view(torch.int16), y_m1.view(torch.int16))
