"""Layering (style.md: imports point down only), checked statically over every import statement,
function-level ones included, plus the deferred imports checked at runtime in a fresh interpreter.

import-linter cannot be used: its graph builder (grimp) accepts only top-level packages, and our
subpackages are mapped from top-level folders (kernels/ -> exl3local.kernels).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "vllm", "triton", "textual", "transformers")

# source files -> module prefixes they must never import
CONTRACTS = {
    "exl3local/manifest.py": HEAVY + ("safetensors",),
    "exl3local/errors.py": HEAVY,
    "exl3local/env.py": HEAVY,
    "kernels": ("vllm", "textual", "exl3local.plugin", "exl3local.tui", "exl3local.cli", "exl3local.daemon"),
    "plugin": ("textual", "exl3local.tui", "exl3local.cli", "exl3local.daemon"),
}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("source", sorted(CONTRACTS))
def test_layer_imports_only_downwards(source):
    files = [REPO / source] if source.endswith(".py") else sorted((REPO / source).rglob("*.py"))
    assert files
    forbidden = CONTRACTS[source]
    violations = [
        f"{f.relative_to(REPO)} imports {name}"
        for f in files
        for name in _imports(f)
        if any(name == bad or name.startswith(bad + ".") for bad in forbidden)
    ]
    assert not violations


def _modules_after_import(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True, cwd="/")
    return set(out.stdout.split())


def test_cli_imports_nothing_heavy():
    loaded = _modules_after_import("exl3local.cli")
    assert not {m for m in loaded if m.split(".")[0] in HEAVY}


def test_plugin_entry_point_import_is_light():
    loaded = _modules_after_import("exl3local.plugin")
    assert "textual" not in loaded and "exl3local.tui" not in loaded
