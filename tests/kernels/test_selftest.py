"""Kernel self-test (kernels/selftest.py): a kernel that mismatches the reference or fails to run is not chosen,
the next candidate serves, and the verdict reaches whoever publishes it; the Triton checks catch a split-K result
read from an unfinished (NaN) workspace."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from exl3local.errors import NoKernelError
from exl3local.kernels import (KernelSpec, dispatch, prepare, reference, selftest, selftest_checks, selftest_compare,
                               selftest_triton)
from exl3local.kernels.dispatch import TorchReferenceKernel, TritonLinearKernel

SPEC = KernelSpec(128, 128, 3, "mcg")


class OffByOnePercent(TorchReferenceKernel):
    """Stands for a kernel whose device code miscomputes: the reference's output, 1% too large."""

    backend = "cpu"

    def apply(self, x, trellis, suh, svh, bias=None):
        return super().apply(x, trellis, suh, svh, bias) * 1.01


class DoesNotCompile(TorchReferenceKernel):
    backend = "cpu"

    def apply(self, x, trellis, suh, svh, bias=None):
        raise RuntimeError("PassManager::run failed")


@pytest.fixture
def fresh(monkeypatch):
    """Empty verdict cache, no publisher, checks on (whatever the environment says)."""
    monkeypatch.setattr(selftest, "_VERDICTS", {})
    monkeypatch.setattr(selftest, "_RESULTS", [])
    monkeypatch.setattr(selftest, "_publish", None)
    monkeypatch.setenv("EXL3LOCAL_KERNEL_SELFTEST", "auto")


@pytest.mark.parametrize("broken,why", [(OffByOnePercent, "relative error"), (DoesNotCompile, "PassManager::run")])
def test_a_kernel_that_fails_its_check_is_not_chosen(fresh, monkeypatch, broken, why):
    monkeypatch.setitem(dispatch.CANDIDATES, "cpu", (broken, TorchReferenceKernel))
    heard = []
    selftest.set_publisher(lambda results, refused: heard.append((results, refused)))
    kernel = prepare(SPEC, "cpu")
    assert isinstance(kernel, TorchReferenceKernel) and type(kernel) is TorchReferenceKernel
    (results, refused), = heard  # one verdict, published once
    assert any(not r.ok and why in r.detail for r in results)
    assert refused and all(why in reason and "3-bit mcg" in reason for reason in refused.values())
    prepare(SPEC, "cpu")  # the verdict is cached: no second run, no second publication
    assert len(heard) == 1


def test_forcing_a_failed_kernel_lists_the_self_test_as_its_refusal(fresh, monkeypatch):
    monkeypatch.setitem(dispatch.CANDIDATES, "cpu", (OffByOnePercent, TorchReferenceKernel))
    with pytest.raises(NoKernelError) as info:
        prepare(SPEC, "cpu", backend="cpu")
    assert any(r.startswith("OffByOnePercent: self-test") for r in info.value.reasons)


def test_switched_off_the_kernel_is_used_unchecked(fresh, monkeypatch):
    monkeypatch.setenv("EXL3LOCAL_KERNEL_SELFTEST", "0")
    monkeypatch.setitem(dispatch.CANDIDATES, "cpu", (OffByOnePercent, TorchReferenceKernel))
    assert type(prepare(SPEC, "cpu")) is OffByOnePercent


def test_a_good_kernel_passes_and_serves(fresh, monkeypatch):
    class Good(TorchReferenceKernel):
        backend = "cpu"

    monkeypatch.setitem(dispatch.CANDIDATES, "cpu", (Good, TorchReferenceKernel))
    assert type(prepare(SPEC, "cpu")) is Good
    assert selftest.results() and all(r.ok and r.error < selftest.TOLERANCE for r in selftest.results())


interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                 reason="Triton on CPU needs TRITON_INTERPRET=1 (scripts/test sets it)")


@interpreted
def test_triton_checks_pass_at_one_rate():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    got = selftest.run_kernel(TritonLinearKernel, 2.5, "mul1", device)
    assert {r.path for r in got} >= {"decode", "gemv", "gemv_split_k", "gemv_one_row", "gemv_one_launch",
                                     "reconstruct_gemm", "moe_decode", "moe_one_launch"}
    assert all(r.ok for r in got), [r for r in got if not r.ok]


