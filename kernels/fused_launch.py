"""One EXL3 projection's launches bound (FusedLaunch): triton_hadamard's input transform, then triton_fused's decode
matmul with the output transform in its epilogue, with weights, grids, split-K and scratch fixed at load time, so a
decode call does no Python-side shape logic, no scratch allocation and no Triton argument binding. Small groups at
decode rows are one launch: the matmul programs make their own input transform (ONE_LAUNCH_MAX_ROWS,
ONE_LAUNCH_MAX_WORK). kernels/bound.py builds whole layers (BoundLinear) and MoE projections (bind_moe) on it; a
fused layer's parts in one grid: kernels/bound_group.py (GroupLaunch).

Rows: up to MAX_ROWS one 16-row dot tile (the FMA ring kernel for one row at FMA_ONE_ROW_BITS); above, with
EXL3LOCAL_TILED_MAX_ROWS set, the same fused kernel with TILE_ROWS-row tiles (triton_gemv.tiled_config: each
weight decoded once per 64 rows, never written out), up to that many rows. Launching and scratch:
kernels/launcher.py (DirectLaunch, Workspace).
"""

from __future__ import annotations

import torch

from exl3local import env
from exl3local.kernels.hadamard import HADAMARD_BLOCK, HADAMARD_SCALE
from exl3local.kernels.launcher import DirectLaunch, Workspace, launch_mode
from exl3local.kernels.selftest import one_launch_refusal
from exl3local.kernels.triton_decode import FRAGMENT_KWIDTH, lanes_per_superlane, rate_constants, words
from exl3local.kernels.triton_fused import FUSED_BLOCK_N_TILES, exl3_fused_kernel, split_loads
from exl3local.kernels.triton_gemv import (
    FMA_ONE_ROW_BITS, TILE_ROWS, TILED_PROGRAMS_PER_CORE, choose_splits, compute_units, exl3_gemv_ring_kernel,
    ring_config, ring_dot_config, tiled_config,
)
from exl3local.kernels.triton_hadamard import NATURAL, _input_kernel, hadamard_operands, rows_per_program

MAX_ROWS = 16  # one dot tile of rows; more rows go to the tiled path if on, else the reconstruct path
# Dense rows up to this many: the matmul program computes its own input transform (triton_fused IN_X), one launch per
# projection or grouped layer instead of two. 0: the separate input-transform launch (the bench's "before").
ONE_LAUNCH_MAX_ROWS = MAX_ROWS
# ...where the transform work every column block repeats, column blocks x k, is at most this: the largest group that
# measured a win. On the H200 (s11a, docs/PERF.md "Session 11") one launch everywhere won every 35B-A3B decode step (its
# groups up to in_proj_qkvz's 96 blocks x 2048) and lost every 27B one (groups 40 x 6144 to 136 x 5120: +8 % at 1 row,
# +32 % at 16). Arc, where a launch costs far more, may gain from a higher limit: unmeasured.
ONE_LAUNCH_MAX_WORK = 96 * 2048
# MoE projections over one (token, expert) unit per program (not expert-sorted tiles) likewise, up to this many units
# per launch (gate/up pairs count two; 0: the input-transform launch, the bench's "before"). 35B-A3B step on the H200
# (s11d), graph, against its MoE in two launches: 1 token (8 / 16 units in down / gate-up) 4.54 vs 4.70 ms, 4 tokens
# (32 / 64) 6.51 vs 6.70, 16 tokens (128 / 256) 19.30 vs 18.78: a loss there.
ONE_LAUNCH_MAX_UNITS = 64

BLOCK_N = FUSED_BLOCK_N_TILES * 16
# Register cap (CUDA maxnreg) of a 4-bit decode matmul launch whose grid is larger than one wave at 64 registers a
# thread (ONE_WAVE_PROGRAMS programs of 4 warps per SM: 64K registers): 56 lets 9 programs stay per SM. H200, per group
# graph µs against the launches as built (s16b, docs/PERF.md "Session 16"): 27B gate_up (1088 programs on 132 SMs)
# -4.2 to -4.8 %, 35B-A3B qkv_proj (1152) -11 to -15 %, its MoE units (2048) -2.4 to -5 %; grids that fit lost 1-12 %
# with the cap (a tighter allocation schedules worse), so they keep theirs. XPU has no such option.
WAVE_MAX_REGISTERS = {4: 56}
ONE_WAVE_PROGRAMS = 8


