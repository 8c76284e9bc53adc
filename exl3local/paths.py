"""Per-user directories (XDG via platformdirs). Each call creates the directory, user-only."""

from __future__ import annotations

import os
import tempfile
from importlib import resources
from pathlib import Path

import platformdirs

APP = "exl3local"


def bundled(*parts: str) -> Path:
    """A file shipped inside the package (the demo model, the fallback chat template), found through
    the package rather than beside a module file, so modules can move between subpackages."""
    return Path(str(resources.files("exl3local").joinpath(*parts)))


def _ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def state_dir() -> Path:
    """Pinned profile, engine record, the engine's cwd."""
    return _ensure(platformdirs.user_state_path(APP))


def log_dir() -> Path:
    """daemon.log and the rotating engine.log."""
    return _ensure(platformdirs.user_log_path(APP))


def config_dir() -> Path:
    """User profile overrides (profiles/*.toml here shadow the bundled ones)."""
    return _ensure(platformdirs.user_config_path(APP))


def cache_dir() -> Path:
    return _ensure(platformdirs.user_cache_path(APP))


def runtime_dir() -> Path:
    """Lock and API token. XDG_RUNTIME_DIR when set; without it platformdirs would warn and pick
    a shared /tmp path, so fall back to a user-only folder in the state dir instead."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = _ensure(Path(base) / APP if base else state_dir() / "run")
    path.chmod(0o700)
    return path


def lock_file() -> Path:
    return runtime_dir() / "daemon.lock"


def token_file() -> Path:
    """Secret for the daemon's mutating endpoints: other local users can reach 127.0.0.1 too."""
    return runtime_dir() / "api.token"


def engine_record() -> Path:
    """The running engine's pid/pgid/tmpdir, so a daemon killed with -9 is cleaned up after."""
    return state_dir() / "engine.json"


def engine_log() -> Path:
    return log_dir() / "engine.log"


def daemon_log() -> Path:
    return log_dir() / "daemon.log"


def pinned_profile() -> Path:
    return config_dir() / "profile"


def write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    """Replace `path` with `text` so readers see the old file or the new one, never a half-written
    one (records, refs, unit files): a synced temp file beside it, then one rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
