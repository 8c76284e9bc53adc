"""The `up` pipeline: machine → profile → checkpoint → manifest → budget → port → launch spec.

Everything that can refuse a model (checkpoint, budget, port) runs here, before vLLM is spawned,
and its Exl3Error goes back to the caller.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exl3local import env, errors, manifest, paths
from exl3local.api.protocol import UpRequest
from exl3local.daemon import unload as idle_unload
from exl3local.engine import launch, model_fit, vllm_version
from exl3local.machine import budget, hardware, transient
from exl3local.machine.select import Device, find_device, model_choices, select
from exl3local.models import catalog, store
from exl3local.profiles import Profile, speculative_config
from exl3local.units import format_gib

ENGINE_HOST = "127.0.0.1"
# vLLM serves on this Unix socket in its private 0700 temp dir; the daemon's endpoint on ENGINE_HOST:port
# forwards to it (daemon/front.py). 12 bytes: within the room engine_tmpdir keeps for vLLM's own socket names.
ENGINE_SOCKET = "engine.sock"
# A dry run creates nothing: the engine's private temp dir is named, not made.
DRY_RUN_TMPDIR = "/tmp/exl3local-XXXXXXXX"
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)


def shown_value(name: str, value: str) -> str:
    """An environment value as a dry run may print it: names that look like secrets are hidden."""
    return "(set, not shown)" if SECRET_NAME.search(name) else value


@dataclass(frozen=True)
class Plan:
    """Everything decided before vLLM starts."""

    key: tuple[Any, ...]  # same key + engine alive → `up` is a no-op
    model_label: str
    model_dir: Path
    names: tuple[str, ...]  # what requests call it: the served name first, then its aliases (models/catalog.py)
    profile: Profile
    profile_reason: str
    gpu: hardware.GpuInfo
    budget: budget.Budget
    spec: launch.LaunchSpec
    device: Device | None = None
    notes: tuple[str, ...] = ()  # what a dry run found that a real start would refuse or should know
    unload: idle_unload.Unload = idle_unload.STOP  # how the keep-alive gives the engine's memory back (daemon/unload.py)

    def describe(self, environ: Mapping[str, str]) -> dict[str, Any]:
        """What `up --dry-run` prints: the exact argv, the engine's environment (what it adds to or changes in
        `environ`, secrets hidden), the budget's arithmetic and the reasons for the profile."""
        env_all = {k: shown_value(k, v) for k, v in sorted(self.spec.env.items())}
        changed = {k: v for k, v in env_all.items() if environ.get(k) != self.spec.env[k]}
        removed = sorted(k for k in environ if k not in self.spec.env)
        dev = self.device
        return {
            "model": self.model_label, "model_dir": str(self.model_dir), "profile": self.profile.id,
            "profile_reasons": [r for r in self.profile_reason.split("; ") if r],
            "gpu": self.gpu.to_json(),
            "gpus": [g.to_json() for g in dev.gpus] if dev else [],
            "cards": [g.slot for g in dev.cards] if dev else [],
            "runtime": dev.runtime.to_json() if dev and dev.runtime else None,
            "memory": ({"ram_total_bytes": dev.mem.total_bytes, "ram_available_bytes": dev.mem.available_bytes,
                        "ttm_pages_limit_bytes": dev.mem.gpu_pages_limit_bytes} if dev and dev.mem else None),
            "budget": {"kv_budget_bytes": self.budget.kv_budget_bytes, "kv_budget_tokens": self.budget.kv_budget_tokens,
                       "max_model_len": self.budget.max_model_len, "pinned": self.budget.pinned,
                       "gpu_memory_utilization": self.budget.gpu_memory_utilization,
                       "engine_bytes": self.budget.engine_bytes, "transient_bytes": self.budget.transient_bytes,
                       "tensor_parallel": self.budget.tensor_parallel, "data_parallel": self.budget.data_parallel,
                       "lines": list(self.budget.lines)},
            "argv": list(self.spec.argv), "cwd": "/",
            "env": env_all, "env_changed": changed, "env_removed": removed,
            "endpoint": self.spec.endpoint, "notes": list(self.notes),
            "idle_unload": {"how": self.unload.words, "detail": self.unload.why},
        }


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
         check_port: Callable[[str, int], bool] = port_free, dry_run: bool = False,
         environ: Mapping[str, str] | None = None) -> Plan:
    """Everything `up` decides, in one place: a real `up` starts `spec`, `up --dry-run` prints it. A dry run
    makes no temp dir and reports a busy port as a note instead of refusing."""
    engine_python = python or env.ENGINE_PYTHON.get() or sys.executable
    # The engine interpreter's vLLM must be in the plugin's range: refused here, before any weight loads.
    vllm_refused = vllm_version.refusal(engine_python)
    if vllm_refused and not dry_run:
        raise errors.ConfigError(vllm_refused, hint=vllm_version.HINT)
    device = find_device(sysfs_root, python=engine_python)
    machine = select(req.profile, req.overrides, device=device)
    prof = machine.profile
    # an installed model's name (a registered one, a profile's served name) means that model
    named = catalog.find(req.model, prof) if req.model and not req.demo else None
    model_dir, label = (store.resolve(named.up_model, named.up_model is None, prof) if named else
                        store.resolve(req.model, req.demo, prof))
    man = read_checkpoint(model_dir)
    fitted = model_fit.fit(prof, man, torchvision_missing=model_fit.torchvision_missing(engine_python))
    prof = fitted.profile
    environ = os.environ if environ is None else environ
    extra = plugin_transients(man, prof, environ)
    try:
        bud = machine.fit(man, mem, prof, transient_bytes=extra.bytes)
    except errors.BudgetError as exc:
        if not prof.model.get("by_memory"):
            raise
        names = ", ".join(f"{c['repo']}:{c.get('revision', 'main')}" for c in model_choices(prof))
        raise errors.BudgetError(exc.message, hint=f"{exc.hint}; this profile's models, largest first: {names} "
                                 "(`exl3local up REPO:REVISION`)") from None
    notes = [f"plugin transients {extra.why}"] if extra.bytes else []
    if vllm_refused:
        notes.append(vllm_refused)
    if device.runtime is not None and device.runtime.error:
        notes.append(f"GPU runtime: {device.runtime.error}")
    if device.gpu.vendor == "intel" and device.runtime is not None and device.affinity is None:
        notes.append("the GPU runtime does not list the Intel GPUs sysfs shows: the device index counts sysfs")
    port = req.port or engine_port()
    if not check_port(ENGINE_HOST, port):
        busy = (f"port {port} on {ENGINE_HOST} is already in use (by {paths.port_holder(ENGINE_HOST, port)}), "
                "so the endpoint cannot listen there")
        if not dry_run:
            raise errors.ConfigError(busy, hint=f"free port {port}, or choose another with `exl3local up --port N`")
        notes.append(busy)
    names = catalog.names_for(model_dir, prof)
    idle = idle_unload.choose(prof.backend, machine.gpu.kind, prof.endpoint.get("idle_unload", "auto"))
    tmpdir = DRY_RUN_TMPDIR if dry_run else engine_tmpdir()
    try:
        spec = launch.build(model_dir, prof, bud, port=port, tmpdir=tmpdir, host=ENGINE_HOST, gpu=machine.gpu,
                            gpus=device.gpus, cards=device.cards, affinity=device.affinity, python=engine_python,
                            base_env=environ, uds=os.path.join(tmpdir, ENGINE_SOCKET), served_name=names,
                            sleep_mode=idle.level is not None)
    except BaseException:
        if not dry_run:
            os.rmdir(tmpdir)  # a refused start (an unreadable key file) leaves no engine temp dir behind
        raise
    key = (str(model_dir), json.dumps(prof.to_json(), sort_keys=True), port)
    return Plan(key=key, model_label=label, model_dir=model_dir, names=names, profile=prof,
                profile_reason="; ".join([machine.reason, f"device: {machine.device.reason}", *fitted.notes,
                                          *_gpu_notes(bud, notes)]),
                gpu=machine.gpu, budget=bud, spec=spec, device=device, notes=tuple(notes), unload=idle)


