"""Python cost of one bound EXL3 linear call without a GPU (kernels/bound.py): BoundLinear.__call__,
FusedLaunch.launch and both DirectLaunch fast paths, with the compiled kernels' launchers replaced by a
no-op. What it leaves out: the driver launch itself and a device allocation (both measured on the H200
by bench/kernels.py's host section).

    TRITON_INTERPRET=1 python -P bench/host_overhead.py [--calls N]   (CPU tensors need the interpreter mode)
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from exl3local.kernels import KernelSpec, prepare, reference
from exl3local.kernels.bound import BoundLinear


class NoLaunch:
    """Stands in for a compiled Triton kernel: what DirectLaunch reads, and a launcher that does nothing."""

    packed_metadata = function = None

    def __init__(self, names) -> None:
        self.src = SimpleNamespace(signature=dict.fromkeys(names))

    def run(self, *args) -> None:
        pass


def no_hooks() -> SimpleNamespace:
    return SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    k, n, bits, codebook = 5120, 1024, 4, "mul1"
    trellis = torch.zeros(k // 16, n // 16, reference.words_per_tile(bits), dtype=torch.int16)
    suh, svh = torch.ones(k, dtype=torch.float16), torch.ones(n, dtype=torch.float16)
    kernel = prepare(KernelSpec(k, n, bits, codebook, torch.float16), "cpu", "triton")
    layer = BoundLinear([(kernel, trellis, suh, svh, n)], k)
    for launch, _, _ in layer.launches:
        for direct in (launch.input, launch.fused):
            direct.hooks = no_hooks()
            direct.fn = StubJit(NoLaunch(direct.names))
    for rows in (1, 16):
        x = torch.zeros(rows, k, dtype=torch.float16)
        layer(x)  # fills the compiled-kernel caches through the stand-in
        start = time.perf_counter()
        for _ in range(args.calls):
            layer(x)
        us = 1e6 * (time.perf_counter() - start) / args.calls
        print(f"{k}x{n} rows {rows}: {us:.2f} µs of Python per bound call (2 launches, launcher excluded)")


class StubJit:
    """`fn[grid](**kwargs)` as Triton's JIT function answers it, returning the stand-in kernel."""

    def __init__(self, kernel: NoLaunch) -> None:
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda **kwargs: self.kernel


if __name__ == "__main__":
    main()
