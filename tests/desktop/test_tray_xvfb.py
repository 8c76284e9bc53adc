"""`exl3local tray` under Xvfb: it docks in a system tray, polls the stub daemon's API and repaints its
icon for each engine state. (pystray's X11 backend: no menus; their wiring is tests/unit/test_tray.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from exl3local.desktop import tray


def _rgb(colour: str) -> tuple[int, int, int]:
    return tuple(int(colour[i : i + 2], 16) for i in (1, 3, 5))


def _wait(predicate, timeout_s: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_tray_docks_and_its_icon_follows_the_engine_state(tray_manager, stub_daemon, tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "exl3local", "tray", "--poll", "0.2"],
        env={**os.environ, "PYSTRAY_BACKEND": "xorg"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _wait(lambda: tray_manager.docked or proc.poll() is not None, what="the icon to dock")
        assert proc.poll() is None, proc.communicate()
        shown: list[str] = []
        for state, extra in (
            ("STOPPED", {}),
            ("STARTING", {"model": "/m/tiny", "served_model_name": "tiny", "progress": "loading"}),
            ("READY", {"endpoint": "http://127.0.0.1:11436/v1"}),
            ("FAILED", {"last_error": "EngineError: exit 1"}),
        ):
            stub_daemon.set(state=state, **extra)
            colour = _rgb(tray.COLOURS[state])
            _wait(lambda: tray_manager.pixel() == colour, what=f"{state} colour {colour}, showing {tray_manager.pixel()}")
            shown.append(state)
        tray_manager.screenshot(str(tmp_path / "tray.png"), 4 * 32, 32)
        assert shown == ["STOPPED", "STARTING", "READY", "FAILED"]
        assert [c for c in stub_daemon.calls if c[0] == "POST"] == []  # polling only reads
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=20)
    # the X11 backend's limit is said, with the packages that lift it
    assert "the icon shows the engine state only" in stderr and "python3-gi gir1.2-gtk-3.0" in stderr, stderr
