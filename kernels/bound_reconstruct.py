"""More rows than a layer's bound decode launches serve (kernels/bound.py's BoundLinear above its max_rows): the
reconstruct path of triton_gemm (W_r = fp16(fp16(Ŵ·Hn)⊙svh) rebuilt per call, u = fp16(H(x⊙suh)), vendor fp16
matmul), with both Triton kernels bound once per part and launched through DirectLaunch, and each part's product
written into its columns of the layer's output (copied there where its dtype or padding differ). Up to
triton_gemm.hadamard_on_y's rows its other form, bound the same way: Ŵ decoded plainly, z = u·Ŵ in fp32, the output
transform H(z)⊙svh writing the part's columns of the layer's output in place (row stride, padding masked).

The same kernels, arguments and rounding points as TritonLinearKernel.apply's reconstruct path (so the same bits),
without what that path spends on the host per call: Triton's argument binding for two launches per part (tens of
µs each), the pad of x to k (the input kernel masks features past k_valid to zero instead), the per-part trims and
the concatenation. The 35B 64-token eager step was host-bound (46 ms eager vs 27 ms in a graph, 1110 launches;
docs/PERF.md "Session 8").

A fused layer's parts sharing x (q/k/v, gate/up, in_proj_qkvz) transform it in one launch (InputLaunch over their
suh stacked, triton_hadamard._input_kernel's PARTS): each block of x read once for every part, each part's u the same
bits as its own launch would write. Parts of one shape (gate/up) on W_r then take one batched matmul (parts_into).
"""

from __future__ import annotations

import torch
import triton

from exl3local.kernels.hadamard import HADAMARD_SCALE
from exl3local.kernels.launcher import DirectLaunch, launch_mode
from exl3local.kernels.triton_decode import _decode_dense_kernel, rate_constants, words
from exl3local.kernels import triton_gemm
from exl3local.kernels.triton_gemm import _right_reconstruct_kernel, fp32_product, hadamard_on_y
from exl3local.kernels.triton_hadamard import (_input_kernel, _product_output_kernel, hadamard_operands,
                                               input_row_blocks, rows_per_program)

INPUT_VARYING = ("x_ptr", "u_ptr", "M", "stride_xm")
REBUILD_VARYING = ("out_ptr",)
OUTPUT_VARYING = ("z_ptr", "y_ptr", "M", "stride_ym", "n_valid")
# Row blocks per program (triton_hadamard.input_row_blocks' RB) of an input transform over several parts, at most:
# each block already does the dot and store of every part. H200, µs at 4096 rows, k 5120 (h200-s19a, docs/PERF.md
# "Session 19"), RB 1 / 2 / 4: two parts 58.0 / 52.3 / 59.7, three 66.0 / 66.6 / 78.3 (each part its own launch at RB
# 4: 71.5, 110.0 in all).
PARTS_ROW_BLOCKS = 2
# Parts of one shape (gate/up), fp16 output, on W_r: both weights rebuilt into one buffer (twice one part's transient
# memory) and one batched matmul writing each part's columns of y in place, so the vendor GEMM's grid covers every
# part's tiles (one last partial wave, not one per part). H200, 27B step at 4096 rows, eager (h200-s19c, docs/PERF.md
# "Session 19"): 354.74 ms against 357.36 / 356.46 per part (exllamav3 353.95 / 353.97). The same products through
# another GEMM kernel: within fp32 accumulation noise of the per-part path, not its bits. Arc unmeasured.
BATCHED_PARTS = True


