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


class ReconstructLaunch:
    """One part (trellis, suh, svh at one rate) on the reconstruct path, bound: `into(x, y, start, out)` writes
    x·W's first `out` columns into y[:, start:start + out]."""

    def __init__(self, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, bits: float, codebook: str,
                 in_features: int) -> None:
        device = trellis.device
        tiles_k, tiles_n, _ = trellis.shape
        self.size_k, self.size_n = tiles_k * 16, tiles_n * 16
        plain, self.stream = launch_mode(_input_kernel, device)
        self.input = DirectLaunch(_input_kernel, INPUT_VARYING, plain)
        self.rebuild = DirectLaunch(_right_reconstruct_kernel, REBUILD_VARYING, plain, num_warps=4,
                                    num_stages=triton_gemm.REBUILD_STAGES)
        self.decode = DirectLaunch(_decode_dense_kernel, REBUILD_VARYING, plain)
        self.output = DirectLaunch(_product_output_kernel, OUTPUT_VARYING, plain)
        had = hadamard_operands(device)
        # Keep the bound tensors referenced: the compiled argument lists hold only their addresses.
        self.input_fixed = dict(suh_ptr=suh, ids_ptr=suh, had_ptr=had, size_k=self.size_k, x_div=1,
                                k_valid=in_features, HAS_IDS=False, SCALE=HADAMARD_SCALE, PAIRS=False, GLU=False)
        per_program = triton_gemm.rebuild_tile_rows(tiles_k)
        self.rebuild_grid = (tiles_n // 8, tiles_k // per_program, 1)
        self.rebuild_fixed = dict(w_ptr=words(trellis), had_ptr=had, svh_ptr=svh, tiles_n=tiles_n,
                                  tk_per_program=per_program, **rate_constants(bits, codebook), SCALE=HADAMARD_SCALE,
                                  KT=4)
        self.decode_grid = (tiles_n // 8, tiles_k // 4, 1)  # triton_decode.decode_dense's
        self.decode_fixed = dict(w_ptr=words(trellis), tiles_n=tiles_n, **rate_constants(bits, codebook), KT=4, BNT=8)
        self.output_fixed = dict(svh_ptr=svh, bias_ptr=svh, had_ptr=had, size_n=self.size_n, HAS_BIAS=False,
                                 SCALE=HADAMARD_SCALE)

    def into(self, x: torch.Tensor, y: torch.Tensor, start: int, out: int) -> None:
        """y[:, start:start + out] = (x·W)[:, :out] through fp16, as TritonLinearKernel.apply rounds it (x: rows ×
        in_features with unit stride in features)."""
        rows = x.shape[0]
        stream = self.stream()
        u = torch.empty(rows, self.size_k, dtype=torch.float16, device=x.device)
        w = torch.empty(self.size_k, self.size_n, dtype=torch.float16, device=x.device)
        block_m, blocks = rows_per_program(rows), input_row_blocks(rows)
        key = (block_m, blocks, x.dtype, x.data_ptr() % 16 == 0)
        self.input((triton.cdiv(rows, block_m * blocks), self.size_k // 128, 1), stream, key,
                   dict(self.input_fixed, BM=block_m, RB=blocks), (x, u, rows, x.stride(0)),
                   (x.data_ptr(), u.data_ptr(), rows, x.stride(0)))
        if hadamard_on_y(rows, self.size_k, x.device):  # triton_gemm.reconstruct_gemm's other form, y in x's dtype
            self.decode(self.decode_grid, stream, (), self.decode_fixed, (w,), (w.data_ptr(),))
            z = fp32_product(u, w)
            part, stride = y[:, start:] if start else y, y.stride(0)
            # the key: what Triton specialises the kernel on besides the fixed arguments (ints: divisible by 16)
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
