"""Helpers shared by bench/kernels.py and its sections (bench/kernels_alone.py): timers (triton.testing's
do_bench median with its L2 flush; CUDA-graph replay), host time with the GPU kept busy, random layers, and
exllamav3's side on our tensors."""

from __future__ import annotations

import time

import torch
from step_timing import DEVICE, log

from exl3local.kernels import KernelSpec, prepare, reference
from exl3local.kernels.bound import BoundLinear
from exl3local.kernels.codebook import MCG_MULTIPLIER, MUL1_MULTIPLIER

RESULTS: list[dict] = []
DEADLINE = [0.0]  # epoch seconds; loops stop adding rows once past it (0: no deadline)


def late() -> bool:
    return bool(DEADLINE[0]) and time.time() > DEADLINE[0]


def timed(fn, graph: bool = False) -> float:
    """Median µs."""
    import triton.testing

    if DEVICE[0] == "cpu":
        start = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - start)
    if graph:
        return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
    return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def host_us(fn, calls: int = 100, busy_cycles: int = 40_000_000) -> float:
    """Host (CPU) µs per call while the GPU is kept busy (`busy_cycles` of a sleep kernel queued first: 40 M is
    ~20 ms, more for calls whose GPU time would drain it), so no call waits on the device."""
    if DEVICE[0] == "cpu":
        return float("nan")
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(busy_cycles)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * elapsed / calls


def bound_linear(trellis, suh, svh, bits, codebook):
    """What the plugin binds per layer (one part), as bench callables take it."""
    k, n = suh.shape[0], svh.shape[0]
    kernel = prepare(KernelSpec(k, n, bits, codebook, torch.float16), trellis.device, "triton")
    bound = BoundLinear([(kernel, trellis, suh, svh, n)], k)
    bound.reserve()
    return bound


def host_profile(fn, calls: int = 300, top: int = 14) -> str:
    """cProfile of `calls` calls with the GPU busy: where the host time of one call goes."""
    import cProfile
    import io
    import pstats

    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def make_layer(size_k, size_n, bits, codebook, seed=0, experts=None):
    device = DEVICE[0]
    g = torch.Generator(device=device).manual_seed(seed)
    lead = () if experts is None else (experts,)
    words = reference.words_per_tile(bits)
    trellis = torch.randint(-32768, 32768, (*lead, size_k // 16, size_n // 16, words), generator=g,
                            dtype=torch.int16, device=device)
    suh = (torch.randn(*lead, size_k, generator=g, device=device) * 0.05).half()
    svh = (torch.randn(*lead, size_n, generator=g, device=device) * 0.05).half()
    return trellis, suh, svh


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


class Exl3:
    """exllamav3's LinearEXL3 and grouped-expert GEMM on our tensors, if the package imports."""

    def __init__(self, enabled: bool = True) -> None:
        self.error = None if enabled else "skipped (--no-exl3)"
        if not enabled:
            return
        try:
            from exllamav3.ext import exllamav3_ext as ext
            from exllamav3.modules.quant.exl3 import LinearEXL3

            self.ext, self.cls = ext, LinearEXL3
        except Exception as exc:  # noqa: BLE001 -- the bench reports why the column is empty
            self.error = f"{type(exc).__name__}: {exc}"

    @property
    def ok(self) -> bool:
        return self.error is None

    @staticmethod
    def markers(codebook: str, device):
        mcg = torch.tensor(MCG_MULTIPLIER - (1 << 32), dtype=torch.int32, device=device) if codebook == "mcg" else None
        mul1 = torch.tensor(MUL1_MULTIPLIER - (1 << 32), dtype=torch.int32, device=device) if codebook == "mul1" else None
        return mcg, mul1

    def linear(self, trellis, suh, svh, codebook):
        """A LinearEXL3 over our tensors, or None (reason logged) if exllamav3 is missing or refuses them."""
        if not self.ok:
            return None
        mcg, mul1 = self.markers(codebook, trellis.device)
        k, n = suh.shape[0], svh.shape[0]
        try:
            return self.cls(None, k, n, suh=suh, svh=svh, trellis=trellis, mcg=mcg, mul1=mul1)
        except Exception as exc:  # noqa: BLE001 -- the bench reports why the column is empty
            log(f"exllamav3 LinearEXL3 refused {k}x{n} {codebook}: {type(exc).__name__}: {exc}")
            return None


def bench_copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE[0])
    dst = torch.empty_like(src)
    us = timed(lambda: dst.copy_(src))
    gbps = 2 * src.numel() / us / 1e3
    log(f"copy bandwidth: {gbps:.0f} GB/s (1 GiB copy, read+write, median {us:.0f} µs)")
    del src, dst
    return gbps
