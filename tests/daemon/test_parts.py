"""Daemon pieces without the daemon process: hotplug decisions, settings from the environment, the
engine record, the instance lock."""

from __future__ import annotations

import fcntl
import json
import os
from types import SimpleNamespace

import pytest

from exl3local import paths
from exl3local.api.protocol import EngineState, UpRequest
from exl3local.daemon import plan
from exl3local.daemon.main import InstanceLock
from exl3local.daemon.service import Daemon
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


async def test_a_hotplug_restart_keeps_the_whole_up_request(xdg, monkeypatch):
    d = Daemon(sysfs_root=xdg)
    calls = []

    async def up(req):
        calls.append(req)
        return {}

    monkeypatch.setattr(d, "up", up)
    egpu = _gpu("0000:05:00.0", "Arc Pro B70")
    await d.gpus_changed([egpu])
    d.plan = SimpleNamespace(gpu=egpu, model_dir="/models/m")
    d.last_request = UpRequest(model=None, profile="b70", port=12345, overrides={"vllm.max_model_len": "2048"})
    d.sup.state = EngineState.READY
    await d.gpus_changed([])
    # the profile is chosen again from what is left; port and --set stay; the model as resolved
    assert calls == [UpRequest(model="/models/m", profile=None, port=12345, overrides={"vllm.max_model_len": "2048"})]
    d.last_request = UpRequest(demo=True, port=23456)
    await d.gpus_changed([egpu])
    await d.gpus_changed([])
    assert calls[-1] == UpRequest(demo=True, port=23456)
    d.engine_log.close()


def test_the_engine_record_is_replaced_atomically(xdg, tmp_path):
    d = Daemon(sysfs_root=xdg)
    record = paths.engine_record()
    record.write_text('{"pid": 1}')
    os.link(record, tmp_path / "old-record")  # the old inode: a reader holding it sees no half-written text
    spec = SimpleNamespace(tmpdir=str(tmp_path / "engine-tmp"), argv=("vllm",))
    d._record_engine(spec, SimpleNamespace(pid=os.getpid()))
    assert json.loads(record.read_text())["pid"] == os.getpid()
    assert (tmp_path / "old-record").read_text() == '{"pid": 1}'  # replaced by a rename, not rewritten in place
    assert oct(record.stat().st_mode & 0o777) == "0o600"
    d.engine_log.close()


def test_releasing_the_instance_lock_never_lets_two_daemons_hold_it(tmp_path):
    path = tmp_path / "daemon.lock"
    first = InstanceLock(path)
    assert first.acquire()
    opened = os.open(path, os.O_RDWR)  # a second daemon starting: it opened the file, not yet locked
    first.release()
    fcntl.flock(opened, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ... and now holds the lock on that file
    third = InstanceLock(path)
    assert not third.acquire()  # the same file, so the lock is seen: no second holder
    os.close(opened)
    assert third.acquire() and path.read_text() == str(os.getpid())
    third.release()
    assert path.read_text() == ""  # no stale pid for clients to trust
