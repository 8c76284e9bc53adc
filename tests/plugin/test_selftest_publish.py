"""Kernel self-test verdicts → the plugin's trace file (plugin.publish_selftest, set by register()) → the daemon's
kernel rows (engine/stats.kernel_summary, what the dashboard and GET /api/kernels show): every path a refused
kernel would have served is OFF with the failed check and rate, and a failed direct launch gets its own row."""

from __future__ import annotations

import time

import pytest
import torch

from exl3local.engine import stats
from exl3local.kernels import selftest, selftest_checks
from exl3local.kernels.dispatch import TritonLinearKernel
from exl3local.plugin import publish_selftest, register, trace


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setattr(selftest, "_VERDICTS", {})
    monkeypatch.setattr(selftest, "_RESULTS", [])
    monkeypatch.setattr(selftest, "_publish", None)
    monkeypatch.setattr(trace, "_COUNTERS", None)
    monkeypatch.setenv("EXL3LOCAL_TRACE_DIR", str(tmp_path))
    monkeypatch.setenv("EXL3LOCAL_KERNEL_SELFTEST", "1")
    return tmp_path


def test_register_sets_the_publisher(fresh):
    register()
    assert selftest._publish is publish_selftest


def test_refusals_reach_the_kernel_rows(fresh, monkeypatch):
    def broken_split_k(bits, codebook, device, shape):
        return False, float("nan"), None, "non-finite output (a split-K partial read before it was stored?)"

    def direct_differs(bits, codebook, device, shape):
        return False, 0.5, 1.0, "direct launch differs from Triton's"

    monkeypatch.setattr(selftest_checks, "checks_for", lambda kernel, device, bits, codebook, dtype=None: {
        "gemv_split_k": broken_split_k if bits == 2.5 else (lambda *a: (True, 0.0, 1.0, "")),
        "bound_direct": direct_differs})
    selftest.set_publisher(publish_selftest)
    cpu = torch.device("cpu")
    assert selftest.refusal(TritonLinearKernel, 2.5, "mul1", cpu).startswith("self-test gemv_split_k failed")
    assert selftest.refusal(TritonLinearKernel, 4, "mul1", cpu) is None  # bound_direct alone keeps the kernel
    rows = {r["path"]: r for r in stats.kernel_summary(trace.read_all(fresh), time.time(), "xpu")["paths"]}
    for path in ("gemv", "reconstruct_gemm", "moe_decode"):
        assert rows[path]["state"] == "latched_off"
        assert "2.5-bit mul1" in rows[path]["reason"] and "non-finite" in rows[path]["reason"]
    assert rows["bound_direct"]["state"] == "latched_off" and "Triton's own launch" in rows["bound_direct"]["reason"]
    flags = trace.counters().snapshot()["flags"]
    assert {r["path"] for r in flags["selftest"]} == {"gemv_split_k", "bound_direct"}
