"""The installed models by name: the one place that says what an OpenAI request's `model` may name, what
the engine serves a model as, and what `/v1/models` lists.

Installed means: pulled (a complete record in the hub cache, store.py), registered by the user
(`exl3local register NAME DIR`: a name for a checkpoint directory, kept in the config dir), or the
bundled demo. Each has one name, used as vLLM's served name and as the id in `/v1/models`, and may have
aliases that are served too:
- a pulled model is `REPO:REVISION` (as `exl3local list` prints it); the profile's default model is
  called by the profile's `served_name` instead, with `REPO:REVISION` as its alias;
- a registered model is the name the user gave;
- the demo is its directory name, alias `demo`.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exl3local import errors, manifest, paths
from exl3local.models import store

REGISTRY_FILE = "models.json"
# a name clients send as `model`: no spaces or control characters; "/" and ":" as hub names have them
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}")


@dataclass(frozen=True)
class Installed:
    name: str  # the served name and /v1/models id
    path: Path  # the checkpoint directory
    source: str  # "pulled" | "registered" | "demo"
    aliases: tuple[str, ...] = ()
    up_model: str | None = None  # what `up` takes to serve it (UpRequest.model); None: the demo
    created: int = 0  # unix time it was pulled or registered (OpenAI's `created`)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


def _registry() -> Path:
    return paths.config_dir() / REGISTRY_FILE


def registered() -> dict[str, dict[str, Any]]:
    """name -> {"path", "created"} as the user registered them (a missing or unreadable file: none)."""
    try:
        data = json.loads(_registry().read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict) and isinstance(v.get("path"), str)}


def installed(profile: Any | None) -> list[Installed]:
    """Every model a request may name, pulled first (newest pull of each REPO:REVISION), then registered ones,
    then the demo. `profile`: the one `up` serves under (its default model gets its `served_name`)."""
    default = store.default_ref(profile) if profile is not None else None
    served_name = profile.model.get("served_name") if profile is not None else None
    out: dict[str, Installed] = {}
    for m in sorted(store.records(), key=lambda m: m.pulled_at):  # a later pull of a revision replaces the older
        is_default = default is not None and served_name and (m.repo_id, m.revision) == (default.repo_id,
                                                                                          default.revision)
        name, aliases = (served_name, (m.name,)) if is_default else (m.name, ())
        out[m.name] = Installed(name, Path(m.path), "pulled", aliases, m.name, int(m.pulled_at))
    for name, rec in sorted(registered().items()):
        out.setdefault(f"registered:{name}", Installed(name, Path(rec["path"]), "registered", (), rec["path"],
                                                       int(rec.get("created", 0))))
    demo = store.DEMO_MODEL
    out["demo"] = Installed(demo.name, demo, "demo", ("demo",), None, 0)
    return list(out.values())


def find(name: str, profile: Any | None) -> Installed | None:
    return next((m for m in installed(profile) if name in m.names), None)


def names_for(model_dir: Path, profile: Any | None) -> tuple[str, ...]:
    """What the engine serves `model_dir` as: its catalogue names, or the directory's name for a directory
    that is not installed (`up DIR`)."""
    target = Path(model_dir).resolve()
    found = next((m for m in installed(profile) if m.path.resolve() == target), None)
    return found.names if found else (target.name,)


def register(name: str, directory: str | Path, profile: Any | None = None) -> Installed:
    """Give a checkpoint directory a name a request can use. The checkpoint is read first, so a directory
    that cannot be served is refused here, not at the first request."""
    if not NAME.fullmatch(name):
        raise errors.ConfigError(f"{name!r} cannot be a model name",
                                 hint="letters, digits and . _ : / @ + -, starting with a letter or digit")
    path = Path(directory).expanduser().resolve()
    manifest.read(path)  # CheckpointError names what is wrong with it
    taken = find(name, profile)
    if taken is not None and not (taken.source == "registered" and taken.name == name):
        raise errors.ConfigError(f"{name!r} already names the {taken.source} model at {taken.path}",
                                 hint="choose another name")
    data = registered()
    data[name] = {"path": str(path), "created": int(time.time())}
    paths.write_atomic(_registry(), json.dumps(data, indent=2, sort_keys=True), mode=0o600)
    return Installed(name, path, "registered", (), str(path), data[name]["created"])


def unregister(name: str) -> bool:
    """Forget a registered name (the directory stays). False: no such name."""
    data = registered()
    if data.pop(name, None) is None:
        return False
    paths.write_atomic(_registry(), json.dumps(data, indent=2, sort_keys=True), mode=0o600)
    return True
