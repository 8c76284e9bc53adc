"""Launches bound once per layer: the fused EXL3 kernel (triton_fused) with its weights, grid, split-K and
scratch fixed at load time, so a decode call does no Python-side shape logic, no scratch allocation and
no Triton argument binding.

    bound = bind_projection(trellis, suh, svh, bits, codebook)    # once, e.g. in process_weights_after_loading
    y = bound(x2d)                                                 # (rows <= 16, k) -> (rows, n), one launch

Launching: the first call per argument signature (dtypes, pointer alignment) goes through Triton's JIT,
which compiles and returns the compiled kernel; later calls hand the compiled kernel's launcher the
argument list directly (pointers as ints; ints that vary per call are marked do_not_specialize in the
kernel). Under TRITON_INTERPRET=1 every call goes through the interpreter.

Scratch: split-K partials and the per-block counters live in one workspace per (device, stream), shared by
every bound projection on that stream (calls on one stream run in order). Counters start at zero and each
launch's last program resets its own. A workspace that is outgrown is kept alive, not freed: a CUDA graph
captured earlier may still point at it.
"""

from __future__ import annotations

import inspect

import torch
import triton

from exl3local.kernels.hadamard import HADAMARD_BLOCK, HADAMARD_SCALE
from exl3local.kernels.triton_decode import rate_constants, words
from exl3local.kernels.triton_fused import FUSED_BLOCK_N_TILES, exl3_fused_kernel
from exl3local.kernels.triton_gemv import SPLIT_TARGET_PROGRAMS_PER_CORE, compute_units, ring_dot_config
from exl3local.kernels.triton_hadamard import NATURAL, hadamard_operands, input_transform

MAX_ROWS = 16  # one dot tile of rows; more rows go to the reconstruct path (dispatch.GEMV_MAX_ROWS)
BLOCK_N = FUSED_BLOCK_N_TILES * 16
ARG_NAMES = tuple(inspect.signature(exl3_fused_kernel.fn).parameters)
X, IDS, Y, Z, CNT, M, STRIDE_XM, STRIDE_YM, STRIDE_ZS = (
    ARG_NAMES.index(name) for name in ("x_ptr", "ids_ptr", "y_ptr", "z_ptr", "cnt_ptr", "M", "stride_xm", "stride_ym",
                                       "stride_zs"))


def interpreting() -> bool:
    return not isinstance(exl3_fused_kernel, triton.runtime.JITFunction)


def fused_splits(blocks: int, k_blocks: int, device: torch.device) -> tuple[int, int]:
    """(splits, 128-row K blocks per split): about SPLIT_TARGET_PROGRAMS_PER_CORE programs per compute unit,
    with no empty split."""
    want = max(1, min(k_blocks, round(SPLIT_TARGET_PROGRAMS_PER_CORE * compute_units(device) / blocks)))
    per = triton.cdiv(k_blocks, want)
    return triton.cdiv(k_blocks, per), per


class Workspace:
    """Split-K partials (fp32) and block counters (int32, zeroed) for one (device, stream)."""

    _live: dict[tuple[torch.device, int], Workspace] = {}
    _retired: list[Workspace] = []  # outgrown, kept allocated for graphs captured against them

    def __init__(self, device: torch.device, partials: int, counters: int) -> None:
        self.partials = torch.empty(max(partials, 1), dtype=torch.float32, device=device)
        self.counters = torch.zeros(max(counters, 1), dtype=torch.int32, device=device)

    @classmethod
    def get(cls, device: torch.device, stream: int, partials: int, counters: int) -> Workspace:
        ws = cls._live.get((device, stream))
        if ws is None or ws.partials.numel() < partials or ws.counters.numel() < counters:
            if ws is not None:
                cls._retired.append(ws)
                partials = max(partials, ws.partials.numel())
                counters = max(counters, ws.counters.numel())
            ws = cls._live[(device, stream)] = Workspace(device, partials, counters)
        return ws


