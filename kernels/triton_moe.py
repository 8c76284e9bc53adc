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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exl3local.kernels.bound import DirectLaunch, FusedLaunch, bind_moe

COMBINE_BLOCK = 512  # output columns per combine program


def moe_decode(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, bits: float,
               codebook: str, ids: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y[t, j] = x_unit · W[ids[t, j]] (+ bias[ids[t, j]]) for every unit, binding the projection for this one call;
    see the module doc for layouts. Repeated calls bind once (`bind_moe`) and run `moe_units`."""
    return moe_units(bind_moe(trellis, suh, svh, bits, codebook, bias), x, ids)


def moe_units(bound: FusedLaunch, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """moe_decode through a projection bound once (`bind_moe`): its weights are the only ones it knows."""
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
    bound.launch(x, y, units, ids.reshape(-1), x_div)
    return y.view(tokens, top_k, -1)


@triton.jit(do_not_specialize=["n_out"])
def _combine_kernel(y_ptr, w_ptr, ids_ptr, out_ptr, size_n, n_out, TOP_K: tl.constexpr, BN: tl.constexpr):
    """out[t, :n_out] = Σ_j w[t, j]·y[t·TOP_K + j] in j order, fp32, units of a negative id (another rank's
    expert) weighted 0."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = cols < n_out
    acc = tl.zeros((BN,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        unit = t * TOP_K + j
        w = tl.load(w_ptr + unit).to(tl.float32)
        w = tl.where(tl.load(ids_ptr + unit) >= 0, w, 0.0)
        acc += w * tl.load(y_ptr + unit.to(tl.int64) * size_n + cols, mask=mask, other=0.0).to(tl.float32)
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
