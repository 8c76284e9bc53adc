"""The fused one-launch kernel and its bound launches (kernels/triton_fused.py, kernels/bound.py) against the
fp64 emulation and the reference: every super-lane width, split-K on and off, fused layers with padding,
trim and bias, MoE units."""

from __future__ import annotations

import os

import pytest
import torch

from exl3local.kernels import KernelSpec, prepare, reference
from exl3local.kernels.bound import BoundLinear, FusedLaunch, Workspace, bind_moe
from exl3local.kernels import triton_gemm
from exl3local.kernels.triton_moe import moe_units

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton on CPU needs TRITON_INTERPRET=1 (scripts/test sets it)",
)
FP32_NOISE = 2e-5  # as test_triton_linear: what is left against the emulation is fp32 accumulation noise


def counters_clear() -> bool:
    return all(int(ws.counters.abs().sum()) == 0 for ws in Workspace._live.values())


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("codebook,bits", [("mul1", 4), ("3inst", 2), ("mcg", 3), ("mul1", 2.5)])
def test_fused_matches_emulation_with_and_without_split_k(make_layer, emulate, relative_error, kernel_device,
                                                          codebook, bits, splits):
    trellis, suh, svh = make_layer(128, 256, bits, codebook, seed=3)  # small: the interpreter's time grows with K·N
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(4)).to(kernel_device)
    launch = FusedLaunch(trellis, suh, svh, bits, codebook)
    launch.splits[1] = (splits, launch.k_steps // splits)
    y = torch.empty(3, 256, device=kernel_device)
    launch.launch(x, y, 3)
    assert relative_error(y, emulate(x, trellis, suh, svh, bits, codebook)) < FP32_NOISE
    assert counters_clear()  # the last split reset its block's counter for the next launch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the direct launch exists on compiled devices only")
def test_replan_rebinds_a_changed_split_count(make_layer, emulate, relative_error, kernel_device):
    """A bench sweep changes the fixed arguments (here 2 splits -> 1) and calls replan(): on a compiled device the
    direct launch's argument template would otherwise keep the old split and sum half of K."""
    trellis, suh, svh = make_layer(256, 128, 4, "mul1", seed=11)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(11)).to(kernel_device)
    launch = FusedLaunch(trellis, suh, svh, 4, "mul1")
    launch.splits[1] = (2, launch.k_steps // 2)
    y = torch.empty(3, 128, device=kernel_device)
    for _ in range(2):  # the second call runs through the direct launch where there is one
        launch.launch(x, y, 3)
    launch.splits[1] = (1, launch.k_steps)
    launch.replan()
    launch.launch(x, y, 3)
    assert relative_error(y, emulate(x, trellis, suh, svh, 4, "mul1")) < FP32_NOISE
    assert counters_clear()


def test_split_partials_loaded_several_at_a_time_give_the_same_bits(make_layer, emulate, relative_error,
                                                                     kernel_device):
    """The finishing program loads SL splits' partials per step of its sum and adds them in split order: the same
    bits as one at a time, for split counts below, at and past a multiple of SL. SL goes through the launch's plan
    (FusedLaunch.loads forced, else triton_fused.split_loads by the launch's split count)."""
    from exl3local.kernels import triton_fused

    trellis, suh, svh = make_layer(256, 128, 4, "mul1", seed=12)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(12)).to(kernel_device)
    for splits in (2, 8, 16):
        outs = []
        for loads in (1, 3, None):
            launch = FusedLaunch(trellis, suh, svh, 4, "mul1")
            launch.splits[1] = (splits, launch.k_steps // splits)
            launch.loads = loads
            outs.append(torch.empty(3, 128, device=kernel_device))
            launch.launch(x, outs[-1], 3)
            (_, _, _, _, _, fixed), = launch.plans.values()
            assert fixed["SL"] == (loads or triton_fused.split_loads(splits))
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
        assert relative_error(outs[0], emulate(x, trellis, suh, svh, 4, "mul1")) < FP32_NOISE
    assert counters_clear()


@pytest.mark.parametrize("codebook,bits", [("mcg", 3), ("mul1", 8)])
def test_flat_and_shaped_word_loads_give_the_same_bits(make_layer, kernel_device, codebook, bits):
    """The trellis words loaded through flat indices (lane-linear, the default) or as [KT, BNT, 32/G] tensors
    (triton_decode.ring_tiles' FLAT): the same words, so the same outputs bit for bit (rates whose super-lanes
    span several words: 3 bits three, 8 bits two)."""
    trellis, suh, svh = make_layer(128, 128, bits, codebook, seed=9)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(9)).to(kernel_device)
    outs = []
    for flat in (True, False):
        launch = FusedLaunch(trellis, suh, svh, bits, codebook)
        launch.fused_fixed["FLAT"] = flat
        outs.append(torch.empty(2, 128, device=kernel_device))
        launch.launch(x, outs[-1], 2)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("codebook,bits", [("mul1", 8), ("3inst", 8)])
