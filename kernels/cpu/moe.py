"""Routed experts on the CPU, not a Python loop over experts: every (token, expert) unit of a decode or verify step
in two library calls (gate and up of all units together, then down); a grouped step (a few to a hundred tokens)
likewise, its rows binned by expert so that each decoded weight serves up to GROUPED_UNIT_ROWS rows.

    experts = CpuExperts(w13_trellis, w13_suh, w13_svh, w2_trellis, w2_suh, w2_svh, proj)   # once per layer
    out = experts.units(xf, weights, ids)      # (T, padded hidden) fp32, routing weights applied
    out = experts.grouped(xf, weights, ids)    # the same, tokens binned by expert

Arenas as kernels/moe_layer.py documents them; gate and up are read as one stack of 2E projections (row 2e is
expert e's gate, 2e+1 its up), a zero-copy view that needs equal bits for both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from exl3local.kernels.cpu.ops import GROUPED_UNIT_ROWS, CpuExpertProjection


def refusal(proj: dict) -> str | None:
    """Why the stacked CPU unit path cannot serve these projections, or None."""
    if proj["gate"].bits != proj["up"].bits:
        return f"gate ({proj['gate'].bits:g} bits) and up ({proj['up'].bits:g} bits) differ: no stacked w13 view"
    return None


class CpuExperts:
    def __init__(self, w13_trellis, w13_suh, w13_svh, w2_trellis, w2_suh, w2_svh, proj: dict) -> None:
        gate, down = proj["gate"], proj["down"]
        E = w13_trellis.shape[0]
        self.hidden = down.size_n
        self.inter = gate.size_n
        self.w13 = CpuExpertProjection(w13_trellis.view(2 * E, *gate.trellis_shape), w13_suh.view(2 * E, gate.size_k),
                                       w13_svh.view(2 * E, gate.size_n), gate.bits, gate.codebook)
        self.w2 = CpuExpertProjection(w2_trellis, w2_suh, w2_svh, down.bits, down.codebook)

    def units(self, xf: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """xf (T, padded hidden) fp32, weights (T, top_k) fp32, ids (T, top_k) local expert ids (-1: another
        rank's) -> the routed sum (T, padded hidden) fp32."""
        tokens, top_k = ids.shape
        local = ids >= 0
        ids13 = torch.where(local[..., None], torch.stack((2 * ids, 2 * ids + 1), -1), -1).view(-1)
        gu = self.w13(xf, ids13, x_div=2 * top_k).view(tokens, top_k, 2, self.inter)
        h = (F.silu(gu[:, :, 0]) * gu[:, :, 1]).reshape(tokens * top_k, self.inter)
        y = self.w2(h, ids.reshape(-1)).view(tokens, top_k, self.hidden)
        return (y * torch.where(local, weights, 0.0)[..., None]).sum(1)

    def grouped(self, xf: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """As `units`, with the (token, expert) rows sorted by expert (stable: each token's sum keeps its j order
        across experts as the per-expert loop adds it) and cut into units of at most GROUPED_UNIT_ROWS rows."""
        tokens, top_k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        order = order[flat[order] >= 0]  # another rank's experts (-1) sort first; they add nothing here
        out = torch.zeros(tokens, self.hidden, dtype=torch.float32)
        rows = order.numel()
        if rows == 0:
            return out
        experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
        pieces = (counts + GROUPED_UNIT_ROWS - 1) // GROUPED_UNIT_ROWS
        first = torch.repeat_interleave(counts.cumsum(0) - counts, pieces)
        piece = torch.arange(int(pieces.sum())) - torch.repeat_interleave(pieces.cumsum(0) - pieces, pieces)
        begin = first + piece * GROUPED_UNIT_ROWS
        unit_ids = torch.repeat_interleave(experts, pieces)
        end = torch.tensor([rows])
        token_of = order // top_k
        # gate units over rows [0, rows), up units over [rows, 2 rows): both read the token's row of xf
        gu = self.w13.grouped(xf, torch.cat((token_of, token_of)), torch.cat((2 * unit_ids, 2 * unit_ids + 1)),
                              torch.cat((begin, begin + rows, 2 * end)))
        h = F.silu(gu[:rows]) * gu[rows:]
        y = self.w2.grouped(h, torch.arange(rows), unit_ids, torch.cat((begin, end)))
        return out.index_add_(0, token_of, y * weights.reshape(-1)[order, None].float())
