"""Grouped MoE decode: every (token, expert) unit against the reference, ids read from a device tensor."""

from __future__ import annotations

import os

import pytest
import torch

from exl3local.kernels import reference
from exl3local.kernels.bound import bind_moe
from exl3local.kernels.triton_moe import expert_tiles, moe_decode, moe_units

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


@pytest.mark.parametrize("splits", [1, 2])
def test_expert_sorted_tiles_match_the_per_unit_reference(make_layer, relative_error, kernel_device, splits):
    """The grouped GEMM (T > 4 tokens): units grouped by expert on the device, tiles of up to 16 units of one expert.
    Expert 0 has 17 units (two tiles), expert 2 18, expert 1 one; remote units (-1) get no tile and stay unread."""
    trellis, suh, svh = make_layer(128, 128, 4, "mul1", seed=12, experts=3)
    ids = torch.tensor([[0, 2]] * 17 + [[-1, 1], [2, -1]], dtype=torch.int32)
    table, tiles = expert_tiles(ids.to(kernel_device), 3, 16)
    # grouped: 2 remote, 17 x expert 0, 1 x expert 1, 18 x expert 2; starts past the 5 tiles hold the unit count
    assert tiles == 6 and table[2 * 38:2 * 38 + tiles].tolist() == [2, 18, 19, 20, 36, 38]
    assert sorted(table[:2].tolist()) == [34, 37] and table[38:40].tolist() == [-1, -1]  # remote units: no tile
    x = torch.randn(19, 128, generator=torch.Generator().manual_seed(12)).to(kernel_device)
    bound = bind_moe(trellis, suh, svh, 4, "mul1")
    bound.splits[tiles] = (splits, bound.k_steps // splits)
    y = moe_units(bound, x, ids.to(kernel_device), (table, tiles))
    local = ids.clamp(min=0)
    expected = _per_unit_reference(x.cpu(), trellis.cpu(), suh.cpu(), svh.cpu(), 4, "mul1", local, None, False)
    for t, j in (ids >= 0).nonzero().tolist():
        assert relative_error(y[t, j].cpu(), expected[t, j]) < 1e-3, (t, j)  # u is fp16


def test_changing_ids_on_device_reroutes_without_host_changes(make_layer, kernel_device):
    trellis, suh, svh = make_layer(128, 128, 4, "3inst", seed=8, experts=3)
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(8)).to(kernel_device)
    ids = torch.tensor([[0, 1]], device=kernel_device)
    first = moe_decode(x, trellis, suh, svh, 4, "3inst", ids)
    ids.copy_(torch.tensor([[1, 2]]))
    second = moe_decode(x, trellis, suh, svh, 4, "3inst", ids)
    assert torch.equal(second[0, 0], first[0, 1])
    assert not torch.allclose(second[0, 1], first[0, 1])


def test_weights_come_from_one_place(make_layer, kernel_device):
    """moe_decode binds the tensors it is given; a projection bound once runs through moe_units, which takes no
    weight tensors. (moe_decode(..., bound=b) used to run b's weights and ignore the tensors passed beside it.)"""
    a = make_layer(128, 128, 4, "mul1", seed=9, experts=2)
    b = make_layer(128, 128, 4, "mul1", seed=10, experts=2)
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(9)).to(kernel_device)
    ids = torch.tensor([[1, 0]], device=kernel_device)
    with pytest.raises(TypeError):
        moe_decode(x, *b, 4, "mul1", ids, bound=bind_moe(*a, 4, "mul1"))
    assert torch.equal(moe_units(bind_moe(*a, 4, "mul1"), x, ids), moe_decode(x, *a, 4, "mul1", ids))