DEFAULT_BATCHED_TOKENS = 8192  # vLLM's default chunk when a profile sets none (at least this many rows per call)


def _gpu_notes(bud: budget.Budget, notes: list[str]) -> list[str]:
    """What `status` says beyond the profile on a GPU: the utilization vLLM's start check gets, and what the GPU
    runtime could not tell (the CPU engine's reasons stay as they were)."""
    if bud.gpu_memory_utilization is None:
        return []
    return [f"vLLM start check: --gpu-memory-utilization {bud.gpu_memory_utilization} (the engine holds "
            f"{format_gib(bud.engine_bytes)})",
            *(n for n in notes if n.startswith(("GPU runtime", "the GPU runtime")))]


def plugin_transients(man: manifest.Manifest, prof: Profile, environ: Mapping[str, str]) -> transient.Transient:
    """The plugin's own short-lived memory for this checkpoint under this profile (machine/transient.py)."""
    drafts = int(speculative_config(prof.vllm).get("num_speculative_tokens", 0))
    return transient.estimate(man.quantized, int(prof.vllm.get("max_num_batched_tokens") or DEFAULT_BATCHED_TOKENS),
                              decode_once=_decode_once(prof, environ),
                              max_logit_rows=int(prof.vllm.get("max_num_seqs", 1)) * (1 + drafts))


def _decode_once(profile: Profile, environ: Mapping[str, str]) -> bool:
    """EXL3LOCAL_DECODE_ONCE as the engine will see it (the user's environment wins over the profile's [env])."""
    value = environ.get(env.DECODE_ONCE.name, profile.env.get(env.DECODE_ONCE.name, env.DECODE_ONCE.default))
    return value.strip().lower() in {"1", "true", "yes", "on"}