def test_one_row_at_fma_rates_finishes_in_the_fma_kernel(make_layer, emulate, relative_error, kernel_device,
                                                         codebook, bits):
    """One row at FMA_ONE_ROW_BITS: the FMA ring kernel with the same epilogue (split-K: the interpreter's one
    compute unit gets several splits)."""
    trellis, suh, svh = make_layer(256, 256, bits, codebook, seed=8)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(8)).to(kernel_device)
    launch = FusedLaunch(trellis, suh, svh, bits, codebook)
    assert launch.fma is not None and launch.fma_split()[1] > 1
    y = torch.empty(1, 256, device=kernel_device)
    launch.launch(x, y, 1)
    assert relative_error(y, emulate(x, trellis, suh, svh, bits, codebook)) < FP32_NOISE
    assert counters_clear()


def test_fused_layer_pads_trims_and_adds_bias(make_layer, relative_error, kernel_device):
    """A q/k/v-like layer: three parts with their own suh and bits share x (100 of 128 features given),
    each keeps fewer columns than it stores, the bias covers the kept columns."""
    in_features, k = 100, 128
    specs = [("mul1", 4, 128, 100), ("3inst", 3, 256, 256), ("mcg", 2, 128, 60)]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, in_features, generator=g).to(kernel_device)
    bias = torch.randn(sum(out for *_, out in specs), generator=g).to(kernel_device)
    parts, expected = [], []
    for i, (codebook, bits, n, out) in enumerate(specs):
        trellis, suh, svh = make_layer(k, n, bits, codebook, seed=10 + i)
        kernel = prepare(KernelSpec(k, n, bits, codebook, torch.float32), kernel_device, "triton")
        parts.append((kernel, trellis, suh, svh, out))
        padded = torch.nn.functional.pad(x, (0, k - in_features))
        expected.append(reference.linear(padded.double(), trellis, suh, svh, bits, codebook)[:, :out])
    expected = torch.cat(expected, -1) + bias.double()
    layer = BoundLinear(parts, in_features, bias)
    for launch, _, _ in layer.launches:
        launch.splits[1] = (2, launch.k_steps // 2)
    y = layer(x.view(1, 5, in_features))
    assert y.shape == (1, 5, expected.shape[-1])
    assert relative_error(y[0], expected) < 1e-3  # u is fp16 (~3e-4)
    assert relative_error(layer.unfused(x), expected) < 1e-3
    assert counters_clear()


def test_more_rows_than_a_tile_take_the_reconstruct_path(monkeypatch, make_layer, kernel_device):
    """Above the bound launches' rows: the reconstruct path with its launches bound per part (bound_reconstruct),
    the same bits as the kernels' own apply per part (padded x, trimmed parts, concatenated, bias added), in both
    its forms (the Hadamard on y up to triton_gemm.HY_MAX_ROWS rows, each part written in place; W_r above: fp16
    parts written in place; the limits lowered to keep x small)."""
    monkeypatch.setattr(triton_gemm, "HY_MAX_ROWS", 64)
    monkeypatch.setattr(triton_gemm, "HY_K_PER_ROW", 1 << 20)
    parts = []
    for seed, (n, out, bits, codebook) in enumerate([(256, 200, 4, "mul1"), (128, 128, 3, "mcg")]):
        trellis, suh, svh = make_layer(128, n, bits, codebook, seed=6 + seed)
        parts.append((prepare(KernelSpec(128, n, bits, codebook, torch.float32), kernel_device, "triton"), trellis,
                      suh, svh, out))
    bias = torch.randn(328, generator=torch.Generator().manual_seed(6)).to(kernel_device)
    layer = BoundLinear(parts, 100, bias)
    whole = BoundLinear(parts[1:], 100)  # one part, all its columns: the product goes straight into y
    # the padded part last: its columns past `out` would run into the next row of y (both forms write in place)
    padded_last = BoundLinear(parts[::-1], 100)
    for shape in ((2, 10, 100), (70, 100)):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(6)).to(kernel_device)
        y = layer(x)
        assert layer.rebuilds is not None and y.shape == (*shape[:-1], 328)
        assert layer.rebuild_input.parts == 2  # one input transform for both parts (bound_reconstruct.InputLaunch)
        assert torch.equal(y, layer.unfused(x))
        assert torch.equal(layer(x), y)  # on a GPU the second call runs through the direct launches
        assert torch.equal(whole(x.half()), whole.unfused(x.half()))
        assert torch.equal(layer(x.half()), layer.unfused(x.half()))  # fp16: parts written in place where they can
        assert torch.equal(padded_last(x), padded_last.unfused(x))