def test_row_count_must_match_tokens_or_units(make_layer, kernel_device):
    trellis, suh, svh = make_layer(128, 128, 2, "mcg", experts=2)
    ids = torch.zeros(2, 2, dtype=torch.int64, device=kernel_device)
    with pytest.raises(ValueError, match="rows"):
        moe_decode(torch.randn(3, 128, device=kernel_device), trellis, suh, svh, 2, "mcg", ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_layer_units_fuse_the_glue_and_match_the_reference(relative_error, kernel_device, dtype):
    """ExpertLayer's five-launch units path: gate/up pairs from ids (no stacked id tensor), silu(gate)·up inside
    the down projection's input transform, the weighted sum in one combine kernel; x unpadded (100 of 128
    features), a remote expert (-1) contributes nothing, several chunks when the grid would be too tall. 6 units
    over 3 experts take tiles of expert-grouped units (gate/up tiles as pairs of the down tiles); the one-token
    chunks run one unit per program."""
    from exl3local.kernels import moe_layer
    from exl3local.kernels.moe_layer import ExpertLayer

    class Proj:
        def __init__(self, k, n):
            self.bits, self.codebook, self.size_k, self.size_n = 4, "mul1", k, n
            self.trellis_shape = (k // 16, n // 16, reference.words_per_tile(4))
            self.words = (k // 16) * (n // 16) * reference.words_per_tile(4)

    E, hidden, k, inter, tokens, top_k = 3, 100, 128, 128, 3, 2
    gate, down = Proj(k, inter), Proj(inter, k)
    g = torch.Generator().manual_seed(31)
    w13 = torch.randint(-32768, 32768, (E, 2 * gate.words), generator=g, dtype=torch.int16)
    # Scales of one: with 0.05 the down projection's input falls into fp16's subnormal range, where u's
    # rounding, not the kernels, sets the error.
    w13_suh, w13_svh = torch.randn(E, 2, k, generator=g).half(), torch.randn(E, 2, inter, generator=g).half()
    w2 = torch.randint(-32768, 32768, (E, *down.trellis_shape), generator=g, dtype=torch.int16)
    w2_suh, w2_svh = torch.randn(E, inter, generator=g).half(), torch.randn(E, k, generator=g).half()
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), -1)
    ids = torch.tensor([[2, 0], [1, -1], [0, 2]], dtype=torch.int32)
    tensors = [t.to(kernel_device) for t in (w13, w13_suh, w13_svh, w2, w2_suh, w2_svh)]
    layer = ExpertLayer(*tensors, {"gate": gate, "up": gate, "down": down}, top_k, backend="triton")
    assert layer.refusal is None

    def ref_expert(e, row):
        xp = torch.nn.functional.pad(row.double(), (0, k - hidden))[None]
        w = w13[e].view(2, *gate.trellis_shape)
        gt = reference.linear(xp, w[0], w13_suh[e, 0], w13_svh[e, 0], 4, "mul1")
        up = reference.linear(xp, w[1], w13_suh[e, 1], w13_svh[e, 1], 4, "mul1")
        return reference.linear(torch.nn.functional.silu(gt) * up, w2[e], w2_suh[e], w2_svh[e], 4, "mul1")[0]

    expected = torch.stack([sum(weights[t, j].double() * ref_expert(int(ids[t, j]), x[t]) for j in range(top_k)
                                if ids[t, j] >= 0) for t in range(tokens)])[:, :hidden]
    out = layer.run(moe_layer.select_path(tokens), x.to(kernel_device), weights.to(kernel_device), ids.to(kernel_device))
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    assert relative_error(out.cpu(), expected) < (1e-3 if dtype == torch.float32 else 1e-2)  # u is fp16
    old = moe_layer.MAX_UNITS_PER_LAUNCH
    moe_layer.MAX_UNITS_PER_LAUNCH = 2 * top_k  # one token per chunk
    try:
        chunked = layer.run(moe_layer.select_path(tokens), x.to(kernel_device), weights.to(kernel_device),
                            ids.to(kernel_device))
    finally:
        moe_layer.MAX_UNITS_PER_LAUNCH = old
    # one token per chunk: 2 units over 3 experts, one unit per program; another split-K, fp32 order only
    assert relative_error(chunked, out) < 1e-5
