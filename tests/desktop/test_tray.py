"""Tray logic without a display: status → icon/tooltip/menu, and menu items → the daemon API.

The daemon side is the real DaemonClient over an httpx.MockTransport that records every request.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from exl3local.api.client import DaemonClient
from exl3local.desktop import tray
from exl3local.errors import ConfigError

READY = {
    "state": "READY", "model": "/models/tiny", "served_model_name": "tiny", "profile": "cpu",
    "endpoint": "http://127.0.0.1:11436/v1",
}  # fmt: skip


class Daemon:
    """A scripted daemon: `status` is what GET /api/status answers; `requests` what was asked."""

    def __init__(self, status: dict | None) -> None:
        self.status = status
        self.requests: list[tuple[str, str, dict | None]] = []
        self.refuse: dict[str, dict] = {}

    def handler(self, request: httpx.Request) -> httpx.Response:
        if self.status is None:
            raise httpx.ConnectError("connection refused", request=request)
        body = json.loads(request.content) if request.content else None
        self.requests.append((request.method, request.url.path, body))
        if request.url.path in self.refuse:
            return httpx.Response(422, json={"error": self.refuse[request.url.path]})
        return httpx.Response(200, json=self.status)


@pytest.fixture(autouse=True)
def no_display_backend(monkeypatch):
    """pystray picks its backend on first import, and the X11 one connects to $DISPLAY right then:
    menus are built with the display-less backend here (tests/desktop runs the X11 one in Xvfb)."""
    monkeypatch.setenv("PYSTRAY_BACKEND", "dummy")
    import pystray  # noqa: F401


@pytest.fixture
def daemon() -> Daemon:
    return Daemon(dict(READY))


@pytest.fixture
def app(daemon: Daemon):
    copied, opened, told = [], [], []
    client = DaemonClient("127.0.0.1:1", token="t", transport=httpx.MockTransport(daemon.handler))
    a = tray.TrayApp(client, ["b70", "cpu"], copy=copied.append, dashboard=lambda: opened.append(True), notify=told.append)
    a.copied, a.opened, a.told = copied, opened, told
    a.refresh()
    return a


def _items(menu) -> dict:
    return {item.text: item for item in menu.items if item.text}


class FakeIcon:
    """What pystray hands a menu action; the tray never needs more than update_menu."""

    def update_menu(self) -> None:
        pass


@pytest.mark.parametrize(
    ("state", "colour"),
    [("READY", "#2fb35a"), ("STARTING", "#f2b233"), ("FAILED", "#e5484d"), ("STOPPED", "#9aa0a6"), (None, "#4a4f57")],
)
def test_icon_colour_follows_the_engine_state(state, colour):
    from exl3local.api.protocol import DaemonStatus

    view = tray.TrayView.of(DaemonStatus.from_json({**READY, "state": state}) if state else None)
    assert view.colour == colour
    img = tray.icon_image(view.colour)
    assert "#%02x%02x%02x" % img.getpixel((32, 32))[:3] == colour
    assert img.getpixel((0, 0))[3] == 0  # transparent corner: a tile, not a square


def test_states_have_distinct_colours():
    assert len({tray.COLOURS[s] for s in ("READY", "STARTING", "FAILED", "STOPPED", tray.DOWN)}) == 5


def test_tooltip_says_state_model_and_endpoint_or_why_it_failed():
    from exl3local.api.protocol import DaemonStatus

    assert tray.TrayView.of(DaemonStatus.from_json(READY)).title == "exl3local: ready · tiny · http://127.0.0.1:11436/v1"
    failed = DaemonStatus.from_json({**READY, "state": "FAILED", "last_error": "BudgetError: short by 1 GiB\nmore"})
    assert tray.TrayView.of(failed).title == "exl3local: failed · tiny · BudgetError: short by 1 GiB"
    assert tray.TrayView.of(None).title == "exl3local: daemon not running"
    # a request named another model: the switch waits for the requests in flight, and says so
    switching = tray.TrayView.of(DaemonStatus.from_json({**READY, "switch_to": "model-b", "requests_waiting": 2}))
    assert switching.title == "exl3local: ready · tiny · http://127.0.0.1:11436/v1 · switching to model-b · 2 waiting"
    assert switching.state_words == "Engine: Ready · switching to model-b · 2 waiting"


def test_menu_shows_state_in_words_model_and_endpoint(app, daemon):
    menu = app.menu()
    assert [item.text for item in menu.items][:3] == ["Engine: Ready", "Model: tiny", "Endpoint: http://127.0.0.1:11436/v1"]
    items = _items(menu)
    assert not items["Engine: Ready"].enabled
    daemon.status = {**READY, "state": "FAILED", "last_error": "BudgetError: short by 1 GiB\nmore"}
    app.refresh()
    assert app.menu().items[0].text == "Engine: Failed: BudgetError: short by 1 GiB"
    daemon.status = None
    app.refresh()
    assert app.menu().items[0].text == "Daemon not running"
    daemon.status = dict(READY)
    app.refresh()
    assert not items["Model: tiny"].enabled
    assert items["Open dashboard"].default


def test_menu_items_call_the_right_api(app, daemon):
    items = _items(app.menu())
    icon = FakeIcon()
    for text in ("Restart engine", "Stop engine"):
        daemon.requests.clear()
        items[text](icon)
        assert daemon.requests[0][:2] == ("POST", {"Restart engine": "/api/restart", "Stop engine": "/api/stop"}[text])
    daemon.requests.clear()
    profiles = _items(items["Switch profile"].submenu)
    assert profiles["cpu"].checked and not profiles["b70"].checked
    profiles["b70"](icon)
    assert daemon.requests[0] == ("POST", "/api/up", {"model": "/models/tiny", "profile": "b70", "port": None, "set": {}, "demo": False})
    items["Copy endpoint URL"](icon)
    items["Open dashboard"](icon)
    assert app.copied == ["http://127.0.0.1:11436/v1"] and app.opened == [True]
    assert all(method == "GET" for method, _, _ in daemon.requests[1:])  # the rest only refreshed


def test_items_follow_the_state(app, daemon):
    daemon.status = {**READY, "state": "STOPPED", "endpoint": None}
    app.refresh()
    items = _items(app.menu())
    assert not items["Stop engine"].enabled and not items["Copy endpoint URL"].enabled
    assert items["Restart engine"].enabled
    daemon.status = None  # the daemon went away
    assert app.refresh().state == tray.DOWN
    items = _items(app.menu())
    assert not items["Restart engine"].enabled and not items["Switch profile"].enabled
    assert items["Open dashboard"].enabled and items["Quit tray"].enabled


def test_a_refusal_is_told_not_raised(app, daemon):
    daemon.refuse["/api/restart"] = {"type": "BudgetError", "message": "the model does not fit", "hint": "try fp8 KV"}
    _items(app.menu())["Restart engine"](FakeIcon())
    assert app.told == ["restart: the model does not fit (try fp8 KV)"]


def test_dashboard_opens_in_the_users_terminal(monkeypatch, tmp_path):
    term = tmp_path / "myterm"
    term.write_text("#!/bin/sh\n")
    term.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert tray.terminal_command(["exl3local", "dash"], {"TERMINAL": "myterm"}) == ["myterm", "-e", "exl3local", "dash"]
    with pytest.raises(ConfigError, match="no terminal"):
        tray.terminal_command(["x"], {})
    with pytest.raises(ConfigError, match="clipboard"):
        tray.copy_to_clipboard("http://127.0.0.1:11436/v1")


def test_cli_without_a_display_says_so():
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    proc = subprocess.run([sys.executable, "-P", "-m", "exl3local", "tray"], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == ConfigError.exit_code
    assert "no graphical session" in proc.stderr


def test_only_profiles_this_machine_can_run_are_offered(machine, xdg, monkeypatch):
    from exl3local.commands.desktop import runnable_profiles

    monkeypatch.setenv("EXL3LOCAL_SYSFS", str(machine("b70")))
    arc = runnable_profiles()
    assert {"b70", "claw8", "140v", "xpu"} <= set(arc) and not {"cpu", "cuda"} & set(arc)
    monkeypatch.setenv("EXL3LOCAL_SYSFS", str(xdg / "no-sysfs"))
    assert runnable_profiles() == ["cpu"]


def _menu_problem(tmp_path, gi_source: str | None) -> str:
    """tray.menu_problem() in a fresh interpreter; gi_source: a `gi` package put first on its path."""
    path = []
    if gi_source is not None:
        (tmp_path / "gi").mkdir(parents=True)
        (tmp_path / "gi" / "__init__.py").write_text(gi_source)
        path = [str(tmp_path)]
    code = "from exl3local.desktop import tray; print(tray.menu_problem())"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_without_pygobject_the_message_names_the_system_packages(tmp_path):
    try:
        import gi  # noqa: F401
        pytest.skip("this Python has PyGObject")
    except ImportError:
        pass
    said = _menu_problem(tmp_path, None)
    assert said.startswith(f"PyGObject is not installed for {sys.executable}")
    assert "sudo apt install python3-gi gir1.2-gtk-3.0 gir1.2-ayatanaappindicator3-0.1" in said
    assert "sudo dnf install python3-gobject gtk3" in said and "pip install PyGObject" in said
    assert "[tray]" not in said  # the extra is installed; naming it again would send the user in a circle


def test_pygobject_without_gtk_data_names_that_package(tmp_path):
    gi_without_gtk = "def require_version(namespace, version):\n    raise ValueError(f'Namespace {namespace} not available')\n"
    said = _menu_problem(tmp_path, gi_without_gtk)
    assert "GTK 3's introspection data is not" in said and "gir1.2-gtk-3.0 (Debian/Ubuntu)" in said
    assert _menu_problem(tmp_path / "ok", "def require_version(namespace, version):\n    pass\n") == "None"


def test_every_engine_state_has_a_colour_and_words():
    """A state the daemon can report (IDLE since issue 23) must not break the icon or its menu."""
    from exl3local.api.protocol import EngineState

    assert all(s.value in tray.COLOURS and s.value in tray.STATE_WORDS for s in EngineState)
