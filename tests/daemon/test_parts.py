"""Daemon pieces without processes: hotplug decisions, settings from the environment."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from exl3local.api.protocol import EngineState
from exl3local.daemon import plan
from exl3local.daemon.server import Daemon
from exl3local.errors import ConfigError
from exl3local.machine import hardware


def _gpu(slot: str, name: str) -> hardware.GpuInfo:
    return hardware.GpuInfo(vendor="intel", name=name, kind="discrete", supported=True, slot=slot)


async def test_engine_restarts_only_when_its_own_gpu_goes_away(xdg, monkeypatch):
    d = Daemon(sysfs_root=xdg)
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


def test_engine_port_must_be_a_positive_number(monkeypatch):
    monkeypatch.setenv("EXL3LOCAL_ENGINE_PORT", "http")
    with pytest.raises(ConfigError, match="EXL3LOCAL_ENGINE_PORT"):
        plan.engine_port()
    monkeypatch.setenv("EXL3LOCAL_ENGINE_PORT", "0")
    with pytest.raises(ConfigError, match="must be positive"):
        plan.engine_port()
