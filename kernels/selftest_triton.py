"""The Triton kernel's self-test checks (the list is in kernels/selftest_checks.py's docstring): each runs one
launch path of the fused, tiled, reconstruct or MoE kernels on a small random layer and compares it with the
bit-exact reference decoder; split-K checks run over a NaN-filled workspace."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from exl3local.kernels import reference
from exl3local.kernels.selftest_compare import (GEMV_ROWS, SIZES, compare, interpreted, kind, random_layer,
                                               random_normal, relative_error, timed)

# MoE check: top-2 of MOE_EXPERTS experts per token.
MOE_EXPERTS, MOE_IDS = 3, ((2, 0), (1, 2))


def _nan_workspace(launch, rows: int) -> None:
    """Size the workspace for `rows` and fill its inputs and partials with NaN (counters stay zero)."""
    from exl3local.kernels.bound import Workspace

    launch.reserve(rows)
    ws = Workspace._live[(launch.device, launch.stream())]
    ws.inputs.fill_(float("nan"))
    ws.partials.fill_(float("nan"))


def _repeats(device: torch.device) -> int:
    """Launches after the first over a refilled NaN workspace. A race between a program's threads (a u or a partial
    loaded before its store reached global memory: the barriers of kernels/triton_sync.py) need not show in one
    launch, and the kernels are deterministic, so every repeat must write the same bits. The interpreter runs
    programs one after another (no race to catch): one repeat there keeps the comparison itself tested."""
    return 1 if interpreted(device) else 3


def _unstable(launch, rows: int, run: Callable[[], torch.Tensor], first: torch.Tensor) -> str:
    """Why `run`, with the workspace refilled with NaN before each repeat, did not write `first`'s bits again;
    "" when every repeat did."""
    for repeat in range(1, _repeats(launch.device) + 1):
        _nan_workspace(launch, rows)
        again = run()
        if not torch.equal(again, first):
            return (f"launch {repeat + 1} over a NaN workspace differs from the first: a race between a program's "
                    "threads (kernels/triton_sync.py's barriers)")
    return ""


def _check_decode(bits, codebook, device, shape):
    from exl3local.kernels.triton_decode import decode_dense

    trellis, _, _ = random_layer(*shape, bits, codebook, device, seed=1)
    w, us = timed(lambda: decode_dense(trellis, bits, codebook), device)
    expected = reference.decode_trellis(trellis.cpu(), bits, codebook)
    same = torch.equal(w.cpu().view(torch.int16), expected.view(torch.int16))
    differ = int((w.cpu().view(torch.int16) != expected.view(torch.int16)).sum())
    return same, 0.0 if same else relative_error(w, expected), us, "" if same else f"{differ} decoded weights differ"


def _split_launch(trellis, suh, svh, bits, codebook, experts=False):
    from exl3local.kernels.bound import FusedLaunch

    return FusedLaunch(trellis, suh, svh, bits, codebook, experts=experts)



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


def _one_launch_served(launch) -> bool:
    """Whether a call of `launch` ran as one launch (the matmul programs transforming x: a plan without an input
    grid)."""
    return any(plan[0] is None for plan in launch.plans.values())


def _check_gemv(bits, codebook, device, shape, rows: int, split: bool, dtype: torch.dtype = torch.float16,
                one_launch: bool = False):
    """`rows` rows through the bound launch: two launches (input transform, then the matmul), or with `one_launch`
    the matmul programs transforming x themselves; `split`: split-K forced over a NaN-filled workspace."""
    trellis, suh, svh = random_layer(*shape, bits, codebook, device, seed=2)
    x = random_normal(rows, shape[0], seed=3).to(dtype).to(device)
    launch = _split_launch(trellis, suh, svh, bits, codebook)
    launch.one_launch_on = one_launch
    if not split:
        launch.splits[1] = (1, launch.k_steps)
        if one_launch:  # its u round trip through the workspace: a load before the store reads NaN
            _nan_workspace(launch, rows)
    else:
        if rows == 1 and launch.fma is not None:
            if launch.fma_split()[1] < 2:
                return None  # this device runs the one-row kernel unsplit at this shape
        elif _force_splits(launch, 1) < 2:
            return None
        _nan_workspace(launch, rows)
    y = torch.empty(rows, shape[1], dtype=x.dtype, device=device)
    out, us = timed(lambda: _into(launch, x, y, rows), device)
    if one_launch and not _one_launch_served(launch):
        return None  # this shape or row count is past the one-launch limits
    expected = reference.linear(x.cpu().float(), trellis.cpu(), suh.cpu(), svh.cpu(), bits, codebook)
    ok, err, why = compare(out, expected, launch if split else None)
    if ok and (split or one_launch):
        why = _unstable(launch, rows, lambda: _into(launch, x, y, rows), out)
        ok = not why
    return ok, err, us, why


def _check_one_launch(bits, codebook, device, shape, dtype: torch.dtype = torch.float16):
    """The one-launch path unsplit (its epilogue) and split-K over NaN (its u stores and the handshake)."""
    results = [_check_gemv(bits, codebook, device, shape, GEMV_ROWS, split, dtype, one_launch=True)
               for split in (False, True)]
    results = [got for got in results if got is not None]
    failed = [got for got in results if not got[0]]
    return (failed or results or [None])[0]


def _check_tiled(bits, codebook, device, shape, dtype: torch.dtype = torch.float16):
    from exl3local.kernels.bound import MAX_ROWS

    rows = MAX_ROWS + 1  # one 64-row tile, its last 47 rows masked
    trellis, suh, svh = random_layer(*shape, bits, codebook, device, seed=12)
    x = random_normal(rows, shape[0], seed=13).to(dtype).to(device)
    launch = _split_launch(trellis, suh, svh, bits, codebook)
    steps, splits = launch.tiled_fixed["k_steps"], 1
    while splits < SIZES[kind(device)][1] and steps % (splits * 2) == 0:
        splits *= 2
    launch.tiled_splits[1] = (splits, steps // splits)
    _nan_workspace(launch, rows)
    y = torch.empty(rows, shape[1], dtype=x.dtype, device=device)
    out, us = timed(lambda: _into(launch, x, y, rows), device)
    expected = reference.linear(x.cpu().float(), trellis.cpu(), suh.cpu(), svh.cpu(), bits, codebook)
    ok, err, why = compare(out, expected, launch)
    return ok, err, us, why


def _check_reconstruct(bits, codebook, device, shape, dtype: torch.dtype = torch.float16):
    """Each form of the path that serves some row count here (triton_gemm.hadamard_on_y), at the fewest rows."""
    from exl3local.kernels import triton_gemm
    from exl3local.kernels.dispatch import GEMV_MAX_ROWS

    trellis, suh, svh = random_layer(*shape, bits, codebook, device, seed=4)
    x = random_normal(GEMV_MAX_ROWS + 1, shape[0], seed=5).to(dtype).to(device)
    expected = reference.linear(x.cpu().float(), trellis.cpu(), suh.cpu(), svh.cpu(), bits, codebook)
    forms = [triton_gemm.weight_form_gemm]
    if triton_gemm.has_fp32_product(x.device):
        forms.append(triton_gemm.product_form_gemm)
    errors = []
    for form in forms:
        y, us = timed(lambda: form(x, trellis, suh, svh, bits, codebook), device)
        ok, err, why = compare(y, expected)
        if not ok:
            return ok, err, us, f"{form.__name__}: {why}"
        errors.append(err)
    return True, max(errors), us, ""


def _check_moe(bits, codebook, device, shape, one_launch: bool = False):
    """MoE units (token, expert) through one projection's experts, split-K over NaN: two launches, or with
    `one_launch` the matmul programs transforming each unit's x themselves."""
    from exl3local.kernels.triton_moe import moe_units

    tokens = SIZES[kind(device)][2]
    trellis, suh, svh = random_layer(*shape, bits, codebook, device, seed=6, experts=MOE_EXPERTS)
    x = random_normal(tokens, shape[0], seed=7).to(device)
    ids = torch.tensor(MOE_IDS[:tokens], dtype=torch.int32, device=device)
    launch = _split_launch(trellis, suh, svh, bits, codebook, experts=True)
    launch.one_launch_on = one_launch
    _force_splits(launch, ids.numel())
    _nan_workspace(launch, ids.numel())
    y, us = timed(lambda: moe_units(launch, x, ids), device)
    if one_launch and not _one_launch_served(launch):
        return None  # past the one-launch limits
    cpu = (trellis.cpu(), suh.cpu(), svh.cpu())
    expected = torch.stack([
        torch.stack([reference.linear(x[t : t + 1].cpu(), cpu[0][e], cpu[1][e], cpu[2][e], bits, codebook)[0]
                     for e in ids[t].tolist()])
        for t in range(tokens)
    ])  # fmt: skip
    ok, err, why = compare(y, expected, launch)
    if ok:
        why = _unstable(launch, ids.numel(), lambda: moe_units(launch, x, ids), y)
        ok = not why
    return ok, err, us, why


