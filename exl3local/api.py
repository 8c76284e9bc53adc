"""DaemonClient: the only way the CLI, dashboard and tray talk to the daemon (docs/api.md).

The daemon serves a small JSON API on 127.0.0.1 (EXL3LOCAL_HOST). Reads are open to local
clients; mutating calls carry the per-user token from `paths.token_file()`, which the client
reads itself. Errors come back as `{"error": {"type", "message", "hint"}}` and are raised here
as the same Exl3Error subclass, so the CLI prints them like local errors.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import httpx

from exl3local import env, errors, paths
from exl3local.supervisor import EngineState

API_VERSION = 1
PREFIX = "/api"
TOKEN_HEADER = "X-Exl3local-Token"
DEFAULT_TIMEOUT_S = 5.0
# POST /api/up returns after the pre-launch checks (manifest, budget, port); model loading is
# reported through /api/status. Checks read safetensors headers only, but a slow disk can take a while.
UP_TIMEOUT_S = 60.0
POLL_S = 0.25


@dataclass(frozen=True)
class GpuStatus:
    """The GPU the engine runs on (or the CPU): see hardware.GpuInfo for the full probe."""

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
        return None if data is None else _build(cls, data)


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
            paths=tuple(_build(KernelPathCount, p) for p in data.get("paths", ())),
            processes=data.get("processes", 0),
            updated=data.get("updated"),
        )


def _build(cls: type, data: dict[str, Any]) -> Any:
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


def _base_url(host: str | None) -> str:
    host = host or env.HOST.get()
    return host if host.startswith(("http://", "https://")) else f"http://{host}"


def _read_token() -> str | None:
    try:
        return paths.token_file().read_text().strip() or None
    except FileNotFoundError:
        return None


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


def _raise_for(resp: httpx.Response) -> None:
    if resp.is_success:
        return
    try:
        payload = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        payload = {"message": f"daemon answered HTTP {resp.status_code}: {resp.text[:500]}"}
    raise error_from_json(payload)


def _unavailable(base_url: str, exc: Exception) -> errors.DaemonUnavailable:
    return errors.DaemonUnavailable(
        f"the exl3local daemon is not reachable at {base_url} ({type(exc).__name__})",
        hint="start it with `exl3local up`",
    )


def _too_slow(base_url: str, method: str, path: str) -> errors.DaemonUnavailable:
    """Connected, but no answer in time: a busy or hung daemon is as unusable as a missing one."""
    return errors.DaemonUnavailable(
        f"the exl3local daemon at {base_url} did not answer {method} {PREFIX}{path} in time",
        hint="see `exl3local logs` and the daemon log; `exl3local down` then `up` restarts it",
    )


class DaemonClient:
    """Synchronous client (CLI, tray). Every method raises DaemonUnavailable when no daemon
    answers, or the daemon's own Exl3Error subclass."""

    def __init__(
        self,
        host: str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        token: str | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = _base_url(host)
        self._token = token
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, transport=transport, trust_env=False)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        if method != "GET":
            token = self._token or _read_token()
            if token:
                kwargs.setdefault("headers", {})[TOKEN_HEADER] = token
        try:
            resp = self._http.request(method, PREFIX + path, **kwargs)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise _unavailable(self.base_url, exc) from exc
        except httpx.TimeoutException as exc:
            raise _too_slow(self.base_url, method, path) from exc
        except httpx.TransportError as exc:  # reset or cut off mid-answer: e.g. a daemon going down
            raise _unavailable(self.base_url, exc) from exc
        _raise_for(resp)
        return resp

    def heartbeat(self) -> dict[str, Any]:
        """GET /api/health: {"ok", "daemon_pid", "version", "api_version"}."""
        return self._request("GET", "/health").json()

    def status(self) -> DaemonStatus:
        return DaemonStatus.from_json(self._request("GET", "/status").json())

    def metrics_text(self) -> str:
        """vLLM's Prometheus text, passed through unchanged (raises EngineError unless READY)."""
        return self._request("GET", "/metrics").text

    def up(
        self,
        model: str | None = None,
        *,
        profile: str | None = None,
        port: int | None = None,
        overrides: dict[str, str] | None = None,
        demo: bool = False,
    ) -> DaemonStatus:
        """Configure and start the engine. Returns once the pre-launch checks passed (state
        STARTING, or READY when the same model already runs); use wait_ready() for the rest."""
        body = {"model": model, "profile": profile, "port": port, "set": overrides or {}, "demo": demo}
        return DaemonStatus.from_json(self._request("POST", "/up", json=body, timeout=UP_TIMEOUT_S).json())

    def restart(self) -> DaemonStatus:
        """Restart the engine with its current configuration (also leaves FAILED)."""
        return DaemonStatus.from_json(self._request("POST", "/restart").json())

    def stop(self) -> DaemonStatus:
        """Stop the engine; the daemon keeps running (state STOPPED)."""
        return DaemonStatus.from_json(self._request("POST", "/stop", timeout=UP_TIMEOUT_S).json())

    def shutdown(self) -> None:
        """Stop the engine and end the daemon (`exl3local down`). Returns once the engine's
        process group is gone; the daemon exits right after answering."""
        self._request("POST", "/shutdown", timeout=UP_TIMEOUT_S)

    def kernels(self) -> KernelCounts:
        return KernelCounts.from_json(self._request("GET", "/kernels").json())

    def logs(self, *, tail: int | None = None, offset: int | None = None) -> LogChunk:
        """The last `tail` lines of engine.log, or everything after byte `offset`."""
        params = {k: v for k, v in (("tail", tail), ("offset", offset)) if v is not None}
        return _build(LogChunk, self._request("GET", "/logs", params=params).json())

    def follow_logs(self, tail: int = 20, poll_s: float = POLL_S) -> Iterator[str]:
        """Yield engine.log text as it is written (`exl3local logs -f`)."""
        chunk = self.logs(tail=tail)
        yield chunk.text
        while True:
            time.sleep(poll_s)
            chunk = self.logs(offset=chunk.offset)
            if chunk.text:
                yield chunk.text

    def wait_ready(
        self,
        on_progress: Callable[[DaemonStatus], None] | None = None,
        poll_s: float = POLL_S,
    ) -> DaemonStatus:
        """Poll until READY. FAILED (or STOPPED: someone ran `down`) raises EngineError with the
        stderr tail. There is no deadline here: the daemon's supervisor owns the stall timeout."""
        while True:
            st = self.status()
            if on_progress:
                on_progress(st)
            if st.state == EngineState.READY:
                return st
            if st.state in (EngineState.FAILED, EngineState.STOPPED):
                raise _engine_error(st)
            time.sleep(poll_s)


