"""The kernel self-test's checks (kernels/selftest.py runs them): each one builds a small random EXL3 layer on the
device, runs one kernel path and compares it with the bit-exact reference decoder (kernels/reference.py).

Checks of the Triton kernel (any exception, a compile error included, is a failure with its message):
    decode            Ŵ from the ring decode equals reference.decode_trellis bit for bit
    gemv              the fused launch (input transform, decode matmul, output transform) at a few rows
    gemv_split_k      the same with split-K forced over a NaN-filled workspace: a partial read before its
                      store → barrier → acq_rel handshake completed shows up as NaN (or as a wrong sum)
    gemv_one_row      one row (the FMA ring kernel at FMA_ONE_ROW_BITS), split-K over NaN as well
    gemv_tiled        only with EXL3LOCAL_TILED_MAX_ROWS on: 17 rows through the 64-row tiled launch, split-K
                      over NaN as well (a failure refuses the whole Triton kernel, as any check does)
    reconstruct_gemm  more than GEMV_MAX_ROWS rows: the vendor matmul with W_r, and with Ŵ then H on y
    moe_decode        grouped (token, expert) units through one launch per projection, over NaN
    bound_direct      the bound launcher's direct call (Triton's compiled-kernel ABI) against Triton's own
                      launch, bit for bit; compiled devices only (the interpreter has no direct call)
Any other kernel (the CPU library) is checked through its `apply` on both sides of its row crossover; the
reference checks itself on the device against the CPU. Outputs must be finite and within TOLERANCE (relative
norm error) of reference.linear; the workspace's block counters must be back at zero after each split-K launch.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from exl3local.kernels import reference
from exl3local.kernels.codebook import CODEBOOKS

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
    dtype: str = "float16"  # the activations' dtype the check fed (the MoE check: float32 whatever this says)

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
                            dtype=torch.int16, device="cpu")
    suh = (torch.randn(*lead, k, generator=g, dtype=torch.float32, device="cpu") * 0.05).half()
    svh = (torch.randn(*lead, n, generator=g, dtype=torch.float32, device="cpu") * 0.05).half()
    return trellis.to(device), suh.to(device), svh.to(device)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    """fp32 normal samples made on the CPU whatever the caller's default dtype and device (vLLM loads weights
    under its model dtype as the default), so the checks feed the same values everywhere."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32, device="cpu")


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
    """The first call's result (a tensor is copied: the timed calls must not overwrite what is checked, their split-K
    partials are no longer NaN) and its wall time in µs: one call on the CPU, else a warm average after it."""
    start = time.perf_counter()
    out = fn()
    _sync(device)
    us = (time.perf_counter() - start) * 1e6
    if isinstance(out, torch.Tensor):
        out = out.clone()
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


def _compare(y: torch.Tensor, expected: torch.Tensor, launch=None, path: str = "") -> tuple[bool, float, str]:
    err = _rel_err(y, expected)
    if err != err:  # NaN: a non-finite output
        return False, err, "non-finite output (a split-K partial read before it was stored?)"
    if err > tolerance(y.dtype, path):
        return False, err, f"relative error {err:.3g} > {tolerance(y.dtype, path):.3g}"
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


