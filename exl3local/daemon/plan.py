"""The `up` pipeline: machine → profile → checkpoint → manifest → budget → port → launch spec.

Everything that can refuse a model (checkpoint, budget, port) runs here, before vLLM is spawned,
and its Exl3Error goes back to the caller.
"""

from __future__ import annotations

import json
import socket
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exl3local import env, errors, manifest
from exl3local.api.protocol import UpRequest
from exl3local.engine import launch, model_fit
from exl3local.machine import budget, hardware
from exl3local.machine.select import select
from exl3local.models import store
from exl3local.profiles import Profile

ENGINE_HOST = "127.0.0.1"


@dataclass(frozen=True)
class Plan:
    """Everything decided before vLLM starts."""

    key: tuple[Any, ...]  # same key + engine alive → `up` is a no-op
    model_label: str
    model_dir: Path
    profile: Profile
    profile_reason: str
    gpu: hardware.GpuInfo
    budget: budget.Budget
    spec: launch.LaunchSpec


def env_number(var: env.EnvVar, kind: type) -> Any:
    try:
        value = kind(var.get())
    except ValueError:
        raise errors.ConfigError(f"{var.name}={var.get()!r} is not a number", hint=var.doc) from None
    if value <= 0:
        raise errors.ConfigError(f"{var.name} must be positive, got {value}", hint=var.doc)
    return value


def engine_port() -> int:
    return env_number(env.ENGINE_PORT, int)


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are fine
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def read_checkpoint(model_dir: Path) -> manifest.Manifest:
    try:
        return manifest.read(model_dir)
    except errors.CheckpointError as exc:
        if Path(exc.file).is_absolute():
            raise
        # the manifest names files relative to the checkpoint; the user needs to know which one
        raise errors.CheckpointError(str(model_dir / exc.file), exc.tensor, exc.expected, exc.found,
                                     hint=exc.hint) from None


def plan(req: UpRequest, *, sysfs_root: Path, mem: budget.MemorySnapshot | None = None, python: str | None = None,
         check_port: Callable[[str, int], bool] = port_free) -> Plan:
    machine = select(req.profile, req.overrides, sysfs_root)
    prof = machine.profile
    model_dir, label = store.resolve(req.model, req.demo, prof)
    engine_python = python or env.ENGINE_PYTHON.get() or sys.executable
    man = read_checkpoint(model_dir)
    fitted = model_fit.fit(prof, man, torchvision_missing=model_fit.torchvision_missing(engine_python))
    prof = fitted.profile
    bud = machine.fit(man, mem, prof)
    port = req.port or engine_port()
    if not check_port(ENGINE_HOST, port):
        raise errors.ConfigError(f"port {port} on {ENGINE_HOST} is already in use, so vLLM cannot listen there",
                                 hint=f"free port {port}, or choose another with `exl3local up --port N`")
    tmpdir = tempfile.mkdtemp(prefix="exl3local-engine-")
    spec = launch.build(model_dir, prof, bud, port=port, tmpdir=tmpdir, host=ENGINE_HOST, gpu=machine.gpu,
                        gpus=machine.device.gpus, python=engine_python)
    key = (str(model_dir), json.dumps(prof.to_json(), sort_keys=True), port)
    return Plan(key=key, model_label=label, model_dir=model_dir, profile=prof,
                profile_reason="; ".join([machine.reason, f"device: {machine.device.reason}", *fitted.notes]),
                gpu=machine.gpu, budget=bud, spec=spec)
