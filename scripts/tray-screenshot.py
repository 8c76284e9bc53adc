"""Screenshot of the tray menu for docs/: the real `TrayApp` with pystray's GTK backend, in Xvfb, docked in the
minimal system tray of tests/desktop, right-clicked through XTEST; the daemon is a canned READY status.

Needs Xvfb, dbus-daemon and GTK 3 with PyGObject (Debian: xvfb dbus-daemon gir1.2-gtk-3.0 python3-gi); PyGObject
is taken from the system's dist-packages when the venv has none. GTK talks to a session bus: without one it would
run `dbus-launch` (package dbus-x11, often missing on servers), so the script starts a private bus itself.
Usage: .venv/bin/python -P scripts/tray-screenshot.py OUT.png
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SWITCH_PROFILE_Y = 183  # where GTK's default theme puts that item under a 16 px tray icon
STATUS = {
    "api_version": 1, "state": "READY", "model": "/home/me/.cache/huggingface/hub/…/snapshots/581c5cd1",
    "served_model_name": "turboderp/Qwen3-8B-exl3:4.0bpw", "profile": "b70",
    "endpoint": "http://127.0.0.1:11436/v1",
}  # fmt: skip


def load_desktop_conftest():
    """The Xvfb starter and minimal system tray of tests/desktop."""
    spec = importlib.util.spec_from_file_location("desktop_conftest", REPO / "tests" / "desktop" / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = conftest  # dataclasses look their module up there
    spec.loader.exec_module(conftest)
    return conftest


def private_session_bus() -> int | None:
    """Start a session bus for GTK when there is none; its pid, to end it after. None: one was there."""
    if os.environ.get("DBUS_SESSION_BUS_ADDRESS"):
        return None
    out = subprocess.run(["dbus-daemon", "--session", "--fork", "--print-address=1", "--print-pid=1"],
                         capture_output=True, text=True, check=True, timeout=30).stdout.split()
    os.environ["DBUS_SESSION_BUS_ADDRESS"] = out[0]
    return int(out[1])


def b70_profiles() -> list[str]:
    """What the tray offers on the B70 desktop: the profiles for its backend, read from the test suite's
    sysfs tree of that machine."""
    sys.path.append(str(REPO / "tests" / "support"))
    from sysfs_trees import MACHINES

    from exl3local.commands.desktop import runnable_profiles

    with tempfile.TemporaryDirectory(prefix="tray-shot-") as tmp:
        os.environ["EXL3LOCAL_SYSFS"] = str(MACHINES["b70"](Path(tmp) / "sys"))
        return runnable_profiles()


def main(out: str) -> None:
    conftest = load_desktop_conftest()
    xvfb, display = conftest.start_xvfb(Path(out).with_suffix(".xvfb.log"))
    bus = private_session_bus()
    try:
        shoot_menu(conftest, display, out)
    finally:
        if bus is not None:
            os.kill(bus, signal.SIGTERM)
        xvfb.terminate()
        xvfb.wait(timeout=10)


def shoot_menu(conftest, display: str, out: str) -> None:
    os.environ.update(DISPLAY=display, PYSTRAY_BACKEND="gtk")
    try:
        import gi  # noqa: F401
    except ImportError:
        sys.path.append("/usr/lib/python3/dist-packages")
    manager = conftest.TrayManager(display)
    manager.start()

    import httpx
    from Xlib import X
    from Xlib.ext import xtest

    from exl3local.api.client import DaemonClient
    from exl3local.desktop import tray

    client = DaemonClient("127.0.0.1:1", transport=httpx.MockTransport(lambda r: httpx.Response(200, json=STATUS)))
    app = tray.TrayApp(client, b70_profiles(), poll_s=0.5)
    icon = app.icon()

    def shoot() -> None:
        icon.visible = True
        app.refresh()
        deadline = time.monotonic() + 20
        while not manager.docked and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)
        d = manager.d
        xtest.fake_input(d, X.MotionNotify, x=8, y=8)  # GTK draws a 16 px icon in the slot's corner
        xtest.fake_input(d, X.ButtonPress, 3)
        xtest.fake_input(d, X.ButtonRelease, 3)
        d.sync()
        time.sleep(1.5)
        xtest.fake_input(d, X.MotionNotify, x=60, y=SWITCH_PROFILE_Y)  # hover: the profile submenu opens
        d.sync()
        time.sleep(1.5)
        manager.screenshot(out, 460, 285)
        icon.stop()

    threading.Thread(target=shoot, daemon=True).start()
    from gi.repository import GLib

    try:
        icon.run(setup=lambda _: None)
    except GLib.Error:
        # pystray hides its notification on stop; Xvfb has no notification service to ask
        if not Path(out).exists():
            raise
    finally:
        manager.close()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(REPO / "docs" / "tray-menu.png"))