def test_three_parts_share_one_input_transform_on_the_reconstruct_path(monkeypatch, make_layer, kernel_device):
    """q/k/v-like parts above the bound launches' rows: one input-transform launch writes every part's u
    (triton_hadamard._input_kernel PARTS 3, part p at rows p·M of u), each part's product the same bits as its
    kernel's own apply, in both forms (20 rows: the Hadamard on y; 70: W_r, the limit lowered)."""
    parts = []
    for seed, n in enumerate((256, 128, 128)):
        trellis, suh, svh = make_layer(128, n, 4, "mul1", seed=40 + seed)
        parts.append((prepare(KernelSpec(128, n, 4, "mul1", torch.float32), kernel_device, "triton"), trellis, suh,
                      svh, n))
    layer = BoundLinear(parts, 128)
    for rows, hy_rows in ((20, 1024), (70, 64)):
        monkeypatch.setattr(triton_gemm, "HY_MAX_ROWS", hy_rows)
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).to(kernel_device).half()
        assert torch.equal(layer(x), layer.unfused(x))
    assert layer.rebuild_input.parts == 3


def test_parts_of_one_shape_take_one_batched_matmul_on_w_r(monkeypatch, make_layer, relative_error, kernel_device):
    """gate/up-like parts (one shape, every column kept) with an fp16 output on the W_r form: both weights rebuilt into
    one buffer and one batched matmul writing each part's columns (bound_reconstruct.BATCHED_PARTS; no per-part call),
    the per-part path's products within fp32 accumulation noise (another GEMM kernel on a GPU; the fp16 outputs may
    differ by an ulp where the fp32 sums straddle a rounding boundary)."""
    from exl3local.kernels import bound_reconstruct

    monkeypatch.setattr(triton_gemm, "HY_MAX_ROWS", 16)
    parts = []
    for seed in range(2):
        trellis, suh, svh = make_layer(128, 128, 4, "mul1", seed=50 + seed)
        parts.append((prepare(KernelSpec(128, 128, 4, "mul1", torch.float16), kernel_device, "triton"), trellis, suh,
                      svh, 128))
    layer = BoundLinear(parts, 128)
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(50)).to(kernel_device).half()
    per_part = layer.unfused(x)
    monkeypatch.setattr(bound_reconstruct.ReconstructLaunch, "into", lambda *a: pytest.fail("a per-part call"))
    y = layer(x)
    assert relative_error(y, per_part) < 1e-3
    assert relative_error(y[:, 128:], per_part[:, 128:]) < 1e-3  # each part in its own columns


