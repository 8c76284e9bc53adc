"""A private exl3local for a bench run: its own XDG dirs, TMPDIR and engine port, so a bench never touches the
user's running daemon. The daemon's API is its Unix socket in the private runtime dir."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def isolated_env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EXL3LOCAL_", "XDG_"))}
    for d in ("state", "config", "cache", "run", "tmp"):
        (root / d).mkdir(mode=0o700, exist_ok=True)
    env.update({
        "XDG_STATE_HOME": str(root / "state"), "XDG_CONFIG_HOME": str(root / "config"),
        "XDG_CACHE_HOME": str(root / "cache"), "XDG_RUNTIME_DIR": str(root / "run"), "TMPDIR": str(root / "tmp"),
        "EXL3LOCAL_ENGINE_PORT": str(free_port()), "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
    })  # fmt: skip
    return env


def cli(env: dict[str, str], *args: str, timeout: float | None = 900) -> subprocess.CompletedProcess:
    """`exl3local ARGS` in that environment (cwd /: the repo's ./packaging must not shadow PyPI's)."""
    return subprocess.run([sys.executable, "-P", "-m", "exl3local", *args], env=env, capture_output=True, text=True,
                          check=False, cwd="/", timeout=timeout)


def engine_socket(root: Path) -> str:
    """The Unix socket the engine of the private exl3local under `root` serves on (its engine.json's private dir)."""
    from exl3local.daemon.plan import ENGINE_SOCKET

    record = json.loads((root / "state" / "exl3local" / "engine.json").read_text())
    return str(Path(record["tmpdir"]) / ENGINE_SOCKET)
