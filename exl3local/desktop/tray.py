"""A status icon and menu for the daemon (`exl3local tray`; the `tray` extra: pystray + Pillow).

It talks to the daemon only through `api.client.DaemonClient`: it polls /api/status and calls up/restart/stop.
The icon's colour is the engine state; the menu shows the model and endpoint, copies the endpoint URL,
opens the dashboard in the user's terminal, restarts the engine, switches profile and stops it.

`TrayView` (status → colour, tooltip, menu texts) and `TrayApp` (menu actions, refresh) are plain Python,
tested without a display; pystray is imported only by `TrayApp.menu()`/`icon()`. pystray's X11 backend
(the one a pip install gets without PyGObject) shows no menu and, in pystray 0.19.5, gets no clicks (its
window does not select ButtonPress): there the icon only shows the state, and `exl3local tray` says which
system packages give the menu (`menu_problem`: PyGObject and GTK's introspection data, for pystray's GTK and
AppIndicator backends).
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from exl3local.api.client import DaemonClient
from exl3local.api.protocol import DaemonStatus
from exl3local.errors import ConfigError, DaemonUnavailable, Exl3Error

if TYPE_CHECKING:
    from PIL import Image

POLL_S = 2.0
ICON_PX = 64
DOWN = "DOWN"  # no daemon answers: not an EngineState, the tray's own
# Colour per engine state: green serves, amber is on its way, red needs the user, grey is idle.
COLOURS = {
    "READY": "#2fb35a",
    "STARTING": "#f2b233",
    "BACKOFF": "#f28c28",
    "STOPPING": "#9aa0a6",
    "STOPPED": "#9aa0a6",
    "FAILED": "#e5484d",
    "IDLE": "#5b8def",  # unloaded by the keep-alive: the next request starts it
    DOWN: "#4a4f57",
}
# The state as the menu's first line says it.
STATE_WORDS = {
    "READY": "Ready",
    "STARTING": "Starting…",
    "BACKOFF": "Restarting after a failure",
    "STOPPING": "Stopping…",
    "STOPPED": "Stopped",
    "FAILED": "Failed",
    "IDLE": "Idle (memory given back; the next request loads the model)",
    DOWN: "Daemon not running",
}
BACKGROUND = "#1f2a44"
# What gives pystray its menu backends, per distribution family (the Python binding, then GTK 3's and the
# AppIndicator library's introspection data). A venv sees the distribution's python3-gi only when created
# with --system-site-packages; else `pip install PyGObject` builds it from the -dev packages named here.
PYGOBJECT_PACKAGES = (
    "Debian/Ubuntu: sudo apt install python3-gi gir1.2-gtk-3.0 gir1.2-ayatanaappindicator3-0.1; "
    "Fedora: sudo dnf install python3-gobject gtk3 libayatana-appindicator-gtk3; "
    "Arch: sudo pacman -S python-gobject gtk3 libayatana-appindicator"
)
PYGOBJECT_BUILD = (
    "or in this venv: pip install PyGObject (Debian/Ubuntu first: sudo apt install libgirepository-2.0-dev "
    "libcairo2-dev pkg-config python3-dev)"
)
# Terminals tried for the dashboard when neither $TERMINAL nor Debian's alternative exists; each runs `-e CMD...`.
TERMINALS = ("x-terminal-emulator", "gnome-terminal", "konsole", "xfce4-terminal", "alacritty", "kitty", "xterm")
CLIPBOARD_TOOLS = (("wl-copy",), ("xclip", "-selection", "clipboard"), ("xsel", "--clipboard", "--input"))


@dataclass(frozen=True)
class TrayView:
    """What the tray shows for one status answer."""

    state: str  # an EngineState value, or DOWN
    model: str | None = None
    endpoint: str | None = None
    profile: str | None = None
    detail: str = ""  # last error, or why the daemon is unreachable
    switch_to: str | None = None  # a request named this model: loaded once the requests in flight end
    waiting: int = 0  # requests waiting for that switch or for READY

    @classmethod
    def of(cls, status: DaemonStatus | None, detail: str = "") -> TrayView:
        if status is None:
            return cls(DOWN, detail=detail)
        return cls(
            status.state.value,
            model=status.served_model_name or status.model,
            endpoint=status.endpoint,
            profile=status.profile,
            detail=status.last_error or "",
            switch_to=status.switch_to,
            waiting=status.requests_waiting,
        )

    @property
    def colour(self) -> str:
        return COLOURS[self.state]

    @property
    def title(self) -> str:
        """Tooltip: one line of state, model and where it answers."""
        if self.state == DOWN:
            return "exl3local: daemon not running"
        parts = [f"exl3local: {self.state.lower()}"]
        if self.model:
            parts.append(self.model)
        if self.state == "READY" and self.endpoint:
            parts.append(self.endpoint)
        if self.state in ("FAILED", "BACKOFF") and self.detail:
            parts.append(self.detail.splitlines()[0][:120])
        if self.switching:
            parts.append(self.switching)
        return " · ".join(parts)

    @property
    def switching(self) -> str:
        """A pending switch, in the words `status` and the dashboard use."""
        if not self.switch_to:
            return ""
        return f"switching to {self.switch_to}" + (f" · {self.waiting} waiting" if self.waiting else "")

    @property
    def state_words(self) -> str:
        """The menu's first line: the state in words, and for a failure its first line."""
        words = STATE_WORDS[self.state]
        if self.state in ("FAILED", "BACKOFF") and self.detail:
            words += f": {self.detail.splitlines()[0][:80]}"
        if self.switching:
            words += f" · {self.switching}"
        return f"Engine: {words}" if self.state != DOWN else words

    @property
    def serving(self) -> bool:
        return self.state in ("STARTING", "READY", "BACKOFF")