@pytest.mark.parametrize("codebook,bits,rows,splits", [("mul1", 4, 20, 2), ("3inst", 3, 70, 1), ("mul1", 2.5, 17, 2)])
def test_tiled_rows_match_emulation(monkeypatch, make_layer, emulate, relative_error, kernel_device, codebook, bits,
                                    rows, splits):
    """More than 16 rows with the tiled path on: 64-row tiles (70 rows: two, the second masked), KT = G tile rows
    per step, split-K on and off; the counters of every (row tile, column block) reset."""
    from exl3local.kernels.triton_gemv import TILE_ROWS

    monkeypatch.setenv("EXL3LOCAL_TILED_MAX_ROWS", "128")
    trellis, suh, svh = make_layer(128, 256, bits, codebook, seed=3)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(4)).to(kernel_device)
    launch = FusedLaunch(trellis, suh, svh, bits, codebook)
    launch.tiled_splits[-(-rows // TILE_ROWS)] = (splits, launch.tiled_fixed["k_steps"] // splits)
    y = torch.empty(rows, 256, device=kernel_device)
    launch.launch(x, y, rows)
    assert relative_error(y, emulate(x, trellis, suh, svh, bits, codebook)) < FP32_NOISE
    assert counters_clear()


def test_bound_moe_projection_reroutes_by_device_ids(make_layer, relative_error, kernel_device):
    trellis, suh, svh = make_layer(128, 128, 4, "mul1", seed=7, experts=4)
    bound = bind_moe(trellis, suh, svh, 4, "mul1")
    bound.splits[4] = (2, bound.k_steps // 2)  # 4 units: split-K with one counter per unit and column block
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(7)).to(kernel_device)
    ids = torch.tensor([[3, 0], [1, 3]], device=kernel_device)
    y = moe_units(bound, x, ids)
    for t in range(2):
        for j in range(2):
            e = int(ids[t, j])
            ref = reference.linear(x[t : t + 1].double(), trellis[e], suh[e], svh[e], 4, "mul1")
            assert relative_error(y[t, j : j + 1], ref) < 1e-3
    ids.copy_(torch.tensor([[0, 3], [3, 1]]))
    again = moe_units(bound, x, ids)
    assert torch.equal(again[0, 1], y[0, 0]) and torch.equal(again[1, 0], y[1, 1])
    assert counters_clear()


def test_outgrown_workspace_stays_allocated():
    device = torch.device("cpu")
    first = Workspace.get(device, 12345, 10, 10, 2)
    grown = Workspace.get(device, 12345, 10, 1000, 2)
    assert grown is not first and grown.partials.numel() >= 1000 and grown.inputs.numel() >= 10
    assert any(ws is first for ws in Workspace._retired)  # a graph captured against it may still use it


@pytest.mark.parametrize("rows", [2, 20])  # the fused launch; the reconstruct path above the bound rows
def test_bound_layer_reads_its_device_tables_where_a_reload_rewrites_them(monkeypatch, make_layer, kernel_device,
                                                                         rows):
    """What a wake from sleep level 2 relies on (plugin/reload.py): the cached Hadamard tables a bound layer's
    launches point at are lost with the weights' memory pool on a GPU, and rewritten in place by the reload; the
    same bound layer must then answer as before, and must not have answered from a copy while they were lost.
    At 2 rows the input-transform launch (which reads the ±1 table; MoE units keep it): the one-launch path reads
    no table."""
    from exl3local.kernels import fused_launch, hadamard, triton_hadamard
    from exl3local.plugin import reload

    monkeypatch.setattr(fused_launch, "ONE_LAUNCH_MAX_ROWS", 0)

    trellis, suh, svh = make_layer(128, 128, 4, "mul1", seed=21)
    kernel = prepare(KernelSpec(128, 128, 4, "mul1", torch.float16), kernel_device, "triton")
    layer = BoundLinear([(kernel, trellis, suh, svh, 128)], 128)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(22)).to(kernel_device).half()
    before = layer(x)
    device = x.device  # as the kernels key their tables ("cuda:0": a bare "cuda" is another cache entry)
    try:
        for table in (hadamard.hadamard_128(device), triton_hadamard.hadamard_operands(device)):
            table.fill_(7)  # what a discarded and re-mapped page may hold
        assert not torch.equal(layer(x), before)
    finally:  # the tables are this process's: a failure here must not break every later test's kernels
        reload.refresh_device_tables(device, set())
    assert torch.equal(layer(x), before)


def test_moe_units_are_one_launch_with_the_input_transform_in_the_matmul(monkeypatch, make_layer, relative_error,
                                                                         kernel_device):
    """An MoE projection over one (token, expert) unit per program computes each unit's u in the matmul program (its
    token's x row, its expert's suh; split-K over 64-feature ranges): no input-transform launch, the two-launch result
    within fp32 noise."""
    from exl3local.kernels import fused_launch

    trellis, suh, svh = make_layer(256, 128, 4, "mul1", seed=17, experts=3)
    proj = bind_moe(trellis, suh, svh, 4, "mul1")
    proj.splits[4] = (4, proj.k_steps // 4)  # 4 units
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(17)).to(kernel_device)
    ids = torch.tensor([[2, 0], [1, 2]], device=kernel_device)
    monkeypatch.setattr(fused_launch, "ONE_LAUNCH_MAX_UNITS", 0)
    before = moe_units(proj, x, ids)
    monkeypatch.setattr(fused_launch, "ONE_LAUNCH_MAX_UNITS", 4)
    monkeypatch.setattr(proj, "input", lambda *args: pytest.fail("the input transform was launched"))
    assert relative_error(moe_units(proj, x, ids), before) < FP32_NOISE
    assert counters_clear()
