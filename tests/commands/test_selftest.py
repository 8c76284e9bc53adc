"""`exl3local selftest [--json]` from the real CLI in a subprocess: the report's shape, on this CPU machine.

Triton's interpreter is switched off here (TRITON_INTERPRET=0) to keep the run to seconds: the CPU kernel and the
reference are checked at every rate; tests/kernels/test_selftest.py covers the Triton checks themselves."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from rich.console import Console

from exl3local.commands.selftest import print_report
from exl3local.kernels.selftest import rates
from exl3local.plugin import version

from arc_machines import environ


def selftest(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "exl3local", "selftest", "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=600, cwd="/",
                          env=environ(TRITON_INTERPRET="0"))


@pytest.fixture(scope="module")
def report() -> dict:
    proc = selftest("--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_json_report_names_device_versions_and_every_check(report):
    data = report
    assert data["device"]["type"] == "cpu"
    assert {"torch", "triton", "vllm", "exl3local"} <= set(data["versions"])
    assert version.supported(data["versions"]["vllm"])  # the engine interpreter's vLLM, by its metadata
    results = data["results"]
    assert results and data["ok"] is True
    for entry in results:
        assert {"path", "kernel", "codebook", "bits", "ok", "error", "us"} <= set(entry)
        assert entry["ok"] and entry["error"] is not None and entry["error"] < 2e-3
    reference = {(r["codebook"], r["bits"]) for r in results if r["path"] == "reference"}
    assert reference == {(cb, float(b)) for cb, b in rates()}  # every codebook and bit width
    assert any("TritonLinearKernel not checked" in note for note in data["notes"])
    assert data["direct_launch"].startswith("off: the direct launch is untested")  # a CPU has none


def test_table_says_what_passed_and_what_failed(report):
    out = io.StringIO()
    print_report(report, Console(file=out, width=100))
    assert "versions  torch" in out.getvalue() and "TorchReferenceKernel" in out.getvalue()
    assert "every path matches the reference" in out.getvalue()
    broken = {**report, "results": [*report["results"], {**report["results"][0], "ok": False,
                                                         "detail": "relative error 0.5 > 0.002"}]}
    out = io.StringIO()
    print_report(broken, Console(file=out, width=100))
    assert "FAIL" in out.getvalue() and "relative error 0.5" in out.getvalue() and "1 failed" in out.getvalue()


def test_status_lists_kernel_paths_out_of_service():
    """status' kernel lines come from the daemon's GET /api/kernels rows (engine/stats.kernel_summary)."""
    import time

    from exl3local.api.protocol import KernelCounts
    from exl3local.commands.selftest import kernel_notes
    from exl3local.engine import stats
    from exl3local.errors import EngineError

    snap = {"pid": 1, "paths": {"reference": {"calls": 3, "tokens": 3}},
            "flags": {"latched_off": {"gemv": "TritonLinearKernel at 2.5-bit mul1: self-test gemv_split_k failed"}}}

    class Daemon:  # the two answers GET /api/kernels gives: counters, or no engine running
        def __init__(self, summary):
            self.summary = summary

        def kernels(self):
            if self.summary is None:
                raise EngineError("stopped", None, "")
            return KernelCounts.from_json(self.summary)

    lines = kernel_notes(Daemon(stats.kernel_summary([snap], time.time(), "xpu")))
    assert lines[0] == "kernels   gemv latched off: TritonLinearKernel at 2.5-bit mul1: self-test gemv_split_k failed"
    assert any(line.startswith("kernels   reference fallback:") for line in lines)
    assert kernel_notes(Daemon(None)) == []


def test_up_shows_the_kernel_check_as_a_start_up_phase():
    from exl3local.commands.progress import StartupPhases

    phases = StartupPhases()
    phases.feed("(EngineCore pid=7) INFO Loading weights took 3.10 seconds")
    label = phases.feed("exl3local: self-testing TritonLinearKernel at 4-bit mul1 on xpu:0 (kernels compile on first "
                        "use)")
    assert label == "checking EXL3 kernels"
    assert phases.feed("(EngineCore pid=7) INFO Available KV cache memory: 2.00 GiB") == "allocating the KV cache"
