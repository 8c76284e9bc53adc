"""Daemon pieces without processes: hotplug decisions, the rotating engine log, request checks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from exl3local import daemon, hardware, profiles
from exl3local.errors import ConfigError
from exl3local.supervisor import EngineState


@pytest.fixture
def xdg(tmp_path, monkeypatch):
    for var in ("XDG_STATE_HOME", "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_RUNTIME_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    return tmp_path


def _gpu(slot: str, name: str) -> hardware.GpuInfo:
    return hardware.GpuInfo(vendor="intel", name=name, kind="discrete", supported=True, slot=slot)


async def test_engine_restarts_only_when_its_own_gpu_goes_away(xdg, monkeypatch):
    d = daemon.Daemon(sysfs_root=xdg)
    calls = []

    async def up(req):
        calls.append(req)
        return {}

    monkeypatch.setattr(d, "up", up)
    egpu, other = _gpu("0000:05:00.0", "Arc Pro B70"), _gpu("0000:03:00.0", "Arc B580")
    await d.gpus_changed([other, egpu])
    d.plan = SimpleNamespace(gpu=egpu, model_dir="/models/m")
    d.sup.state = EngineState.READY
    await d.gpus_changed([egpu])  # the other card left: reported, engine untouched
    assert calls == [] and d.events[-1]["action"] == "remove" and not d.events[-1]["engine_gpu"]
    await d.gpus_changed([])  # the engine's eGPU was unplugged
    assert d.events[-1] == {**d.events[-1], "action": "remove", "slot": "0000:05:00.0", "engine_gpu": True}
    assert [c.model for c in calls] == ["/models/m"]
    await d.gpus_changed([egpu])  # plugged back: an add event, no restart
    assert d.events[-1]["action"] == "add" and len(calls) == 1
    d.engine_log.close()


def test_engine_log_rotates_and_offsets_report_it(tmp_path):
    (tmp_path / "engine.log").write_bytes(b"from an earlier daemon\n")
    log = daemon.EngineLog(tmp_path / "engine.log", max_bytes=100, backups=2)
    assert log.read(tail=5) == {"text": "from an earlier daemon\n", "offset": 0, "rotated": False}
    log.write(b"a" * 60 + b"\n")
    first = log.read(tail=1)
    assert first["offset"] == 61 and first["text"].startswith("a")
    assert log.read(offset=61) == {"text": "", "offset": 61, "rotated": False}
    log.write(b"b" * 60 + b"\n")  # would pass 100 bytes: rotate first
    assert (tmp_path / "engine.log.1").read_bytes().endswith(b"a\n")
    after = log.read(offset=first["offset"])
    # nothing was lost: the new file starts exactly where the client stopped
    assert not after["rotated"] and after["text"].startswith("b") and after["offset"] == 61 + 61
    assert log.read(offset=10**9)["rotated"]  # an offset from another daemon's life
    for _ in range(5):
        log.write(b"c" * 60 + b"\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine.log", "engine.log.1", "engine.log.2"]
    behind = log.read(offset=after["offset"])  # lines went to files the client never read
    assert behind["rotated"] and behind["text"].startswith("c")
    log.close()


@pytest.mark.parametrize("body", [[], {"port": 0}, {"port": "80"}, {"set": {"a.b": 1}}, {"model": 3}])
def test_bad_up_requests_are_config_errors(body):
    with pytest.raises(ConfigError):
        daemon.UpRequest.from_json(body)


def test_pinned_profile_wins_over_detection_and_mismatch_is_said(xdg):
    from exl3local import paths

    paths.pinned_profile().write_text('{"pinned": "b70", "set": {"vllm.max_num_seqs": "2"}}')
    prof, why = profiles.select(None, {}, hardware.cpu_device(8 * 2**30), "")
    assert prof.id == "b70" and prof.vllm["max_num_seqs"] == 2
    assert "pinned" in why and "this machine serves on cpu" in why
    prof, why = profiles.select("cpu", {"vllm.max_num_seqs": "3"}, hardware.cpu_device(8 * 2**30), "")
    assert prof.id == "cpu" and prof.vllm["max_num_seqs"] == 3 and why.startswith("--profile cpu")


def test_broken_settings_and_env_numbers_are_config_errors(xdg, monkeypatch):
    from exl3local import paths

    paths.pinned_profile().write_text('{"pinned": 7}')
    with pytest.raises(ConfigError, match="profile --unpin|expected"):
        profiles.read_settings()
    paths.pinned_profile().write_text("not json")
    with pytest.raises(ConfigError, match="unreadable"):
        profiles.read_settings()
    monkeypatch.setenv("EXL3LOCAL_ENGINE_PORT", "http")
    with pytest.raises(ConfigError, match="EXL3LOCAL_ENGINE_PORT"):
        daemon.engine_port()