def fragment_order(bits: float, device: torch.device) -> int:
    """FRAG of the decode matmul (up to MAX_ROWS rows; 0: ring order): the weight operand in the matrix unit's fragment
    order (triton_decode.fragment_operand, rows for the installed Triton's operand width: FRAGMENT_KWIDTH) where a
    lane's decoded weights are a fragment (G = 1: 4 and 8 bits), except on
    XPU. There Intel's backend (3.3, offline Xe2 compile, compile_kernels' IR) stages Ŵ through shared local memory in
    either order, in this one with half-width stores (16 <2 x half> instead of 8 <4 x half>) and u read back one fp16
    at a time (16 loads instead of one of 16): more work per K step, so XPU keeps the ring order (unverified on Arc).
    The tiled path (8 warps: not the fragment's layout) keeps it everywhere."""
    return FRAGMENT_KWIDTH if device.type != "xpu" and lanes_per_superlane(bits) == 1 else 0


def tiled_max_rows() -> int:
    """Rows up to which bound launches serve a call, TILE_ROWS-row tiles above MAX_ROWS (EXL3LOCAL_TILED_MAX_ROWS;
    MAX_ROWS or less, the default: the tiled path is off and more rows take the reconstruct path)."""
    try:
        return max(MAX_ROWS, int(env.TILED_MAX_ROWS.get()))
    except ValueError:
        return MAX_ROWS


INPUT_VARYING = ("x_ptr", "ids_ptr", "u_ptr", "M", "stride_xm")
FUSED_VARYING = ("u_ptr", "ids_ptr", "y_ptr", "z_ptr", "cnt_ptr", "M", "stride_ym", "stride_zs")
ONE_LAUNCH_VARYING = FUSED_VARYING + ("x_ptr", "stride_xm")
FMA_VARYING = ("u_ptr", "y_ptr", "z_ptr", "cnt_ptr", "M", "stride_ym", "stride_zs")