def _check_direct(bits, codebook, device, shape, dtype: torch.dtype = torch.float16):
    """Bound launches: the first call per signature goes through Triton's launch, the next ones hand the compiled
    kernel its arguments directly (Triton's private CompiledKernel.run ABI). Both must write the same bits. Run
    with the direct path forced on, so an untested Triton reports whether it would work."""
    trellis, suh, svh = random_layer(*shape, bits, codebook, device, seed=8)
    x = random_normal(GEMV_ROWS, shape[0], seed=9).to(dtype).to(device)
    launch = _split_launch(trellis, suh, svh, bits, codebook)
    runtime = getattr(getattr(sys.modules.get("triton"), "knobs", None), "runtime", None)
    if runtime is None:
        return None  # a Triton without knobs has no direct path at all
    for direct in (launch.input, launch.fused, launch.one, launch.fma):
        if direct is not None:
            direct.hooks = runtime
    first = torch.empty(GEMV_ROWS, shape[1], dtype=x.dtype, device=device)
    launch.launch(x, first, GEMV_ROWS)
    if not (launch.fused.compiled or launch.input.compiled or launch.one.compiled):
        return None  # a launch hook (a profiler) is set: every call takes Triton's path, nothing to compare
    second = torch.empty_like(first)
    _, us = timed(lambda: launch.launch(x, second, GEMV_ROWS), device)
    same = torch.equal(first.view(torch.int16), second.view(torch.int16))
    why = "" if same else "direct launch differs from Triton's"
    return same, 0.0 if same else relative_error(second, first), us, why


