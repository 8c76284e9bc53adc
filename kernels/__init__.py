"""EXL3 math: the bit-exact PyTorch reference decoder and the Triton kernels.

`linear(x, trellis, suh, svh, bits, codebook, bias=None, backend=None)` is the one entry point;
layers that run repeatedly use `prepare(KernelSpec(...), device)` once and `kernel.apply(...)`, or bind
their tensors once with `bound.BoundLinear` / `bound.bind_moe` (fewest launches, least host time per call).
"""

from exl3local.kernels.dispatch import (
    CANDIDATES,
    DeviceInfo,
    Exl3Kernel,
    KernelPath,
    KernelSpec,
    choose_kernel,
    linear,
    prepare,
)

__all__ = [
    "CANDIDATES",
    "DeviceInfo",
    "Exl3Kernel",
    "KernelPath",
    "KernelSpec",
    "choose_kernel",
    "linear",
    "prepare",
]