def icon_image(colour: str, size: int = ICON_PX) -> Image.Image:
    """The tray icon: the launcher icon's dark tile with a state-coloured disc (no fonts needed)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGBA", (size, size), (0, 0, 0, 0))
    draw = ImageDraw.Draw(img)
    draw.rounded_rectangle((0, 0, size - 1, size - 1), radius=size // 5, fill=BACKGROUND)
    inset = size // 6
    draw.ellipse((inset, inset, size - 1 - inset, size - 1 - inset), fill=colour)
    return img


def copy_to_clipboard(text: str) -> None:
    """Through the desktop's clipboard tool (Wayland, then X11); there is no portable Python way."""
    for tool in CLIPBOARD_TOOLS:
        if shutil.which(tool[0]):
            subprocess.run(tool, input=text, text=True, check=True, timeout=5)
            return
    raise ConfigError(
        "no clipboard tool found (wl-copy, xclip or xsel)",
        hint=f"install one (e.g. `apt install xclip`), or copy it by hand: {text}",
    )


def terminal_command(argv: Sequence[str], environ: dict[str, str] | None = None) -> list[str]:
    """The user's terminal running argv: $TERMINAL, else the first of TERMINALS installed."""
    environ = os.environ if environ is None else environ
    candidates = [environ["TERMINAL"]] if environ.get("TERMINAL") else list(TERMINALS)
    for term in candidates:
        if shutil.which(term):
            return [term, "-e", *argv]
    raise ConfigError("no terminal emulator found to open the dashboard in", hint="set $TERMINAL, or run `exl3local dash`")