class FusedLaunch:
    """exl3_fused_kernel with one projection's weights bound; `launch` fills in the per-call arguments."""

    def __init__(self, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, bits: float, codebook: str,
                 bias: torch.Tensor | None = None, experts: bool = False, fuse_input: bool = True) -> None:
        self.device = trellis.device
        self.size_k = trellis.shape[-3] * 16
        self.size_n = trellis.shape[-2] * 16
        self.k_blocks = self.size_k // HADAMARD_BLOCK
        self.n_blocks = self.size_n // BLOCK_N
        _, block_kt, self.num_warps = ring_dot_config(bits)
        self.experts = experts
        self.constexprs = dict(rate_constants(bits, codebook), HAS_IDS=experts, HAS_BIAS=bias is not None,
                               FUSE_INPUT=fuse_input, SCALE=HADAMARD_SCALE, BM=MAX_ROWS, KT=block_kt)
        self.fuse_input = fuse_input
        # Keep the bound tensors referenced: the argument list below may hold only their addresses.
        self.tensors = dict(suh_ptr=suh, w_ptr=words(trellis), svh_ptr=svh, bias_ptr=bias if bias is not None else svh,
                            had_ptr=hadamard_operands(self.device)[NATURAL.value])
        self.expert_words = trellis[0].numel() // 2 if experts else 0
        self.interpret = interpreting() or self.device.type == "cpu"
        # Triton's launch hooks (profilers) run only through the JIT path; a Triton without `knobs` always takes it.
        self.hooks = None if self.interpret else getattr(getattr(triton, "knobs", None), "runtime", None)
        self.compiled: dict[tuple, object] = {}
        self.splits: dict[int, tuple[int, int]] = {}
        if not self.interpret:
            self.stream_of = triton.runtime.driver.active.get_current_stream
            self.device_index = self.device.index if self.device.index is not None else torch.cuda.current_device()

    def split_for(self, m_blocks: int) -> tuple[int, int]:
        split = self.splits.get(m_blocks)
        if split is None:
            split = self.splits[m_blocks] = fused_splits(m_blocks * self.n_blocks, self.k_blocks, self.device)
        return split

    def reserve(self, rows: int) -> None:
        """Size this device's workspaces for `rows` rows (units) now, before any graph capture."""
        m_blocks = rows if self.experts else triton.cdiv(rows, MAX_ROWS)
        splits, _ = self.split_for(m_blocks)
        Workspace.get(self.device, self.stream(), splits * rows * self.size_n, m_blocks * self.n_blocks)

    def stream(self) -> int:
        return 0 if self.interpret else self.stream_of(self.device_index)

    def launch(self, x: torch.Tensor, y: torch.Tensor, rows: int, ids: torch.Tensor | None = None, x_div: int = 1,
               k_valid: int | None = None, n_out: int | None = None) -> None:
        """y[:rows, :n_out] = the projection of x's rows (MoE: of unit r = x[r // x_div] through expert ids[r]);
        x has unit stride along k, y along n."""
        if not self.fuse_input:  # the input transform as its own launch (comparison in bench/kernels.py)
            x = input_transform(x, self.tensors["suh_ptr"], ids, x_div, rows=rows)
            x_div = 1
        m_blocks = rows if self.experts else 1
        splits, per_split = self.splits.get(m_blocks) or self.split_for(m_blocks)
        stream = self.stream()
        partials = splits * rows * self.size_n
        ws = Workspace._live.get((self.device, stream))
        if ws is None or ws.partials.numel() < partials or ws.counters.numel() < m_blocks * self.n_blocks:
            ws = Workspace.get(self.device, stream, partials, m_blocks * self.n_blocks)
        grid = (self.n_blocks, splits, m_blocks)
        x_ptr, y_ptr = x.data_ptr(), y.data_ptr()
        key = (x.dtype, y.dtype, x_ptr % 16 == 0, y_ptr % 16 == 0, None if ids is None else ids.dtype,
               ids is None or ids.data_ptr() % 16 == 0, x_div, k_valid, n_out, splits, per_split)
        entry = None if self.hooks is None else self.compiled.get(key)
        if entry is None or self.hooks.launch_enter_hook is not None or self.hooks.launch_exit_hook is not None:
            args = dict(self.tensors, x_ptr=x, ids_ptr=ids if ids is not None else x, y_ptr=y, z_ptr=ws.partials,
                        cnt_ptr=ws.counters, M=rows, size_k=self.size_k, tiles_n=self.size_n // 16,
                        stride_xm=x.stride(0), x_div=x_div, k_valid=self.size_k if k_valid is None else k_valid,
                        stride_ym=y.stride(0), n_out=self.size_n if n_out is None else n_out, k_blocks=self.k_blocks,
                        blocks_per_split=per_split, expert_words=self.expert_words, stride_zs=rows * self.size_n,
                        **self.constexprs, SPLIT=splits > 1)
            kernel = exl3_fused_kernel[grid](**args, num_warps=self.num_warps, num_stages=1)
            if not self.interpret and hasattr(kernel, "packed_metadata") and \
                    len(getattr(kernel.src, "signature", ())) == len(ARG_NAMES):
                values = [args[name] for name in ARG_NAMES]
                for name, value in enumerate(values):  # bound tensors travel as addresses
                    if isinstance(value, torch.Tensor):
                        values[name] = value.data_ptr()
                self.compiled[key] = (kernel, values)
            return
        kernel, values = entry
        a = values.copy()
        a[X], a[Y], a[Z], a[CNT] = x_ptr, y_ptr, ws.partials.data_ptr(), ws.counters.data_ptr()
        a[IDS] = ids.data_ptr() if ids is not None else x_ptr
        a[M], a[STRIDE_XM], a[STRIDE_YM], a[STRIDE_ZS] = rows, x.stride(0), y.stride(0), rows * self.size_n
        kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata, None, None, None, *a)