class FusedLaunch:
    """One projection (or, with experts=True, one projection of every expert, stacked) bound: `launch` runs
    the input transform and the decode matmul with the output transform in its epilogue: the ring dot kernel
    (triton_fused), or for one row at FMA_ONE_ROW_BITS the FMA ring kernel (triton_gemv), which measured
    faster there."""

    def __init__(self, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, bits: float, codebook: str,
                 bias: torch.Tensor | None = None, experts: bool = False) -> None:
        self.device = trellis.device
        self.size_k = trellis.shape[-3] * 16
        self.size_n = trellis.shape[-2] * 16
        self.k_blocks = self.size_k // HADAMARD_BLOCK
        self.n_blocks = self.size_n // BLOCK_N
        _, block_kt, num_warps = ring_dot_config(bits)
        self.k_steps = self.size_k // 16 // block_kt
        self.experts = experts
        # False where the self-test's one-launch check failed on this device: decode rows take two launches.
        self.one_launch_on = one_launch_refusal(self.device) is None
        plain, self.stream = launch_mode(exl3_fused_kernel, self.device)
        self.input = DirectLaunch(_input_kernel, INPUT_VARYING, plain)
        self.fused = DirectLaunch(exl3_fused_kernel, FUSED_VARYING, plain, num_warps=num_warps, num_stages=1)
        self.one = DirectLaunch(exl3_fused_kernel, ONE_LAUNCH_VARYING, plain, num_warps=num_warps, num_stages=1)
        self.fma = None if experts or bits not in FMA_ONE_ROW_BITS else DirectLaunch(exl3_gemv_ring_kernel,
                                                                                      FMA_VARYING, plain)
        # More than MAX_ROWS rows (not MoE units): the same kernel with TILE_ROWS-row tiles, own warps and KT.
        self.max_rows = MAX_ROWS if experts else tiled_max_rows()
        tile_kt, tile_warps = tiled_config(bits)
        self.tiled = DirectLaunch(exl3_fused_kernel, FUSED_VARYING, plain, num_warps=tile_warps, num_stages=1) \
            if self.max_rows > MAX_ROWS else None
        # Keep the bound tensors referenced: the compiled argument lists hold only their addresses.
        self.input_fixed = dict(suh_ptr=suh, had_ptr=hadamard_operands(self.device)[NATURAL.value],
                                size_k=self.size_k, HAS_IDS=experts, SCALE=HADAMARD_SCALE, PAIRS=False, GLU=False, RB=1,
                                PARTS=1)
        self.fused_fixed = dict(w_ptr=words(trellis), svh_ptr=svh, bias_ptr=bias if bias is not None else svh,
                                tiles_n=self.size_n // 16, k_steps=self.k_steps,
                                expert_words=trellis[0].numel() // 2 if experts else 0,
                                **rate_constants(bits, codebook), HAS_IDS=experts, HAS_BIAS=bias is not None,
                                SCALE=HADAMARD_SCALE, BM=MAX_ROWS, KT=block_kt, parts_ptr=svh, PARTS=0, PAIRS=False,
                                FLAT=True, GROUPED=False, x_ptr=svh, suh_ptr=suh, stride_xm=0, k_valid=self.size_k,
                                x_div=1, IN_X=False, GLU=False, FRAG=fragment_order(bits, trellis.device))
        self.fma_fixed = dict(w_ptr=self.fused_fixed["w_ptr"], svh_ptr=svh, bias_ptr=self.fused_fixed["bias_ptr"],
                              size_k=self.size_k, tiles_n=self.size_n // 16, **rate_constants(bits, codebook),
                              EPILOGUE=True, HAS_BIAS=bias is not None, SCALE=HADAMARD_SCALE)
        self.fused_fixed["PF"] = self.fused_fixed["FRAG"] > 0  # the next K step's words in flight (triton_ring_dot)
        self.tiled_fixed = dict(self.fused_fixed, BM=TILE_ROWS, KT=tile_kt, k_steps=self.size_k // 16 // tile_kt,
                                FRAG=0, PF=False)
        self.bits = bits
        self.splits: dict[int, tuple[int, int]] = {}
        self.tiled_splits: dict[int, tuple[int, int]] = {}
        self.plans: dict[tuple, tuple] = {}
        self.loads: int | None = None  # SL forced on every split-K matmul (tests, the bench); None: split_loads
        self.wave_cap = WAVE_MAX_REGISTERS.get(bits) if self.device.type == "cuda" else None
        self.capped: dict[int, DirectLaunch] = {}  # id(launch) -> its twin under wave_cap

    def loads_for(self, splits: int) -> int:
        """SL of a matmul launch of `splits` K splits (triton_fused.split_loads unless self.loads forces one)."""
        return self.loads or split_loads(splits)

    def split_for(self, m_blocks: int) -> tuple[int, int]:
        """(splits, K steps per split) of the dot kernel for m_blocks row blocks (units)."""
        split = self.splits.get(m_blocks)
        if split is None:
            blocks = m_blocks * self.n_blocks
            splits = choose_splits(blocks, self.k_steps, self.device, self.programs_per_core(blocks))
            split = self.splits[m_blocks] = (splits, self.k_steps // splits)
        return split

    def programs_per_core(self, blocks: int) -> float | None:
        """Split-K target of this launch's dot kernel over `blocks` blocks (choose_splits' per_core; None: default)."""
        return None

    def replan(self) -> None:
        """Forget the call plans and the direct launches' argument templates, after a change to the fixed
        arguments (splits, FLAT: the bench's sweeps); the next call of each signature binds afresh."""
        self.plans.clear()
        for launch in (self.input, self.fused, self.one, self.tiled, self.fma, *self.capped.values()):
            if launch is not None:
                launch.compiled.clear()

    def for_grid(self, launch: DirectLaunch, grid: tuple[int, int, int]) -> DirectLaunch:
        """launch, or its twin under wave_cap registers where the grid is more than one wave of ONE_WAVE_PROGRAMS
        programs per compute unit (WAVE_MAX_REGISTERS)."""
        if self.wave_cap is None or grid[0] * grid[1] * grid[2] <= ONE_WAVE_PROGRAMS * compute_units(self.device):
            return launch
        twin = self.capped.get(id(launch))
        if twin is None:
            twin = self.capped[id(launch)] = DirectLaunch(launch.fn, launch.varying, launch.hooks is None,
                                                          **dict(launch.options, maxnreg=self.wave_cap))
        return twin

    def tiled_split_for(self, m_blocks: int) -> tuple[int, int]:
        """(splits, K steps per split) of the tiled path for m_blocks row tiles."""
        split = self.tiled_splits.get(m_blocks)
        if split is None:
            steps = self.tiled_fixed["k_steps"]
            splits = choose_splits(m_blocks * self.n_blocks, steps, self.device, TILED_PROGRAMS_PER_CORE)
            split = self.tiled_splits[m_blocks] = (splits, steps // splits)
        return split

    def tiled_grid(self, rows: int) -> tuple[int, int, int]:
        """(column blocks, splits, row tiles) of the tiled path for `rows` rows."""
        m_blocks = -(-rows // TILE_ROWS)
        return self.n_blocks, self.tiled_split_for(m_blocks)[0], m_blocks

    def fma_split(self) -> tuple[int, int, int]:
        """(column blocks, splits, BNT) of the one-row FMA kernel."""
        _, block_nt = ring_config(1, self.bits)
        blocks = -(-(self.size_n // 16) // block_nt)
        return blocks, choose_splits(blocks, self.size_k // 16, self.device), block_nt

    def needs(self, rows: int) -> tuple[int, int, int]:
        """Workspace elements (inputs, partials, counters) for `rows` rows (units)."""
        if rows > MAX_ROWS and not self.experts:
            blocks, splits, m_blocks = self.tiled_grid(rows)
            return rows * self.size_k, splits * rows * self.size_n, blocks * m_blocks
        m_blocks = rows if self.experts else -(-rows // MAX_ROWS)
        splits, _ = self.split_for(m_blocks)
        blocks = m_blocks * self.n_blocks
        if self.fma is not None:
            fma_blocks, fma_splits, _ = self.fma_split()
            splits, blocks = max(splits, fma_splits), max(blocks, fma_blocks)
        return rows * self.size_k, splits * rows * self.size_n, blocks

    def reserve(self, rows: int | None = None) -> None:
        """Size the current stream's workspace for up to `rows` rows (units; default: the most this launch serves)
        now, before any graph capture."""
        stream = self.stream()
        for r in {rows or MAX_ROWS, rows or self.max_rows}:
            Workspace.get(self.device, stream, *self.needs(r))

    def _plan(self, key: tuple) -> tuple:
        """Grids, workspace needs and the fixed arguments of both launches for one call signature."""
        rows, _, _, _, _, x_div, k_valid, n_out, _, pairs, glu, tiles, one = key
        if not self.experts and rows > self.max_rows:
            raise ValueError(f"{rows} rows: more than this launch serves ({self.max_rows}, EXL3LOCAL_TILED_MAX_ROWS)")
        m_blocks = rows if self.experts else 1
        splits, per_split = self.split_for(m_blocks)
        block_m = rows_per_program(rows)
        input_fixed = dict(self.input_fixed, x_div=x_div, k_valid=k_valid, BM=block_m, PAIRS=pairs, GLU=glu)
        needs = self.needs(rows)
        if tiles:  # MoE over expert-sorted tiles: tile rows (x2 with pairs) instead of units in the grid
            m_blocks = tiles * (2 if pairs else 1)
            splits, per_split = self.split_for(m_blocks)
            needs = (needs[0], splits * rows * self.size_n, m_blocks * self.n_blocks)
            grid = (self.n_blocks, splits, m_blocks)
            matmul = (self.for_grid(self.fused, grid), grid,
                      dict(self.fused_fixed, n_out=n_out, steps_per_split=per_split, SPLIT=splits > 1, PAIRS=pairs,
                           HAS_IDS=False, GROUPED=True, SL=self.loads_for(splits)))
        elif rows > MAX_ROWS and not self.experts:
            blocks, splits, m_blocks = self.tiled_grid(rows)
            per_split = self.tiled_fixed["k_steps"] // splits
            matmul = (self.tiled, (blocks, splits, m_blocks),
                      dict(self.tiled_fixed, n_out=n_out, steps_per_split=per_split, SPLIT=splits > 1, PAIRS=pairs,
                           SL=self.loads_for(splits)))
        elif rows == 1 and self.fma is not None and not pairs:
            blocks, splits, block_nt = self.fma_split()
            matmul = (self.fma, (blocks, splits, 1),
                      dict(self.fma_fixed, n_out=n_out, tk_per_split=self.size_k // 16 // splits, BM=1, BNT=block_nt))
        else:
            fixed = dict(self.fused_fixed, n_out=n_out, steps_per_split=per_split, SPLIT=splits > 1, PAIRS=pairs,
                         SL=self.loads_for(splits))
            grid = (self.n_blocks, splits, m_blocks)
            if one:  # the matmul programs transform x themselves (triton_fused IN_X)
                return self._keep(key, (None, needs, None, self.for_grid(self.one, grid), grid,
                                        dict(fixed, IN_X=True, k_valid=k_valid, x_div=x_div, GLU=glu)))
            matmul = (self.for_grid(self.fused, grid), grid, fixed)
        return self._keep(key, ((-(-rows // block_m), self.k_blocks, 1), needs, input_fixed, *matmul))

    def _keep(self, key: tuple, plan: tuple) -> tuple:
        self.plans[key] = plan
        return plan

    def launch(self, x: torch.Tensor, y: torch.Tensor, rows: int, ids: torch.Tensor | None = None, x_div: int = 1,
               k_valid: int | None = None, n_out: int | None = None, pairs: bool = False, glu: bool = False,
               tiles: tuple[torch.Tensor, int] | None = None) -> None:
        """y[:rows, :n_out] = the projection of x's rows (MoE: of unit r = x[r // x_div] through expert ids[r]);
        x has k_valid features (unit stride), y's columns have unit stride. MoE only: `pairs`, unit r runs
        expert row 2·ids[r // 2] + r % 2 (gate/up of a stacked w13); `glu`, unit r's input is silu(x[2r]) ⊙
        x[2r + 1] (x_div 1); `tiles`, triton_moe.expert_tiles' (table, tiles) of these ids: the matmul runs over
        tiles of expert-sorted units (GROUPED) instead of one unit per program."""
        x_ptr, y_ptr = x.data_ptr(), y.data_ptr()
        key = (rows, x.dtype, y.dtype, x_ptr % 16 == 0, y_ptr % 16 == 0, x_div,
               self.size_k if k_valid is None else k_valid, self.size_n if n_out is None else n_out,
               None if ids is None else (ids.dtype, ids.data_ptr() % 16 == 0), pairs, glu, tiles[1] if tiles else 0,
               self.one_launch_on
               and (rows <= ONE_LAUNCH_MAX_UNITS and not tiles if self.experts else rows <= ONE_LAUNCH_MAX_ROWS)
               and self.n_blocks * self.size_k <= ONE_LAUNCH_MAX_WORK)
        input_grid, needs, input_fixed, matmul, grid, fixed = self.plans.get(key) or self._plan(key)
        stream = self.stream()
        ws = Workspace._live.get((self.device, stream))
        if ws is None or not ws.holds(*needs):
            ws = Workspace.get(self.device, stream, *needs)
        ids_ = ids if ids is not None else ws.counters  # any device pointer: HAS_IDS=False never reads it
        ids_ptr, u_ptr = ids_.data_ptr(), ws.inputs_ptr
        x_stride, y_stride, stride_zs = x.stride(0), y.stride(0), rows * self.size_n
        if input_grid is None:  # one launch: the matmul programs transform x themselves (IN_X)
            matmul(grid, stream, key, fixed,
                   (ws.inputs, ids_, y, ws.partials, ws.counters, rows, y_stride, stride_zs, x, x_stride),
                   (u_ptr, ids_ptr, y_ptr, ws.partials_ptr, ws.counters_ptr, rows, y_stride, stride_zs, x_ptr,
                    x_stride))
            return
        self.input(input_grid, stream, key, input_fixed, (x, ids_, ws.inputs, rows, x_stride),
                   (x_ptr, ids_ptr, u_ptr, rows, x_stride))
        if tiles:
            ids_, ids_ptr = tiles[0], tiles[0].data_ptr()
        if matmul is not self.fma:
            matmul(grid, stream, key, fixed, (ws.inputs, ids_, y, ws.partials, ws.counters, rows, y_stride, stride_zs),
                   (u_ptr, ids_ptr, y_ptr, ws.partials_ptr, ws.counters_ptr, rows, y_stride, stride_zs))
        else:
            matmul(grid, stream, key, fixed, (ws.inputs, y, ws.partials, ws.counters, rows, y_stride, stride_zs),
                   (u_ptr, y_ptr, ws.partials_ptr, ws.counters_ptr, rows, y_stride, stride_zs))
