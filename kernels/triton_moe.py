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
output transform in the last split's epilogue). `bound.bind_moe` binds a projection once so repeated calls
skip Triton's argument binding; `moe_decode` binds per call.
"""

from __future__ import annotations

import torch

from exl3local.kernels.bound import FusedLaunch, bind_moe


def moe_decode(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, bits: float,
               codebook: str, ids: torch.Tensor, bias: torch.Tensor | None = None,
               bound: FusedLaunch | None = None) -> torch.Tensor:
    """y[t, j] = x_unit · W[ids[t, j]] (+ bias[ids[t, j]]) for every unit; see the module doc for layouts.
    `bound`: this projection's `bind_moe(trellis, suh, svh, bits, codebook, bias)`, made once."""
    tokens, top_k = ids.shape
    units = tokens * top_k
    if x.shape[0] == tokens:
        x_div = top_k
    elif x.shape[0] == units:
        x_div = 1
    else:
        raise ValueError(f"x has {x.shape[0]} rows; expected {tokens} (per token) or {units} (per unit)")
    if bound is None:
        bound = bind_moe(trellis, suh, svh, bits, codebook, bias)
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(units, bound.size_n, dtype=x.dtype, device=x.device)
    bound.launch(x, y, units, ids.reshape(-1), x_div)
    return y.view(tokens, top_k, -1)
