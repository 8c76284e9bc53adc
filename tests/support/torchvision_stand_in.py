"""The engine's torchvision stand-in for vLLM model code loaded inside the test process.

vLLM's Qwen3.5 module imports torchvision; the engine gets the text-only stand-in on its PYTHONPATH
(exl3local.engine.textonly). A test that builds such a model in its own process needs the stand-in on
sys.path for its imports *and* on PYTHONPATH for the subprocess vLLM starts to inspect a model class when
its modelinfo cache has no entry (always so on a fresh machine)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from exl3local.engine import textonly


@contextmanager
def torchvision_stand_in() -> Iterator[None]:
    """Where torchvision is missing: the stand-in importable here and in child Pythons, then gone again, so
    later tests see no torchvision (nothing changes where a real torchvision is installed)."""
    if not textonly.torchvision_missing():
        yield
        return
    before = os.environ.get("PYTHONPATH")
    sys.path.insert(0, str(textonly.SHIM_DIR))
    os.environ["PYTHONPATH"] = textonly.engine_pythonpath(os.environ)
    try:
        yield
    finally:
        sys.path.remove(str(textonly.SHIM_DIR))
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
