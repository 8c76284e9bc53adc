"""torchvision.transforms for a text-only engine: the interpolation enum transformers imports."""

import enum

from exl3local.engine.textonly import missing_attribute

from . import functional, v2  # noqa: F401 — imported by name in transformers


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def __getattr__(name: str):
    return missing_attribute(__name__, name)
