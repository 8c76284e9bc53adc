"""Triton decode against the reference: bit-exact Ŵ from the dense decode and from inside the GEMV kernel."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from exl3local.kernels import reference
from exl3local.kernels.triton_decode import decode_dense
from exl3local.kernels.hadamard import hadamard_cols
from exl3local.kernels.triton_gemm import right_reconstruct
from exl3local.kernels.triton_gemv import ring_dot_partials, ring_partials

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton on CPU needs TRITON_INTERPRET=1 (scripts/test sets it)",
)
ALL_COMBOS = [(cb, b) for cb in ("3inst", "mcg", "mul1") for b in reference.INTEGER_BITS] + [
    ("mul1", b) for b in reference.HALF_BITS
]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of fp16 elements whose bit patterns differ."""
    return (a.view(torch.int16) != b.view(torch.int16)).sum().item()


@pytest.fixture(scope="module")
def fixture_cases(fixtures_dir, kernel_device):
    meta = json.loads((fixtures_dir / "exl3" / "tensors_public.json").read_text())
    tensors = load_file(fixtures_dir / "exl3" / "tensors_public.safetensors")
    return [
        (case, {k.split(".", 1)[1]: tensors[k].to(kernel_device) for k in case["keys"]}) for case in meta["cases"]
    ]


@pytest.mark.parametrize("codebook,bits", ALL_COMBOS)
def test_dense_decode_is_bit_exact_for_every_codebook_and_rate(make_layer, codebook, bits):
    trellis, _, _ = make_layer(64, 128, bits, codebook, seed=int(bits * 10))
    decoded = decode_dense(trellis, bits, codebook)
    assert _same_bits(decoded, reference.decode_trellis(trellis, bits, codebook)) == 0


def test_dense_decode_matches_exllamav3_on_every_fixture(fixture_cases):
    # Tiles decode independently, so a corner block of each fixture (its codebook, rate and exllamav3's data) is
    # the check; the whole tensors are the reference decoder's test, and the interpreter takes ~4 s per tensor.
    for case, t in fixture_cases:
        tiles_k, tiles_n = 8, 8
        decoded = decode_dense(t["trellis"][:tiles_k, :tiles_n].contiguous(), case["K"], case["codebook"])
        assert _same_bits(decoded, t["w_inner"][: tiles_k * 16, : tiles_n * 16]) == 0, case["case"]


@pytest.mark.parametrize(
    "codebook,bits",
    # every super-lane width (G = 1, 2, 4, 8) and every codebook
    [("3inst", 3), ("mcg", 5), ("mul1", 4), ("mul1", 2.5), ("mul1", 1.5), ("mul1", 2), ("mcg", 6), ("3inst", 8)],
)
@pytest.mark.parametrize("block_m,block_nt,block_kt", [(16, 8, 1), (32, 4, 2)])
def test_ring_dot_kernel_decodes_bit_exactly_in_registers(make_layer, kernel_device, codebook, bits, block_m,
                                                          block_nt, block_kt):
    # One-hot rows pick single rows of Ŵ: each output is one product w*1 in fp32, so z == Ŵ exactly.
    # Rows 17i mod 128 hit every in-tile row once, across all eight tile rows.
    trellis, _, _ = make_layer(128, 128, bits, codebook, seed=3)
    picked = (torch.arange(block_m) * 17) % 128
    one_hot = torch.eye(128, dtype=torch.float16, device=kernel_device)[picked.to(kernel_device)]
    z = ring_dot_partials(one_hot, trellis, bits, codebook, block_m, block_nt, block_kt, splits=2).sum(0)
    expected = reference.decode_trellis(trellis, bits, codebook)[picked.to(kernel_device)]
    assert _same_bits(z.half(), expected) == 0


def test_right_reconstruct_is_within_exllamav3_spread(fixture_cases):
    # W_r = Ŵ·Hn⊙svh, so diag(suh)·Hk·W_r is the weight in the original basis (exllamav3's w_recon). Both
    # Hadamard transforms mix within 128-blocks only, so the corner 128x128 block is checked on its own (the
    # interpreter's time grows with the tensor: whole fixtures took a minute).
    for case, t in fixture_cases[::4]:
        w_r = right_reconstruct(t["trellis"][:8, :8].contiguous(), t["svh"][:128], case["K"], case["codebook"])
        w = hadamard_cols(w_r) * t["suh"][:128].float()[:, None]
        w_recon = t["w_recon"][:128, :128].float()
        tolerance = 2e-3 * w_recon.abs().max().item()
        err = (w.float() - w_recon).abs().max().item()
        assert err <= tolerance, f"{case['case']}: max |W - w_recon| = {err:.2e}"


@pytest.mark.parametrize(
    "codebook,bits",
    # every super-lane width (G = 1, 2, 4, 8) and every codebook; the dense decode covers all 27 combinations
    [("mul1", 4), ("mul1", 2), ("mul1", 3), ("mul1", 2.5), ("mul1", 1.5), ("3inst", 7), ("mcg", 6), ("mcg", 8)],
)
def test_ring_kernel_decodes_bit_exactly(make_layer, kernel_device, codebook, bits):
    # The ring GEMV fed one-hot rows: z = the picked rows of Ŵ, exactly.
    trellis, _, _ = make_layer(32, 128, bits, codebook, seed=int(bits * 10) + 1)
    expected = reference.decode_trellis(trellis, bits, codebook)
    picked = torch.tensor([3, 30], device=kernel_device)
    one_hot = torch.eye(32, dtype=torch.float16, device=kernel_device)[picked]
    z = ring_partials(one_hot, trellis, bits, codebook, 2, 8, splits=2).sum(0)
    assert _same_bits(z.half(), expected[picked]) == 0


@pytest.mark.parametrize("codebook,bits", [("mul1", 4), ("3inst", 8)])
def test_fragment_order_operand_serves_g1_rates_like_the_ring_order(make_layer, emulate, relative_error,
                                                                    kernel_device, codebook, bits):
    """At G = 1 (4 and 8 bits) the fused kernel takes Ŵ in the matrix unit's fragment order (triton_decode.
    fragment_operand, columns through fragment_cols; rows for a dot operand of kWidth 2 or 4, the served one by the
    installed Triton's), with or without the words loaded one K step ahead (PF): served, and within fp32 noise of the
    emulation like the ring order beside it (a weight in a wrong row or a column stored in a wrong place, or a step
    decoding another step's words, is an error of ~1)."""
    from exl3local.kernels.bound import FusedLaunch

    trellis, suh, svh = make_layer(256, 256, bits, codebook, seed=21)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(21)).to(kernel_device)
    expected = emulate(x, trellis, suh, svh, bits, codebook)
    for frag, pf in ((2, False), (4, False), (4, True), (0, False)):
        launch = FusedLaunch(trellis, suh, svh, bits, codebook)
        assert launch.fused_fixed["FRAG"] in (2, 4) and launch.fused_fixed["PF"]
        launch.fused_fixed.update(FRAG=frag, PF=pf)
        launch.splits[1] = (2, launch.k_steps // 2)
        y = torch.empty(3, 256, device=kernel_device)
        launch.launch(x, y, 3)
        assert relative_error(y, expected) < 2e-5, (frag, pf)
