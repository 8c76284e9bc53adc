"""Every part of a fused layer (q/k/v, gate/up) in one input-transform launch and one matmul grid: GroupLaunch, a
FusedLaunch over the parts side by side (kernels/bound.py's BoundLinear uses it where the parts allow)."""

from __future__ import annotations

import torch

from exl3local.kernels import fused_launch
from exl3local.kernels.fused_launch import BLOCK_N, FUSED_VARYING, MAX_ROWS, ONE_LAUNCH_VARYING, FusedLaunch
from exl3local.kernels.launcher import DirectLaunch, Workspace
from exl3local.kernels.triton_fused import exl3_fused_kernel
from exl3local.kernels.triton_gemv import FMA_ONE_ROW_BITS, SPLIT_TARGET_PROGRAMS_PER_CORE, choose_splits, compute_units
from exl3local.kernels.triton_hadamard import rows_per_program

# Fused layers wider than this many 128-column blocks keep a launch pair per part. H200: one grid lost at 272 blocks
# (27B gate_up, 2 x 17408) in sessions 5 and 8 (h200-s8d-groups-512.log: 125 vs 119 µs per part at M = 1) and won at
# 128 and below; since the fragment order, the wave register cap and the words one step ahead it wins there too: 27B
# gate_up 6797 vs 7401 µs per step at M = 1 (-8 %), whole step 15.90 vs 16.48 ms graph at M = 1, 16.03 vs 16.65 at
# M = 4 (h200-s17d, docs/PERF.md "Session 17"). Above 272 blocks unmeasured.
GROUP_MAX_BLOCKS = 512
# Register cap of a GroupLaunch's decode matmul on CUDA (ptxas maxnreg) at 4 bits: its PARTS mode took 72 registers
# (43.75 % theoretical occupancy, h200-s7-ncu-qkvz-m1-flat.log); capped at 64 (no spills, 50 %), 27B in_proj_qkvz
# ran 79 -> 53 µs in ncu and 74 -> 52 µs graph at M = 1, q/k/v 48 -> 46 µs (docs/dev/perf/h200-s8*-layers-config.log,
# h200-s8c-ncu-qkvz-m1-cap64.log). Other rates unmeasured: uncapped. XPU has no such option: uncapped there. A grid
# larger than one wave at 64 takes fused_launch.WAVE_MAX_REGISTERS' cap instead (FusedLaunch.for_grid).
GROUP_MAX_REGISTERS = {4: 64}
# Programs per SM a GroupLaunch's split-K aims for on CUDA (triton_gemv.choose_splits' per_core) where the default
# target's grid is more than one wave at ONE_WAVE_PROGRAMS a SM: twice the default, halving each program's K range.
# H200, graph µs per step, default / doubled (h200-s18c, docs/PERF.md "Session 18"): 27B gate_up (1088 programs by
# default, the only grid over a wave) 6759 / 6278 at M = 1, 6793 / 6313 at M = 4, step 15.83 / 15.32 ms (M = 1),
# 15.96 / 15.47 (M = 4). Doubled below a wave (h200-s18b): 27B qkv_proj (896) 800 / 821 µs, 35B-A3B in_proj_qkvz
# (768, one launch) 638 / 665 at M = 1, 871 / 1094 at M = 16: lost; 27B in_proj_qkvz (1024) 2620 / 2585, a 1.3 %
# gain the rule leaves out. Arc unmeasured: XPU keeps its own target.
GROUP_PROGRAMS_PER_CORE = 2 * SPLIT_TARGET_PROGRAMS_PER_CORE


