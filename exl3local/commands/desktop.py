"""CLI subcommands for the desktop: `service` (the systemd user unit) and `tray` (status icon)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from exl3local import paths, profiles
from exl3local.api.client import DaemonClient
from exl3local.desktop import service, tray
from exl3local.errors import ConfigError, Exl3Error
from exl3local.machine.select import find_device


def _context() -> dict:
    return {"python": sys.executable, "state_dir": paths.state_dir(), "env": service.carried_env()}


def _cmd_service(args: argparse.Namespace) -> int:
    layout = service.Layout.from_env()
    if args.action == "install":
        lines = service.install(layout, **_context(), autoload=args.autoload, tray=args.tray, force=args.force, now=args.now)
        lines += service.secrets_left_out()
    elif args.action == "uninstall":
        lines = service.uninstall(layout)
    elif args.action == "status":
        lines = service.status(layout, **_context())
    else:
        try:
            return service.autoload()
        except Exl3Error as err:  # logged in the journal; the unit itself stays up
            print(f"exl3local service autoload: {err}", file=sys.stderr)
            return 1
    print("\n".join(lines))
    return 0


def _add_service(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("service", help="run the daemon as a systemd user service (install, uninstall, status)")
    p.add_argument("action", choices=("install", "uninstall", "status", "autoload"),
                   help="autoload is what the unit runs after start: serve the profile's default model")  # fmt: skip
    p.add_argument("--force", action="store_true", help="install: overwrite files that differ")
    p.add_argument("--now", action="store_true", help="install: also (re)start the service now")
    p.add_argument("--autoload", action="store_true", help="install: serve the default model at login")
    p.add_argument("--tray", action="store_true", help="install: start the tray icon at login")
    p.set_defaults(handler=_cmd_service)


def _cmd_tray(args: argparse.Namespace) -> int:
    if not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        raise ConfigError("no graphical session (DISPLAY and WAYLAND_DISPLAY are unset): there is no tray to sit in",
                          hint="run it from your desktop session; `exl3local status` works anywhere")  # fmt: skip
    if importlib.util.find_spec("pystray") is None or importlib.util.find_spec("PIL") is None:
        raise ConfigError("the tray needs pystray and Pillow (the [tray] extra)", hint="pip install 'exl3local[tray]'")
    try:
        import pystray  # noqa: F401 - picks its backend on import
    except ImportError as err:  # the extra is there: a backend's own dependency is missing
        raise ConfigError(f"pystray found no usable backend: {err}",
                          hint=tray.menu_problem() or "pip install 'exl3local[tray]' again") from None
    except Exception as err:  # pystray raises what Xlib/GTK raise when it cannot reach the display
        raise ConfigError(f"no system tray available: {type(err).__name__}: {err}",
                          hint="`exl3local status` and `exl3local dash` work without one") from None  # fmt: skip
    if not tray.backend_has_menu():
        why = tray.menu_problem() or ("pystray chose its X11 backend (PYSTRAY_BACKEND?), which shows no menu: "
                                      "unset PYSTRAY_BACKEND or set it to gtk or appindicator")
        print(f"exl3local tray: the icon shows the engine state only. {why}", file=sys.stderr)
    with DaemonClient() as client:
        tray.TrayApp(client, runnable_profiles(), poll_s=args.poll).run()
    return 0


def runnable_profiles() -> list[str]:
    """The profiles whose backend this machine serves on: switching to another would only fail."""
    backend = find_device().gpu.backend
    return [name for name in profiles.names() if profiles.load(name).backend == backend]


def _add_tray(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tray", help="status icon and menu for the daemon (needs the [tray] extra)")
    p.add_argument("--poll", type=float, default=tray.POLL_S, help="seconds between status polls")
    p.set_defaults(handler=_cmd_tray)


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    for add in (_add_service, _add_tray):
        add(sub)
