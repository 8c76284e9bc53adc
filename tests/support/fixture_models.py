"""The tiny model fixtures by what they are, read from each tar's config.json without untarring, so tests
parametrize over every fixture of a family (held-out checkpoints included), not over a fixed list of names."""

from __future__ import annotations

import json
import os
import tarfile
from functools import cache
from pathlib import Path

SHARED = Path(os.environ.get("EXL3LOCAL_SHARED", Path(__file__).resolve().parents[2].parent / "shared"))
MODELS = SHARED / "fixtures" / "models"


@cache
def configs() -> dict[str, dict]:
    """fixture name -> its config.json (empty when the fixtures are missing: the tests then fail on that)."""
    out = {}
    for tar_path in sorted(MODELS.glob("*/*.tar")):
        name = tar_path.parent.name
        with tarfile.open(tar_path) as tar:
            member = tar.extractfile(f"{name}/config.json")
            if member is not None:
                out[name] = json.loads(member.read())
    return out


def names() -> list[str]:
    return list(configs())


def qwen35_family() -> list[str]:
    return [n for n, c in configs().items() if c.get("architectures", [""])[0].startswith("Qwen3_5")]


def with_mtp_head() -> list[str]:
    def layers(c: dict) -> int:
        return int(c.get("text_config", c).get("mtp_num_hidden_layers") or 0)

    return [n for n in qwen35_family() if layers(configs()[n]) > 0]


def with_vision_tower() -> list[str]:
    return [n for n in qwen35_family() if isinstance(configs()[n].get("vision_config"), dict)]