@interpreted
def test_a_failing_one_launch_path_switches_only_itself_off(fresh, monkeypatch):
    """Decode rows of small layers run as one launch (the matmul programs transform x), the rest as two: each path is
    checked on its own, and a one-launch path that reads its u too early (NaN here) takes only itself out of service:
    the kernel stays, and layers bound afterwards take two launches."""
    from exl3local.kernels import bound

    real = bound.FusedLaunch.launch

    def early_read_in_one_launch(self, x, y, rows, *args, **kwargs):
        real(self, x, y, rows, *args, **kwargs)
        if self.one_launch_on and any(plan[0] is None for plan in self.plans.values()):
            y.view(-1)[:1] = float("nan")

    monkeypatch.setattr(bound.FusedLaunch, "launch", early_read_in_one_launch)
    monkeypatch.setenv("EXL3LOCAL_KERNEL_SELFTEST", "1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert selftest.one_launch_refusal(device) is None
    assert selftest.refusal(TritonLinearKernel, 2.5, "mul1", device) is None  # the two-launch checks passed
    failed = {r.path for r in selftest.results() if not r.ok}
    assert failed == {"gemv_one_launch", "moe_one_launch"}, failed
    assert "gemv_one_launch failed" in selftest.one_launch_refusal(device)
    assert "two launches" in selftest.refused_paths()["gemv_one_launch"]
    trellis, suh, svh = selftest_compare.random_layer(128, 128, 2.5, "mul1", device, seed=0)
    assert not bound.FusedLaunch(trellis, suh, svh, 2.5, "mul1").one_launch_on


@interpreted
def test_split_k_read_of_an_unfinished_workspace_is_caught(monkeypatch):
    """A launch whose output took what the split-K partials held before this launch stored them (a last split
    that passed the barrier too early) fails gemv_split_k: the check filled the workspace with NaN."""
    from exl3local.kernels import bound

    real = bound.FusedLaunch.launch

    def skipped_handshake(self, x, y, rows, *args, **kwargs):
        ws = bound.Workspace._live.get((self.device, self.stream()))
        before = ws.partials[: y.numel()].clone() if ws is not None else None
        real(self, x, y, rows, *args, **kwargs)
        if before is not None and self.split_for(1)[0] > 1:
            y.view(-1)[:1] = before[:1].to(y.dtype)  # one element read early is enough to be wrong

    monkeypatch.setattr(bound.FusedLaunch, "launch", skipped_handshake)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    checks = selftest_triton.triton_checks(device)
    shape = selftest_compare.SIZES[selftest_compare.kind(device)][0]
    ok, _, _, detail = checks["gemv_split_k"](4, "3inst", device, shape)
    assert not ok and "non-finite" in detail


def test_a_launch_that_writes_other_bits_when_repeated_fails_its_check(monkeypatch):
    """A race between a program's threads need not show in one launch: the checks over a NaN workspace launch again
    (refilled) and refuse a path whose repeat writes other bits, though each output is within tolerance. The
    check without a NaN workspace (no hand-off through global memory to race on) does not repeat."""
    from exl3local.kernels import bound

    real = bound.FusedLaunch.launch

    def last_bit_off_when_repeated(self, x, y, rows, *args, **kwargs):
        real(self, x, y, rows, *args, **kwargs)
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls > 1:  # a relative 2**-8: far inside the tolerance, but other bits
            y.view(-1)[:1] *= 1 + 2**-8

    monkeypatch.setattr(bound.FusedLaunch, "launch", last_bit_off_when_repeated)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    checks = selftest_triton.triton_checks(device)
    shape = selftest_compare.SIZES[selftest_compare.kind(device)][0]
    for path in ("gemv_split_k", "gemv_one_launch"):
        ok, err, _, detail = checks[path](4, "3inst", device, shape)
        assert not ok and err < selftest_compare.TOLERANCE and "differs from the first" in detail, (path, detail)
    ok, _, _, detail = checks["gemv"](4, "3inst", device, shape)
    assert ok, detail


def test_tiled_path_is_checked_only_where_it_is_on(monkeypatch):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.delenv("EXL3LOCAL_TILED_MAX_ROWS", raising=False)
    assert "gemv_tiled" not in selftest_triton.triton_checks(device)
    monkeypatch.setenv("EXL3LOCAL_TILED_MAX_ROWS", "64")
    check = selftest_triton.triton_checks(device)["gemv_tiled"]
    ok, err, _, detail = check(3, "mcg", device, selftest_compare.SIZES[selftest_compare.kind(device)][0])
    assert ok and err < selftest_compare.TOLERANCE, detail


def test_every_rate_is_listed():
    got = selftest.rates()
    assert len(got) == 3 * 8 + 3 and ("mul1", 3.5) in got and ("3inst", 1.5) not in got
    for codebook, bits in got:
        reference.check_bits(bits, codebook)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() and not (hasattr(torch, "xpu") and torch.xpu.is_available()),
                    reason="needs a CUDA or XPU device")
