"""Grouped EXL3 MoE decode (Triton): T tokens × top-k experts as T·top-k independent (token, expert) units,
all in one matmul launch per projection, the routing ids read on the device (no host sync, graph-safe).

Layouts (the plugin stacks the per-expert checkpoint tensors once at load):
    trellis  int16 (E, k/16, n/16, 16*bits)   one projection of every expert; same bits/codebook for all
    suh      fp16 (E, k);  svh fp16 (E, n);  bias (E, n) or None
    ids      int (T, top_k) on the device       expert of each unit, unit = t*top_k + j
    x        (T, k) shared by a token's units (gate/up), or (T*top_k, k) one row per unit (down)
    y        (T, top_k, n) in x's dtype         routing weights and the sum over j are the caller's

Three launches per projection: the per-unit input transform (each unit has its expert's suh), the decode
matmul (triton_gemv.exl3_ring_dot_kernel, one unit per program in row 0 of its dot tile, split-K for
parallelism; it beat the FMA ring kernel on these units: 8.9 vs 9.6 µs at T=1, 26 vs 32 µs at T=4 per
projection on the H200), and the per-unit output transform that also reduces the split-K partials.
"""

from __future__ import annotations

import torch

from exl3local.kernels.triton_gemv import ring_dot_config, ring_dot_partials
from exl3local.kernels.triton_hadamard import input_transform, output_transform



def moe_decode(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, bits: float,
               codebook: str, ids: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y[t, j] = x_unit · W[ids[t, j]] (+ bias[ids[t, j]]) for every unit; see the module doc for layouts."""
    tokens, top_k = ids.shape
    units = tokens * top_k
    if x.shape[0] == tokens:
        x_div = top_k
    elif x.shape[0] == units:
        x_div = 1
    else:
        raise ValueError(f"x has {x.shape[0]} rows; expected {tokens} (per token) or {units} (per unit)")
    if trellis.dim() != 4 or suh.dim() != 2 or svh.dim() != 2:
        raise ValueError("MoE tensors must be stacked per expert: trellis (E, k/16, n/16, w), suh (E, k), svh (E, n)")
    flat_ids = ids.reshape(-1).contiguous()
    u = input_transform(x.contiguous(), suh, flat_ids, x_div, rows=units)
    block_nt, block_kt, warps = ring_dot_config(bits)  # one unit per program: each has its own expert
    z = ring_dot_partials(u, trellis, bits, codebook, 16, block_nt, block_kt, ids=flat_ids, num_warps=warps)
    y = output_transform(z, svh, bias, x.dtype, flat_ids)
    return y.view(tokens, top_k, -1)
