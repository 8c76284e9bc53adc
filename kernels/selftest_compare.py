"""How a kernel self-test check (kernels/selftest_checks.py, kernels/selftest_triton.py) builds its random layer,
times one call and judges the output against the reference: the tolerances, the per-device check sizes, the
comparison. Below both check modules, so each can use them without importing the other."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from exl3local.kernels import reference

# Relative norm error allowed against reference.linear: the kernels round the transformed input to fp16
# (measured 2.4e-4 .. 4.8e-4 at these shapes on the CPU interpreter); a wrong weight or a lost partial
# gives errors of order 1. A bf16 output adds its own rounding (half of bf16's eps, 3.9e-3; measured 1.6e-3
# relative for the CPU kernel), so bf16 outputs get that much more (`tolerance`).
TOLERANCE = 2e-3


# The CPU kernel's opt-in int8-activation path (EXL3LOCAL_CPU_INT8): one int8 scale per row costs about 0.7-1 %
# relative (measured 6.4e-3 .. 1.0e-2, 128x128 to 2048x2048, K 2.5-4); still far below a wrong weight's order 1.
INT8_TOLERANCE = 3e-2


def tolerance(dtype: torch.dtype, path: str = "") -> float:
    """TOLERANCE plus the output dtype's own rounding where that is coarser than fp16's (INT8_TOLERANCE instead on
    an int8-activation path)."""
    base = INT8_TOLERANCE if path.endswith("_int8") else TOLERANCE
    return base + (torch.finfo(dtype).eps / 2 if dtype == torch.bfloat16 else 0.0)


# Per device kind: layer shape (k, n), the most K splits forced in the split-K checks, MoE tokens (top-2 of 3
# experts each). The interpreter runs every program in Python, so the CPU gets the smallest legal shape and
# the fewest programs that still split K (about 10 s per rate on one core); GPUs get several Hadamard
# blocks per dimension and as many splits as the kernels use on a large device. GEMV_ROWS: the "few rows" checks.
SIZES = {"cpu": ((128, 128), 2, 1), "gpu": ((1024, 512), 8, 2)}
GEMV_ROWS = 3


def kind(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else "gpu"


def random_layer(k: int, n: int, bits: float, codebook: str, device: torch.device, seed: int,
                 experts: int | None = None):
    """A random EXL3 layer (any 16-bit pattern is a valid trellis), made on the CPU from `seed`, moved to `device`."""
    g = torch.Generator().manual_seed(seed)
    lead = () if experts is None else (experts,)
    trellis = torch.randint(-32768, 32768, (*lead, k // 16, n // 16, reference.words_per_tile(bits)), generator=g,
                            dtype=torch.int16, device="cpu")
    suh = (torch.randn(*lead, k, generator=g, dtype=torch.float32, device="cpu") * 0.05).half()
    svh = (torch.randn(*lead, n, generator=g, dtype=torch.float32, device="cpu") * 0.05).half()
    return trellis.to(device), suh.to(device), svh.to(device)


def random_normal(*shape: int, seed: int) -> torch.Tensor:
    """fp32 normal samples made on the CPU whatever the caller's default dtype and device (vLLM loads weights
    under its model dtype as the default), so the checks feed the same values everywhere."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32, device="cpu")


def relative_error(y: torch.Tensor, expected: torch.Tensor) -> float:
    y, expected = y.detach().double().cpu(), expected.detach().double().cpu()
    if not torch.isfinite(y).all():
        return float("nan")
    return ((y - expected).norm() / expected.norm()).item()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu":
        torch.xpu.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> tuple[object, float]:
    """The first call's result (a tensor is copied: the timed calls must not overwrite what is checked, their split-K
    partials are no longer NaN) and its wall time in µs: one call on the CPU, else a warm average after it."""
    start = time.perf_counter()
    out = fn()
    sync(device)
    us = (time.perf_counter() - start) * 1e6
    if isinstance(out, torch.Tensor):
        out = out.clone()
    if device.type != "cpu":
        reps = 5
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(device)
        us = (time.perf_counter() - start) * 1e6 / reps
    return out, us


def interpreted(device: torch.device) -> bool:
    return device.type == "cpu"


def counters_clear(launch) -> bool:
    from exl3local.kernels.bound import Workspace

    ws = Workspace._live.get((launch.device, launch.stream()))
    return ws is None or int(ws.counters.abs().sum()) == 0


def compare(y: torch.Tensor, expected: torch.Tensor, launch=None, path: str = "") -> tuple[bool, float, str]:
    err = relative_error(y, expected)
    if err != err:  # NaN: a non-finite output
        return False, err, ("non-finite output (a u or split-K partial read before it was stored? "
                           "the barriers of kernels/triton_sync.py)")
    if err > tolerance(y.dtype, path):
        return False, err, f"relative error {err:.3g} > {tolerance(y.dtype, path):.3g}"
    if launch is not None and not counters_clear(launch):
        return False, err, "split-K block counters not reset after the launch"
    return True, err, ""

