"""systemd user unit, launcher and tray autostart: rendered, verified, installed into temp XDG dirs.

No systemd user manager runs on the test machines, so systemctl is a recording stub here (and the
real one is only asked for `status`); the unit file itself is checked by `systemd-analyze --user verify`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from exl3local.desktop import service
from exl3local.errors import ConfigError


class FakeSystemctl:
    def __init__(self, reachable: bool = True) -> None:
        self.calls: list[list[str]] = []
        self.reachable = reachable

    def __call__(self, args: list[str]) -> tuple[int, str] | None:
        self.calls.append(args)
        if not self.reachable:
            return 1, "Failed to connect to bus: No medium found"
        return (0, "active") if args[0] == "is-active" else (0, "")


@pytest.fixture
def layout(tmp_path: Path) -> service.Layout:
    lay = service.Layout(tmp_path / "config", tmp_path / "data")
    lay.config_home.mkdir()
    lay.data_home.mkdir()
    return lay


@pytest.fixture
def ctx(tmp_path: Path) -> dict:
    state = tmp_path / "state dir"  # a space, as in a real home directory name
    state.mkdir()
    return {"python": sys.executable, "state_dir": state, "env": {"EXL3LOCAL_HOST": "127.0.0.1:11435"}}


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): (os.readlink(p) if p.is_symlink() else "dir" if p.is_dir() else p.read_text())
        for p in sorted(root.rglob("*"))
    }


def test_unit_runs_the_daemon_restarts_on_failure_and_stops_the_group_within_a_bound(ctx):
    unit = service.render_unit(**ctx, autoload=False)
    lines = unit.splitlines()
    assert f"ExecStart={sys.executable} -P -m exl3local daemon" in lines
    assert f"WorkingDirectory=-{ctx['state_dir']}" in lines
    assert "Environment=EXL3LOCAL_HOST=127.0.0.1:11435" in lines
    for setting in ("Restart=on-failure", "KillMode=mixed", "KillSignal=SIGTERM", "TimeoutStopSec=20s", "WantedBy=default.target"):
        assert setting in lines
    assert not any(line.startswith("ExecStartPost") for line in lines)
    assert "@" not in unit.replace("# ", "")  # every placeholder filled
    auto = service.render_unit(**ctx, autoload=True)
    assert f"ExecStartPost=-{sys.executable} -P -m exl3local service autoload" in auto.splitlines()


def test_environment_values_are_quoted_for_systemd_and_secrets_stay_out():
    env = service.carried_env({"EXL3LOCAL_HOST": "127.0.0.1:1", "HF_HOME": '/h f/50%"x', "HF_TOKEN": "hf_secret", "PATH": "/bin"})
    assert env == {"EXL3LOCAL_HOST": "127.0.0.1:1", "HF_HOME": '/h f/50%"x'}
    unit = service.render_unit("/usr/bin/python3", Path("/s"), env, autoload=False)
    assert 'Environment="HF_HOME=/h f/50%%\\"x"' in unit.splitlines()


def test_the_unit_carries_the_key_file_never_the_key_nor_internal_variables(tmp_path):
    """Issue 24 item 6: the unit file is world-readable and `systemctl show` prints Environment=."""
    shell = {"EXL3LOCAL_API_KEY": "sk-secret-123", "EXL3LOCAL_API_KEY_FILE": "/home/u/.key",
             "EXL3LOCAL_ENGINE_PARENT": "4242", "EXL3LOCAL_CORS_ORIGINS": "[]", "EXL3LOCAL_HOST": "127.0.0.1:1"}
    env = service.carried_env(shell)
    assert env == {"EXL3LOCAL_API_KEY_FILE": "/home/u/.key", "EXL3LOCAL_HOST": "127.0.0.1:1"}
    unit = service.render_unit("/usr/bin/python3", tmp_path, env, autoload=False)
    assert "sk-secret-123" not in unit and "ENGINE_PARENT" not in unit and "CORS_ORIGINS" not in unit
    # a key only in the variable: install says the service's endpoint goes without one, and how to fix it
    (note,) = service.secrets_left_out({"EXL3LOCAL_API_KEY": "sk-secret-123"})
    assert "EXL3LOCAL_API_KEY_FILE" in note and "sk-secret-123" not in note
    assert service.secrets_left_out({}) == []


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("autoload", [False, True])
def test_rendered_unit_passes_systemd_analyze_verify(tmp_path, ctx, autoload):
    unit = tmp_path / service.UNIT
    tricky = {**ctx, "env": {**ctx["env"], "HF_HOME": '/a b/%c"d'}}
    unit.write_text(service.render_unit(**tricky, autoload=autoload))
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    proc = subprocess.run(
        ["systemd-analyze", "--user", "verify", str(unit)],
        capture_output=True, text=True, env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)}, timeout=60,
    )
    # systemd-analyze exits 0 on unknown keys and bad values; its warnings on stderr are the findings
    assert (proc.returncode, proc.stderr) == (0, "")


@pytest.mark.skipif(shutil.which("desktop-file-validate") is None, reason="desktop-file-utils not installed")
def test_desktop_entries_validate(layout, ctx):
    files = service.planned(layout, **ctx, autoload=False, tray=True)
    for path in (layout.desktop, layout.autostart):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(files[path])
        proc = subprocess.run(["desktop-file-validate", str(path)], capture_output=True, text=True, timeout=30)
        assert (proc.returncode, proc.stdout + proc.stderr) == (0, "")


def test_install_writes_every_file_enables_and_is_idempotent(layout, ctx):
    systemctl = FakeSystemctl()
    report = service.install(layout, **ctx, tray=True, systemctl=systemctl)
    assert layout.unit.read_text() == service.render_unit(**ctx, autoload=False)
    assert os.readlink(layout.wants_link) == "../exl3local.service"
    assert layout.desktop.is_file() and layout.icon.read_text().startswith("<svg") and layout.autostart.is_file()
    assert sum(line.startswith("wrote") for line in report) == 4
    assert systemctl.calls == [["daemon-reload"]]  # enabled by the link; not started without --now
    before = _tree(layout.config_home.parent)
    again = service.install(layout, **ctx, tray=True, systemctl=systemctl)
    assert all(line.startswith(("unchanged", "note")) for line in again), again
    assert _tree(layout.config_home.parent) == before


def test_install_now_starts_it_and_an_unreachable_manager_is_reported_not_fatal(layout, ctx):
    systemctl = FakeSystemctl()
    assert "started    exl3local.service" in service.install(layout, **ctx, now=True, systemctl=systemctl)
    assert systemctl.calls == [["daemon-reload"], ["restart", service.UNIT]]
    service.uninstall(layout, systemctl=systemctl)
    report = service.install(layout, **ctx, now=True, systemctl=FakeSystemctl(reachable=False))
    assert layout.unit.is_file() and layout.wants_link.is_symlink()
    assert any("not reachable" in line and "next login" in line for line in report)


def test_a_differing_unit_is_not_overwritten_without_force(layout, ctx):
    layout.unit.parent.mkdir(parents=True)
    layout.unit.write_text("[Service]\nExecStart=/usr/bin/my-own-daemon\n")
    with pytest.raises(ConfigError, match="differs"):
        service.install(layout, **ctx, systemctl=FakeSystemctl())
    assert layout.unit.read_text() == "[Service]\nExecStart=/usr/bin/my-own-daemon\n"
    assert not layout.desktop.exists() and not layout.wants_link.exists()  # nothing half-installed
    service.install(layout, **ctx, force=True, systemctl=FakeSystemctl())
    assert "exl3local daemon" in layout.unit.read_text()


def test_uninstall_stops_it_and_leaves_nothing_behind_twice(layout, ctx):
    (layout.config_home / "autostart").mkdir()
    (layout.config_home / "autostart" / "someone-else.desktop").write_text("[Desktop Entry]\n")
    before = _tree(layout.config_home.parent)
    systemctl = FakeSystemctl()
    service.install(layout, **ctx, autoload=True, tray=True, systemctl=systemctl)
    systemctl.calls.clear()
    service.uninstall(layout, systemctl=systemctl)
    assert systemctl.calls == [["stop", service.UNIT], ["daemon-reload"]]
    assert _tree(layout.config_home.parent) == before
    assert service.uninstall(layout, systemctl=systemctl) == ["nothing to remove: exl3local.service is not installed"]
    assert _tree(layout.config_home.parent) == before


def test_status_reports_files_and_systemd_state(layout, ctx):
    lines = service.status(layout, **ctx, systemctl=FakeSystemctl(reachable=False))
    assert lines[0].startswith("unit       not installed")
    assert any("user manager not reachable" in line for line in lines)
    service.install(layout, **ctx, systemctl=FakeSystemctl())
    lines = service.status(layout, **ctx, systemctl=FakeSystemctl())
    assert "up to date" in lines[0] and "enabled    yes" in lines and "systemd    active" in lines
    lines = service.status(layout, **{**ctx, "env": {}}, systemctl=FakeSystemctl())
    assert "differs" in lines[0]  # e.g. EXL3LOCAL_HOST changed since install


def test_cli_install_status_uninstall_with_the_real_systemctl(tmp_path):
    env = {
        **os.environ,
        "XDG_CONFIG_HOME": str(tmp_path / "c"), "XDG_DATA_HOME": str(tmp_path / "d"),
        "XDG_STATE_HOME": str(tmp_path / "s"), "XDG_RUNTIME_DIR": str(tmp_path / "r"),
    }  # fmt: skip

    def cli(*args: str) -> str:
        proc = subprocess.run([sys.executable, "-P", "-m", "exl3local", "service", *args],
                              capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    assert "wrote" in cli("install")
    assert (tmp_path / "c" / "systemd" / "user" / service.UNIT).is_file()
    assert "up to date" in cli("status")
    assert "removed" in cli("uninstall")
    assert not (tmp_path / "c" / "systemd").exists()


def test_up_starts_the_installed_unit_and_falls_back_when_systemd_cannot(layout, ctx, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(layout.config_home))
    monkeypatch.setenv("XDG_DATA_HOME", str(layout.data_home))
    systemctl = FakeSystemctl()
    assert not service.start_if_installed(systemctl) and systemctl.calls == []  # not installed: detached daemon
    service.install(layout, **ctx, systemctl=systemctl)
    systemctl.calls.clear()
    assert service.start_if_installed(systemctl) and systemctl.calls == [["start", service.UNIT]]
    assert not service.start_if_installed(FakeSystemctl(reachable=False))
