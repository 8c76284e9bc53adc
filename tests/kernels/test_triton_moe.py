"""Grouped MoE decode: every (token, expert) unit against the reference, ids read from a device tensor."""

from __future__ import annotations

import os

import pytest
import torch

from exl3local.kernels import reference
from exl3local.kernels.triton_moe import moe_decode

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton on CPU needs TRITON_INTERPRET=1 (scripts/test sets it)",
)


def _per_unit_reference(x, trellis, suh, svh, bits, codebook, ids, bias, per_unit):
    tokens, top_k = ids.shape
    out = torch.empty(tokens, top_k, svh.shape[-1], dtype=torch.float64)
    for t in range(tokens):
        for j in range(top_k):
            e = int(ids[t, j])
            row = x[t * top_k + j] if per_unit else x[t]
            b = None if bias is None else bias[e]
            out[t, j] = reference.linear(row[None].double(), trellis[e], suh[e], svh[e], bits, codebook, b)[0]
    return out


@pytest.mark.parametrize("per_unit", [False, True])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_grouped_units_match_per_expert_reference(make_layer, relative_error, kernel_device, per_unit, ids_dtype):
    bits, codebook = 4, "mul1"  # one lane per super-lane: the fastest ring kernel under the interpreter
    trellis, suh, svh = make_layer(128, 128, bits, codebook, seed=7, experts=5)
    g = torch.Generator().manual_seed(7)
    ids = torch.tensor([[3, 0, 4], [4, 3, 1], [2, 2, 0]], dtype=ids_dtype)  # repeats and reuse across tokens
    x = torch.randn(9 if per_unit else 3, 128, generator=g).to(kernel_device)
    bias = torch.randn(5, 128, generator=g).to(kernel_device)
    y = moe_decode(x, trellis, suh, svh, bits, codebook, ids.to(kernel_device), bias)
    assert y.shape == (3, 3, 128) and y.dtype == torch.float32
    expected = _per_unit_reference(x.cpu(), trellis.cpu(), suh.cpu(), svh.cpu(), bits, codebook, ids, bias.cpu(), per_unit)
    for t in range(3):
        for j in range(3):
            assert relative_error(y[t, j].cpu(), expected[t, j]) < 1e-3, (t, j)  # u is fp16 (~2e-4)


def test_changing_ids_on_device_reroutes_without_host_changes(make_layer, kernel_device):
    trellis, suh, svh = make_layer(128, 128, 4, "3inst", seed=8, experts=3)
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(8)).to(kernel_device)
    ids = torch.tensor([[0, 1]], device=kernel_device)
    first = moe_decode(x, trellis, suh, svh, 4, "3inst", ids)
    ids.copy_(torch.tensor([[1, 2]]))
    second = moe_decode(x, trellis, suh, svh, 4, "3inst", ids)
    assert torch.equal(second[0, 0], first[0, 1])
    assert not torch.allclose(second[0, 1], first[0, 1])


def test_row_count_must_match_tokens_or_units(make_layer, kernel_device):
    trellis, suh, svh = make_layer(128, 128, 2, "mcg", experts=2)
    ids = torch.zeros(2, 2, dtype=torch.int64, device=kernel_device)
    with pytest.raises(ValueError, match="rows"):
        moe_decode(torch.randn(3, 128, device=kernel_device), trellis, suh, svh, 2, "mcg", ids)
