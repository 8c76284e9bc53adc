"""How many K splits a split-K launch takes (kernels/triton_gemv.choose_splits): pure arithmetic, no kernel runs."""

from __future__ import annotations

import os

import pytest
import torch


def test_split_k_fills_an_xe2_core_with_sixteen_programs(monkeypatch):
    """The split-K target per compute unit: 4.5 programs on CUDA (measured on the H200), 16 on XPU (an Xe2 core's
    64 hardware threads, 4 per program; Arc review #8)."""
    from exl3local.kernels import triton_gemv

    monkeypatch.setattr(triton_gemv, "compute_units", lambda device: 32)  # a B70's Xe cores
    assert triton_gemv.choose_splits(136, 320, torch.device("cuda")) == 2  # 272 programs >= 4.5 x 32
    assert triton_gemv.choose_splits(136, 320, torch.device("xpu")) == 4  # 544 >= 16 x 32
    assert triton_gemv.choose_splits(136, 320, torch.device("xpu"), per_core=2) == 1


def test_split_k_leaves_every_split_its_minimum_of_k_steps(monkeypatch):
    """Narrow groups stop splitting where a split would get fewer than MIN_STEPS_PER_SPLIT K steps (the finishing
    sum's serial tail), wide ones split as before (H200: 132 SMs)."""
    from exl3local.kernels import triton_gemv

    monkeypatch.setattr(triton_gemv, "compute_units", lambda device: 132)
    floor = triton_gemv.MIN_STEPS_PER_SPLIT
    assert floor > 1
    cuda = torch.device("cuda")
    assert triton_gemv.choose_splits(8, 128, cuda) == 128 // floor  # 35B-A3B shared_gate_up: was 128 splits of 1
    assert triton_gemv.choose_splits(16, 32, cuda) == 32 // floor  # 35B-A3B shared_down: was 32 of 1
    assert triton_gemv.choose_splits(40, 384, cuda) == 16  # 27B out_proj: 24 steps each, as before
    assert triton_gemv.choose_splits(136, 320, cuda) == 8  # 27B gate_up (a part): 40 steps each, as before


def test_launches_of_many_splits_load_eight_partials_at_a_time():
    """The finishing sum loads eight splits' partials per step from MANY_SPLITS splits on (the 27B's 16-split groups
    gained 9-10 % on the H200), four below (8-split launches lost 1-2 % with eight)."""
    from exl3local.kernels import triton_fused

    assert [triton_fused.split_loads(s) for s in (1, 2, 4, 8, 16, 32, 64)] == [4, 4, 4, 4, 8, 8, 8]


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="binding a launch needs a GPU or TRITON_INTERPRET=1")
def test_a_grid_of_more_than_one_wave_takes_the_register_capped_twin(kernel_device):
    """On CUDA a 4-bit decode matmul whose grid is more than ONE_WAVE_PROGRAMS programs per compute unit launches
    under WAVE_MAX_REGISTERS (fused_launch.FusedLaunch.for_grid); one twin per launch, its other options kept; elsewhere
    no cap."""
    from exl3local.kernels import fused_launch
    from exl3local.kernels.triton_gemv import compute_units

    scale = torch.ones(128, device=kernel_device).half()
    trellis = torch.zeros(8, 8, 32, dtype=torch.int16, device=kernel_device)
    launch = fused_launch.FusedLaunch(trellis, scale, scale, 4, "mul1")
    cap = fused_launch.WAVE_MAX_REGISTERS[4]
    assert launch.wave_cap == (cap if launch.device.type == "cuda" else None)
    launch.wave_cap = cap
    one_wave = fused_launch.ONE_WAVE_PROGRAMS * compute_units(launch.device)
    assert launch.for_grid(launch.fused, (one_wave, 1, 1)) is launch.fused
    twin = launch.for_grid(launch.fused, (1, one_wave + 1, 1))
    assert twin.options == dict(launch.fused.options, maxnreg=cap) and twin.varying == launch.fused.varying
    assert launch.for_grid(launch.fused, (one_wave, 2, 1)) is twin
    assert launch.for_grid(launch.one, (one_wave + 1, 1, 1)).varying == launch.one.varying


def test_a_grouped_grid_over_one_wave_takes_twice_the_split_target(monkeypatch):
    """bound_group.GroupLaunch's split-K on CUDA (132 SMs, as the H200): 27B gate_up as one grid (272 blocks, 320 K
    steps) takes 4 splits by the default target, 1088 programs, more than one wave (1056): twice the target, 8
    splits. in_proj_qkvz (128 blocks: 1024 programs) and q/k/v (112: 896) keep the default; XPU keeps its own."""
    from types import SimpleNamespace

    from exl3local.kernels import bound_group, fused_launch, triton_gemv

    monkeypatch.setattr(triton_gemv, "compute_units", lambda device: 132)
    monkeypatch.setattr(bound_group, "compute_units", lambda device: 132)

    def splits(blocks: int, k_steps: int, device: str = "cuda") -> int:
        launch = SimpleNamespace(device=torch.device(device), k_steps=k_steps, n_blocks=blocks, splits={})
        launch.programs_per_core = lambda b: bound_group.GroupLaunch.programs_per_core(launch, b)
        return fused_launch.FusedLaunch.split_for(launch, 1)[0]

    assert splits(272, 320) == 8 and triton_gemv.choose_splits(272, 320, torch.device("cuda")) == 4
    assert splits(128, 320) == 8 and splits(112, 320) == 8
    assert splits(272, 320, "xpu") == triton_gemv.choose_splits(272, 320, torch.device("xpu"))
