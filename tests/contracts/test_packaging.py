"""The wheel holds every package (exl3local/ and its subpackages, and the mapped folders) and data file, nothing imports as a bare top-level name,
and vLLM can find our plugin through its entry point."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import entry_points
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MAPPED = {"exl3local": "exl3local", "kernels": "exl3local/kernels", "plugin": "exl3local/plugin",
          "tui": "exl3local/tui", "profiles": "exl3local/profiles", "packaging": "exl3local/packaging"}  # fmt: skip
DATA_SUFFIXES = (".py", ".toml", ".tcss", ".in", ".desktop", ".png", ".svg")


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set[str]:
    """The wheel of a copy of the source tree: building in the checkout would reuse setuptools'
    build/ folder, whose leftovers hide a package missing from pyproject.toml."""
    out = tmp_path_factory.mktemp("wheel")
    src = tmp_path_factory.mktemp("src")
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, text=True, check=True, cwd=REPO).stdout.split("\n")
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    subprocess.run(
        [sys.executable, "-P", "-m", "pip", "wheel", "-q", "--no-deps", "--disable-pip-version-check", "-w", str(out), str(src)],
        check=True, capture_output=True, cwd=out,
    )  # fmt: skip
    (wheel,) = out.glob("exl3local-*.whl")
    return set(zipfile.ZipFile(wheel).namelist())


def _tracked(folder: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", folder], capture_output=True, text=True, check=True, cwd=REPO)
    return [line for line in out.stdout.split() if line.endswith(DATA_SUFFIXES)]


def test_every_mapped_module_and_data_file_is_in_the_wheel(wheel_names):
    for folder, package in MAPPED.items():
        assert f"{package}/__init__.py" in wheel_names, folder
        for path in _tracked(folder):
            relative = Path(path).relative_to(folder)
            if len(relative.parts) == 1 or (REPO / folder / relative.parts[0] / "__init__.py").exists():
                assert f"{package}/{relative.as_posix()}" in wheel_names, path


def test_no_bare_top_level_packages_in_the_wheel(wheel_names):
    tops = {name.split("/")[0] for name in wheel_names}
    assert tops <= {"exl3local"} | {t for t in tops if t.startswith("exl3local-")}


def test_vllm_finds_the_plugin_entry_point():
    plugins = entry_points(group="vllm.general_plugins")
    assert [ep.value for ep in plugins if ep.name == "exl3"] == ["exl3local.plugin:register"]
    console = entry_points(group="console_scripts")
    assert [ep.value for ep in console if ep.name == "exl3local"] == ["exl3local.cli:main"]
