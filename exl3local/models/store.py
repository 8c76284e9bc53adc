"""Models on disk: what a model argument means, the bundled demo, and the records of complete pulls.

Pulled models live in the Hugging Face hub cache (its layout, so `hf cache` sees them); a pull is
complete only when `<repo cache>/.exl3local/<commit>.json` exists. `list`, `rm` and `up` read these
records, so a partial download is never listed or served as complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exl3local import paths
from exl3local.errors import CheckpointError, ConfigError

RECORD_DIR = ".exl3local"
DEMO_MODEL = paths.bundled("demo", "tiny-llama-exl3-4.0bpw")


@dataclass(frozen=True)
class ModelRef:
    """REPO[:REVISION] (also REPO@REVISION, the daemon API's spelling); the revision defaults to main."""

    repo_id: str
    revision: str = "main"

    @classmethod
    def parse(cls, text: str) -> ModelRef:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        repo_id, sep, revision = text.partition(":") if ":" in text else text.partition("@")
        if sep and not revision:
            raise ConfigError(f"{text!r}: empty revision after {sep!r}", hint="write REPO:REVISION, e.g. org/model:4.0bpw")
        try:
            validate_repo_id(repo_id)
        except HFValidationError as err:
            raise ConfigError(f"{text!r} is not a hub repo: {err}", hint="write REPO[:REVISION], e.g. org/model:4.0bpw") from None
        if "/" not in repo_id:
            raise ConfigError(f"{text!r} is not a hub repo", hint="hub repos are ORG/NAME, e.g. turboderp/Qwen3-8B-exl3")
        return cls(repo_id, revision or "main")

    def __str__(self) -> str:
        return f"{self.repo_id}:{self.revision}"


@dataclass(frozen=True)
class PulledModel:
    """The record of a complete, verified pull (`<repo cache>/.exl3local/<commit>.json`)."""

    repo_id: str
    revision: str
    commit: str
    path: str  # the snapshot directory in the hub cache
    size_bytes: int
    bits: float | None
    head_bits: float | None
    architecture: str
    pulled_at: float

    @property
    def name(self) -> str:
        return f"{self.repo_id}:{self.revision}"


def parse_argument(text: str) -> Path | ModelRef:
    """What a model argument means: an existing path, or text spelled as one (/, ., ~), is a
    checkpoint directory; anything else is a hub REPO[:REVISION]."""
    path = Path(text).expanduser()
    if path.exists() or text.startswith(("/", ".", "~")):
        return path
    return ModelRef.parse(text)


def default_ref(profile: Any) -> ModelRef | None:
    """The profile's default model on the hub; None when its default is the bundled demo."""
    if profile.model.get("demo") or not profile.model.get("repo"):
        return None
    return ModelRef(profile.model["repo"], profile.model.get("revision", "main"))


def resolve(model: str | None, demo: bool, profile: Any) -> tuple[Path, str]:
    """A local checkpoint dir for a request, and how to name it: the bundled demo, a directory, or a
    pulled hub repo (the profile's default when `model` is None)."""
    target = None if demo else parse_argument(model) if model is not None else default_ref(profile)
    if target is None:
        return DEMO_MODEL, f"demo ({DEMO_MODEL.name})"
    if isinstance(target, Path):
        if not target.is_dir():
            raise CheckpointError(str(model), None, "a checkpoint directory", "no such directory")
        return target.resolve(), str(target.resolve())
    pulled = find(target)
    if pulled is None:
        raise ConfigError(f"{target} is not downloaded", hint=f"run `exl3local pull {target}` first")
    return Path(pulled.path), f"{pulled.repo_id}:{pulled.revision}@{pulled.commit[:12]}"


def hub_cache() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE).expanduser()


def repo_folder(repo_id: str) -> Path:
    from huggingface_hub.file_download import repo_folder_name

    return hub_cache() / repo_folder_name(repo_id=repo_id, repo_type="model")


def records() -> list[PulledModel]:
    """Complete pulls whose snapshot is still in the cache (e.g. not removed by `hf cache rm`)."""
    out = []
    for record in sorted(hub_cache().glob(f"models--*/{RECORD_DIR}/*.json")):
        model = PulledModel(**json.loads(record.read_text()))
        if Path(model.path).is_dir():
            out.append(model)
    return out


def find(ref: ModelRef) -> PulledModel | None:
    """The newest complete pull of REPO at REVISION (a branch, a tag or a commit)."""
    matches = [
        m for m in records()
        if m.repo_id == ref.repo_id and ref.revision in (m.revision, m.commit)
    ]  # fmt: skip
    return max(matches, key=lambda m: m.pulled_at, default=None)


def record_path(model: PulledModel) -> Path:
    return repo_folder(model.repo_id) / RECORD_DIR / f"{model.commit}.json"


def remove(model: PulledModel) -> int:
    """Delete one pulled revision from the hub cache (blobs another revision uses stay). Returns bytes freed."""
    from huggingface_hub import scan_cache_dir

    strategy = scan_cache_dir(hub_cache()).delete_revisions(model.commit)
    freed = strategy.expected_freed_size
    strategy.execute()
    record_path(model).unlink(missing_ok=True)
    ref = repo_folder(model.repo_id) / "refs" / model.revision
    if ref.is_file() and ref.read_text().strip() == model.commit:
        ref.unlink()
    return freed
