"""The daemon API's vocabulary (docs/api.md): wire constants, the engine's states, the status and
log/kernel answers, the `up` request, and errors as JSON. The daemon and every client import this
module; it imports nothing of ours but the foundation, so neither side depends on the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

from exl3local import errors

API_VERSION = 1
PREFIX = "/api"
TOKEN_HEADER = "X-Exl3local-Token"


class EngineState(StrEnum):
    STOPPED = "STOPPED"  # no engine, none wanted
    STARTING = "STARTING"  # spawned, /health not yet 200
    READY = "READY"  # /health 200: the OpenAI endpoint answers
    BACKOFF = "BACKOFF"  # exited unexpectedly; restarts after a delay
    STOPPING = "STOPPING"  # SIGTERM sent to the group, SIGKILL after a timeout
    FAILED = "FAILED"  # gave up after repeated fast failures; the daemon stays up
    IDLE = "IDLE"  # no request for the keep-alive time: the engine gave its memory back; the next request wakes it


# An engine in these states holds (or is about to hold) its model files, memory and port.
ENGINE_ALIVE = frozenset({EngineState.STARTING, EngineState.READY, EngineState.BACKOFF})


@dataclass(frozen=True)
class GpuStatus:
    """The GPU the engine runs on (or the CPU): the part of machine.hardware.GpuInfo that goes on the wire."""

    name: str
    vendor: str  # "intel" | "nvidia" | "cpu"
    kind: str  # "discrete" | "integrated" | "cpu"
    pci_id: str | None = None  # "8086:e223"
    slot: str | None = None  # PCI BDF, "0000:03:00.0"
    driver: str | None = None  # "xe" | "i915" | "nvidia"
    render_node: str | None = None  # "/dev/dri/renderD128"
    xe_gen: str | None = None  # "Xe2-HPG"
    memory_bytes: int | None = None  # device total; iGPU: the shared-RAM ceiling

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> GpuStatus | None:
        return None if data is None else build(cls, data)

    @classmethod
    def of(cls, device: Any) -> GpuStatus:
        """The wire fields of a probed device (anything with these attributes, e.g. a GpuInfo)."""
        return cls(**{f.name: getattr(device, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class DaemonStatus:
    """GET /api/status. Unknown keys from a newer daemon are kept in `raw`."""

    state: EngineState
    model: str | None = None  # checkpoint dir, or hub repo@revision
    served_model_name: str | None = None  # the `model` field clients send to /v1
    profile: str | None = None
    profile_reason: str = ""
    gpu: GpuStatus | None = None
    endpoint: str | None = None  # "http://127.0.0.1:11436/v1" once a model is configured
    api_key_required: bool | None = None  # the endpoint wants `Authorization: Bearer`; None: an older daemon
    engine_pid: int | None = None
    engine_rss_bytes: int | None = None  # whole engine process tree
    restarts: int = 0
    kv_budget_bytes: int | None = None
    kv_budget_tokens: int | None = None
    kv_budget_pinned: bool = False  # passed as --kv-cache-memory-bytes (else an estimate)
    max_model_len: int | None = None
    uptime_s: float | None = None  # since the engine became READY
    state_age_s: float = 0.0  # time in the current state
    retry_in_s: float | None = None  # BACKOFF: seconds until the next start
    progress: str = ""  # last engine log line while STARTING
    last_error: str | None = None
    exit_status: int | None = None  # of the last engine exit
    stderr_tail: str = ""  # last <= 8 KiB of engine output after a failure
    log_errors: int = 0  # engine output that could not be written to engine.log (full disk, ...): dropped
    log_dropped_bytes: int = 0
    log_last_error: str | None = None  # the latest such error, with its time
    keep_alive_s: float | None = None  # idle time before the engine is unloaded; None: never
    idle_since: float | None = None  # IDLE: unix time the engine was unloaded
    idle_freed_bytes: int | None = None  # IDLE: what came back (a stop: the engine's RSS; a sleep: its GPU memory)
    idle_unload: str | None = None  # IDLE: "engine stopped", "sleep level 1" or "sleep level 2"
    idle_detail: str | None = None  # IDLE: what the unload freed, and why this way
    switch_to: str | None = None  # a request named this installed model: loaded once the requests in flight end
    requests_waiting: int = 0  # requests at the endpoint waiting for a switch or for READY
    requests_in_flight: int = 0  # requests at the endpoint admitted (forwarded, or about to be)
    daemon_pid: int | None = None
    daemon_uptime_s: float = 0.0
    events: tuple[dict[str, Any], ...] = ()  # recent hotplug events, newest last
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DaemonStatus:
        known = {f.name for f in fields(cls)} - {"raw", "gpu", "state", "events"}
        kwargs = {k: data[k] for k in known if k in data}
        return cls(
            state=EngineState(data["state"]),
            gpu=GpuStatus.from_json(data.get("gpu")),
            events=tuple(data.get("events", ())),
            raw=data,
            **kwargs,
        )


@dataclass(frozen=True)
class LogChunk:
    """GET /api/logs: text of engine.log from a byte offset (or its last lines)."""

    text: str
    offset: int  # pass back as `offset` to get only what follows
    rotated: bool = False  # the log rotated since the offset; text starts at the new file


@dataclass(frozen=True)
class KernelPathCount:
    """One EXL3 kernel path in GET /api/kernels, summed over the engine's processes."""

    path: str  # a kernels.dispatch.KernelPath value
    calls: int = 0
    tokens: int = 0
    last_seen: float | None = None  # unix s of the latest call; None: never ran
    roles: dict[str, int] = field(default_factory=dict)  # layer role (attention, gdn, experts, ...) -> calls
    state: str = "ok"  # "ok" | "latched_off" | "fallback": the dashboard paints the last two red
    reason: str | None = None


