"""`exl3local doctor` on an Arc machine's sysfs tree, with a stand-in for the engine interpreter's XPU runtime:
the XPU properties that matter, /dev/dri/by-path, and TTM's page limit against the iGPU."""

from __future__ import annotations

import subprocess
import sys

from arc_machines import GiB, PAGE, device, environ, lunar, xpu_standin


def doctor(tmp_path, tree, python, model):
    return subprocess.run([sys.executable, "-P", "-m", "exl3local", "doctor", "--quick", str(model)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=environ(EXL3LOCAL_SYSFS=str(tree), EXL3LOCAL_ENGINE_PYTHON=str(python)))


def test_doctor_prints_the_xpu_properties_by_path_and_the_ttm_limit(tmp_path, xdg, tiny_models):
    ram = 32 * GiB
    tree = lunar(tmp_path / "sys", ram=ram)
    python = xpu_standin(tmp_path, [device(0, 0x64A0, 24 * GiB, name="Intel(R) Arc(TM) 140V GPU (16GB)", xe_cores=8,
                                           driver="1.13.31740")])
    out = doctor(tmp_path, tree, python, tiny_models["tiny-llama-exl3-4.0bpw"]).stdout
    xpu = next(line for line in out.splitlines() if " xpu " in line)
    assert "Arc(TM) 140V" in xpu and "8086:64a0" in xpu and "XMX yes" in xpu and "8 Xe cores" in xpu
    assert "24.0 GiB total" in xpu and "driver 1.13.31740" in xpu
    assert any(" by-path " in line and "/dev/dri/by-path" in line for line in out.splitlines())
    ttm = next(line for line in out.splitlines() if " ttm " in line)
    assert ttm.startswith("[warn]") and f"ttm.pages_limit=" in ttm  # the default (half of RAM) is below the iGPU's
    assert "--gpu-memory-utilization" in out
    # a limit above the iGPU's share is fine
    roomy = lunar(tmp_path / "sys2", ram=ram, ttm_pages=ram // PAGE)
    ok = doctor(tmp_path, roomy, python, tiny_models["tiny-llama-exl3-4.0bpw"]).stdout
    assert next(line for line in ok.splitlines() if " ttm " in line).startswith("[ok  ]")


def test_doctor_says_when_the_engine_interpreter_sees_no_xpu(tmp_path, xdg, tiny_models):
    tree = lunar(tmp_path / "sys")
    out = doctor(tmp_path, tree, sys.executable, tiny_models["tiny-llama-exl3-4.0bpw"]).stdout
    line = next(line for line in out.splitlines() if " xpu " in line)
    assert line.startswith("[FAIL]") and "sees no Intel GPU" in line and "PyTorch for XPU" in line
