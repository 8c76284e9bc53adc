"""Whole EXL3 layers bound once: BoundLinear (a vLLM linear, its fused parts side by side) and bind_moe (one MoE
projection of every expert, stacked), built on kernels/fused_launch.py's FusedLaunch (one projection's input transform
and decode matmul, bound) and kernels/bound_group.py's GroupLaunch (a fused layer's parts in one grid).

    layer = BoundLinear([(kernel, trellis, suh, svh, out_features), ...], in_features, bias)   # once
    y = layer(x)                                                  # (..., in_features) -> (..., Σ out_features)
    proj = bind_moe(trellis, suh, svh, bits, codebook)            # MoE: triton_moe.moe_units(proj, x, ids)

More rows than the bound launches serve (fused_launch.MAX_ROWS, or EXL3LOCAL_TILED_MAX_ROWS with the tiled path on)
take BoundLinear.rebuilt: the fp16 reconstruct path, its launches bound per part by kernels/bound_reconstruct.py.
"""

from __future__ import annotations

import torch

from exl3local.kernels.bound_group import group_launch
from exl3local.kernels.bound_reconstruct import parts_into, reconstruct_parts
from exl3local.kernels.fused_launch import MAX_ROWS, FusedLaunch
# Re-exported: the self-test (kernels/selftest*.py) and tests import them from here.
from exl3local.kernels.fused_launch import tiled_max_rows  # noqa: F401
from exl3local.kernels.launcher import Workspace  # noqa: F401


class BoundLinear:
    """A whole EXL3 linear with its tensors bound: x (..., in_features) -> (..., sum of out_features).

    Parts (fused vLLM layers: q/k/v, gate/up) share x, each with its own suh and bits. Up to max_rows rows,
    parts at one rate in one allocation run as one GroupLaunch (two launches for the whole layer, one
    where ONE_LAUNCH_MAX_WORK allows); otherwise every part is two launches (one where it allows) writing its
    columns of the output in place: x's padding to k and the
    output's trim to out_features are masks in the kernels, the bias is added in the epilogue. More rows
    take the reconstruct path with its launches bound per part (`rebuilt`); a part whose kernel is not Triton makes
    every call take each kernel's `apply` (pad, per part, trim, concatenate)."""

    def __init__(self, parts, in_features: int, bias: torch.Tensor | None = None) -> None:
        """parts: [(kernel (dispatch.Exl3Kernel), trellis, suh, svh, out_features)] in output order."""
        self.parts = list(parts)
        self.in_features = in_features
        self.size_k = self.parts[0][1].shape[0] * 16
        self.out_features = sum(part[4] for part in self.parts)
        self.bias = bias
        self.launches = None
        self.rebuilds = None  # the parts' ReconstructLaunch, made on the first call above max_rows...
        self.rebuild_input = None  # ...and their shared InputLaunch where there are several parts
        self.max_rows = MAX_ROWS
        group = None
        if all(kernel.backend == "triton" for kernel, *_ in self.parts):
            group = group_launch(self.parts, bias)
        if group is not None:
            self.launches = [(group, 0, self.out_features)]
        elif all(kernel.backend == "triton" for kernel, *_ in self.parts):
            self.launches = []
            start = 0
            for kernel, trellis, suh, svh, out in self.parts:
                part_bias = bias[start:start + out] if bias is not None else None
                launch = FusedLaunch(trellis, suh, svh, kernel.spec.bits, kernel.spec.codebook, bias=part_bias)
                self.launches.append((launch, start, out))
                start += out
        if self.launches:
            self.max_rows = min(launch.max_rows for launch, _, _ in self.launches)
        # kernels/cpu runs a whole fused layer in one library call (dispatch.CpuLinearKernel.bind_layer; None where
        # its parts cannot share one).
        self.whole = None
        if all(kernel.backend == "cpu" for kernel, *_ in self.parts):
            self.whole = self.parts[0][0].bind_layer(self.parts, in_features)

    def reserve(self, rows: int | None = None) -> None:
        """Size the current stream's workspace for this layer (before graph capture; default: every row count
        its launches serve)."""
        for launch, _, _ in self.launches or ():
            launch.reserve(rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.whole is not None:
            y = self.whole(x)
            return y + self.bias if self.bias is not None else y
        x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        rows = x2d.shape[0]
        if self.launches and rows > self.max_rows:
            return self.rebuilt(x)
        if self.launches is None or not 0 < rows <= self.max_rows:
            return self.unfused(x)
        if x2d.stride(-1) != 1:
            x2d = x2d.contiguous()
        y = torch.empty(rows, self.out_features, dtype=x.dtype, device=x.device)
        for launch, start, out in self.launches:
            launch.launch(x2d, y[:, start:] if start else y, rows, k_valid=self.in_features, n_out=out)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def rebuilt(self, x: torch.Tensor) -> torch.Tensor:
        """More rows than the bound launches serve, Triton parts: the reconstruct path bound per part
        (kernels/bound_reconstruct.py), the same bits as `unfused` (parts of one shape in one batched matmul: within
        fp32 accumulation noise of it, bound_reconstruct.BATCHED_PARTS)."""
        if self.rebuilds is None:
            self.rebuilds, self.rebuild_input = reconstruct_parts(self.parts, self.in_features)
        x2d = x.reshape(-1, x.shape[-1])
        if x2d.stride(-1) != 1:
            x2d = x2d.contiguous()
        y = torch.empty(x2d.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        parts_into(self.rebuilds, self.rebuild_input, x2d, y, [part[4] for part in self.parts])
        y = y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y

    def unfused(self, x: torch.Tensor) -> torch.Tensor:
        pad = self.size_k - x.shape[-1]
        xp = torch.nn.functional.pad(x, (0, pad)) if pad else x
        outs = []
        for kernel, trellis, suh, svh, out in self.parts:
            y = kernel.apply(xp, trellis, suh, svh)
            outs.append(y[..., :out] if y.shape[-1] != out else y)
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return y + self.bias if self.bias is not None else y


def bind_moe(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, bits: float, codebook: str,
             bias: torch.Tensor | None = None) -> FusedLaunch:
    """One MoE projection of every expert, stacked (E, k/16, n/16, w) / (E, k) / (E, n): see triton_moe."""
    if trellis.dim() != 4 or suh.dim() != 2 or svh.dim() != 2:
        raise ValueError("MoE tensors must be stacked per expert: trellis (E, k/16, n/16, w), suh (E, k), svh (E, n)")
    return FusedLaunch(trellis, suh, svh, bits, codebook, bias=bias, experts=True)
