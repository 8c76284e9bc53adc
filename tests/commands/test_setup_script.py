"""scripts/setup chooses its path by exl3local's own GPU detection: the XPU stack on an Arc machine (printed
step by step with --dry-run, stopped with what to install where a step cannot work), today's CPU path
elsewhere or with --cpu. Run on a copy of the script and package with a recording stand-in for the venv's
Python, so nothing is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from arc_machines import b70s, environ, lunar

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """scripts/setup and the exl3local package in a fresh folder, a .venv whose python records its arguments,
    and the desktop tools present (so the CPU path runs no apt-get)."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup", root / "scripts" / "setup")
    shutil.copytree(REPO / "exl3local", root / "exl3local", ignore=shutil.ignore_patterns("__pycache__"))
    venv = root / ".venv" / "bin"
    venv.mkdir(parents=True)
    (root / ".venv" / "triton-xpu" / "triton").mkdir(parents=True)
    (venv / "python").write_text(f"#!/bin/sh\necho \"$*\" >> {root / 'calls.log'}\n")
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("Xvfb", "desktop-file-validate"):
        (tools / tool).write_text("#!/bin/sh\n")
    for f in [venv / "python", *tools.iterdir()]:
        f.chmod(0o755)
    return root


def setup(checkout: Path, tree: Path, *args: str) -> subprocess.CompletedProcess:
    env = environ(EXL3LOCAL_SYSFS=str(tree), PATH=f"{checkout.parent / 'bin'}:{os.environ['PATH']}")
    return subprocess.run(["bash", "scripts/setup", *args], capture_output=True, text=True, timeout=120, cwd=checkout,
                          env=env)


def calls(checkout: Path) -> list[str]:
    """What the venv's python was asked to install or remove (its version check is no install)."""
    log = checkout / "calls.log"
    return [c for c in log.read_text().splitlines() if c.startswith("-m ")] if log.exists() else []


CPU_CALLS = ["-m pip install -q --disable-pip-version-check -e .[cpu,test,tray]",
             "-m pip uninstall -q -y torchvision torchaudio torchcodec"]


def test_a_machine_without_an_arc_gpu_takes_todays_cpu_path(checkout, tmp_path):
    proc = setup(checkout, tmp_path / "nosys")
    assert proc.returncode == 0, proc.stderr
    assert calls(checkout) == CPU_CALLS


def test_cpu_forces_the_cpu_path_on_an_arc_machine(checkout, tmp_path):
    proc = setup(checkout, lunar(tmp_path / "sys"), "--cpu")
    assert proc.returncode == 0, proc.stderr
    assert calls(checkout) == CPU_CALLS


@pytest.mark.parametrize("machine", ["claw", "b70x2"])
def test_an_arc_machine_gets_the_xpu_steps_and_a_dry_run_installs_nothing(checkout, tmp_path, machine):
    tree = lunar(tmp_path / "sys") if machine == "claw" else b70s(tmp_path / "sys", cards=2)
    proc = setup(checkout, tree, "--dry-run")
    out = proc.stdout
    assert ("Arc 130V/140V" if machine == "claw" else "Arc Pro B70") in out
    for step in ("--index-url https://download.pytorch.org/whl/xpu", "install -q --disable-pip-version-check "
                 "vllm-xpu-kernels", "VLLM_TARGET_DEVICE=xpu", "-e .[test]", ".venv/bin/exl3local doctor"):
        assert step in out, step
    assert "cpu" not in out.split("exl3local itself")[1].split("\n")[1]  # no cpu extra
    assert calls(checkout) == []  # the dry run ran nothing in the venv
    # this machine has neither Level Zero nor the fixture's render node: the steps name what to install
    assert "STOP: no Level Zero GPU runtime" in out and "libze" in out and "render" in out
    assert proc.returncode == 1


def test_a_real_run_on_an_arc_machine_stops_before_installing_when_a_step_cannot_work(checkout, tmp_path):
    proc = setup(checkout, lunar(tmp_path / "sys"))
    assert proc.returncode == 1 and "STOP:" in proc.stdout
    assert calls(checkout) == []
