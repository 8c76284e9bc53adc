"""Triton EXL3 linear against the reference: every path, codebook and rate, odd row counts, bias, dtypes."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from exl3local.kernels import KernelPath, KernelSpec, linear, prepare, reference
from exl3local.kernels.dispatch import GEMV_MAX_ROWS, TritonLinearKernel
from exl3local.kernels.hadamard import hadamard_rows
from exl3local.kernels import triton_gemm, triton_hadamard
from exl3local.kernels.triton_hadamard import input_transform
from exl3local.kernels.triton_gemv import gemv, ring_dot_partials, ring_partials

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton on CPU needs TRITON_INTERPRET=1 (scripts/test sets it)",
)
# One rate per super-lane width G (1, 2, 4, 8 lanes) and codebook: the ring kernel's unrolled interpreter
# runs take seconds each; test_triton_decode covers every combination bit-exactly.
COMBOS = [("mul1", 4), ("mul1", 2), ("mcg", 6), ("3inst", 3), ("mul1", 2.5)]
FP32_NOISE = 2e-5  # relative norm error of fp32 accumulation at these sizes (measured ~1e-5)


@pytest.mark.parametrize("rows", [1, 2])  # one row: the FMA ring kernel at some rates (DOT_ONE_ROW_BITS)
@pytest.mark.parametrize("codebook,bits", COMBOS)
def test_gemv_matches_emulation_for_every_rate(make_layer, emulate, relative_error, kernel_device,
                                                              codebook, bits, rows):
    trellis, suh, svh = make_layer(128, 128, bits, codebook, seed=1)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(2)).to(kernel_device)
    y = gemv(x, trellis, suh, svh, bits, codebook)
    assert y.dtype == torch.float32
    assert relative_error(y, emulate(x, trellis, suh, svh, bits, codebook)) < FP32_NOISE


@pytest.mark.parametrize("rows", [3, 300])
def test_input_transform_is_within_one_fp16_rounding(monkeypatch, kernel_device, rows):
    # 300 rows: programs of triton_hadamard.INPUT_ROW_BLOCKS 64-row blocks, the last one ragged
    monkeypatch.setattr(triton_hadamard, "INPUT_BLOCKS_MIN_ROWS", 100)
    assert triton_hadamard.input_row_blocks(rows) == (1 if rows < 100 else triton_hadamard.INPUT_ROW_BLOCKS)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(rows, 256, generator=g).to(kernel_device)
    suh = (torch.randn(256, generator=g) * 0.05).half().to(kernel_device)
    # spec §5 (exllamav3's had_hf): x ⊙ suh is rounded to fp16, then transformed and rounded once more
    exact = hadamard_rows((x.double() * suh.double()).half().double().cpu()).double()
    u = input_transform(x, suh).double().cpu()
    ulp = exact.abs().clamp_min(2**-14) * 2**-10
    assert ((u - exact).abs() <= ulp).all()


@pytest.mark.parametrize("rows", [1, 3, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 5, 70])
def test_every_path_with_bias_and_odd_rows(monkeypatch, make_layer, emulate, relative_error, kernel_device, rows):
    monkeypatch.setattr(triton_gemm, "HY_MAX_ROWS", 64)  # 70 rows: the W_r form, at a small x
    bits, codebook = 4, "mul1"
    trellis, suh, svh = make_layer(128, 256, bits, codebook, seed=rows)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 128, generator=g).to(kernel_device)
    bias = torch.randn(256, generator=g).to(kernel_device)
    kernel = prepare(KernelSpec(128, 256, bits, codebook, torch.float32, has_bias=True), kernel_device, "triton")
    assert isinstance(kernel, TritonLinearKernel)
    path = kernel.path_for(rows)
    y = kernel.apply(x, trellis, suh, svh, bias)
    assert y.shape == (rows, 256) and y.dtype == torch.float32
    if path is KernelPath.RECONSTRUCT_GEMM and not triton_gemm.hadamard_on_y(rows, 128, x.device):
        # Dense fp16 W and an fp16 matmul: exllamav3's own prefill numerics (~5e-4).
        assert relative_error(y, reference.linear(x, trellis, suh, svh, bits, codebook, bias)) < 2e-3
    else:
        assert relative_error(y, emulate(x, trellis, suh, svh, bits, codebook, bias)) < FP32_NOISE


def test_paths_follow_the_row_thresholds():
    kernel = TritonLinearKernel(KernelSpec(128, 128, 4, "mul1"), None)
    assert kernel.path_for(1) is KernelPath.GEMV
    assert kernel.path_for(GEMV_MAX_ROWS) is KernelPath.GEMV
    assert kernel.path_for(GEMV_MAX_ROWS + 1) is KernelPath.RECONSTRUCT_GEMM
    assert kernel.path_for(4096) is KernelPath.RECONSTRUCT_GEMM


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_keep_their_dtype(make_layer, emulate, relative_error, kernel_device, dtype):
    trellis, suh, svh = make_layer(128, 256, 4, "3inst", seed=5)
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(5)).to(kernel_device, dtype)
    y = linear(x, trellis, suh, svh, 4, "3inst", backend="triton")
    assert y.shape == (2, 3, 256) and y.dtype == dtype
    rounding = 2e-3 if dtype == torch.float16 else 1e-2  # the output's own rounding
    assert relative_error(y.reshape(6, 256), emulate(x.reshape(6, 128), trellis, suh, svh, 4, "3inst")) < rounding


@pytest.mark.parametrize("kernel", ["dot", "fma"])
def test_split_k_does_not_change_the_result(make_layer, relative_error, kernel_device, kernel):
    trellis, _, _ = make_layer(128, 128, 2, "mcg", seed=6)  # 8 tile rows: four splits of two
    u = torch.randn(5, 128, generator=torch.Generator().manual_seed(6)).half().to(kernel_device)

    def partials(splits):
        if kernel == "dot":
            return ring_dot_partials(u, trellis, 2, "mcg", 16, 8, 1, splits=splits)
        return ring_partials(u, trellis, 2, "mcg", 8, 4, splits=splits)

    one, four = partials(1), partials(4)
    assert one.shape[0] == 1 and four.shape[0] == 4
    assert relative_error(four.sum(0), one[0]) < 1e-6


def test_matches_exllamav3_outputs_on_fixtures(fixtures_dir, kernel_device, relative_error):
    meta = json.loads((fixtures_dir / "exl3" / "tensors_public.json").read_text())
    tensors = load_file(fixtures_dir / "exl3" / "tensors_public.safetensors")
    for case in meta["cases"][::9]:  # 3inst K1, mcg K2, mul1 K3, 3inst K4 at 512x256
        t = {k.split(".", 1)[1]: tensors[k].to(kernel_device) for k in case["keys"]}
        for rows in (1, 5):
            y = linear(t["x"][:rows], t["trellis"], t["suh"], t["svh"], case["K"], case["codebook"], backend="triton")
            # exllamav3's mul1 int8 GEMV (rows <= 2, see test_reference) is ~1% off every fp16 path.
            int8 = case["codebook"] == "mul1" and rows <= 2 and case["n"] % 256 == 0 and case["K"] <= 6
            assert relative_error(y, t[f"y_m{rows}"]) < (1.5e-2 if int8 else 1e-3), (case["case"], rows)
