"""torchvision.io for a text-only engine: the enum transformers imports, nothing that decodes."""

import enum

from exl3local.engine.textonly import missing_attribute


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


def __getattr__(name: str):
    return missing_attribute(__name__, name)