def triton_checks(device: torch.device, dtype: torch.dtype = torch.float16) -> dict[str, Callable]:
    """name -> check(bits, codebook, device, shape), in the order they run; `dtype`: the layer's activations
    (the MoE check always feeds fp32, as the MoE ladder does)."""
    checks: dict[str, Callable] = {
        "decode": _check_decode,
        "gemv": lambda b, c, d, s: _check_gemv(b, c, d, s, GEMV_ROWS, split=False, dtype=dtype),
        "gemv_split_k": lambda b, c, d, s: _check_gemv(b, c, d, s, GEMV_ROWS, split=True, dtype=dtype),
        "gemv_one_row": lambda b, c, d, s: _check_gemv(b, c, d, s, 1, split=True, dtype=dtype),
        "gemv_one_launch": lambda b, c, d, s: _check_one_launch(b, c, d, s, dtype),
        "reconstruct_gemm": lambda b, c, d, s: _check_reconstruct(b, c, d, s, dtype),
        "moe_decode": _check_moe,
        "moe_one_launch": lambda b, c, d, s: _check_moe(b, c, d, s, one_launch=True),
    }
    from exl3local.kernels.bound import MAX_ROWS, tiled_max_rows

    if tiled_max_rows() > MAX_ROWS:  # opt-in path: checked where it is on
        checks["gemv_tiled"] = lambda b, c, d, s: _check_tiled(b, c, d, s, dtype)
    if not interpreted(device):
        checks["bound_direct"] = lambda b, c, d, s: _check_direct(b, c, d, s, dtype)
    return checks


