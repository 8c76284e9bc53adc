"""Layering (style.md: imports point down only), checked statically over every import statement,
function-level ones included, plus the deferred imports checked at runtime in a fresh interpreter.

The floors, lowest first (each may import only floors below it, and itself):
1. foundation (errors, env, paths, units, manifest, model_config, safetensors_files, kernel_paths) and api/protocol
2. profiles, kernels
3. plugin
4. machine; models (never the client)
5. engine (profiles below it; reads plugin.trace files; never imports vLLM)
6. daemon (never the client, commands, tui or desktop); api/client and api/metrics beside it
7. desktop, tui (never engine or daemon), commands, cli

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
PACKAGE_DIRS = {"kernels": "exl3local.kernels", "plugin": "exl3local.plugin", "tui": "exl3local.tui",
                "profiles": "exl3local.profiles", "packaging": "exl3local.packaging"}  # fmt: skip
FOUNDATION = ("exl3local.errors", "exl3local.env", "exl3local.paths", "exl3local.units", "exl3local.manifest",
              "exl3local.model_config", "exl3local.kernel_paths", "exl3local.safetensors_files", "exl3local.__version__")  # fmt: skip
PROTOCOL = ("exl3local.api.protocol",)
CLIENT = ("exl3local.api", "exl3local.api.client", "exl3local.api.metrics")

# module (prefix) -> the modules of ours it may import (prefixes); the first matching row counts
ALLOWED: dict[str, tuple[str, ...]] = {
    "exl3local.api.protocol": FOUNDATION,
    "exl3local.errors": (),
    "exl3local.env": (),
    "exl3local.units": (),
    "exl3local.paths": (),
    "exl3local.kernel_paths": (),
    "exl3local.manifest": FOUNDATION,
    "exl3local.model_config": ("exl3local.safetensors_files",),
    "exl3local.safetensors_files": ("exl3local.errors",),
    "exl3local.profiles": (*FOUNDATION, "exl3local.profiles"),
    "exl3local.kernels": (*FOUNDATION, "exl3local.kernels"),
    "exl3local.plugin": (*FOUNDATION, "exl3local.kernels", "exl3local.plugin"),
    "exl3local.machine": (*FOUNDATION, "exl3local.profiles", "exl3local.machine"),
    "exl3local.models": (*FOUNDATION, "exl3local.profiles", "exl3local.machine", "exl3local.models"),
    # profiles sit below the engine: it reads what a profile says about vLLM's flags
    "exl3local.engine": (*FOUNDATION, *PROTOCOL, "exl3local.profiles", "exl3local.plugin.trace", "exl3local.engine"),
    "exl3local.daemon": (*FOUNDATION, *PROTOCOL, "exl3local.profiles", "exl3local.machine", "exl3local.models",
                         "exl3local.engine", "exl3local.daemon"),
    "exl3local.api": (*FOUNDATION, *PROTOCOL, *CLIENT),
    "exl3local.desktop": (*FOUNDATION, *PROTOCOL, *CLIENT, "exl3local.profiles", "exl3local.desktop"),
    "exl3local.tui": (*FOUNDATION, *PROTOCOL, *CLIENT, "exl3local.tui"),
    "exl3local.commands": (*FOUNDATION, *PROTOCOL, *CLIENT, "exl3local.profiles", "exl3local.machine",
                           "exl3local.models", "exl3local.engine", "exl3local.daemon", "exl3local.desktop",
                           "exl3local.commands"),
    "exl3local.cli": (*FOUNDATION, "exl3local.commands", "exl3local.tui.command"),
    "exl3local.__main__": ("exl3local.cli",),
    "exl3local": (),  # __init__: the version only
}
# third-party modules a layer must never import, even lazily
FORBIDDEN = {
    "exl3local.manifest": HEAVY + ("safetensors",),
    "exl3local.model_config": HEAVY + ("safetensors",),
    "exl3local.safetensors_files": HEAVY + ("safetensors",),
    "exl3local.errors": HEAVY,
    "exl3local.env": HEAVY,
    "exl3local.units": HEAVY,
    "exl3local.kernel_paths": HEAVY,
    "exl3local.api": HEAVY,
    "exl3local.engine": HEAVY,
    "exl3local.daemon": HEAVY,
    "exl3local.machine": HEAVY,
    "exl3local.models": ("torch", "triton", "textual", "transformers"),  # vLLM's registry only, lazily (hub.py)
    "exl3local.kernels": ("vllm", "textual"),
    "exl3local.plugin": ("textual",),
}
# The folders of the control plane; plugin/ and kernels/ have owners of their own and are
# checked for direction only.
CONTROL_PLANE = ("exl3local", "profiles", "tui")


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[0] in PACKAGE_DIRS:
        parts = [*PACKAGE_DIRS[parts[0]].split("."), *parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> list[Path]:
    files = sorted((REPO / "exl3local").rglob("*.py"))
    for folder in PACKAGE_DIRS:
        files += sorted((REPO / folder).rglob("*.py"))
    # the torchvision stand-in is put on an engine's PYTHONPATH, not imported as ours
    return [f for f in files if "shims" not in f.relative_to(REPO).parts]


def _is_main_guard(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) and "__name__" in ast.unparse(node.test)


def _imports(path: Path) -> list[tuple[str, ast.stmt, bool]]:
    """(module, statement, inside a function) for every absolute import, except under a
    `__main__` guard (the engine launcher's vLLM start: that code runs as the engine process only)."""
    out = []
    tree = ast.parse(path.read_text(), str(path))

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_main_guard(child):
                continue
            inner = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.Import):
                out.extend((alias.name, child, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                # `from exl3local.plugin import trace` imports exl3local.plugin.trace: judge the full name
                ours = child.module.startswith("exl3local")
                out.extend((f"{child.module}.{alias.name}" if ours else child.module, child, in_function)
                           for alias in child.names)
            visit(child, inner)

    visit(tree, False)
    return out


def _matches(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _rule(module: str, table: dict[str, tuple[str, ...]]) -> tuple[str, ...] | None:
    for prefix in sorted(table, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return table[prefix]
    return None


def test_every_module_has_a_floor():
    missing = [_module_name(f) for f in _sources() if _rule(_module_name(f), ALLOWED) is None]
    assert not missing


def test_imports_point_down_only():
    violations = []
    for f in _sources():
        module = _module_name(f)
        allowed = _rule(module, ALLOWED) or ()
        for name, node, _ in _imports(f):
            if name.startswith("exl3local") and not _matches(name, allowed):
                violations.append(f"{f.relative_to(REPO)}:{node.lineno} ({module}) imports {name}")
    assert not violations


def test_no_layer_imports_what_it_must_not_even_lazily():
    violations = []
    for f in _sources():
        forbidden = _rule(_module_name(f), FORBIDDEN) or ()
        violations += [f"{f.relative_to(REPO)}:{node.lineno} imports {name}"
                       for name, node, _ in _imports(f) if _matches(name, forbidden)]
    assert not violations


def test_function_level_imports_of_our_modules_say_why():
    """A function-level import of our own module hides the real graph; it is kept only where the
    module pulls in something heavy that must stay lazy, and the line says so (`# lazy: ...`)."""
    unexplained = []
    for f in _sources():
        if f.relative_to(REPO).parts[0] not in CONTROL_PLANE:
            continue
        lines = f.read_text().splitlines()
        for name, node, in_function in _imports(f):
            if in_function and name.startswith("exl3local") and "# lazy:" not in lines[node.lineno - 1]:
                unexplained.append(f"{f.relative_to(REPO)}:{node.lineno} imports {name} inside a function")
    assert not unexplained


def _modules_after_import(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True, cwd="/")
    return set(out.stdout.split())


def test_cli_imports_nothing_heavy():
    """Every command pays for what the CLI imports (`status` is run in loops): the daemon's server stack loads
    only where a daemon runs, the planning code only for the commands that plan."""
    loaded = _modules_after_import("exl3local.cli")
    assert not {m for m in loaded if m.split(".")[0] in HEAVY + ("uvicorn", "starlette", "aiohttp")}
    assert not {m for m in loaded if _matches(m, ("exl3local.daemon.server", "exl3local.daemon.plan"))}


def test_the_daemon_never_loads_a_front_end():
    loaded = _modules_after_import("exl3local.daemon.main")
    assert not {m for m in loaded if _matches(m, ("exl3local.api.client", "exl3local.commands", "exl3local.tui",
                                                   "exl3local.desktop", "exl3local.cli"))}
    assert not {m for m in loaded if m.split(".")[0] in HEAVY}


def test_plugin_entry_point_import_is_light():
    loaded = _modules_after_import("exl3local.plugin")
    assert "textual" not in loaded and "exl3local.tui" not in loaded
