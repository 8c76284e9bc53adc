"""Grouped EXL3 MoE decode (Triton): T tokens × top-k experts as T·top-k independent (token, expert) units,
all in one matmul launch per projection, the routing ids read on the device (no host sync, graph-safe).

Layouts (the plugin stacks the per-expert checkpoint tensors once at load):
    trellis  int16 (E, k/16, n/16, 16*bits)   one projection of every expert; same bits/codebook for all
    suh      fp16 (E, k);  svh fp16 (E, n);  bias (E, n) or None
    ids      int (T, top_k) on the device       expert of each unit, unit = t*top_k + j
    x        (T, k) shared by a token's units (gate/up), or (T*top_k, k) one row per unit (down)
    y        (T, top_k, n) in x's dtype         routing weights and the sum over j are the caller's

One launch per projection (triton_fused.exl3_fused_kernel: each unit's input transform with its expert's
suh, the ring-order decode matmul with one unit per program in row 0 of its dot tile, split-K, and the
output transform in the last split's epilogue). `moe_decode` binds the projection per call; `bound.bind_moe`
binds it once and `moe_units` runs it, so repeated calls skip Triton's argument binding.

Many tokens (kernels/moe_layer.TILES_MIN_UNITS_PER_EXPERT): one unit per program decodes each expert's weights
once per unit. TileTable groups the units by expert on the device (one single-program launch, no host sync) and
the fused kernel's GROUPED mode gives each program a tile of up to 16 units of one expert, so a weight is decoded
once per tile. The grid is sized by a bound known from the shapes (max_tiles); tiles past the last do nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exl3local.kernels.bound import bind_moe
from exl3local.kernels.fused_launch import FusedLaunch
from exl3local.kernels.launcher import DirectLaunch
from exl3local.kernels.triton_sync import cta_barrier

COMBINE_BLOCK = 512  # output columns per combine program
TABLE_BLOCK = 1024  # units per step of the tile-table kernel (one program walks them all)


def max_tiles(units: int, experts: int, tile_rows: int) -> int:
    """The grouped grid's row dimension: a bound on the tiles of `units` units over `experts` experts, known
    without reading the ids (each expert's last tile may be partial; every tile holds at least one unit)."""
    return min(units, -(-units // tile_rows) + experts)


@triton.jit(do_not_specialize=["units", "tiles"])
def _tile_table_kernel(ids_ptr, cnt_ptr, out_ptr, units, tiles, experts, TILE: tl.constexpr, EB: tl.constexpr,
                       BLOCK: tl.constexpr):
    """out (int32) = [order (units) | skey (units) | starts (tiles) | ranks (units, scratch)]: the units grouped by
    expert (a counting sort: remote units, ids < 0, first, then expert 0, 1, ...), their experts, and the first
    grouped position of each tile of up to TILE units of one expert; starts past the last tile hold `units`.
    cnt_ptr: experts + 1 int32, zero on entry and on exit (bin `experts` counts the remote units).

    One program, four passes with a CTA barrier between (triton_sync's: the passes hand over global memory): rank
    each unit within its bin by an atomic add on the bin's count (the order inside a bin is whatever the atomics
    give: each unit's output depends on its own row only, so the results do not), prefix sums into bin starts and
    tiles, scatter, reset the counts."""
    for b in range(0, units, BLOCK):
        p = b + tl.arange(0, BLOCK)
        valid = p < units
        key = tl.load(ids_ptr + p, mask=valid, other=0).to(tl.int32)
        key = tl.where(key < 0, experts, key)
        tl.store(out_ptr + 2 * units + tiles + p, tl.atomic_add(cnt_ptr + key, 1, mask=valid), mask=valid)
    cta_barrier(cnt_ptr, units)
    e = tl.arange(0, EB)
    count = tl.load(cnt_ptr + e, mask=e < experts, other=0)
    start = tl.cumsum(count, 0) - count + (units - tl.sum(count, 0))  # the remote units come first
    per_expert = (count + TILE - 1) // TILE
    first_tile = tl.cumsum(per_expert, 0) - per_expert
    for i in range(0, tl.max(per_expert, 0)):
        tl.store(out_ptr + 2 * units + first_tile + i, start + TILE * i, mask=i < per_expert)
    used = tl.sum(per_expert, 0)
    for b in range(0, tiles, BLOCK):
        t = b + tl.arange(0, BLOCK)
        tl.store(out_ptr + 2 * units + t, units, mask=(t >= used) & (t < tiles))
    cta_barrier(cnt_ptr, units)  # every thread has read the counts before they become bin starts
    tl.store(cnt_ptr + e, start, mask=e < experts)
    tl.store(cnt_ptr + experts, 0)  # the remote bin starts at position 0
    cta_barrier(cnt_ptr, units)
    for b in range(0, units, BLOCK):
        p = b + tl.arange(0, BLOCK)
        valid = p < units
        key = tl.load(ids_ptr + p, mask=valid, other=0).to(tl.int32)
        key = tl.where(key < 0, experts, key)
        pos = tl.load(cnt_ptr + key, mask=valid, other=0) + tl.load(out_ptr + 2 * units + tiles + p, mask=valid)
        tl.store(out_ptr + pos, p, mask=valid)
        tl.store(out_ptr + units + pos, tl.where(key == experts, -1, key), mask=valid)
    cta_barrier(cnt_ptr, units)
    tl.store(cnt_ptr + e, 0, mask=e <= experts)


TABLE_VARYING = ("ids_ptr", "out_ptr", "units", "tiles")


class TileTable:
    """The tile table of one MoE layer's calls (experts fixed): its bin counts (zero between calls) and the table
    kernel's launch, bound once (direct launch where the fused launches have one)."""

    def __init__(self, experts: int, tile_rows: int, device: torch.device, like: FusedLaunch | None = None) -> None:
        self.experts, self.tile_rows = experts, tile_rows
        self.counts = torch.zeros(experts + 1, dtype=torch.int32, device=device)
        self.launch = DirectLaunch(_tile_table_kernel, TABLE_VARYING, like is None or like.fused.hooks is None)
        self.fixed = dict(cnt_ptr=self.counts, experts=experts, TILE=tile_rows,
                          EB=triton.next_power_of_2(experts + 1), BLOCK=TABLE_BLOCK)

    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(table, tiles) for the fused kernel's GROUPED mode over ids (T, top_k), contiguous. tiles = max_tiles(...):
        the grid's bound, fixed by the shapes alone, so nothing here waits for the device."""
        units = ids.numel()
        tiles = max_tiles(units, self.experts, self.tile_rows)
        table = torch.empty(3 * units + tiles, dtype=torch.int32, device=ids.device)
        key = (ids.dtype, ids.data_ptr() % 16 == 0)
        self.launch((1, 1, 1), _stream(ids.device), key, self.fixed, (ids, table, units, tiles),
                    (ids.data_ptr(), table.data_ptr(), units, tiles))
        return table, tiles


def expert_tiles(ids: torch.Tensor, experts: int, tile_rows: int) -> tuple[torch.Tensor, int]:
    """TileTable for one call (tests, benches): see TileTable.__call__."""
    return TileTable(experts, tile_rows, ids.device)(ids.contiguous())


def moe_decode(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, bits: float,
               codebook: str, ids: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y[t, j] = x_unit · W[ids[t, j]] (+ bias[ids[t, j]]) for every unit, binding the projection for this one call;
    see the module doc for layouts. Repeated calls bind once (`bind_moe`) and run `moe_units`."""
    return moe_units(bind_moe(trellis, suh, svh, bits, codebook, bias), x, ids)


def moe_units(bound: FusedLaunch, x: torch.Tensor, ids: torch.Tensor,
              tiles: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """moe_decode through a projection bound once (`bind_moe`): its weights are the only ones it knows. With
    `tiles` (expert_tiles of these ids) the matmul runs over tiles of expert-sorted units."""
    tokens, top_k = ids.shape
    units = tokens * top_k
    if x.shape[0] == tokens:
        x_div = top_k
    elif x.shape[0] == units:
        x_div = 1
    else:
        raise ValueError(f"x has {x.shape[0]} rows; expected {tokens} (per token) or {units} (per unit)")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(units, bound.size_n, dtype=x.dtype, device=x.device)
    bound.launch(x, y, units, ids.reshape(-1), x_div, tiles=tiles)
    return y.view(tokens, top_k, -1)


@triton.jit(do_not_specialize=["n_out"])
def _combine_kernel(y_ptr, w_ptr, ids_ptr, out_ptr, size_n, n_out, TOP_K: tl.constexpr, BN: tl.constexpr):
    """out[t, :n_out] = Σ_j w[t, j]·y[t·TOP_K + j] in j order, fp32, units of a negative id (another rank's
    expert) left out."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = cols < n_out
    acc = tl.zeros((BN,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        unit = t * TOP_K + j
        w = tl.load(w_ptr + unit).to(tl.float32)
        # a remote unit's y row may never be written (the grouped path gives it no tile): never read it
        limit = tl.where(tl.load(ids_ptr + unit) >= 0, n_out, 0)
        y = tl.load(y_ptr + unit.to(tl.int64) * size_n + cols, mask=cols < limit, other=0.0)
        acc += w * y.to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * n_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


COMBINE_VARYING = ("y_ptr", "w_ptr", "ids_ptr", "out_ptr", "n_out")


def bind_combine(like: FusedLaunch, top_k: int) -> DirectLaunch:
    """The combine launch, bound like `like`'s launches (direct launcher or Triton's own path)."""
    return DirectLaunch(_combine_kernel, COMBINE_VARYING, like.fused.hooks is None)


def combine_units(y: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, n_out: int, dtype: torch.dtype,
                  launch: DirectLaunch | None = None) -> torch.Tensor:
    """(T, n_out) in dtype: each token's unit outputs y (T·top_k, n) fp32 weighted by weights (T, top_k) and
    summed over j; ids (T, top_k) mark remote units (< 0). weights and ids contiguous."""
    tokens, top_k = ids.shape
    out = torch.empty(tokens, n_out, dtype=dtype, device=y.device)
    if tokens == 0:
        return out
    launch = launch or DirectLaunch(_combine_kernel, COMBINE_VARYING, True)
    grid = (tokens, triton.cdiv(n_out, COMBINE_BLOCK), 1)
    key = (y.dtype, weights.dtype, ids.dtype, dtype, y.shape[1])  # the grid and n_out vary freely
    launch(grid, _stream(y.device), key, dict(size_n=y.shape[1], TOP_K=top_k, BN=COMBINE_BLOCK), (y, weights, ids, out, n_out),
           (y.data_ptr(), weights.data_ptr(), ids.data_ptr(), out.data_ptr(), n_out))
    return out


def _stream(device: torch.device) -> int:
    if device.type == "cpu":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return triton.runtime.driver.active.get_current_stream(index)
