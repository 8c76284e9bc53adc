"""torchvision.transforms.v2 for a text-only engine: each operation raises TextOnlyEngineError when called."""

from exl3local.engine.textonly import missing_attribute

from . import functional  # noqa: F401 — imported by name in transformers


def __getattr__(name: str):
    return missing_attribute(__name__, name)
