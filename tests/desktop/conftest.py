"""An X server (Xvfb) with a minimal system tray, and a stub daemon API on 127.0.0.1, for the tray tests.

The tray manager speaks just enough of the freedesktop system tray protocol (XEmbed) for pystray:
it owns the _NET_SYSTEM_TRAY_S0 selection and, on SYSTEM_TRAY_REQUEST_DOCK, reparents the icon's
window into its own 32 px slots, left to right.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

SLOT_PX = 32
TRAY_W, TRAY_H = 4 * SLOT_PX, SLOT_PX


def start_xvfb(log_path: Path) -> tuple[subprocess.Popen, str]:
    """Xvfb on the first free display from :90; another run may race us to a number, so a server that
    exits before its socket appears moves us on to the next one."""
    for number in range(90, 190):
        if Path(f"/tmp/.X{number}-lock").exists():
            continue
        proc = subprocess.Popen(
            ["Xvfb", f":{number}", "-screen", "0", "640x400x24", "-nolisten", "tcp", "-noreset"],
            stdout=subprocess.DEVNULL, stderr=log_path.open("a"),
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while proc.poll() is None and time.monotonic() < deadline:
            if Path(f"/tmp/.X11-unix/X{number}").exists():
                return proc, f":{number}"
            time.sleep(0.02)
        proc.kill()
        proc.wait()
    pytest.fail(f"no X display could be started (see {log_path})")


@pytest.fixture
def xvfb(tmp_path, monkeypatch) -> Iterator[str]:
    """A private X display for one test; DISPLAY points at it."""
    if shutil.which("Xvfb") is None:
        pytest.skip("Xvfb not installed (scripts/setup installs it)")
    proc, display = start_xvfb(tmp_path / "xvfb.log")
    monkeypatch.setenv("DISPLAY", display)
    yield display
    proc.terminate()
    proc.wait(timeout=10)


class TrayManager(threading.Thread):
    def __init__(self, display: str) -> None:
        super().__init__(daemon=True, name="tray-manager")
        from Xlib import X, display as xdisplay

        self.d = xdisplay.Display(display)
        screen = self.d.screen()
        self.window = screen.root.create_window(
            0, 0, TRAY_W, TRAY_H, 0, screen.root_depth,
            background_pixel=screen.white_pixel, event_mask=X.SubstructureNotifyMask,
        )  # fmt: skip
        self.window.map()
        self.opcode = self.d.intern_atom("_NET_SYSTEM_TRAY_OPCODE")
        self.window.set_selection_owner(self.d.intern_atom("_NET_SYSTEM_TRAY_S0"), X.CurrentTime)
        self.d.sync()
        # pixel() and screenshot() run in the test's thread on a connection of their own: python-xlib's wait for a
        # reply hung for good (session 18, get_image) while this thread read the same connection's events
        self.reader = xdisplay.Display(display)
        self.docked: list[int] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        from Xlib import X

        while not self.stopped.is_set():
            ready, _, _ = select.select([self.d.fileno()], [], [], 0.05)
            while self.d.pending_events():
                ev = self.d.next_event()
                # pystray repeats the dock request on every icon update; a docked window keeps its slot
                if (ev.type == X.ClientMessage and ev.client_type == self.opcode and ev.data[1][1] == 0
                        and ev.data[1][2] not in self.docked):
                    icon = self.d.create_resource_object("window", ev.data[1][2])
                    icon.reparent(self.window, SLOT_PX * len(self.docked), 0)
                    icon.configure(width=SLOT_PX, height=SLOT_PX)
                    icon.map()
                    self.d.sync()
                    self.docked.append(ev.data[1][2])

    def pixel(self, slot: int = 0) -> tuple[int, int, int]:
        """Colour at the centre of a slot, as the screen shows it."""
        from Xlib import X

        root = self.reader.screen().root
        raw = root.get_image(SLOT_PX * slot + SLOT_PX // 2, SLOT_PX // 2, 1, 1, X.ZPixmap, 0xFFFFFFFF).data
        return raw[2], raw[1], raw[0]  # BGRX

    def screenshot(self, path: str, width: int, height: int) -> None:
        from PIL import Image
        from Xlib import X

        raw = self.reader.screen().root.get_image(0, 0, width, height, X.ZPixmap, 0xFFFFFFFF).data
        Image.frombytes("RGB", (width, height), bytes(raw), "raw", "BGRX").save(path)

    def close(self) -> None:
        self.stopped.set()
        self.join(timeout=5)
        self.d.close()
        self.reader.close()


@pytest.fixture
def tray_manager(xvfb: str) -> Iterator[TrayManager]:
    manager = TrayManager(xvfb)
    manager.start()
    yield manager
    manager.close()


@dataclass
class StubDaemon:
    """The daemon's API as docs/api.md describes it, with a settable state and a log of calls."""

    status: dict = field(default_factory=lambda: {"api_version": 1, "state": "STOPPED"})
    calls: list[tuple[str, str, dict | None]] = field(default_factory=list)
    host: str = ""

    def set(self, **kwargs: object) -> None:
        self.status = {**self.status, **kwargs}


@pytest.fixture
def stub_daemon(tmp_path, monkeypatch) -> Iterator[StubDaemon]:
    stub = StubDaemon()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _answer(self, body: dict, status: int = 200) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            stub.calls.append(("GET", self.path, None))
            if self.path == "/api/health":
                return self._answer({"ok": True, "daemon_pid": os.getpid(), "version": "0.1.0", "api_version": 1})
            if self.path == "/api/status":
                return self._answer(stub.status)
            self._answer({"error": {"type": "Exl3Error", "message": "no such path", "hint": ""}}, 404)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
            stub.calls.append(("POST", self.path, body))
            if self.path == "/api/stop":
                stub.set(state="STOPPED")
            elif self.path in ("/api/restart", "/api/up"):
                stub.set(state="STARTING", profile=(body or {}).get("profile") or stub.status.get("profile"))
            self._answer(stub.status, 202 if self.path != "/api/stop" else 200)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    stub.host = f"127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("EXL3LOCAL_HOST", stub.host)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    yield stub
    server.shutdown()
    server.server_close()