def test_every_path_and_rate_on_the_gpu():
    data = selftest.report(selftest.default_device())
    failed = [r for r in data["results"] if not r["ok"]]
    assert not failed, failed
    paths = {r["path"] for r in data["results"]}
    assert {"decode", "gemv_split_k", "moe_decode", "bound_direct", "reference"} <= paths
    assert data["benchmarks"] and all("us" in b for b in data["benchmarks"]), data["benchmarks"]


def test_direct_launch_only_where_tested_and_not_refuted(fresh, monkeypatch):
    import triton

    cuda = torch.device("cuda", 0)
    here = selftest.release_of(triton.__version__)
    monkeypatch.setattr(selftest, "DIRECT_LAUNCH_TESTED", {"cuda": ((3, 6),)})
    if here != (3, 6):
        assert "untested with Triton" in selftest.direct_launch_refusal(cuda)
    monkeypatch.setattr(selftest, "DIRECT_LAUNCH_TESTED", {"cuda": (here,)})
    assert selftest.direct_launch_refusal(cuda) is None
    assert "untested" in selftest.direct_launch_refusal(torch.device("xpu", 0))  # another backend: not tested
    selftest._RESULTS.append(selftest.Result("bound_direct", "TritonLinearKernel", "mul1", 4.0, False, 0.5, None,
                                             "direct launch differs from Triton's"))
    assert "bound_direct failed" in selftest.direct_launch_refusal(cuda)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the direct launch exists on compiled devices only")
def test_bound_launches_take_tritons_path_where_the_direct_launch_is_refused(fresh, monkeypatch):
    from exl3local.kernels.bound import FusedLaunch

    trellis, suh, svh = selftest_compare.random_layer(256, 256, 4, "mul1", torch.device("cuda"), seed=0)
    monkeypatch.setattr(selftest, "DIRECT_LAUNCH_TESTED", {})
    assert FusedLaunch(trellis, suh, svh, 4, "mul1").fused.hooks is None  # never caches: Triton's launch
    import triton

    monkeypatch.setattr(selftest, "DIRECT_LAUNCH_TESTED", {"cuda": (selftest.release_of(triton.__version__),)})
    assert FusedLaunch(trellis, suh, svh, 4, "mul1").fused.hooks is not None


def test_triton_gemv_failing_on_a_gpu_falls_to_the_reconstruct_kernel_then_the_reference(fresh, monkeypatch):
    """The GPU order: TritonLinearKernel, TritonReconstructKernel (another Triton config: dense W_r per call), the
    reference. The checks are stood in for (no GPU here); the choice and its reasons are the dispatch's own."""
    from exl3local.kernels import selftest_checks
    from exl3local.kernels.dispatch import DeviceInfo, TritonReconstructKernel, choose_kernel

    def failing(*args):
        return False, float("nan"), None, "non-finite output"

    def passing(*args):
        return True, 0.0, 1.0, ""

    broken = {"TritonLinearKernel"}
    monkeypatch.setattr(selftest_checks, "checks_for", lambda kernel, device, bits, codebook, dtype=None: {
        "gemv_split_k" if kernel.backend == "triton" else "reconstruct_gemm":
            failing if kernel.__name__ in broken else passing})
    monkeypatch.setattr(TritonLinearKernel, "refuse", classmethod(lambda cls, spec, device: None))
    cuda = DeviceInfo("cuda")
    assert choose_kernel(SPEC, cuda, verify=torch.device("cuda", 0)) is TritonReconstructKernel
    broken.add("TritonReconstructKernel")
    spec = KernelSpec(128, 128, 4, "mul1")  # another rate: checked afresh
    assert choose_kernel(spec, cuda, verify=torch.device("cuda", 0)) is TorchReferenceKernel
    assert set(selftest.refused_paths()) >= {"gemv", "reconstruct_gemm", "moe_decode"}