def _engine_error(st: DaemonStatus) -> errors.EngineError:
    cls = errors.EngineGaveUp if st.state == EngineState.FAILED else errors.EngineError
    err = cls(st.state.value, st.exit_status, st.stderr_tail or (st.last_error or ""))
    if st.last_error:
        err.message = f"{st.last_error}\n{err.message}"
        err.args = (err.message,)
    err.hint = "see `exl3local logs` for the whole engine log; `exl3local up` retries"
    return err


class AsyncDaemonClient:
    """The same API for asyncio callers (the Textual dashboard's workers)."""

    def __init__(
        self,
        host: str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        token: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = _base_url(host)
        self._token = token
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s, transport=transport, trust_env=False)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncDaemonClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        if method != "GET":
            token = self._token or _read_token()
            if token:
                kwargs.setdefault("headers", {})[TOKEN_HEADER] = token
        try:
            resp = await self._http.request(method, PREFIX + path, **kwargs)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise _unavailable(self.base_url, exc) from exc
        except httpx.TimeoutException as exc:
            raise _too_slow(self.base_url, method, path) from exc
        except httpx.TransportError as exc:  # reset or cut off mid-answer: e.g. a daemon going down
            raise _unavailable(self.base_url, exc) from exc
        _raise_for(resp)
        return resp

    async def heartbeat(self) -> dict[str, Any]:
        return (await self._request("GET", "/health")).json()

    async def status(self) -> DaemonStatus:
        return DaemonStatus.from_json((await self._request("GET", "/status")).json())

    async def metrics_text(self) -> str:
        return (await self._request("GET", "/metrics")).text

    async def up(
        self,
        model: str | None = None,
        *,
        profile: str | None = None,
        port: int | None = None,
        overrides: dict[str, str] | None = None,
        demo: bool = False,
    ) -> DaemonStatus:
        body = {"model": model, "profile": profile, "port": port, "set": overrides or {}, "demo": demo}
        return DaemonStatus.from_json((await self._request("POST", "/up", json=body, timeout=UP_TIMEOUT_S)).json())

    async def restart(self) -> DaemonStatus:
        return DaemonStatus.from_json((await self._request("POST", "/restart")).json())

    async def stop(self) -> DaemonStatus:
        return DaemonStatus.from_json((await self._request("POST", "/stop", timeout=UP_TIMEOUT_S)).json())

    async def kernels(self) -> KernelCounts:
        return KernelCounts.from_json((await self._request("GET", "/kernels")).json())

    async def logs(self, *, tail: int | None = None, offset: int | None = None) -> LogChunk:
        params = {k: v for k, v in (("tail", tail), ("offset", offset)) if v is not None}
        return _build(LogChunk, (await self._request("GET", "/logs", params=params)).json())
