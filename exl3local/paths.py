"""Where things are: per-user directories (XDG via platformdirs; each call creates the directory,
user-only), and which process listens on a local TCP port (the daemon's and the engine's ports
are checked before anyone trusts what answers there)."""

from __future__ import annotations

import os
import socket
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import platformdirs
import psutil

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


def daemon_socket() -> Path:
    """The daemon API's Unix socket (0600, in the 0700 runtime dir: the file system keeps others off)."""
    return runtime_dir() / "daemon.sock"


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


@dataclass(frozen=True)
class Listener:
    """A listening TCP socket: its owner's pid (None: another user's process, hidden from us)."""

    pid: int | None
    ip: str
    port: int

    def describe(self) -> str:
        if self.pid is None:
            return "a process of another user (its pid is hidden from you)"
        try:
            return f"pid {self.pid} ({psutil.Process(self.pid).name()})"
        except psutil.Error:
            return f"pid {self.pid}"


def _covers(listen_ip: str, host: str) -> bool:
    """A socket bound to listen_ip receives connections for host (wildcards receive all)."""
    return listen_ip in (host, "0.0.0.0", "::") or listen_ip == f"::ffff:{host}"


def port_listeners(host: str, port: int) -> list[Listener]:
    """Every socket listening for connections to host:port, system-wide (one /proc scan)."""
    try:
        conns = psutil.net_connections("tcp")
    except psutil.Error:
        return []
    return [Listener(c.pid, c.laddr.ip, c.laddr.port) for c in conns
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port and _covers(c.laddr.ip, host)]


def listens(pid: int, host: str, port: int) -> bool:
    """pid itself holds a socket listening for host:port (reads only that process's fds)."""
    try:
        conns = psutil.Process(pid).net_connections("tcp")
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port and _covers(c.laddr.ip, host) for c in conns)


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are fine
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def port_holder(host: str, port: int) -> str:
    """Who holds host:port, in words, for an error message."""
    found = port_listeners(host, port)
    return found[0].describe() if found else "a socket that is bound but not listening"


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