@interpreted
def test_reconstruct_kernel_matches_the_reference_and_passes_its_checks():
    from exl3local.kernels.dispatch import DeviceInfo, TritonReconstructKernel

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    trellis, suh, svh = selftest_compare.random_layer(128, 256, 3, "mcg", device, seed=4)
    x = torch.randn(2, 5, 128).half().to(device)
    y = TritonReconstructKernel(KernelSpec(128, 256, 3, "mcg"), DeviceInfo.of(device)).apply(x, trellis, suh, svh)
    expected = reference.linear(x.cpu().float(), trellis.cpu(), suh.cpu(), svh.cpu(), 3, "mcg")
    assert y.shape == (2, 5, 256) and selftest_compare.relative_error(y, expected) < selftest.TOLERANCE
    got = selftest.run_kernel(TritonReconstructKernel, 3, "mcg", device)
    assert [r.path for r in got] == ["decode", "reconstruct_gemm"] and all(r.ok for r in got)



@pytest.mark.parametrize("broken", ["weight_form_gemm", "product_form_gemm"])
def test_the_reconstruct_check_refuses_either_form_that_is_wrong(monkeypatch, broken):
    """Both forms serve (the Hadamard on the product up to HY_MAX_ROWS rows, W_r above: every prefill chunk past
    it): a form that is wrong fails the check although the check's own row count is served by the other one."""
    from exl3local.kernels import triton_gemm

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if broken == "product_form_gemm" and not triton_gemm.has_fp32_product(device):
        pytest.skip("no fp32-output matmul here: the product form never serves")
    right = getattr(triton_gemm, broken)
    wrong = functools.wraps(right)(lambda *args, **kwargs: right(*args, **kwargs) * 1.01)
    monkeypatch.setattr(triton_gemm, broken, wrong)
    ok, _, _, why = selftest_triton._check_reconstruct(3, "mcg", device, (128, 256))
    assert not ok and why.startswith(broken), why

def test_each_activation_dtype_gets_its_own_verdict(fresh, monkeypatch):
    """bf16 and fp16 layers compile different kernel variants: a kernel broken for one dtype still serves the
    other."""

    class BrokenInBf16(TorchReferenceKernel):
        backend = "cpu"

        def apply(self, x, trellis, suh, svh, bias=None):
            y = super().apply(x, trellis, suh, svh, bias)
            return y * 1.01 if x.dtype == torch.bfloat16 else y

    monkeypatch.setitem(dispatch.CANDIDATES, "cpu", (BrokenInBf16, TorchReferenceKernel))
    assert type(prepare(KernelSpec(128, 128, 3, "mcg", torch.float16), "cpu")) is BrokenInBf16
    assert type(prepare(KernelSpec(128, 128, 3, "mcg", torch.bfloat16), "cpu")) is TorchReferenceKernel
    assert {r.dtype for r in selftest.results()} == {"float16", "bfloat16"}


def test_a_correct_kernel_with_bf16_activations_passes_at_every_rate():
    """bf16 outputs round coarser than fp16: the reference's own answer cast to bf16 measured up to 2.2e-3
    relative here (3-bit mul1), above the fp16 tolerance; a correct kernel must not be refused for that."""

    class Bf16Reference(TorchReferenceKernel):
        backend = "cpu"

    for codebook, bits in selftest.rates():
        got = selftest_checks.run_kernel(Bf16Reference, bits, codebook, torch.device("cpu"), dtype=torch.bfloat16)
        assert got and all(r.ok for r in got), got


def skip_without_the_cpu_library() -> None:
    from exl3local.kernels.dispatch import CpuLinearKernel

    if CpuLinearKernel.refuse(KernelSpec(128, 128, 4, "mul1"), dispatch.DeviceInfo.of(torch.device("cpu"))):
        pytest.skip("the CPU library is not built here")


def test_the_cpu_librarys_checks_are_named_for_the_path_that_serves_their_activations():
    """The load-time check of bf16 and fp16 rows past the GEMV crossover runs the AMX GEMM where the CPU has it (fp16
    rows up to ops.AMX_U_MAX_ROWS: the u split): its result must carry that path's name, as the dashboard's counters
    do, not the fp32 GEMM's; fp16's most rows (past AMX_U_MAX_ROWS) take the fp32 GEMM on every CPU, and their check
    is named so."""
    from exl3local.kernels.cpu import ops
    from exl3local.kernels.dispatch import CpuLinearKernel

    skip_without_the_cpu_library()
    amx = ops.amx_active(ops.library())
    bf16 = selftest_checks.checks_for(CpuLinearKernel, torch.device("cpu"), dtype=torch.bfloat16)
    fp16 = selftest_checks.checks_for(CpuLinearKernel, torch.device("cpu"), dtype=torch.float16)
    assert ("cpu_gemm_amx" in bf16) == amx and ("cpu_gemm_amx" in fp16) == amx, (list(bf16), list(fp16))
    assert ("cpu_gemm" in bf16) != amx, list(bf16)
    assert selftest_checks.MANY_ROWS > ops.AMX_U_MAX_ROWS and "cpu_gemm" in fp16, list(fp16)


