"""Every Triton kernel compiles for real GPU targets, not only under the interpreter (compile_kernels.py):
SPIR-V for an Xe2 Arc GPU with Intel's XPU backend in every run (no Arc device exists to compile on), and sm_90
with the installed Triton where the GPU tests run: there the GPU tests compile and run the kernels themselves, so
CI does not spend two minutes of its budget on the NVIDIA target as well."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a compile of every kernel: minutes on CI
triton = pytest.importorskip("triton")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
# scripts/setup installs Intel's backend here, outside the venv's import path: it is also named `triton`.
TRITON_XPU = Path(sys.prefix) / "triton-xpu"
SCRIPT = Path(__file__).with_name("compile_kernels.py")


def compile_all(target: str, pythonpath: str | None = None) -> str:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-P", str(SCRIPT), target], env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton wheel ships no CUDA backend (ptxas)")
def test_every_kernel_compiles_for_sm90():
    out = compile_all("cuda")
    assert out.count("ok ") >= 20 and out.count("(matrix units)") >= 18


def test_every_kernel_compiles_to_spirv_for_arc():
    assert (TRITON_XPU / "triton").is_dir(), f"Intel's XPU Triton backend is not in {TRITON_XPU}: run scripts/setup"
    out = compile_all("xpu", str(TRITON_XPU))
    assert str(TRITON_XPU) in out.splitlines()[0]  # Intel's backend compiled, not the CUDA wheel's Triton
    assert out.count("ok ") >= 20 and out.count("(matrix units)") >= 18
