"""Which profile applies: the bundled and user profile files, detection by device, and the
pinned choice that `exl3local profile NAME` / `--set` persist."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from exl3local import paths
from exl3local.errors import ConfigError
from exl3local.profiles.profile import ID_RE, Profile, parse, with_overrides

BUNDLED = Path(__file__).resolve().parent


def _dirs() -> list[Path]:
    return [paths.config_dir() / "profiles", BUNDLED]


def names(dirs: Iterable[Path] | None = None) -> list[str]:
    found = {p.stem for d in (dirs or _dirs()) if d.is_dir() for p in d.glob("*.toml") if ID_RE.match(p.stem)}
    return sorted(found)


def load(profile_id: str, overrides: Mapping[str, str] | None = None, dirs: Iterable[Path] | None = None) -> Profile:
    for d in dirs or _dirs():
        path = d / f"{profile_id}.toml"
        if ID_RE.match(profile_id) and path.is_file():
            try:
                text = path.read_text()
            except (OSError, UnicodeError) as exc:
                raise ConfigError(f"{path}: cannot read: {exc}") from None
            prof = parse(text, profile_id, str(path))
            return with_overrides(prof, overrides) if overrides else prof
    raise ConfigError(f"no profile named {profile_id!r}", hint=f"profiles: {', '.join(names(dirs))}")


def _matches(profile: Profile, gpu: Any, dmi: str) -> bool:
    m = profile.match
    if not m or set(m) == {"priority"}:
        return False
    if "vendor" in m and m["vendor"] != gpu.vendor:
        return False
    if "kind" in m and m["kind"] != gpu.kind:
        return False
    if "pci_ids" in m and (gpu.pci_id or "") not in m["pci_ids"]:
        return False
    if "dmi_product" in m and not any(s.lower() in dmi.lower() for s in m["dmi_product"]):
        return False
    return bool(gpu.supported)


def detect(gpu: Any, dmi: str = "", dirs: Iterable[Path] | None = None) -> tuple[Profile, str]:
    """The profile for this device (a hardware.GpuInfo): the matching profile with the highest
    [match] priority, and a sentence saying why."""
    candidates = [load(n, dirs=dirs) for n in names(dirs)]
    hits = sorted((p for p in candidates if _matches(p, gpu, dmi)), key=lambda p: p.match["priority"], reverse=True)
    if not hits:
        raise ConfigError(f"no profile matches {gpu.name} ({gpu.pci_id or gpu.vendor})",
                          hint="pin one with `exl3local profile NAME`")
    best = hits[0]
    what = f"{gpu.name} ({gpu.pci_id})" if gpu.pci_id else gpu.name
    extra = f" on \"{dmi}\"" if "dmi_product" in best.match else ""
    return best, f"detected {what}{extra} → {best.id}: {best.description}"


def read_settings() -> dict[str, Any]:
    """`exl3local profile NAME` / `--set` persisted: {"pinned": str|None, "set": {...}}."""
    try:
        data = json.loads(paths.pinned_profile().read_text())
    except FileNotFoundError:
        return {"pinned": None, "set": {}}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{paths.pinned_profile()}: unreadable ({exc})",
                          hint="fix it or run `exl3local profile --unpin`") from None
    pinned, sets = (data.get("pinned"), data.get("set") or {}) if isinstance(data, dict) else (None, None)
    if not (isinstance(pinned, str | None) and isinstance(sets, dict) and all(isinstance(v, str) for v in sets.values())):
        raise ConfigError(f"{paths.pinned_profile()}: expected {{\"pinned\": NAME or null, \"set\": {{KEY: VALUE}}}}",
                          hint="fix it or run `exl3local profile --unpin`")
    return {"pinned": pinned, "set": dict(sets)}


def _shown(key: str, value: str) -> str:
    """An override as `status` may show it: environment values can be secrets (an API key, a hub token),
    and the status is readable by any local process."""
    return "(set, not shown)" if key.startswith("env.") else value


def select(requested: str | None, overrides: Mapping[str, str], gpu: Any, dmi: str) -> tuple[Any, str]:
    """--profile > pinned > detected; persisted --set, then this call's --set."""
    settings = read_settings()
    if requested:
        prof, why = load(requested), f"--profile {requested}"
    elif settings["pinned"]:
        prof, why = load(settings["pinned"]), f"pinned with `exl3local profile {settings['pinned']}`"
    else:
        prof, why = detect(gpu, dmi)
    merged = {**settings["set"], **overrides}
    if merged:
        prof = with_overrides(prof, merged)
        why += "; overrides " + ", ".join(f"{k}={_shown(k, v)}" for k, v in sorted(merged.items()))
    if prof.backend != gpu.backend:
        why += f" (the profile is for {prof.backend}; this machine serves on {gpu.backend}: {gpu.name})"
    return prof, why
