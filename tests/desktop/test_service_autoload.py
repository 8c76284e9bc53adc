"""The unit's ExecStartPost (`exl3local service autoload`) asks the running daemon for the default model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_autoload_asks_the_daemon_for_the_profiles_default_model(stub_daemon):
    proc = subprocess.run([sys.executable, "-P", "-m", "exl3local", "service", "autoload"],
                          capture_output=True, text=True, env=dict(os.environ), timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    posts = [c for c in stub_daemon.calls if c[0] == "POST"]
    assert posts == [("POST", "/api/up", {"model": None, "profile": None, "port": None, "set": {}, "demo": False})]


def test_autoload_without_a_daemon_fails_without_hanging(monkeypatch, tmp_path):
    from exl3local.desktop import service
    from exl3local.errors import DaemonUnavailable

    monkeypatch.setenv("EXL3LOCAL_HOST", "127.0.0.1:9")  # discard port: nothing listens
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    with pytest.raises(DaemonUnavailable):
        service.autoload(wait_s=0.5)
