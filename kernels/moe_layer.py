"""The routed experts of one MoE layer as math (no vLLM): the path ladder over stacked EXL3 arenas.

plugin/moe.py owns loading and vLLM's hooks and builds one `ExpertLayer` per layer; bench/model_step.py
builds the same object on random arenas, so the benchmark times exactly what the plugin runs.

Arenas (per layer, every expert stacked; Hp, Ip: hidden and intermediate padded to 128):

    w13_trellis int16 (E, gate_words + up_words)   per expert: gate (Hp/16, Ip/16, 16*bits), then up
    w13_suh fp16 (E, 2, Hp)    w13_svh fp16 (E, 2, Ip)
    w2_trellis  int16 (E, Ip/16, Hp/16, 16*bits)   w2_suh fp16 (E, Ip)   w2_svh fp16 (E, Hp)

Paths by token count (select_path): one token, a speculative verify step (≤ VERIFY_MAX_TOKENS), the grouped
path (≤ GROUPED_MAX_TOKENS) and the batched path. Wherever the dispatch chose Triton for every projection,
every path runs as (token, expert) units in five launches (routing ids read on the device: no host sync,
graph-safe). Otherwise the CPU kernel's units serve decode/verify and grouped calls (kernels/cpu/moe.py), and the
rest go per expert: tokens binned per expert (one host sync), each expert's projections through its kernel or,
batched, reconstructed densely.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from exl3local.kernels import reference
from exl3local.kernels.dispatch import Exl3Kernel, KernelPath, KernelSpec, prepare
from exl3local.kernels.hadamard import HADAMARD_BLOCK, hadamard_128

TILE = reference.TILE
# Speculative verify sends at most this many tokens per sequence step; each stays an M=1 unit.
VERIFY_MAX_TOKENS = 4
# Above this many tokens each expert sees enough rows (T*top_k/E) for a dense reconstruction to pay for its
# two weight-side Hadamards. Provisional (bench/moe_paths.py was too noisy on the 2-core CPU; the GPU
# kernels must re-measure it with bench/model_step.py).
GROUPED_MAX_TOKENS = 128
# Units per launch (gate and up count apart): the unit grid's third dimension, under CUDA's 65535.
MAX_UNITS_PER_LAUNCH = 32768
PATHS = (KernelPath.MOE_DECODE, KernelPath.MOE_VERIFY, KernelPath.MOE_GROUPED, KernelPath.MOE_BATCHED)
# Paths the grouped (token, expert) unit kernel (kernels/triton_moe.py) serves when Triton serves the layer:
# all of them (the per-expert dense loop it replaced took 14.0 s per 35B-A3B 512-token step on the H200).
TRITON_MOE_PATHS = PATHS
# From this many units per expert on average (tokens·top_k / experts) the units are grouped by expert on the device
# and each matmul program takes a tile of up to 16 units of one expert (each weight decoded once per tile, not once
# per unit); below, one unit per program. H200, 35B-A3B step (docs/PERF.md "Session 8"): at 0.5 per expert (16
# tokens) tiles ran 2 % slower (graph 19.47 vs 19.09 ms), at 2 (64 tokens) 1.55x faster (26.96 vs 41.86 ms);
# between them unmeasured.
TILES_MIN_UNITS_PER_EXPERT = 1.0


def select_path(tokens: int) -> KernelPath:
    """The one place a path is chosen: by the number of tokens in the call."""
    if tokens <= 0:
        raise ValueError(f"an MoE call needs at least one token, got {tokens}")
    if tokens == 1:
        return KernelPath.MOE_DECODE
    if tokens <= VERIFY_MAX_TOKENS:
        return KernelPath.MOE_VERIFY
    if tokens <= GROUPED_MAX_TOKENS:
        return KernelPath.MOE_GROUPED
    return KernelPath.MOE_BATCHED


def path_refusal(path: KernelPath, tokens: int) -> str | None:
    """Why `path` cannot serve a call of `tokens` tokens, or None."""
    if path == KernelPath.MOE_DECODE and tokens != 1:
        return f"{path} serves exactly one token, got {tokens}"
    if path == KernelPath.MOE_VERIFY and not 1 <= tokens <= VERIFY_MAX_TOKENS:
        return f"{path} serves 1..{VERIFY_MAX_TOKENS} tokens as independent M=1 units, got {tokens}"
    if path not in PATHS:
        return f"{path} is not an MoE path"
    return None


def triton_moe_refusal(chosen: dict[str, Exl3Kernel], proj: dict) -> str | None:
    """Why the grouped Triton MoE kernel cannot serve this layer, or None. It serves only where the
    dispatch chose Triton for every projection, and reads gate and up as one zero-copy stack
    (2E, k/16, n/16, w) of the w13 arena, which needs equal bits for both."""
    for name, kernel in chosen.items():
        if kernel.backend != "triton":
            return f"the dispatch chose {type(kernel).__name__} for {name}"
    if proj["gate"].bits != proj["up"].bits:
        return f"gate ({proj['gate'].bits:g} bits) and up ({proj['up'].bits:g} bits) differ: no stacked w13 view"
    return None


class ExpertLayer:
    """One layer's routed experts over its arenas. `proj` maps gate/up/down to objects with bits, codebook,
    size_k, size_n, words and trellis_shape (plugin.moe.Projection)."""

    def __init__(self, w13_trellis, w13_suh, w13_svh, w2_trellis, w2_suh, w2_svh, proj: dict, top_k: int,
                 backend: str | None = None) -> None:
        self.w13_trellis, self.w13_suh, self.w13_svh = w13_trellis, w13_suh, w13_svh
        self.w2_trellis, self.w2_suh, self.w2_svh = w2_trellis, w2_suh, w2_svh
        self.proj = proj
        self.top_k = top_k
        self.experts = w13_trellis.shape[0]
        device = w13_trellis.device
        # The ladder accumulates in fp32, so the per-projection kernels are asked for fp32 activations.
        self.kernels = {name: prepare(KernelSpec(p.size_k, p.size_n, p.bits, p.codebook, torch.float32), device, backend)
                        for name, p in proj.items()}
        self.refusal = triton_moe_refusal(self.kernels, proj)
        self.bound = self.combine = None
        if self.refusal is None:
            self._bind()
        self.cpu = None  # kernels/cpu's unit path, where the dispatch chose the CPU kernel for every projection
        if all(k.backend == "cpu" for k in self.kernels.values()):
            from exl3local.kernels.cpu import moe as cpu_moe

            if cpu_moe.refusal(proj) is None:
                self.cpu = cpu_moe.CpuExperts(w13_trellis, w13_suh, w13_svh, w2_trellis, w2_suh, w2_svh, proj)

    def _bind(self) -> None:
        """Both projections' launches bound once, over zero-copy views of the arenas: w13 as 2E experts (row 2e
        is expert e's gate, 2e+1 its up), w2 as E; workspace sized for the largest verify step up front."""
        from exl3local.kernels.bound import bind_moe

        gate, down = self.proj["gate"], self.proj["down"]
        E = self.experts
        self.w13_units = (self.w13_trellis.view(2 * E, *gate.trellis_shape), self.w13_suh.view(2 * E, gate.size_k),
                          self.w13_svh.view(2 * E, gate.size_n))
        self.bound = (bind_moe(*self.w13_units, gate.bits, gate.codebook),
                      bind_moe(self.w2_trellis, self.w2_suh, self.w2_svh, down.bits, down.codebook))
        for bound in self.bound:
            bound.reserve(VERIFY_MAX_TOKENS * 2 * self.top_k)
        from exl3local.kernels.bound import MAX_ROWS
        from exl3local.kernels.triton_moe import TileTable, bind_combine

        self.combine = bind_combine(self.bound[0], self.top_k)
        self.tile_table = TileTable(E, MAX_ROWS, self.w13_trellis.device, like=self.bound[0])

    # -- views into the arenas
    def trellis(self, name: str, e: int) -> torch.Tensor:
        if name == "down":
            return self.w2_trellis[e]
        gate_words = self.proj["gate"].words
        flat = self.w13_trellis[e, :gate_words] if name == "gate" else self.w13_trellis[e, gate_words:]
        return flat.view(self.proj[name].trellis_shape)

    def scales(self, name: str, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        if name == "down":
            return self.w2_suh[e], self.w2_svh[e]
        part = 0 if name == "gate" else 1
        return self.w13_suh[e, part], self.w13_svh[e, part]

    def project(self, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
        """x (m, padded k) fp32 through one expert projection: (m, padded n) fp32."""
        suh, svh = self.scales(name, e)
        return self.kernels[name].apply(x, self.trellis(name, e), suh, svh)

    def dense(self, name: str, e: int) -> torch.Tensor:
        """One expert projection reconstructed for this call only: W (padded k, padded n) fp32."""
        p = self.proj[name]
        suh, svh = self.scales(name, e)
        if self.kernels[name].backend == "triton":  # never the int64 reference decode on a GPU
            from exl3local.kernels.triton_decode import decode_dense

            w = decode_dense(self.trellis(name, e), p.bits, p.codebook).float()
        elif self.kernels[name].backend == "cpu":
            from exl3local.kernels.cpu.ops import CpuLinear

            w = CpuLinear(self.trellis(name, e), suh, svh, p.bits, p.codebook).decode()
        else:
            w = reference.decode_trellis(self.trellis(name, e), p.bits, p.codebook).float()
        h = hadamard_128(w.device)
        blocks_k, blocks_n = p.size_k // HADAMARD_BLOCK, p.size_n // HADAMARD_BLOCK
        # Both blockwise Hadamards as batched matmuls on views (no transposed copies): Hk·Ŵ, then ·Hn.
        w = (h @ w.view(blocks_k, HADAMARD_BLOCK, p.size_n)).view(p.size_k, p.size_n) * suh.float()[:, None]
        w = (w.view(p.size_k, blocks_n, HADAMARD_BLOCK) @ h).view(p.size_k, p.size_n)
        return w * svh.float()[None, :]

    def expert(self, e: int, x: torch.Tensor, dense: bool = False) -> torch.Tensor:
        """silu(x·gate) ⊙ (x·up) ·down for rows x (m, padded hidden) fp32 → (m, padded hidden) fp32."""
        if dense:
            h = F.silu(x @ self.dense("gate", e)) * (x @ self.dense("up", e))
            return h @ self.dense("down", e)
        h = F.silu(self.project("gate", e, x)) * self.project("up", e, x)
        return self.project("down", e, h)

    def grouped_units(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every (token, expert) unit at once, ids read on the device (no host sync), launches bound at load:
        five launches in all (six from TILES_MIN_UNITS_PER_EXPERT: the tile table, triton_moe.TileTable).
        gate+up: one input transform and one matmul over the w13 stack (unit pairs, expert
        row 2·id + part, x unpadded in any float dtype); down: its input transform computes silu(gate) ⊙ up
        from those outputs (fp32); one combine kernel weights each token's units and sums them in j order.
        Returns (T, hidden) in x's dtype."""
        from exl3local.kernels.triton_moe import combine_units

        bound13, bound2 = self.bound
        tokens, top_k = ids.shape
        chunk = MAX_UNITS_PER_LAUNCH // (2 * top_k)
        if tokens > chunk:  # one unit per program row of the grid: keep the grid inside the device's limits
            return torch.cat([self.grouped_units(x[t:t + chunk], weights[t:t + chunk], ids[t:t + chunk])
                              for t in range(0, tokens, chunk)])
        units = tokens * top_k
        ids, weights = ids.contiguous(), weights.contiguous()
        if x.stride(-1) != 1:
            x = x.contiguous()
        # one expert-sorted table serves both projections (gate/up tiles are the down tiles' pairs)
        tiles = self.tile_table(ids) if units >= TILES_MIN_UNITS_PER_EXPERT * self.experts else None
        gu = torch.empty(2 * units, self.proj["gate"].size_n, dtype=torch.float32, device=x.device)
        bound13.launch(x, gu, 2 * units, ids, x_div=2 * top_k, k_valid=x.shape[1], pairs=True, tiles=tiles)
        y = torch.empty(units, self.proj["down"].size_n, dtype=torch.float32, device=x.device)
        bound2.launch(gu, y, units, ids, glu=True, tiles=tiles)
        return combine_units(y, weights, ids, x.shape[1], x.dtype, self.combine)

    def run(self, path: KernelPath, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed sum (T, hidden) in x's dtype for input rows x (T, hidden), fp32 routing weights and local
        expert ids (-1: another rank's) through `path` (already checked with path_refusal). Where Triton serves
        the layer every path runs as units (one launch set, no host sync); the per-expert paths below are the
        other backends'."""
        if path in TRITON_MOE_PATHS and self.refusal is None:
            return self.grouped_units(x, weights, ids)
        hidden = x.shape[-1]
        pad = self.proj["gate"].size_k - hidden
        xf = F.pad(x.float(), (0, pad)) if pad else x.float()
        ids = ids.long()
        return self._per_expert(path, xf, weights, ids)[:, :hidden].to(x.dtype)

    def _per_expert(self, path: KernelPath, xf: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """(T, padded hidden) fp32 from padded fp32 rows: the CPU units, or one expert at a time."""
        if path in (KernelPath.MOE_DECODE, KernelPath.MOE_VERIFY) and self.cpu is not None:
            return self.cpu.units(xf, weights, ids)
        if path == KernelPath.MOE_GROUPED and self.cpu is not None:
            return self.cpu.grouped(xf, weights, ids)
        out = torch.zeros(xf.shape[0], self.proj["down"].size_n, dtype=torch.float32, device=xf.device)
        if path in (KernelPath.MOE_DECODE, KernelPath.MOE_VERIFY):
            host_ids = ids.tolist()  # the layer's one host sync: the units to run
            for t, row in enumerate(host_ids):
                for j, e in enumerate(row):
                    if e >= 0:
                        out[t] += weights[t, j] * self.expert(e, xf[t : t + 1])[0]
            return out
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)  # binned by expert on the device; -1 (remote) first
        counts = torch.bincount(flat + 1, minlength=self.experts + 1).tolist()  # one host sync
        token_of = order // ids.shape[1]
        weight_of = weights.flatten()[order]
        start = counts[0]
        for e, n in enumerate(counts[1:]):
            if n == 0:
                continue
            rows = token_of[start : start + n]
            y = self.expert(e, xf[rows], dense=path == KernelPath.MOE_BATCHED)
            out.index_add_(0, rows, y * weight_of[start : start + n, None])
            start += n
        return out