class BoundLinear:
    """A whole EXL3 linear with its tensors bound: x (..., in_features) -> (..., sum of out_features).

    Parts (fused vLLM layers: q/k/v, gate/up) share x, each with its own suh and bits. Up to MAX_ROWS rows,
    every part is one fused launch writing its columns of the output in place: x's padding to k and the
    output's trim to out_features are masks in the kernel, the bias is added in its epilogue. More rows,
    or a part whose kernel is not Triton, take each kernel's `apply` (pad, per part, trim, concatenate)."""

    def __init__(self, parts, in_features: int, bias: torch.Tensor | None = None) -> None:
        """parts: [(kernel (dispatch.Exl3Kernel), trellis, suh, svh, out_features)] in output order."""
        self.parts = list(parts)
        self.in_features = in_features
        self.size_k = self.parts[0][1].shape[0] * 16
        self.out_features = sum(part[4] for part in self.parts)
        self.bias = bias
        self.launches = None
        if all(kernel.backend == "triton" for kernel, *_ in self.parts):
            self.launches = []
            start = 0
            for kernel, trellis, suh, svh, out in self.parts:
                part_bias = bias[start:start + out] if bias is not None else None
                launch = FusedLaunch(trellis, suh, svh, kernel.spec.bits, kernel.spec.codebook, bias=part_bias)
                self.launches.append((launch, start, out))
                start += out

    def reserve(self, rows: int = MAX_ROWS) -> None:
        """Size the workspace of the current stream for this layer (before graph capture)."""
        for launch, _, _ in self.launches or ():
            launch.reserve(rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        rows = x2d.shape[0]
        if self.launches is None or not 0 < rows <= MAX_ROWS:
            return self.unfused(x)
        if x2d.stride(-1) != 1:
            x2d = x2d.contiguous()
        y = torch.empty(rows, self.out_features, dtype=x.dtype, device=x.device)
        for launch, start, out in self.launches:
            launch.launch(x2d, y[:, start:] if start else y, rows, k_valid=self.in_features, n_out=out)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

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
