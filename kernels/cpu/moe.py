"""Routed experts on the CPU, not a Python loop over experts: every (token, expert) unit of a decode or verify step
in two library calls (gate and up of all units together, then down); a grouped step (a few to a hundred tokens)
likewise, its rows binned by expert: experts with up to ops.gemv_max_rows rows (where the GEMV beats the GEMM path:
24 on the AVX2 tiers and Intel's AVX-512 CPUs without AMX, 8 with AMX, 3 on the portable tier; before the own GEMM
MOE_UNIT_ROWS_OWN_GEMM) as units (each decoded weight
serves all of the expert's rows), busier experts one at a time through CpuLinear's GEMM path.

    experts = CpuExperts(w13_trellis, w13_suh, w13_svh, w2_trellis, w2_suh, w2_svh, proj)   # once per layer
    out = experts.units(xf, weights, ids)      # (T, padded hidden) fp32, routing weights applied
    out = experts.grouped(xf, weights, ids)    # the same, tokens binned by expert

Arenas as kernels/moe_layer.py documents them; gate and up are read as one stack of 2E projections (row 2e is
expert e's gate, 2e+1 its up), a zero-copy view that needs equal bits for both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from exl3local.kernels.cpu import ops
from exl3local.kernels.cpu.ops import CpuLinear

# Units up to this many rows where the own GEMM serves past the GEMV (ops.GEMV_MAX_ROWS_OWN_GEMM, 5 since session 19):
# an expert taken out of the units is a CpuLinear call of its own. At the fixtures' and a 30B-A3B layer's expert sizes
# (bench/cpu_moe_units.py, Zen 4, 1 thread; its rounds vary by ~10 %): units up to 5 rows took 1.10-1.20x the time of
# units up to 8 at 16-32 tokens, units up to 15 took 1.19x at 128 tokens (42 experts with 9-15 rows), even elsewhere.
MOE_UNIT_ROWS_OWN_GEMM = 8


class CpuExpertProjection:
    """One projection of every expert, stacked: trellis (E, k/16, n/16, w), suh (E, k), svh (E, n). A call runs
    any number of (row, expert) units in one library call: each unit is the one-pass GEMV of its expert."""

    def __init__(self, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, bits: float, codebook: str) -> None:
        if not trellis.is_contiguous():
            raise ValueError("the CPU kernel reads the expert trellises as stored: they must be contiguous")
        ops.bind_operands(self, ops.library(), trellis, trellis.shape[1], trellis.shape[2], suh, svh, bits, codebook)
        # Rows up to which an expert runs as a unit of grouped(): where CpuLinear's GEMV would serve them too, except
        # before the own GEMM (MOE_UNIT_ROWS_OWN_GEMM).
        self.unit_rows = MOE_UNIT_ROWS_OWN_GEMM if ops.own_gemm_serves(self.lib) else ops.gemv_max_rows(self.lib)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, x_div: int = 1) -> torch.Tensor:
        """Unit i = row x[i // x_div] through expert ids[i] (< 0: another rank's, its row stays zero):
        x (rows, k) -> y (len(ids), n) fp32."""
        x = x.float().contiguous() if x.dtype != torch.float32 or not x.is_contiguous() else x
        ids = ids.to(torch.int32).contiguous()
        units = ids.numel()
        y = torch.zeros(units, self.size_n, dtype=torch.float32)
        u = torch.empty(units, self.size_k, dtype=torch.float32)
        self.lib.exl3_cpu_moe(self.trellis.data_ptr(), self.tiles_k, self.tiles_n, self.bits2, self.codebook,
                              self.lut_ptr, x.data_ptr(), x_div, ids.data_ptr(), units, self.suh.data_ptr(),
                              self.svh.data_ptr(), u.data_ptr(), y.data_ptr(), torch.get_num_threads())
        return y

    def grouped(self, x: torch.Tensor, xrow: torch.Tensor, ids: torch.Tensor, start: torch.Tensor,
                max_rows: int) -> torch.Tensor:
        """Unit i = rows start[i]:start[i+1] (at most max_rows, which sizes the GEMV's accumulators) through expert
        ids[i] (>= 0), row r's input being x[xrow[r]]: x (rows, k) -> y (start[-1], n) fp32, in one library call."""
        x = x.float().contiguous() if x.dtype != torch.float32 or not x.is_contiguous() else x
        xrow, ids, start = (t.to(torch.int32).contiguous() for t in (xrow, ids, start))
        rows = xrow.numel()
        y = torch.empty(rows, self.size_n, dtype=torch.float32)
        u = torch.empty(rows, self.size_k, dtype=torch.float32)
        self.lib.exl3_cpu_moe_grouped(self.trellis.data_ptr(), self.tiles_k, self.tiles_n, self.bits2, self.codebook,
                                      self.lut_ptr, x.data_ptr(), xrow.data_ptr(), ids.data_ptr(), start.data_ptr(),
                                      ids.numel(), max_rows, self.suh.data_ptr(), self.svh.data_ptr(),
                                      u.data_ptr(), y.data_ptr(), torch.get_num_threads())
        return y



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
        self.unit_rows = self.w13.unit_rows
        self.bound: dict[int, tuple] = {}

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
        across experts as the per-expert loop adds it)."""
        tokens, top_k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        order = order[flat[order] >= 0]  # another rank's experts (-1) sort first; they add nothing here
        out = torch.zeros(tokens, self.hidden, dtype=torch.float32)
        rows = order.numel()
        if rows == 0:
            return out
        experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
        begin = counts.cumsum(0) - counts
        token_of = order // top_k
        y = torch.empty(rows, self.hidden, dtype=torch.float32)
        light = counts <= self.unit_rows
        if light.any():
            unit_ids, unit_begin, unit_counts = experts[light], begin[light], counts[light]
            most = int(unit_counts.max())
            # unit rows packed: gate units over [0, n), up units over [n, 2n), down over [0, n)
            starts = torch.cat((torch.zeros(1, dtype=torch.long), unit_counts.cumsum(0)))
            n = int(starts[-1])
            picked = torch.arange(n) + torch.repeat_interleave(unit_begin - starts[:-1], unit_counts)  # their sorted rows
            gu = self.w13.grouped(xf, torch.cat((token_of[picked],) * 2), torch.cat((2 * unit_ids, 2 * unit_ids + 1)),
                                  torch.cat((starts[:-1], starts + n)), most)
            y[picked] = self.w2.grouped(F.silu(gu[:n]) * gu[n:], torch.arange(n), unit_ids, starts, most)
        for e, b, c in zip(experts[~light].tolist(), begin[~light].tolist(), counts[~light].tolist()):
            gate, up, down = self._expert(e)
            x = xf[token_of[b : b + c]]
            y[b : b + c] = down(F.silu(gate(x)) * up(x))
        return out.index_add_(0, token_of, y * weights.reshape(-1)[order, None].float())

    def _expert(self, e: int) -> tuple[CpuLinear, CpuLinear, CpuLinear]:
        """Expert e's three projections bound as linears (views of the stacks; made on first use)."""
        bound = self.bound.get(e)
        if bound is None:
            w13, w2 = self.w13, self.w2
            bound = self.bound[e] = tuple(
                CpuLinear(p.trellis[i], p.suh[i], p.svh[i], p.bits, p.codebook_name)
                for p, i in ((w13, 2 * e), (w13, 2 * e + 1), (w2, e)))
        return bound
