"""The kernel self-test's checks (kernels/selftest.py runs them): each one builds a small random EXL3 layer on the
device, runs one kernel path and compares it with the bit-exact reference decoder (kernels/reference.py).

Checks of the Triton kernel (any exception, a compile error included, is a failure with its message):
    decode            Ŵ from the ring decode equals reference.decode_trellis bit for bit
    gemv              the two launches (input transform; decode matmul with the output transform) at a few rows
    gemv_split_k      the same with split-K forced over a NaN-filled workspace: a partial read before its
                      store → barrier → acq_rel handshake completed shows up as NaN (or as a wrong sum)
    gemv_one_row      one row (the FMA ring kernel at FMA_ONE_ROW_BITS), split-K over NaN as well
    gemv_one_launch   a few rows with the matmul programs transforming x themselves (kernels/bound.py's one launch
                      per projection), unsplit and split-K over NaN; a failure switches only that path off
    gemv_tiled        only with EXL3LOCAL_TILED_MAX_ROWS on: 17 rows through the 64-row tiled launch, split-K
                      over NaN as well (a failure refuses the whole Triton kernel, as any check does)
    reconstruct_gemm  more than GEMV_MAX_ROWS rows: the vendor matmul with W_r, and with Ŵ then H on y
    moe_decode        (token, expert) units, input transform and matmul, split-K over NaN
    moe_one_launch    the same units in one launch (each program transforms its unit's x); like gemv_one_launch
    bound_direct      the bound launcher's direct call (Triton's compiled-kernel ABI) against Triton's own
                      launch, bit for bit; compiled devices only (the interpreter has no direct call)
Any other kernel (the CPU library) is checked through its `apply` on both sides of its row crossover; the
reference checks itself on the device against the CPU. Outputs must be finite and within TOLERANCE (relative
norm error) of reference.linear; the workspace's block counters must be back at zero after each split-K launch.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from exl3local.kernels import reference
from exl3local.kernels.codebook import CODEBOOKS
from exl3local.kernels.selftest_compare import (GEMV_ROWS, SIZES, compare, kind, random_layer, random_normal,
                                               timed)
from exl3local.kernels.selftest_triton import triton_checks

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


def _check_reference(bits, codebook, device, shape):
    """The reference itself on this device: Ŵ bit-exact with the CPU's, the output within tolerance."""
    trellis, suh, svh = random_layer(*shape, bits, codebook, device, seed=10)
    x = random_normal(GEMV_ROWS, shape[0], seed=11).to(device)
    y, us = timed(lambda: reference.linear(x, trellis, suh, svh, bits, codebook), device)
    w = reference.decode_trellis(trellis, bits, codebook).cpu()
    if not torch.equal(w.view(torch.int16), reference.decode_trellis(trellis.cpu(), bits, codebook).view(torch.int16)):
        return False, None, us, f"Ŵ decoded on {device} differs from the CPU's"
    expected = x.cpu().double() @ reference.reconstruct(trellis.cpu(), suh.cpu(), svh.cpu(), bits, codebook).double()
    ok, err, why = compare(y, expected)
    return ok, err, us, why


def _check_apply(kernel, row_counts: tuple[int, ...], dtype: torch.dtype):
    """Any kernel through its own `apply` (what a layer calls) at each of `row_counts`: the check every kernel gets.
    The worst error is reported; the first row count that fails says so."""

    def check(bits, codebook, device, shape):
        from exl3local.kernels.dispatch import DeviceInfo, KernelSpec

        instance = kernel(KernelSpec(*shape, bits, codebook, dtype), DeviceInfo.of(device))
        errors = []
        for rows in row_counts:
            trellis, suh, svh = random_layer(*shape, bits, codebook, device, seed=12 + rows)
            x = random_normal(rows, shape[0], seed=rows).to(dtype).to(device)
            y, us = timed(lambda: instance.apply(x, trellis, suh, svh), device)
            ok, err, why = compare(y, reference.linear(x.cpu().float(), trellis.cpu(), suh.cpu(), svh.cpu(), bits,
                                                        codebook), path=str(instance.path_for(rows)))
            if not ok:
                return ok, err, us, f"at {rows} rows: {why}"
            errors.append(err)
        return True, max(errors), us, ""

    return check


# Past the one-row crossover, the CPU library's AMX GEMM has two exact forms: the u split up to 32 rows
# (kernels/cpu/ops.AMX_U_MAX_ROWS), the W' planes above. The last path's check runs at MANY_ROWS too, so the form
# that serves every longer prefill chunk is checked.
MANY_ROWS = 64


def checks_for(kernel: type, device: torch.device, bits: float = 4, codebook: str = "mul1",
               dtype: torch.dtype = torch.float16) -> dict[str, Callable]:
    """name -> check(bits, codebook, device, shape) for a kernel class (dispatch.Exl3Kernel), in run order:
    the reference checks itself on the device; Triton gets its per-launch checks; any other kernel (the CPU
    library) is checked through `apply` on every path that 1 to MANY_ROWS rows take, each under that path's name."""
    if kernel.backend == "reference":
        return {"reference": _check_reference}
    if kernel.backend == "triton":
        return triton_checks(device, dtype)
    if kernel.backend == "triton_dense":  # Triton's decode and reconstruct kernels only
        checks = triton_checks(device, dtype)
        return {name: checks[name] for name in ("decode", "reconstruct_gemm")}
    from exl3local.kernels.dispatch import DeviceInfo, KernelSpec

    instance = kernel(KernelSpec(*SIZES[kind(device)][0], bits, codebook, dtype), DeviceInfo.of(device))
    served: dict[str, list[int]] = {}
    for rows in (1, 3, 4, 8, 16, 32, MANY_ROWS):
        served.setdefault(str(instance.path_for(rows)), []).append(rows)
    # each path at its first row count, its second (a multi-row loop is other code than the one-row one) and its
    # last (the most rows it serves among these), named by the path that serves them: with int8 on, one row is
    # int8's, 2 rows up to the crossover the exact GEMV's, past it the GEMM path's
    return {path: _check_apply(kernel, tuple(dict.fromkeys((counts[0], *counts[1:2], counts[-1]))), dtype)
            for path, counts in served.items()}


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