def kind(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else "gpu"


def _force_splits(launch, m_blocks: int) -> int:
    """The most K splits (a power of two up to the device kind's limit) the layer allows, for m_blocks blocks."""
    most = SIZES[kind(launch.device)][1]
    splits = 1
    while splits < most and launch.k_steps % (splits * 2) == 0:
        splits *= 2
    launch.splits[m_blocks] = (splits, launch.k_steps // splits)
    return splits


def _into(launch, x: torch.Tensor, y: torch.Tensor, rows: int) -> torch.Tensor:
    launch.launch(x, y, rows)
    return y


def _check_gemv(bits, codebook, device, shape, rows: int, split: bool, dtype: torch.dtype = torch.float16):
    trellis, suh, svh = _layer(*shape, bits, codebook, device, seed=2)
    x = _randn(rows, shape[0], seed=3).to(dtype).to(device)
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
    out, us = _timed(lambda: _into(launch, x, y, rows), device)
    expected = reference.linear(x.cpu().float(), trellis.cpu(), suh.cpu(), svh.cpu(), bits, codebook)
    ok, err, why = _compare(out, expected, launch if split else None)
    return ok, err, us, why


def _check_tiled(bits, codebook, device, shape, dtype: torch.dtype = torch.float16):
    from exl3local.kernels.bound import MAX_ROWS

    rows = MAX_ROWS + 1  # one 64-row tile, its last 47 rows masked
    trellis, suh, svh = _layer(*shape, bits, codebook, device, seed=12)
    x = _randn(rows, shape[0], seed=13).to(dtype).to(device)
    launch = _split_launch(trellis, suh, svh, bits, codebook)
    steps, splits = launch.tiled_fixed["k_steps"], 1
    while splits < SIZES[kind(device)][1] and steps % (splits * 2) == 0:
        splits *= 2
    launch.tiled_splits[1] = (splits, steps // splits)
    _nan_workspace(launch, rows)
    y = torch.empty(rows, shape[1], dtype=x.dtype, device=device)
    out, us = _timed(lambda: _into(launch, x, y, rows), device)
    expected = reference.linear(x.cpu().float(), trellis.cpu(), suh.cpu(), svh.cpu(), bits, codebook)
    ok, err, why = _compare(out, expected, launch)
    return ok, err, us, why


def _check_reconstruct(bits, codebook, device, shape, dtype: torch.dtype = torch.float16):
    """Each form of the path that serves some row count here (triton_gemm.hadamard_on_y), at the fewest rows."""
    from exl3local.kernels import triton_gemm
    from exl3local.kernels.dispatch import GEMV_MAX_ROWS

    trellis, suh, svh = _layer(*shape, bits, codebook, device, seed=4)
    x = _randn(GEMV_MAX_ROWS + 1, shape[0], seed=5).to(dtype).to(device)
    expected = reference.linear(x.cpu().float(), trellis.cpu(), suh.cpu(), svh.cpu(), bits, codebook)
    forms = [triton_gemm.weight_form_gemm]
    if triton_gemm.has_fp32_product(x.device):
        forms.append(triton_gemm.product_form_gemm)
    errors = []
    for form in forms:
        y, us = _timed(lambda: form(x, trellis, suh, svh, bits, codebook), device)
        ok, err, why = _compare(y, expected)
        if not ok:
            return ok, err, us, f"{form.__name__}: {why}"
        errors.append(err)
    return True, max(errors), us, ""


def _check_moe(bits, codebook, device, shape):
    from exl3local.kernels.triton_moe import moe_units

    tokens = SIZES[kind(device)][2]
    trellis, suh, svh = _layer(*shape, bits, codebook, device, seed=6, experts=MOE_EXPERTS)
    x = _randn(tokens, shape[0], seed=7).to(device)
    ids = torch.tensor(MOE_IDS[:tokens], dtype=torch.int32, device=device)
    launch = _split_launch(trellis, suh, svh, bits, codebook, experts=True)
    _force_splits(launch, ids.numel())
    _nan_workspace(launch, ids.numel())
    y, us = _timed(lambda: moe_units(launch, x, ids), device)
    cpu = (trellis.cpu(), suh.cpu(), svh.cpu())
    expected = torch.stack([
        torch.stack([reference.linear(x[t : t + 1].cpu(), cpu[0][e], cpu[1][e], cpu[2][e], bits, codebook)[0]
                     for e in ids[t].tolist()])
        for t in range(tokens)
    ])  # fmt: skip
    ok, err, why = _compare(y, expected, launch)
    return ok, err, us, why


def _check_direct(bits, codebook, device, shape, dtype: torch.dtype = torch.float16):
    """Bound launches: the first call per signature goes through Triton's launch, the next ones hand the compiled
    kernel its arguments directly (Triton's private CompiledKernel.run ABI). Both must write the same bits. Run
    with the direct path forced on, so an untested Triton reports whether it would work."""
    trellis, suh, svh = _layer(*shape, bits, codebook, device, seed=8)
    x = _randn(GEMV_ROWS, shape[0], seed=9).to(dtype).to(device)
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


def triton_checks(device: torch.device, dtype: torch.dtype = torch.float16) -> dict[str, Callable]:
    """name -> check(bits, codebook, device, shape), in the order they run; `dtype`: the layer's activations
    (the MoE check always feeds fp32, as the MoE ladder does)."""
    checks: dict[str, Callable] = {
        "decode": _check_decode,
        "gemv": lambda b, c, d, s: _check_gemv(b, c, d, s, GEMV_ROWS, split=False, dtype=dtype),
        "gemv_split_k": lambda b, c, d, s: _check_gemv(b, c, d, s, GEMV_ROWS, split=True, dtype=dtype),
        "gemv_one_row": lambda b, c, d, s: _check_gemv(b, c, d, s, 1, split=True, dtype=dtype),
        "reconstruct_gemm": lambda b, c, d, s: _check_reconstruct(b, c, d, s, dtype),
        "moe_decode": _check_moe,
    }
    from exl3local.kernels.bound import MAX_ROWS, tiled_max_rows

    if tiled_max_rows() > MAX_ROWS:  # opt-in path: checked where it is on
        checks["gemv_tiled"] = lambda b, c, d, s: _check_tiled(b, c, d, s, dtype)
    if not _interpreted(device):
        checks["bound_direct"] = lambda b, c, d, s: _check_direct(b, c, d, s, dtype)
    return checks


def _check_reference(bits, codebook, device, shape):
    """The reference itself on this device: Ŵ bit-exact with the CPU's, the output within tolerance."""
    trellis, suh, svh = _layer(*shape, bits, codebook, device, seed=10)
    x = _randn(GEMV_ROWS, shape[0], seed=11).to(device)
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
        x = _randn(rows, shape[0], seed=rows).to(dtype).to(device)
        instance = kernel(KernelSpec(*shape, bits, codebook, dtype), DeviceInfo.of(device))
        y, us = _timed(lambda: instance.apply(x, trellis, suh, svh), device)
        ok, err, why = _compare(y, reference.linear(x.cpu().float(), trellis.cpu(), suh.cpu(), svh.cpu(), bits,
                                                    codebook), path=str(instance.path_for(rows)))
        return ok, err, us, why

    return check


def checks_for(kernel: type, device: torch.device, bits: float = 4, codebook: str = "mul1",
               dtype: torch.dtype = torch.float16) -> dict[str, Callable]:
    """name -> check(bits, codebook, device, shape) for a kernel class (dispatch.Exl3Kernel), in run order:
    the reference checks itself on the device; Triton gets its per-launch checks; any other kernel (the CPU
    library) is checked through `apply` on both sides of its row crossover."""
    if kernel.backend == "reference":
        return {"reference": _check_reference}
    if kernel.backend == "triton":
        return triton_checks(device, dtype)
    if kernel.backend == "triton_dense":  # Triton's decode and reconstruct kernels only
        checks = triton_checks(device, dtype)
        return {name: checks[name] for name in ("decode", "reconstruct_gemm")}
    from exl3local.kernels.dispatch import DeviceInfo, KernelSpec

    instance = kernel(KernelSpec(*SIZES[kind(device)][0], bits, codebook, dtype), DeviceInfo.of(device))
    few = instance.path_for(1)
    checks = {str(few): _check_apply(kernel, 1, dtype)}
    for rows in (4, 8, 16, 32, 64):
        many = instance.path_for(rows)
        if many != few:
            checks[str(many)] = _check_apply(kernel, rows, dtype)
            break
    return checks


def run_kernel(kernel: type, bits: float, codebook: str, device: torch.device,
               progress: Callable[[str], None] | None = None, dtype: torch.dtype = torch.float16) -> list[Result]:
    """Every check of `kernel` (a dispatch.Exl3Kernel class) at one rate on `device`, activations in `dtype`."""
    shape = SIZES[kind(device)][0]
    act = str(dtype).removeprefix("torch.")
    out = []
    for name, check in checks_for(kernel, device, bits, codebook, dtype).items():
        if progress is not None:
            progress(f"{kernel.__name__} {name} {bits:g}-bit {codebook}")
        try:
            got = check(bits, codebook, device, shape)
        except Exception as exc:  # a compile error, a launch failure, a device fault: this path is not used
            last = traceback.extract_tb(exc.__traceback__)[-1]
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            detail = f"{type(exc).__name__}: {text} ({last.filename.rsplit('/', 1)[-1]}:{last.lineno})"
            out.append(Result(name, kernel.__name__, codebook, bits, False, None, None, detail, act))
            continue
        if got is None:
            continue  # not applicable here (said in the check)
        ok, err, us, detail = got
        out.append(Result(name, kernel.__name__, codebook, bits, bool(ok), err, us, detail, act))
    return out
