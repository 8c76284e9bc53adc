"""Image operations of torchvision, for a text-only engine: each one raises TextOnlyEngineError when called."""

from exl3local.engine.textonly import missing_attribute


def __getattr__(name: str):
    return missing_attribute(__name__, name)
