"""exllamav3 1.6.5's side of bench/model_step.py and bench/layers.py: its modules on our random tensors."""

from __future__ import annotations

import torch
from step_timing import DEVICE

from exl3local.kernels.codebook import MCG_MULTIPLIER, MUL1_MULTIPLIER

MGEMM_MAX_TOKENS = 64  # its grouped expert GEMM up to here; per expert over host-binned rows above


class Exl3Side:
    """exllamav3 1.6.5 on the same tensors: LinearEXL3 per part, exl3_mgemm / per-expert LinearEXL3 for MoE."""

    def __init__(self) -> None:
        self.error = None
        try:
            from exllamav3.ext import exllamav3_ext as ext
            from exllamav3.modules.quant.exl3 import LinearEXL3

            self.ext, self.cls = ext, LinearEXL3
        except Exception as exc:  # noqa: BLE001 -- the bench reports why the column is empty
            self.error = f"{type(exc).__name__}: {exc}"

    def markers(self, codebook):
        mcg = torch.tensor(MCG_MULTIPLIER - (1 << 32), dtype=torch.int32, device=DEVICE[0]) if codebook == "mcg" else None
        mul1 = torch.tensor(MUL1_MULTIPLIER - (1 << 32), dtype=torch.int32, device=DEVICE[0]) if codebook == "mul1" else None
        return mcg, mul1

    def linear(self, trellis, suh, svh, codebook):
        mcg, mul1 = self.markers(codebook)
        return self.cls(None, suh.shape[0], svh.shape[0], suh=suh, svh=svh, trellis=trellis, mcg=mcg, mul1=mul1)

    def bind_linear(self, lin: Linear, codebook: str):
        mods = [self.linear(*v, codebook) for v in lin.views]

        def call(x):
            return [m.forward(x, {}) for m in mods]

        return call

    def bind_experts(self, ex: Experts, bits: float, codebook: str):
        """exllamav3's grouped expert GEMM for few tokens; per-expert LinearEXL3 on host-binned rows above."""
        E, hidden, inter, top_k = ex.experts, ex.hidden, ex.inter, ex.top_k
        gate = ex.proj["gate"]
        w13t = ex.w13[0].view(E, 2, *gate.trellis_shape)
        projs = [(w13t[:, 0], ex.w13[1][:, 0], ex.w13[2][:, 0]), (w13t[:, 1], ex.w13[1][:, 1], ex.w13[2][:, 1]),
                 ex.w2]
        ptrs = [[torch.tensor([a[e].data_ptr() for e in range(E)], dtype=torch.long, device=DEVICE[0]) for a in p]
                for p in projs]
        mcg_flag, mul1_flag = codebook == "mcg", codebook == "mul1"
        mods: dict[tuple[int, int], object] = {}

        def module(e, i):
            if (e, i) not in mods:
                mods[(e, i)] = self.linear(projs[i][0][e], projs[i][1][e], projs[i][2][e], codebook)
            return mods[(e, i)]

        bufs: dict[int, tuple] = {}

        def call(x, weights, ids):
            tokens = x.shape[0]
            slots = tokens * top_k
            if tokens <= MGEMM_MAX_TOKENS:
                if tokens not in bufs:
                    half = dict(dtype=torch.half, device=DEVICE[0])
                    bufs[tokens] = (torch.empty(slots, 1, inter, **half), torch.empty(slots, 1, inter, **half),
                                    torch.empty(slots, 1, hidden, **half), torch.empty(slots, 1, hidden, **half),
                                    torch.empty(slots, 1, inter, **half))
                c_g, c_u, c_d, had_gu, had_d = bufs[tokens]
                flat = ids.reshape(1, slots)
                xa = x.repeat_interleave(top_k, 0).view(slots, 1, hidden)
                for (tp, sp, vp), inp, c, had in ((ptrs[0], xa, c_g, had_gu), (ptrs[1], xa, c_u, had_gu)):
                    self.ext.exl3_mgemm(inp, tp, c, sp, had, vp, flat, None, bits, -1, mcg_flag, mul1_flag, -1, -1, 0,
                                        1, None, None)
                a = (torch.nn.functional.silu(c_g) * c_u).view(slots, 1, inter)
                tp, sp, vp = ptrs[2]
                self.ext.exl3_mgemm(a, tp, c_d, sp, had_d, vp, flat, None, bits, -1, mcg_flag, mul1_flag, -1, -1, 0,
                                    1, None, None)
                return (c_d.view(tokens, top_k, hidden).float() * weights[..., None]).sum(1).half()
            flat = ids.flatten()
            order = torch.argsort(flat)
            counts = torch.bincount(flat, minlength=E).tolist()
            token_of = order // top_k
            out = torch.zeros(tokens, hidden, dtype=torch.float, device=x.device)
            start = 0
            for e, n in enumerate(counts):
                if n:
                    rows = token_of[start:start + n]
                    xe = x[rows]
                    h = torch.nn.functional.silu(module(e, 0).forward(xe, {})) * module(e, 1).forward(xe, {})
                    y = module(e, 2).forward(h.contiguous(), {}).float()
                    out.index_add_(0, rows, y * weights.flatten()[order[start:start + n], None])
                    start += n
            return out.half()

        return call
