"""A private user for end-to-end tests: own XDG dirs, TMPDIR and 127.0.0.1 ports, `exl3local` run as
subprocesses in that environment, and cleanup by pid of exactly what it started."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@dataclass
class Box:
    """One isolated user: dirs, ports, env; `cli()` runs `exl3local ...` as that user."""

    root: Path
    env: dict[str, str]
    daemon_port: int
    engine_port: int
    started: list[subprocess.Popen] = field(default_factory=list)

    @property
    def tmp(self) -> Path:
        return Path(self.env["TMPDIR"])

    @property
    def runtime(self) -> Path:
        return Path(self.env["XDG_RUNTIME_DIR"]) / "exl3local"

    @property
    def state(self) -> Path:
        return Path(self.env["XDG_STATE_HOME"]) / "exl3local"

    def cli(self, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-P", "-m", "exl3local", *args], env={**self.env, **env},
                              capture_output=True, text=True, timeout=timeout, cwd=self.root, stdin=subprocess.DEVNULL)

    def popen(self, *args: str, **env: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-P", "-m", "exl3local", *args], env={**self.env, **env},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=self.root)
        self.started.append(proc)
        return proc

    def engines(self) -> list[tuple[int, int]]:
        """(stand-in pid, its child pid) for every engine start."""
        log = Path(self.env["STANDIN_LOG"])
        if not log.exists():
            return []
        return [tuple(map(int, line.split())) for line in log.read_text().split("\n") if line.strip()]

    def wait_status(self, pred: Callable[[dict], bool], timeout: float = 30.0) -> dict:
        """Poll the daemon's /api/status directly until pred holds: CLI round trips are too slow
        (~1 s on a loaded 2-core box) to see a 1 s BACKOFF window."""
        deadline = time.monotonic() + timeout
        st: dict = {}
        while True:
            try:
                st = httpx.get(f"http://127.0.0.1:{self.daemon_port}/api/status", timeout=5).json()
            except httpx.TransportError:
                pass  # the daemon is not up yet
            else:
                if pred(st):
                    return st
            assert time.monotonic() < deadline, st
            time.sleep(0.05)

    def token(self) -> str:
        return (self.runtime / "api.token").read_text()

    def daemon_pid(self) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            return int((self.runtime / "daemon.lock").read_text())
        return None


def make_box(root: Path, engine_script: Path | None = None) -> Box:
    """A private user under `root`; with `engine_script`, that Python file stands in for vLLM."""
    for d in ("state", "config", "cache", "data", "run", "tmp", "nosys"):
        (root / d).mkdir(mode=0o700)
    daemon_port, engine_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EXL3LOCAL_", "XDG_"))}
    env.update({
        "XDG_STATE_HOME": str(root / "state"), "XDG_CONFIG_HOME": str(root / "config"),
        "XDG_CACHE_HOME": str(root / "cache"), "XDG_DATA_HOME": str(root / "data"), "XDG_RUNTIME_DIR": str(root / "run"),
        "TMPDIR": str(root / "tmp"),
        "EXL3LOCAL_HOST": f"127.0.0.1:{daemon_port}", "EXL3LOCAL_ENGINE_PORT": str(engine_port),
        "EXL3LOCAL_SYSFS": str(root / "nosys"),
        "STANDIN_LOG": str(root / "engines.log"), "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
    })  # fmt: skip
    if engine_script is not None:
        engine = root / "engine-python"
        engine.write_text(f"#!/bin/sh\nexec {sys.executable} {engine_script} \"$@\"\n")
        engine.chmod(0o755)
        env["EXL3LOCAL_ENGINE_PYTHON"] = str(engine)
    return Box(root, env, daemon_port, engine_port)


def clean_box(b: Box) -> None:
    """Stop only what this box started, by pid."""
    b.cli("down", timeout=60)
    for proc in b.started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    pid = b.daemon_pid()
    if pid and pid_alive(pid):
        os.kill(pid, signal.SIGKILL)
    for pair in b.engines():
        for p in pair:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)
