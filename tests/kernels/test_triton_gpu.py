"""Full-shape checks of the Triton kernels on a GPU (the lent H200; also meant for Arc): marker `gpu`."""

from __future__ import annotations

import pytest
import torch

from exl3local.kernels import KernelPath, KernelSpec, prepare, reference
from exl3local.kernels.triton_decode import decode_dense
from exl3local.kernels.triton_moe import moe_decode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize(
    "size_k,size_n,bits,codebook",
    [(4096, 4096, 4, "mul1"), (5120, 17408, 2, "3inst"), (17408, 5120, 3, "mcg"), (5120, 1024, 2.5, "mul1"),
     (4096, 14336, 8, "mul1"), (5120, 5120, 6, "3inst")],
)
def test_full_shape_decode_bit_exact_and_outputs_close(make_layer, relative_error, size_k, size_n, bits, codebook):
    trellis, suh, svh = make_layer(size_k, size_n, bits, codebook, seed=size_k)
    decoded = decode_dense(trellis, bits, codebook)
    assert torch.equal(decoded.view(torch.int16), reference.decode_trellis(trellis, bits, codebook).view(torch.int16))
    kernel = prepare(KernelSpec(size_k, size_n, bits, codebook, torch.float16), "cuda", "triton")
    for rows in (1, 7, 16, 100, 333):
        x = torch.randn(rows, size_k, device="cuda").half()
        y = kernel.apply(x, trellis, suh, svh)
        ref = reference.linear(x.float(), trellis, suh, svh, bits, codebook)
        path = kernel.path_for(rows)
        # fp16 output rounding (~3e-4); the reconstruct path adds fp16 W and an fp16 matmul output.
        limit = 2e-3 if path is KernelPath.RECONSTRUCT_GEMM else 1e-3
        assert relative_error(y, ref) < limit, (rows, path)


def test_full_shape_moe_units(make_layer, relative_error):
    trellis, suh, svh = make_layer(2048, 512, 4, "mul1", seed=9, experts=64)
    ids = torch.stack([torch.randperm(64, device="cuda")[:8] for _ in range(4)])
    x = torch.randn(4, 2048, device="cuda").half()
    y = moe_decode(x, trellis, suh, svh, 4, "mul1", ids)
    for t in range(4):
        for j in (0, 7):
            e = int(ids[t, j])
            ref = reference.linear(x[t : t + 1].float(), trellis[e], suh[e], svh[e], 4, "mul1")
            assert relative_error(y[t, j : j + 1], ref) < 1e-3


@pytest.mark.parametrize("size_k,size_n,bits,codebook", [(5120, 1024, 4, "mul1"), (17408, 5120, 3, "mcg"),
                                                         (5120, 17408, 6, "3inst")])
def test_bound_launch_equals_apply_and_replays_in_a_graph(make_layer, relative_error, size_k, size_n, bits, codebook):
    """The direct launcher (second call on) gives the JIT launch's bits exactly, in eager calls and in a
    captured CUDA graph replayed with new activations; split-K counters end at zero."""
    from exl3local.kernels.bound import BoundLinear, Workspace

    trellis, suh, svh = make_layer(size_k, size_n, bits, codebook, seed=3)
    kernel = prepare(KernelSpec(size_k, size_n, bits, codebook, torch.float16), "cuda", "triton")
    layer = BoundLinear([(kernel, trellis, suh, svh, size_n)], size_k)
    layer.reserve()
    for rows in (1, 7, 16):
        x = torch.randn(rows, size_k, device="cuda").half()
        layer(x)  # compiles (JIT path)
        y = layer(x)
        assert torch.equal(y, kernel.apply(x, trellis, suh, svh)), rows
        ref = reference.linear(x.float(), trellis, suh, svh, bits, codebook)
        assert relative_error(y, ref) < 1e-3, rows
    x = torch.randn(4, size_k, device="cuda").half()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(x)  # warm the capture stream's workspace and compiled kernel
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(x)
    for _ in range(3):
        x.copy_(torch.randn(4, size_k, device="cuda").half())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, kernel.apply(x, trellis, suh, svh))
    assert all(int(ws.counters.abs().sum()) == 0 for ws in Workspace._live.values())