def open_dashboard() -> None:
    subprocess.Popen(
        terminal_command([sys.executable, "-P", "-m", "exl3local", "dash"]),
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip


class TrayApp:
    """The tray's state and actions. `icon()` builds the pystray icon; everything else runs without one."""

    def __init__(
        self,
        client: DaemonClient,
        profiles: Sequence[str],
        *,
        copy: Callable[[str], None] = copy_to_clipboard,
        dashboard: Callable[[], None] = open_dashboard,
        notify: Callable[[str], None] | None = None,
        poll_s: float = POLL_S,
    ) -> None:
        self.client = client
        self.profiles = tuple(profiles)
        self._copy = copy
        self._dashboard = dashboard
        self._notify = notify or (lambda message: print(f"exl3local tray: {message}", file=sys.stderr))
        self.poll_s = poll_s
        self.view = TrayView.of(None)
        self.status: DaemonStatus | None = None  # the last answer; its `model` is what up() takes
        self._icon: Any = None
        self._stop = threading.Event()

    # -- state ----------------------------------------------------------------------------------
    def refresh(self) -> TrayView:
        """Poll the daemon once; redraw the icon, tooltip and menu when anything changed."""
        try:
            self.status = self.client.status()
            view = TrayView.of(self.status)
        except DaemonUnavailable as err:
            self.status = None
            view = TrayView.of(None, str(err))
        if view != self.view:
            self.view = view
            if self._icon is not None:
                self._icon.icon = icon_image(view.colour)
                self._icon.title = view.title
                self._icon.update_menu()
        return view

    def _call(self, what: str, action: Callable[[], object]) -> None:
        """Run one menu action; the daemon's refusal is told to the user, never raised into pystray."""
        try:
            action()
        except Exl3Error as err:
            self._notify(f"{what}: {err}" + (f" ({err.hint})" if err.hint else ""))
        self.refresh()

    # -- menu actions ---------------------------------------------------------------------------
    def copy_endpoint(self) -> None:
        if self.view.endpoint:
            self._call("copy endpoint", lambda: self._copy(self.view.endpoint or ""))

    def open_dashboard(self) -> None:
        self._call("open dashboard", self._dashboard)

    def restart(self) -> None:
        self._call("restart", self.client.restart)

    def stop_engine(self) -> None:
        self._call("stop", self.client.stop)

    def switch_profile(self, name: str) -> None:
        """Serve the current model with another profile (the daemon restarts the engine)."""
        model = self.status.model if self.status is not None else None
        self._call(f"switch to {name}", lambda: self.client.up(model, profile=name))

    def quit(self) -> None:
        self._stop.set()
        if self._icon is not None:
            self._icon.stop()

    # -- pystray --------------------------------------------------------------------------------
    def menu(self) -> Any:
        from pystray import Menu, MenuItem

        v = lambda: self.view  # noqa: E731 - pystray re-reads texts and flags on every update_menu()

        def profile_item(name: str) -> MenuItem:
            return MenuItem(name, lambda: self.switch_profile(name), checked=lambda item: v().profile == name, radio=True)

        profiles = Menu(*(profile_item(name) for name in self.profiles))
        return Menu(
            MenuItem(lambda item: v().state_words, None, enabled=False),
            MenuItem(lambda item: f"Model: {v().model or '-'}", None, enabled=False),
            MenuItem(lambda item: f"Endpoint: {v().endpoint or '-'}", None, enabled=False),
            Menu.SEPARATOR,
            MenuItem("Copy endpoint URL", lambda: self.copy_endpoint(), enabled=lambda item: bool(v().endpoint)),
            MenuItem("Open dashboard", lambda: self.open_dashboard(), default=True),
            MenuItem("Restart engine", lambda: self.restart(), enabled=lambda item: v().state != DOWN),
            MenuItem("Switch profile", profiles, enabled=lambda item: v().state != DOWN),
            MenuItem("Stop engine", lambda: self.stop_engine(), enabled=lambda item: v().serving),
            Menu.SEPARATOR,
            MenuItem("Quit tray", lambda: self.quit()),
        )

    def icon(self) -> Any:
        import pystray

        self._icon = pystray.Icon("exl3local", icon_image(self.view.colour), self.view.title, self.menu())
        return self._icon

    def _poll(self, icon: Any) -> None:
        icon.visible = True
        while not self._stop.is_set():
            self.refresh()
            self._stop.wait(self.poll_s)

    def run(self) -> None:
        """Blocks until Quit (pystray wants the main thread)."""
        self.icon().run(setup=self._poll)


def backend_has_menu() -> bool:
    import pystray

    return bool(pystray.Icon.HAS_MENU)


def menu_problem() -> str | None:
    """What this Python lacks for a tray menu, naming the packages to install; None when GTK is there."""
    try:
        gi = importlib.import_module("gi")
    except ImportError:
        return (f"PyGObject is not installed for {sys.executable}, so the tray has no menu (pystray's X11 backend "
                f"only shows the icon). Install it: {PYGOBJECT_PACKAGES}; {PYGOBJECT_BUILD}.")
    try:
        gi.require_version("Gtk", "3.0")
    except ValueError:
        return ("PyGObject is installed but GTK 3's introspection data is not, so the tray has no menu. Install "
                "gir1.2-gtk-3.0 (Debian/Ubuntu), gtk3 (Fedora, Arch).")
    return None