class InputLaunch:
    """The input transform u = fp16(H(fp16(x⊙suh))) of one part (suh (k,)) or of `parts` parts sharing x (suh
    (parts, k)), bound: `transform(x, u, stream)` writes u (parts, rows, k), or (rows, k) for one part."""

    def __init__(self, suh: torch.Tensor, size_k: int, in_features: int, device: torch.device, parts: int = 1) -> None:
        self.size_k, self.parts = size_k, parts
        plain, self.stream = launch_mode(_input_kernel, device)
        self.input = DirectLaunch(_input_kernel, INPUT_VARYING, plain)
        # Keep the bound tensors referenced: the compiled argument lists hold only their addresses.
        self.input_fixed = dict(suh_ptr=suh, ids_ptr=suh, had_ptr=hadamard_operands(device), size_k=size_k, x_div=1,
                                k_valid=in_features, HAS_IDS=False, SCALE=HADAMARD_SCALE, PAIRS=False, GLU=False,
                                PARTS=parts)

    def transform(self, x: torch.Tensor, u: torch.Tensor, stream) -> None:
        rows = x.shape[0]
        block_m, blocks = rows_per_program(rows), input_row_blocks(rows)
        if self.parts > 1:
            blocks = min(blocks, PARTS_ROW_BLOCKS)
        key = (block_m, blocks, x.dtype, x.data_ptr() % 16 == 0)
        self.input((triton.cdiv(rows, block_m * blocks), self.size_k // 128, 1), stream, key,
                   dict(self.input_fixed, BM=block_m, RB=blocks), (x, u, rows, x.stride(0)),
                   (x.data_ptr(), u.data_ptr(), rows, x.stride(0)))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """u of every part, (parts, rows, k)."""
        u = torch.empty(self.parts, x.shape[0], self.size_k, dtype=torch.float16, device=x.device)
        self.transform(x, u, self.stream())
        return u


class ReconstructLaunch(InputLaunch):
    """One part (trellis, suh, svh at one rate) on the reconstruct path, bound: `into(x, y, start, out)` writes
    x·W's first `out` columns into y[:, start:start + out]."""

    def __init__(self, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, bits: float, codebook: str,
                 in_features: int) -> None:
        device = trellis.device
        tiles_k, tiles_n, _ = trellis.shape
        super().__init__(suh, tiles_k * 16, in_features, device)
        self.size_n = tiles_n * 16
        plain = self.input.hooks is None
        self.rebuild = DirectLaunch(_right_reconstruct_kernel, REBUILD_VARYING, plain, num_warps=4,
                                    num_stages=triton_gemm.REBUILD_STAGES)
        self.decode = DirectLaunch(_decode_dense_kernel, REBUILD_VARYING, plain)
        self.output = DirectLaunch(_product_output_kernel, OUTPUT_VARYING, plain)
        had = hadamard_operands(device)
        per_program = triton_gemm.rebuild_tile_rows(tiles_k)
        self.rebuild_grid = (tiles_n // 8, tiles_k // per_program, 1)
        self.rebuild_fixed = dict(w_ptr=words(trellis), had_ptr=had, svh_ptr=svh, tiles_n=tiles_n,
                                  tk_per_program=per_program, **rate_constants(bits, codebook), SCALE=HADAMARD_SCALE,
                                  KT=4)
        self.decode_grid = (tiles_n // 8, tiles_k // 4, 1)  # triton_decode.decode_dense's
        self.decode_fixed = dict(w_ptr=words(trellis), tiles_n=tiles_n, **rate_constants(bits, codebook), KT=4, BNT=8)
        self.output_fixed = dict(svh_ptr=svh, bias_ptr=svh, had_ptr=had, size_n=self.size_n, HAS_BIAS=False,
                                 SCALE=HADAMARD_SCALE)

    def into(self, x: torch.Tensor, y: torch.Tensor, start: int, out: int, u: torch.Tensor | None = None) -> None:
        """y[:, start:start + out] = (x·W)[:, :out] through fp16, as TritonLinearKernel.apply rounds it (x: rows ×
        in_features with unit stride in features); u: this part's input transform of x if made already (an
        InputLaunch over the layer's parts), else made here."""
        rows = x.shape[0]
        stream = self.stream()
        w = torch.empty(self.size_k, self.size_n, dtype=torch.float16, device=x.device)
        if u is None:
            u = self(x)[0]
        if hadamard_on_y(rows, self.size_k, x.device):  # triton_gemm.reconstruct_gemm's other form, y in x's dtype
            self.decode(self.decode_grid, stream, (), self.decode_fixed, (w,), (w.data_ptr(),))
            z = fp32_product(u, w)
            part, stride = y[:, start:] if start else y, y.stride(0)
            # the key: what Triton specialises the kernel on besides the fixed arguments (ints: divisible by 16)
            block_m = rows_per_program(rows)
            self.output((triton.cdiv(rows, block_m), self.size_n // 128, 1), stream,
                        (block_m, y.dtype, part.data_ptr() % 16 == 0, stride % 16 == 0, out % 16 == 0),
                        dict(self.output_fixed, BM=block_m), (z, part, rows, stride, out),
                        (z.data_ptr(), part.data_ptr(), rows, stride, out))
            return
        self.rebuild(self.rebuild_grid, stream, (), self.rebuild_fixed, (w,), (w.data_ptr(),))
        if y.dtype == torch.float16 and out == self.size_n:
            # straight into the part's columns (the vendor matmul takes a row stride): no product to copy
            torch.mm(u, w, out=y[:, start:start + out])
            return
        product = u @ w
        y[:, start:start + out].copy_(product[:, :out] if out != self.size_n else product)


def reconstruct_parts(parts, in_features: int) -> tuple[list[ReconstructLaunch], InputLaunch | None]:
    """A fused layer's parts [(kernel, trellis, suh, svh, out_features)] on the reconstruct path: a ReconstructLaunch
    per part, and one InputLaunch for all of them where there are several (they share x, so k)."""
    launches = [ReconstructLaunch(trellis, suh, svh, kernel.spec.bits, kernel.spec.codebook, in_features)
                for kernel, trellis, suh, svh, _ in parts]
    if len(launches) < 2:
        return launches, None
    suh = torch.stack([part[2] for part in parts])
    return launches, InputLaunch(suh, launches[0].size_k, in_features, suh.device, len(launches))


def parts_into(launches: list[ReconstructLaunch], shared: InputLaunch | None, x: torch.Tensor, y: torch.Tensor,
               outs: list[int]) -> None:
    """y = x·W of every part side by side (outs: each part's out_features), through `shared` (reconstruct_parts'
    InputLaunch) where the layer has one; parts of one shape with every column kept, fp16 y and the W_r form take
    one batched matmul (BATCHED_PARTS)."""
    u = shared(x) if shared is not None else None
    first = launches[0]
    shape = (first.size_k, first.size_n, first.size_n)
    if u is not None and BATCHED_PARTS and y.dtype == torch.float16 and \
            not hadamard_on_y(x.shape[0], first.size_k, x.device) and \
            all((part.size_k, part.size_n, out) == shape for part, out in zip(launches, outs)):
        w = torch.empty(len(launches), first.size_k, first.size_n, dtype=torch.float16, device=x.device)
        stream = first.stream()
        for part, w_part in zip(launches, w):
            part.rebuild(part.rebuild_grid, stream, (), part.rebuild_fixed, (w_part,), (w_part.data_ptr(),))
        torch.bmm(u, w, out=y.view(x.shape[0], len(launches), first.size_n).transpose(0, 1))
        return
    start = 0
    for i, (part, out) in enumerate(zip(launches, outs)):
        part.into(x, y, start, out, None if u is None else u[i])
        start += out
