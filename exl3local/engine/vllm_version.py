"""Before an engine starts: is the vLLM in the engine's interpreter one the exl3 plugin serves with?

The supported range lives with the plugin (plugin/version.py), which reads the installed version without importing
vLLM; this asks it in the engine's interpreter (EXL3LOCAL_ENGINE_PYTHON may differ from the daemon's) and turns
the answer into a refusal that names the range, before any weight is loaded.
"""

from __future__ import annotations

import json
import subprocess

from exl3local.errors import ConfigError

PROBE_MODULE = "exl3local.plugin.version"


def probe(python: str) -> dict:
    """{"vllm": version or None, "range": text, "supported": bool} as the engine's interpreter answers."""
    try:
        proc = subprocess.run([python, "-P", "-m", PROBE_MODULE], capture_output=True, text=True, timeout=60, cwd="/")
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"cannot ask {python} for its vLLM version: {exc}",
                          hint="EXL3LOCAL_ENGINE_PYTHON names the interpreter that runs vLLM") from None
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-2:])
        raise ConfigError(f"{python} could not run the exl3 plugin's version check: {tail}",
                          hint="install exl3local into the engine's environment (`pip install -e .` there)") from None


def refusal(python: str) -> str | None:
    """Why vLLM in `python` cannot serve EXL3 models (missing, or outside the plugin's range), else None."""
    got = probe(python)
    if got["supported"]:
        return None
    if got["vllm"] is None:
        return f"vLLM is not installed in {python} (the exl3 plugin needs vLLM {got['range']})"
    return f"vLLM {got['vllm']} in {python} is outside the range the exl3 plugin supports ({got['range']})"


HINT = ("install a vLLM in that range there (README: Installing on an Arc machine), or point "
        "EXL3LOCAL_ENGINE_PYTHON at an interpreter that has one")
