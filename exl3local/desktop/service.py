"""The daemon as a systemd *user* unit (`exl3local service install|uninstall|status`), no root needed.

What install writes (XDG base dirs, from templates in packaging/):
  $XDG_CONFIG_HOME/systemd/user/exl3local.service            the unit (exl3local.service.in)
  $XDG_CONFIG_HOME/systemd/user/default.target.wants/...     the link `systemctl --user enable` makes
  $XDG_DATA_HOME/applications/exl3local.desktop              launcher: the dashboard in a terminal
  $XDG_DATA_HOME/icons/hicolor/scalable/apps/exl3local.svg
  $XDG_CONFIG_HOME/autostart/exl3local-tray.desktop          with --tray: the tray icon at login
The files are written here, so install works where no systemd user manager runs (ssh, containers,
CI); systemctl is only asked to reload, start and stop, and its absence is reported, not fatal.
Install and uninstall are idempotent; a file that exists and differs is not overwritten without --force.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from exl3local import env, paths
from exl3local.api.client import DaemonClient
from exl3local.errors import ConfigError, DaemonUnavailable

UNIT = "exl3local.service"
# Carried into the unit when set: the user's shell sets them, a systemd user service would not see them.
# HF_* so the daemon finds the models `pull` put in the hub cache. Never a secret: the unit file is
# readable by every user and `systemctl show` prints its Environment= lines, so neither HF_TOKEN
# (huggingface_hub reads its stored token itself) nor EXL3LOCAL_API_KEY (the key file's path travels
# instead). Never an internal variable either: the daemon sets those for its own children.
SECRET_ENV = (env.API_KEY.name,)
CARRIED_ENV = ("HF_HOME", "HF_HUB_CACHE", "HF_ENDPOINT", "HF_HUB_OFFLINE") + tuple(
    v.name for v in env.ALL
    if v.name.startswith("EXL3LOCAL_") and not v.doc.startswith("internal:") and v.name not in SECRET_ENV
)
PLACEHOLDER = re.compile(r"@[A-Z_]+@")
SYSTEMCTL_TIMEOUT_S = 15.0
AUTOLOAD_WAIT_S = 20.0

Systemctl = Callable[[list[str]], "tuple[int, str] | None"]


@dataclass(frozen=True)
class Layout:
    """Where the files go: the XDG base directories (the spec's defaults when unset)."""

    config_home: Path
    data_home: Path

    @classmethod
    def from_env(cls) -> Layout:
        home = Path.home()
        return cls(
            Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config"),
            Path(os.environ.get("XDG_DATA_HOME") or home / ".local" / "share"),
        )

    @property
    def unit(self) -> Path:
        return self.config_home / "systemd" / "user" / UNIT

    @property
    def wants_link(self) -> Path:
        return self.config_home / "systemd" / "user" / "default.target.wants" / UNIT

    @property
    def desktop(self) -> Path:
        return self.data_home / "applications" / "exl3local.desktop"

    @property
    def icon(self) -> Path:
        return self.data_home / "icons" / "hicolor" / "scalable" / "apps" / "exl3local.svg"

    @property
    def autostart(self) -> Path:
        return self.config_home / "autostart" / "exl3local-tray.desktop"

    def all_files(self) -> tuple[Path, ...]:
        return (self.unit, self.desktop, self.icon, self.autostart)


def _template(name: str) -> str:
    return (resources.files("exl3local.packaging") / name).read_text()


def _quote(value: str) -> str:
    """One systemd word: specifiers (%) escaped, quoted when it has spaces, quotes or backslashes."""
    value = value.replace("%", "%%")
    if any(c in value for c in ' "\\\t'):
        value = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return value


def _fill(template: str, values: Mapping[str, str]) -> str:
    """Replace @NAME@ placeholders; a placeholder line that renders empty is dropped."""
    out = []
    for line in template.splitlines():
        stripped = line.strip()
        if stripped.startswith("@") and stripped.endswith("@") and stripped[1:-1] in values:
            if values[stripped[1:-1]]:
                out.append(values[stripped[1:-1]])
            continue
        if unknown := set(PLACEHOLDER.findall(line)) - {f"@{k}@" for k in values}:
            raise ConfigError(f"template placeholder {sorted(unknown)[0]} has no value")
        for key, value in values.items():
            line = line.replace(f"@{key}@", value)
        out.append(line)
    return "\n".join(out) + "\n"


def carried_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    environ = os.environ if environ is None else environ
    return {
        k: v for k, v in sorted(environ.items())
        if k in CARRIED_ENV
    }  # fmt: skip


def secrets_left_out(environ: Mapping[str, str] | None = None) -> list[str]:
    """Report lines for the secrets set in this shell that the unit does not carry, and what to do instead."""
    environ = os.environ if environ is None else environ
    if not environ.get(env.API_KEY.name):
        return []
    if environ.get(env.API_KEY_FILE.name):
        return [f"note: {env.API_KEY.name} is not written into the unit (every user can read a unit file); "
                f"the unit carries {env.API_KEY_FILE.name}, which takes precedence anyway"]
    return [f"note: {env.API_KEY.name} is not written into the unit (every user can read a unit file, and "
            f"`systemctl show` prints it), so the service's endpoint has no key: put the key in a file "
            f"(chmod 600) and install again with {env.API_KEY_FILE.name}=/path/to/file set"]


def render_unit(python: str, state_dir: Path, env: Mapping[str, str], autoload: bool) -> str:
    py = _quote(python)
    return _fill(
        _template("exl3local.service.in"),
        {
            "PYTHON": py,
            "STATE_DIR": str(state_dir).replace("%", "%%"),  # a path, not a command line: no quotes
            "ENVIRONMENT": "\n".join(f"Environment={_quote(f'{k}={v}')}" for k, v in env.items()),
            # `-`: a model that cannot start must not fail the daemon's unit (it reports the error itself).
            "AUTOLOAD": f"ExecStartPost=-{py} -P -m exl3local service autoload" if autoload else "",
        },
    )


def _desktop_exec(python: str) -> str:
    """Desktop Entry spec: arguments with reserved characters are double-quoted; % is doubled."""
    if any(c in python for c in ' \t"`$\\'):
        python = '"' + "".join("\\" + c if c in '"`$\\' else c for c in python) + '"'
    return python.replace("%", "%%")


def planned(layout: Layout, *, python: str, state_dir: Path, env: Mapping[str, str],
            autoload: bool, tray: bool) -> dict[Path, str]:  # fmt: skip
    files = {
        layout.unit: render_unit(python, state_dir, env, autoload),
        layout.desktop: _fill(_template("exl3local.desktop.in"), {"PYTHON": _desktop_exec(python)}),
        layout.icon: _template("exl3local.svg"),
    }
    if tray:
        files[layout.autostart] = _fill(_template("exl3local-tray.desktop.in"), {"PYTHON": _desktop_exec(python)})
    return files


# ---------------------------------------------------------------------------------------------
# systemctl


def run_systemctl(args: list[str]) -> tuple[int, str] | None:
    """`systemctl --user ARGS` → (exit status, output), or None when there is no systemctl at all."""
    exe = shutil.which("systemctl")
    if exe is None:
        return None
    try:
        proc = subprocess.run([exe, "--user", *args], capture_output=True, text=True, timeout=SYSTEMCTL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return 124, f"systemctl --user {' '.join(args)} timed out after {SYSTEMCTL_TIMEOUT_S:.0f} s"
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def _manager_reachable(systemctl: Systemctl) -> tuple[bool, str]:
    result = systemctl(["daemon-reload"])
    if result is None:
        return False, "systemctl not found"
    rc, out = result
    return rc == 0, out


# ---------------------------------------------------------------------------------------------
# install / uninstall / status


def install(layout: Layout, *, python: str, state_dir: Path, env: Mapping[str, str], autoload: bool = False,
            tray: bool = False, force: bool = False, now: bool = False,
            systemctl: Systemctl = run_systemctl) -> list[str]:  # fmt: skip
    """Write the unit, launcher, icon (and tray autostart), enable the unit. Returns report lines."""
    files = planned(layout, python=python, state_dir=state_dir, env=env, autoload=autoload, tray=tray)
    differing = [p for p, text in files.items() if p.exists() and p.read_text() != text]
    if differing and not force:  # checked for all files before writing any: no half-done install
        raise ConfigError(
            "already exists and differs from what install would write: " + ", ".join(map(str, differing)),
            hint="`exl3local service install --force` overwrites (see `exl3local service status`)",
        )
    report = []
    for path, text in files.items():
        if path.exists() and path.read_text() == text:
            report.append(f"unchanged  {path}")
        else:
            paths.write_atomic(path, text)
            report.append(f"wrote      {path}")
    # What `systemctl --user enable` does; done here so it also works without a running user manager.
    link_target = Path("..") / UNIT
    if not layout.wants_link.is_symlink() or Path(os.readlink(layout.wants_link)) != link_target:
        layout.wants_link.parent.mkdir(parents=True, exist_ok=True)
        layout.wants_link.unlink(missing_ok=True)
        layout.wants_link.symlink_to(link_target)
        report.append(f"enabled    {layout.wants_link} (starts at login)")
    reachable, why = _manager_reachable(systemctl)
    if not reachable:
        report.append(f"note: the systemd user manager is not reachable ({why}); the unit starts at the next login")
    elif now:
        rc, out = systemctl(["restart", UNIT]) or (1, "systemctl vanished")
        report.append("started    exl3local.service" if rc == 0 else f"could not start exl3local.service: {out}")
    return report


def _prune(directory: Path, stop: Path) -> None:
    """Remove now-empty directories from `directory` up to (not including) `stop`."""
    while directory != stop and stop in directory.parents and directory.is_dir() and not any(directory.iterdir()):
        directory.rmdir()
        directory = directory.parent


def uninstall(layout: Layout, *, systemctl: Systemctl = run_systemctl) -> list[str]:
    """Stop the unit if systemd runs it, remove every file install writes, and the directories it made."""
    report = []
    result = systemctl(["stop", UNIT]) if layout.unit.exists() else None
    if result is not None and result[0] == 0:
        report.append("stopped    exl3local.service")
    for path in (layout.wants_link, *layout.all_files()):
        if path.is_symlink() or path.exists():
            path.unlink()
            report.append(f"removed    {path}")
        home = layout.config_home if layout.config_home in path.parents else layout.data_home
        _prune(path.parent, home)
    _manager_reachable(systemctl)  # daemon-reload, so systemd forgets the unit; best effort
    return report or ["nothing to remove: exl3local.service is not installed"]


def status(layout: Layout, *, python: str, state_dir: Path, env: Mapping[str, str],
           systemctl: Systemctl = run_systemctl) -> list[str]:  # fmt: skip
    lines = []
    if not layout.unit.exists():
        lines.append(f"unit       not installed ({layout.unit})")
    else:
        current = layout.unit.read_text()
        same = any(current == render_unit(python, state_dir, env, autoload) for autoload in (False, True))
        lines.append(f"unit       {layout.unit} ({'up to date' if same else 'differs from what install would write now'})")
        lines.append(f"enabled    {'yes' if layout.wants_link.is_symlink() else 'no'}")
    result = systemctl(["is-active", UNIT])
    if result is None:
        lines.append("systemd    systemctl not found")
    else:
        rc, out = result
        # is-active prints the state on stdout; without a user manager it prints only an error
        state = out.splitlines()[0] if out else "unknown"
        known = state in {"active", "inactive", "failed", "activating", "deactivating", "reloading"}
        lines.append(f"systemd    {state}" if known else f"systemd    user manager not reachable ({out})")
    lines.append(f"launcher   {'installed' if layout.desktop.exists() else 'not installed'}")
    lines.append(f"tray       {'starts at login' if layout.autostart.exists() else 'not in autostart'}")
    return lines


def installed(layout: Layout | None = None) -> bool:
    return (layout or Layout.from_env()).unit.exists()


def start_if_installed(systemctl: Systemctl = run_systemctl) -> bool:
    """For `up`: start the daemon through systemd when the unit is installed and systemd answers.
    False means the caller starts a detached daemon itself."""
    if not installed():
        return False
    result = systemctl(["start", UNIT])
    return result is not None and result[0] == 0


def autoload(wait_s: float = AUTOLOAD_WAIT_S) -> int:
    """ExecStartPost of the unit: once the daemon answers, ask it to serve the profile's default model."""
    deadline = time.monotonic() + wait_s
    with DaemonClient() as client:
        while True:
            try:
                client.heartbeat()
                break
            except DaemonUnavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        client.up(None)
    return 0
