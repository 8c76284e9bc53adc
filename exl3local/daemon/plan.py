"""The `up` pipeline: machine → profile → checkpoint → manifest → budget → port → launch spec.

Everything that can refuse a model (checkpoint, budget, port) runs here, before vLLM is spawned,
and its Exl3Error goes back to the caller.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exl3local import env, errors, manifest, paths
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


port_free = paths.port_free  # doctor and `up` ask the same question; the supervisor asks before every start

# sockaddr_un.sun_path holds 108 bytes with the NUL. vLLM names its ZMQ IPC sockets
# "$TMPDIR/<uuid4>" (VLLM_RPC_BASE_PATH defaults to the temp dir): 37 characters after the dir.
UNIX_PATH_MAX = 107
VLLM_IPC_NAME_LEN = 1 + 36
ENGINE_TMP_PREFIX = "exl3local-"


def engine_tmpdir() -> str:
    """A new private (0700) temp dir for one engine: vLLM's IPC sockets, its scratch files and the
    kernel-path counters live there; the supervisor removes it once the engine's group is gone.
    The first candidate where vLLM's socket paths stay under the Unix limit wins: the user's
    TMPDIR, then XDG_RUNTIME_DIR, then /tmp (a long TMPDIR made every start fail in ZMQ)."""
    room = UNIX_PATH_MAX - VLLM_IPC_NAME_LEN - 1 - len(ENGINE_TMP_PREFIX) - 8  # mkdtemp adds 8 characters
    candidates = [tempfile.gettempdir(), os.environ.get("XDG_RUNTIME_DIR") or "", "/tmp"]
    for base in dict.fromkeys(c for c in candidates if c):
        if len(base) <= room and os.access(base, os.W_OK | os.X_OK):
            return tempfile.mkdtemp(prefix=ENGINE_TMP_PREFIX, dir=base)
    raise errors.ConfigError(
        f"no temp dir short enough for vLLM's IPC sockets: TMPDIR={tempfile.gettempdir()!r} is longer than "
        f"{room} characters and /tmp is not writable",
        hint=f"set TMPDIR to a writable directory of at most {room} characters")


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
        raise errors.ConfigError(f"port {port} on {ENGINE_HOST} is already in use (by "
                                 f"{paths.port_holder(ENGINE_HOST, port)}), so vLLM cannot listen there",
                                 hint=f"free port {port}, or choose another with `exl3local up --port N`")
    tmpdir = engine_tmpdir()
    spec = launch.build(model_dir, prof, bud, port=port, tmpdir=tmpdir, host=ENGINE_HOST, gpu=machine.gpu,
                        gpus=machine.device.gpus, python=engine_python)
    key = (str(model_dir), json.dumps(prof.to_json(), sort_keys=True), port)
    return Plan(key=key, model_label=label, model_dir=model_dir, profile=prof,
                profile_reason="; ".join([machine.reason, f"device: {machine.device.reason}", *fitted.notes]),
                gpu=machine.gpu, budget=bud, spec=spec)
