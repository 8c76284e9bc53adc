"""Grouped launches (kernels/bound_group.py: every part of a fused layer in one input transform and one matmul grid,
triton_fused's PARTS mode) against the per-part launches and the reference: decode rows, split-K, the tiled path, one
launch, which layers group and which keep a launch pair per part."""

from __future__ import annotations

import os

import pytest
import torch

from exl3local.kernels import KernelSpec, prepare, reference
from exl3local.kernels.bound import BoundLinear, Workspace

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton on CPU needs TRITON_INTERPRET=1 (scripts/test sets it)",
)
FP32_NOISE = 2e-5  # as test_bound and test_triton_linear: fp32 accumulation noise


def counters_clear() -> bool:
    return all(int(ws.counters.abs().sum()) == 0 for ws in Workspace._live.values())


def grouped_layer(k, widths, outs, bits, rows, in_features, seed, device):
    """A fused layer's parts as the plugin lays them out: the trellises of `widths` columns in one flat arena (their
    word counts `sizes`), suh per part, svh and bias over all parts, and `rows` rows of x with `in_features`."""
    g = torch.Generator().manual_seed(seed)
    words = reference.words_per_tile(bits)
    sizes = [(k // 16) * (n // 16) * words for n in widths]
    arena = torch.randint(-32768, 32768, (sum(sizes),), generator=g, dtype=torch.int16).to(device)
    suh = (torch.randn(len(widths), k, generator=g) * 0.05).half().to(device)
    svh = (torch.randn(sum(widths), generator=g) * 0.05).half().to(device)
    bias = torch.randn(sum(outs), generator=g).to(device)
    x = torch.randn(rows, in_features, generator=g).to(device)
    return words, sizes, arena, suh, svh, bias, x


QKV = (256, 128, 128), (200, 128, 100)


@pytest.mark.parametrize("codebook,bits,splits,widths,outs", [
    ("mul1", 4, 1, *QKV), ("mul1", 4, 2, *QKV), ("3inst", 3, 1, *QKV), ("3inst", 3, 2, *QKV),
    ("mul1", 4, 2, (128, 256, 128, 128), (128, 256, 100, 128)),  # four parts
])
def test_grouped_parts_run_as_one_grid_and_match_the_per_part_launches(relative_error, kernel_device, codebook, bits,
                                                                       splits, widths, outs):
    """q/k/v-like parts at one rate, laid out as the plugin lays them out (views of one flat arena, suh per part):
    one input transform and one matmul grid for the whole layer, padding, trim and bias as masks."""
    from exl3local.kernels.bound_group import GroupLaunch

    in_features, k = 100, 128
    words, sizes, arena, suh, svh, bias, x = grouped_layer(k, widths, outs, bits, 5, in_features, 21, kernel_device)
    parts, expected, t0, n0 = [], [], 0, 0
    for i, (n, size, out) in enumerate(zip(widths, sizes, outs)):
        trellis = arena[t0:t0 + size].view(k // 16, n // 16, words)
        kernel = prepare(KernelSpec(k, n, bits, codebook, torch.float32), kernel_device, "triton")
        parts.append((kernel, trellis, suh[i], svh[n0:n0 + n], out))
        padded = torch.nn.functional.pad(x, (0, k - in_features))
        expected.append(reference.linear(padded.double(), trellis, suh[i], svh[n0:n0 + n], bits, codebook)[:, :out])
        t0, n0 = t0 + size, n0 + n
    expected = torch.cat(expected, -1) + bias.double()
    layer = BoundLinear(parts, in_features, bias)
    (group, _, _), = layer.launches
    assert isinstance(group, GroupLaunch) and group.n_blocks == sum(widths) // 128
    group.splits[1] = (splits, group.k_steps // splits)
    y = layer(x)
    assert relative_error(y, expected) < 1e-3  # u is fp16 (~3e-4)
    per_part = torch.cat([BoundLinear([p], in_features, bias[sum(outs[:i]):sum(outs[:i + 1])])(x)
                          for i, p in enumerate(parts)], -1)
    assert relative_error(y, per_part) < FP32_NOISE
    assert counters_clear()


def test_parts_at_different_rates_keep_a_launch_each(make_layer, kernel_device):
    parts = []
    for bits in (4, 3):
        trellis, suh, svh = make_layer(128, 128, bits, "mul1", seed=int(bits))
        parts.append((prepare(KernelSpec(128, 128, bits, "mul1"), kernel_device, "triton"), trellis, suh, svh, 128))
    assert len(BoundLinear(parts, 128).launches) == 2


def test_very_wide_fused_layers_keep_a_launch_pair_per_part(kernel_device):
    """Above GROUP_MAX_BLOCKS column blocks in all (wider than any group measured) the parts stay separate; at or
    below it they share one grid (27B gate_up, 272 blocks: measured faster as one grid)."""
    from exl3local.kernels.bound_group import GROUP_MAX_BLOCKS, GroupLaunch

    def layer(n):
        words = reference.words_per_tile(4)
        size = 8 * (n // 16) * words
        arena = torch.zeros(2 * size, dtype=torch.int16, device=kernel_device)
        kernel = prepare(KernelSpec(128, n, 4, "mul1"), kernel_device, "triton")
        parts = [(kernel, arena[i * size:(i + 1) * size].view(8, n // 16, words),
                  torch.ones(128, dtype=torch.float16, device=kernel_device),
                  torch.ones(n, dtype=torch.float16, device=kernel_device), n) for i in range(2)]
        return BoundLinear(parts, 128)

    assert isinstance(layer(GROUP_MAX_BLOCKS * 64).launches[0][0], GroupLaunch)
    assert len(layer(GROUP_MAX_BLOCKS * 64 + 128).launches) == 2


def test_tiled_path_serves_grouped_layers_up_to_its_row_limit(monkeypatch, relative_error, kernel_device):
    """A fused two-part layer (padding, trim, bias) at 20 rows runs as one grouped tiled grid, equal to the per-part
    launches; above EXL3LOCAL_TILED_MAX_ROWS the layer takes the reconstruct path, and so says path_for."""
    from exl3local.kernels.bound_group import GroupLaunch
    from exl3local.kernels.dispatch import KernelPath

    monkeypatch.setenv("EXL3LOCAL_TILED_MAX_ROWS", "32")
    in_features, k, widths, outs = 100, 128, (256, 128), (200, 128)
    g = torch.Generator().manual_seed(22)
    words = reference.words_per_tile(4)
    sizes = [(k // 16) * (n // 16) * words for n in widths]
    arena = torch.randint(-32768, 32768, (sum(sizes),), generator=g, dtype=torch.int16).to(kernel_device)
    suh = (torch.randn(2, k, generator=g) * 0.05).half().to(kernel_device)
    svh = (torch.randn(sum(widths), generator=g) * 0.05).half().to(kernel_device)
    bias = torch.randn(sum(outs), generator=g).to(kernel_device)
    parts, t0, n0 = [], 0, 0
    for i, (n, size, out) in enumerate(zip(widths, sizes, outs)):
        kernel = prepare(KernelSpec(k, n, 4, "mul1", torch.float32), kernel_device, "triton")
        parts.append((kernel, arena[t0:t0 + size].view(k // 16, n // 16, words), suh[i], svh[n0:n0 + n], out))
        t0, n0 = t0 + size, n0 + n
    layer = BoundLinear(parts, in_features, bias)
    (group, _, _), = layer.launches
    assert isinstance(group, GroupLaunch) and layer.max_rows == 32
    group.tiled_splits[1] = (2, group.tiled_fixed["k_steps"] // 2)
    x = torch.randn(20, in_features, generator=g).to(kernel_device)
    y = layer(x)
    expected = torch.cat([reference.linear(torch.nn.functional.pad(x, (0, k - in_features)).double(), t, su, sv, 4,
                                           "mul1")[:, :out] for _, t, su, sv, out in parts], -1) + bias.double()
    assert relative_error(y, expected) < 1e-3  # u is fp16 (~3e-4)
    per_part = torch.cat([BoundLinear([p], in_features, bias[s:s + p[4]])(x) for p, s in zip(parts, (0, outs[0]))], -1)
    assert relative_error(y, per_part) < FP32_NOISE
    assert counters_clear()
    kernel = parts[0][0]
    assert kernel.path_for(32) is KernelPath.GEMV and kernel.path_for(33) is KernelPath.RECONSTRUCT_GEMM
    x = torch.randn(33, in_features, generator=g).to(kernel_device)
    assert torch.equal(layer(x), layer.unfused(x))


@pytest.mark.parametrize("grouped", [False, True])
def test_decode_rows_are_one_launch_with_the_input_transform_in_the_matmul(monkeypatch, relative_error, kernel_device,
                                                                          grouped):
    """Up to ONE_LAUNCH_MAX_ROWS rows the matmul programs compute u from x for their own K range (triton_fused IN_X):
    no input-transform launch, the same result as the two-launch path within fp32 noise. Four splits over k = 256
    give 64-feature K ranges (a part of a Hadamard block each); grouped parts each use their own suh; padding and
    bias as masks."""
    from exl3local.kernels import fused_launch
    from exl3local.kernels.bound_group import GroupLaunch

    in_features, k, widths, outs = 200, 256, (128, 128) if grouped else (128,), (128, 100) if grouped else (100,)
    words, sizes, arena, suh, svh, bias, x = grouped_layer(k, widths, outs, 4, 3, in_features, 31, kernel_device)
    kernel = prepare(KernelSpec(k, 128, 4, "mul1", torch.float32), kernel_device, "triton")
    parts = [(kernel, arena[sum(sizes[:i]):sum(sizes[:i + 1])].view(k // 16, n // 16, words), suh[i],
              svh[i * 128:(i + 1) * 128], out) for i, (n, out) in enumerate(zip(widths, outs))]
    layer = BoundLinear(parts, in_features, bias)
    (launch, _, _), = layer.launches
    assert isinstance(launch, GroupLaunch) == grouped
    launch.splits[1] = (4, launch.k_steps // 4)
    monkeypatch.setattr(fused_launch, "ONE_LAUNCH_MAX_ROWS", 0)  # the two-launch path
    before = layer(x)
    monkeypatch.setattr(fused_launch, "ONE_LAUNCH_MAX_ROWS", fused_launch.MAX_ROWS)
    monkeypatch.setattr(launch, "input", lambda *args: pytest.fail("the input transform was launched"))
    one = layer(x)
    assert relative_error(one, before) < FP32_NOISE
    padded = torch.nn.functional.pad(x, (0, k - in_features)).double()
    expected = torch.cat([reference.linear(padded, t, s, v, 4, "mul1")[:, :out] for _, t, s, v, out in parts], -1)
    assert relative_error(one, expected + bias.double()) < 1e-3  # u is fp16 (~3e-4)
    assert counters_clear()