def test_the_cpu_gemm_check_refuses_either_amx_form_that_is_wrong(monkeypatch):
    """bf16 rows past the GEMV run the u split up to AMX_U_MAX_ROWS and the W' planes above (every longer prefill
    chunk): a wrong W' form fails the load-time check although the check's first row count takes the u split."""
    from exl3local.kernels.cpu import ops
    from exl3local.kernels.dispatch import CpuLinearKernel

    skip_without_the_cpu_library()
    if not ops.amx_active(ops.library()):
        pytest.skip("no AMX here: one GEMM form serves")
    right = ops.CpuLinear._gemm_amx

    def wrong_past_the_u_split(self, x, *args, **kwargs):
        y = right(self, x, *args, **kwargs)
        return y * 1.01 if x.shape[0] > ops.AMX_U_MAX_ROWS else y

    check = selftest_checks.checks_for(CpuLinearKernel, torch.device("cpu"), dtype=torch.bfloat16)["cpu_gemm_amx"]
    ok, _, _, why = check(4, "mul1", torch.device("cpu"), (128, 128))
    assert ok, why
    monkeypatch.setattr(ops.CpuLinear, "_gemm_amx", wrong_past_the_u_split)
    ok, _, _, why = check(4, "mul1", torch.device("cpu"), (128, 128))
    assert not ok and why.startswith(f"at {selftest_checks.MANY_ROWS} rows"), why


def test_the_cpu_gemv_check_runs_its_multi_row_loop():
    """The CPU GEMV serves one row through one loop and 2 rows up to its crossover through another (rows held in
    registers, a pass per group): the load-time check of that path runs both, so a wrong multi-row loop is refused
    although one row is right."""
    from exl3local.kernels.cpu import ops
    from exl3local.kernels.dispatch import CpuLinearKernel

    skip_without_the_cpu_library()
    name, check = next(iter(selftest_checks.checks_for(CpuLinearKernel, torch.device("cpu")).items()))
    ok, _, _, why = check(4, "mul1", torch.device("cpu"), (128, 128))
    assert ok, why
    right = ops.CpuLinear.__call__

    def wrong_past_one_row(self, x, *args, **kwargs):
        y = right(self, x, *args, **kwargs)
        return y * 1.01 if 1 < x.shape[0] <= self.gemv_rows else y

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ops.CpuLinear, "__call__", wrong_past_one_row)
        ok, _, _, why = check(4, "mul1", torch.device("cpu"), (128, 128))
    assert not ok and why.startswith("at 3 rows"), (name, why)


@pytest.mark.parametrize("int8", [False, True])
def test_each_cpu_check_runs_only_rows_its_path_serves(monkeypatch, int8):
    """A CPU check is named by a path and must run only rows that path serves: with int8 on, one row is int8's, 2
    rows up to the crossover the exact GEMV's, past it the GEMM path's (a check named by the GEMV once ran 64 rows)."""
    from exl3local.kernels.dispatch import CpuLinearKernel

    cpu = torch.device("cpu")
    skip_without_the_cpu_library()
    monkeypatch.setenv("EXL3LOCAL_CPU_INT8", "1" if int8 else "0")
    monkeypatch.setattr(selftest_checks, "_check_apply", lambda kernel, rows, dtype: rows)
    checks = selftest_checks.checks_for(CpuLinearKernel, cpu)
    instance = CpuLinearKernel(KernelSpec(*selftest_checks.SIZES[selftest_checks.kind(cpu)][0], 4, "mul1"),
                               dispatch.DeviceInfo.of(cpu))
    for name, rows in checks.items():
        assert {str(instance.path_for(r)) for r in rows} == {name}, (name, rows)
    assert set(checks) == {str(instance.path_for(r)) for r in range(1, selftest_checks.MANY_ROWS + 1)}