class GroupLaunch(FusedLaunch):
    """Every part of a fused layer (q/k/v, gate/up: one x, same rate, codebook and k, each its own suh/svh/bits)
    in two launches: one input transform over all parts (the parts' suh stacked, row m of part p written as u
    row m·P + p, so the MoE unit mode of the input kernel serves it with ids = p) and one matmul grid over every
    part's column blocks (triton_fused PARTS mode, a per-block table names the part). The parts' trellises must
    be views of one allocation (the plugin's flat arena), so one base pointer reaches them all."""

    def __init__(self, parts, bits: float, codebook: str, bias: torch.Tensor | None = None) -> None:
        """parts: [(trellis, suh, svh, out_features)] at one rate; bias covers the sum of out_features."""
        trellis0, suh0, _, _ = parts[0]
        super().__init__(trellis0, suh0, torch.cat([svh for _, _, svh, _ in parts]), bits, codebook, bias=bias)
        self.count = len(parts)
        self.size_n = sum(t.shape[-2] * 16 for t, *_ in parts)
        self.n_blocks = self.size_n // BLOCK_N
        self.fma = None  # one grid over parts: the dot kernel at every row count
        if self.device.type == "cuda" and bits in GROUP_MAX_REGISTERS:
            self.fused = DirectLaunch(exl3_fused_kernel, FUSED_VARYING, self.fused.hooks is None,
                                      maxnreg=GROUP_MAX_REGISTERS[bits], **self.fused.options)
            self.one = DirectLaunch(exl3_fused_kernel, ONE_LAUNCH_VARYING, self.one.hooks is None,
                                    maxnreg=GROUP_MAX_REGISTERS[bits], **self.one.options)
        device = self.device
        self.suh = torch.stack([suh for _, suh, _, _ in parts])
        rows = []
        cols = out_start = 0
        for i, (trellis, _, _, out) in enumerate(parts):
            offset = trellis.data_ptr() - trellis0.data_ptr()
            if offset % 4 or trellis.untyped_storage().data_ptr() != trellis0.untyped_storage().data_ptr():
                raise ValueError("grouped parts need their trellises in one allocation, 4-byte aligned")
            tiles_n = trellis.shape[-2]
            rows += [[offset // 4, cols, out_start, out, tiles_n, i, cols // BLOCK_N, 0]
                     for _ in range(tiles_n * 16 // BLOCK_N)]
            cols += tiles_n * 16
            out_start += out
        self.table = torch.tensor(rows, dtype=torch.int64, device=device)
        self.part_ids = torch.arange(self.max_rows * self.count, device=device, dtype=torch.int32) % self.count
        self.input_fixed = dict(self.input_fixed, suh_ptr=self.suh, HAS_IDS=True)
        grouped = dict(tiles_n=self.size_n // 16, parts_ptr=self.table, PARTS=self.count, suh_ptr=self.suh)
        self.fused_fixed = dict(self.fused_fixed, **grouped)
        self.tiled_fixed = dict(self.tiled_fixed, **grouped)

    def programs_per_core(self, blocks: int) -> float | None:
        """GROUP_PROGRAMS_PER_CORE on CUDA where the default target's grid is more than one wave (FusedLaunch.for_grid's
        test), else the default."""
        if self.device.type != "cuda":
            return None
        wave = fused_launch.ONE_WAVE_PROGRAMS * compute_units(self.device)
        return GROUP_PROGRAMS_PER_CORE if blocks * choose_splits(blocks, self.k_steps, self.device) > wave else None

    def needs(self, rows: int) -> tuple[int, int, int]:
        if rows > MAX_ROWS:
            blocks, splits, m_blocks = self.tiled_grid(rows)
            return rows * self.count * self.size_k, splits * rows * self.size_n, blocks * m_blocks
        splits, _ = self.split_for(1)
        return rows * self.count * self.size_k, splits * rows * self.size_n, self.n_blocks

    def _plan(self, key: tuple) -> tuple:
        rows, _, _, _, _, _, k_valid, _, _, _, _, one = key
        if rows > self.max_rows:
            raise ValueError(f"{rows} rows: more than this launch serves ({self.max_rows}, EXL3LOCAL_TILED_MAX_ROWS)")
        units = rows * self.count
        block_m = rows_per_program(units)
        input_fixed = dict(self.input_fixed, x_div=self.count, k_valid=k_valid, BM=block_m)
        if rows > MAX_ROWS:
            blocks, splits, m_blocks = self.tiled_grid(rows)
            matmul = (self.tiled, (blocks, splits, m_blocks),
                      dict(self.tiled_fixed, n_out=0, steps_per_split=self.tiled_fixed["k_steps"] // splits,
                           SPLIT=splits > 1, SL=self.loads_for(splits)))
        else:
            splits, per_split = self.split_for(1)
            fixed = dict(self.fused_fixed, n_out=0, steps_per_split=per_split, SPLIT=splits > 1,
                         SL=self.loads_for(splits))
            grid = (self.n_blocks, splits, 1)
            if one:  # the matmul programs transform x themselves (triton_fused IN_X), each part with its suh
                return self._keep(key, (None, self.needs(rows), None, self.for_grid(self.one, grid), grid,
                                        dict(fixed, IN_X=True, k_valid=k_valid)))
            matmul = (self.for_grid(self.fused, grid), grid, fixed)
        return self._keep(key, ((-(-units // block_m), self.k_blocks, 1), self.needs(rows), input_fixed, *matmul))

    def launch(self, x: torch.Tensor, y: torch.Tensor, rows: int, ids=None, x_div: int = 1,
               k_valid: int | None = None, n_out: int | None = None) -> None:
        """y[:rows, :Σ out] = every part of x's rows, side by side (k_valid features of x are given)."""
        x_ptr, y_ptr = x.data_ptr(), y.data_ptr()
        key = (rows, x.dtype, y.dtype, x_ptr % 16 == 0, y_ptr % 16 == 0, 1,
               self.size_k if k_valid is None else k_valid, 0, None, False, False,
               self.one_launch_on and rows <= min(fused_launch.ONE_LAUNCH_MAX_ROWS, MAX_ROWS)
               and self.n_blocks * self.size_k <= fused_launch.ONE_LAUNCH_MAX_WORK)
        input_grid, needs, input_fixed, matmul, grid, fixed = self.plans.get(key) or self._plan(key)
        stream = self.stream()
        ws = Workspace._live.get((self.device, stream))
        if ws is None or not ws.holds(*needs):
            ws = Workspace.get(self.device, stream, *needs)
        ids_, units, u_ptr = self.part_ids, rows * self.count, ws.inputs_ptr
        x_stride, y_stride, stride_zs = x.stride(0), y.stride(0), rows * self.size_n
        if input_grid is None:
            matmul(grid, stream, key, fixed,
                   (ws.inputs, ids_, y, ws.partials, ws.counters, rows, y_stride, stride_zs, x, x_stride),
                   (u_ptr, ids_.data_ptr(), y_ptr, ws.partials_ptr, ws.counters_ptr, rows, y_stride, stride_zs, x_ptr,
                    x_stride))
            return
        self.input(input_grid, stream, key, input_fixed, (x, ids_, ws.inputs, units, x_stride),
                   (x_ptr, ids_.data_ptr(), u_ptr, units, x_stride))
        matmul(grid, stream, key, fixed, (ws.inputs, ids_, y, ws.partials, ws.counters, rows, y_stride, stride_zs),
               (u_ptr, ids_.data_ptr(), y_ptr, ws.partials_ptr, ws.counters_ptr, rows, y_stride, stride_zs))


def group_launch(parts, bias: torch.Tensor | None = None) -> GroupLaunch | None:
    """One GroupLaunch for a fused layer's parts [(kernel, trellis, suh, svh, out_features)], or None where the
    parts cannot share one grid (one part, different rates or codebooks, FMA one-row rates, separate
    allocations): those keep a FusedLaunch per part."""
    kernels = [part[0] for part in parts]
    specs = {(k.spec.bits, k.spec.codebook, k.spec.size_k) for k in kernels}
    if len(parts) < 2 or len(specs) != 1 or kernels[0].spec.bits in FMA_ONE_ROW_BITS:
        return None
    if sum(k.spec.size_n for k in kernels) // BLOCK_N > GROUP_MAX_BLOCKS:
        return None
    trellis0 = parts[0][1]
    if any(p[1].untyped_storage().data_ptr() != trellis0.untyped_storage().data_ptr() or
           (p[1].data_ptr() - trellis0.data_ptr()) % 4 for p in parts):
        return None
    return GroupLaunch([p[1:] for p in parts], kernels[0].spec.bits, kernels[0].spec.codebook, bias)