@dataclass(frozen=True)
class KernelCounts:
    """GET /api/kernels: the plugin's kernel-path counters (docs/api.md, "GET /api/kernels")."""

    paths: tuple[KernelPathCount, ...] = ()
    processes: int = 0  # engine processes that reported counters
    updated: float | None = None  # daemon's unix time when it read them ("last seen" is relative to it)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KernelCounts:
        return cls(
            paths=tuple(build(KernelPathCount, p) for p in data.get("paths", ())),
            processes=data.get("processes", 0),
            updated=data.get("updated"),
        )


def build(cls: type, data: dict[str, Any]) -> Any:
    """A dataclass from a JSON object, ignoring keys a newer daemon added."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class UpRequest:
    """POST /api/up: what to serve. All empty (a bare `up`) keeps or brings back what was served."""

    model: str | None = None  # checkpoint dir, or hub REPO[:REVISION]
    profile: str | None = None
    port: int | None = None
    overrides: Mapping[str, str] = field(default_factory=dict)  # `--set section.key=value`
    demo: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "profile": self.profile, "port": self.port, "set": dict(self.overrides),
                "demo": self.demo}

    @classmethod
    def from_json(cls, body: Any) -> UpRequest:
        """Strict: every key documented, every value of its JSON type (`"demo": "no"` is refused,
        not read as true), strings bounded."""
        if not isinstance(body, dict):
            raise errors.ConfigError("POST /api/up needs a JSON object")
        unknown = sorted(set(body) - UP_KEYS)
        if unknown:
            raise errors.ConfigError(f"POST /api/up: unknown key {_short(unknown[0])}",
                                     hint=f"keys: {', '.join(sorted(UP_KEYS))}")
        port = body.get("port")
        if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535):
            raise errors.ConfigError(f"port must be an integer 1..65535, got {_short(port)}")
        overrides = body.get("set") or {}
        if not isinstance(overrides, dict) or not all(isinstance(v, str) for v in overrides.values()):
            raise errors.ConfigError("`set` must map section.key to a string value")
        if any(len(k) > MAX_SETTING_CHARS or len(v) > MAX_SETTING_CHARS for k, v in overrides.items()):
            raise errors.ConfigError(f"`set`: keys and values are at most {MAX_SETTING_CHARS} characters")
        for key in ("model", "profile"):
            value = body.get(key)
            if value is not None and not isinstance(value, str):
                raise errors.ConfigError(f"`{key}` must be a string, got {_short(value)}")
        _check_model_name(body.get("model"))
        profile = body.get("profile")
        if profile is not None and len(profile) > MAX_NAME_CHARS:
            raise errors.ConfigError(f"`profile` is a name of at most {MAX_NAME_CHARS} characters")
        demo = body.get("demo", False)
        if not isinstance(demo, bool):
            raise errors.ConfigError(f"`demo` must be true or false, got {_short(demo)}")
        return cls(model=body.get("model"), profile=profile, port=port, overrides=overrides, demo=demo)


UP_KEYS = frozenset({"model", "profile", "port", "set", "demo"})
MAX_NAME_CHARS = 255  # a file name (NAME_MAX), a profile id
MAX_PATH_CHARS = 4095  # PATH_MAX without the NUL
MAX_SETTING_CHARS = 4096


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:60]}… ({len(text)} characters)"


def _check_model_name(model: str | None) -> None:
    """A checkpoint path or a hub REPO[:REVISION]: bounded before it reaches the file system,
    which answers a component over 255 bytes with an OSError that quotes all of it."""
    if model is None:
        return
    if not model.strip() or "\x00" in model:
        raise errors.ConfigError("`model` is empty or holds a NUL character")
    if len(model.encode()) > MAX_PATH_CHARS:
        raise errors.ConfigError(f"`model` is {len(model.encode())} bytes long; a path is at most {MAX_PATH_CHARS}")
    longest = max(len(part.encode()) for part in model.split("/"))
    if longest > MAX_NAME_CHARS:
        raise errors.ConfigError(f"`model` has a path component of {longest} bytes; a file name is at most "
                                 f"{MAX_NAME_CHARS}")


_ERROR_TYPES: dict[str, type[errors.Exl3Error]] = {
    cls.__name__: cls
    for cls in (
        errors.Exl3Error,
        errors.ConfigError,
        errors.CheckpointError,
        errors.HardwareError,
        errors.BudgetError,
        errors.NoKernelError,
        errors.EngineError,
        errors.EngineGaveUp,
        errors.DaemonUnavailable,
    )
}


def error_from_json(payload: dict[str, Any]) -> errors.Exl3Error:
    """Rebuild the daemon's error as the same class (exit codes stay right). Subclasses with a
    structured __init__ get their message as sent, plus whichever attributes came along."""
    err_type = _ERROR_TYPES.get(payload.get("type", ""), errors.Exl3Error)
    err = err_type.__new__(err_type)
    errors.Exl3Error.__init__(err, payload.get("message", "daemon error"), payload.get("hint", ""))
    for key, value in payload.get("fields", {}).items():
        setattr(err, key, value)
    return err


def error_to_json(err: errors.Exl3Error) -> dict[str, Any]:
    """The daemon's side of error_from_json."""
    extra = {k: getattr(err, k) for k in ("state", "exit_status", "tail", "file", "tensor") if hasattr(err, k)}
    return {"error": {"type": type(err).__name__, "message": err.message, "hint": err.hint, "fields": extra}}


def error_body(message: str, hint: str = "") -> dict[str, Any]:
    """An error the daemon raises about the request itself (404, 403, 500), as clients read it."""
    return {"error": {"type": "Exl3Error", "message": message, "hint": hint}}
