"""Shared test fixtures: the oracle data in ../shared/fixtures and untarred tiny models."""

from __future__ import annotations

import os
import sys
import tarfile
from pathlib import Path

import pytest

# Shared helpers for every test directory (`from private_user import make_box`). Only tests/support goes on
# the path: tests/ itself holds directories named like packages (kernels, plugin) that must not shadow any.
sys.path.append(str(Path(__file__).resolve().parent / "support"))
import fixture_models  # noqa: E402 - tests/support is on the path from here on
from interpreter_checks import drop_unused_overflow_checks  # noqa: E402
from sysfs_trees import MACHINES  # noqa: E402

FIXTURES = fixture_models.SHARED / "fixtures"


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        drop_unused_overflow_checks()  # the interpreted kernel tests run ~1.7x faster, results unchanged


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules with a `slow` test first, each module's own order kept. scripts/test hands whole modules to
    two xdist workers in this order (--no-loadscope-reorder): the modules that take minutes start early and
    the many quick ones fill the gaps at the end, instead of a long module running alone at the end."""
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow)


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    if not FIXTURES.is_dir():
        pytest.fail(f"oracle fixtures not found at {FIXTURES} (set EXL3LOCAL_SHARED)")
    return FIXTURES


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory, fixtures_dir: Path) -> dict[str, Path]:
    """Each tiny EXL3 model untarred once per session: name -> checkpoint dir (read-only use)."""
    root = tmp_path_factory.mktemp("tiny_models")
    out = {}
    for name in fixture_models.names():
        with tarfile.open(fixtures_dir / "models" / name / f"{name}.tar") as tar:
            tar.extractall(root, filter="data")
        out[name] = root / name
    return out


@pytest.fixture
def machine(tmp_path: Path):
    """machine("b70") -> the root of a fresh fixture sysfs tree for that machine (tests/support/sysfs_trees.py)."""
    def build(name: str) -> Path:
        return MACHINES[name](tmp_path / f"sys-{name}")
    return build


@pytest.fixture
def xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Private XDG state/config/cache/runtime dirs, so pinned profiles and records stay in the test."""
    for var in ("XDG_STATE_HOME", "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_RUNTIME_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    return tmp_path
