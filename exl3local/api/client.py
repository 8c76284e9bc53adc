"""DaemonClient: the only way the CLI, dashboard and tray talk to a running daemon (docs/api.md).

The daemon serves a small JSON API on a Unix socket in the user-only runtime dir (or on a TCP
address when EXL3LOCAL_HOST names one). Mutating calls and the engine log carry the per-user token
from `paths.token_file()`, which the client reads itself and sends only to this user's own daemon:
the socket must be this user's file; on TCP, the process listening on the address must be the pid
in the daemon's lock file (in the user-only runtime dir), since another local user who took the
port would otherwise collect the token. Errors come back as `{"error": {"type", "message", "hint"}}` and are raised here
as the same Exl3Error subclass, so the CLI prints them like local errors.

Each operation is one `_Call` (method, path, arguments, how to read the answer), built once; the
synchronous and the asyncio client differ only in how they send it.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from exl3local import env, errors, paths
from exl3local.api.protocol import (
    PREFIX,
    TOKEN_HEADER,
    DaemonStatus,
    EngineState,
    KernelCounts,
    LogChunk,
    UpRequest,
    build,
    error_from_json,
)

DEFAULT_TIMEOUT_S = 5.0
# POST /api/up returns after the pre-launch checks (manifest, budget, port); model loading is
# reported through /api/status. Checks read safetensors headers only, but a slow disk can take a while.
UP_TIMEOUT_S = 60.0
POLL_S = 0.25
# While an engine starts, the machine can be too busy (imports, a first compile on every core) for one status
# answer to come within DEFAULT_TIMEOUT_S; waiting for READY gives up only when none came for this long.
WAIT_PATIENCE_S = 60.0
ERROR_TAIL_LINES = 20  # of the engine's output in an EngineError: the cause is in last_error's first line


@dataclass(frozen=True)
class _Call:
    """One request and how to read its answer."""

    method: str
    path: str
    read: Callable[[httpx.Response], Any]
    options: dict[str, Any] = field(default_factory=dict)  # json, params, timeout for httpx
    token: bool = False  # carries the API token (mutating calls, the engine log)


def _status(resp: httpx.Response) -> DaemonStatus:
    return DaemonStatus.from_json(resp.json())


_HEARTBEAT = _Call("GET", "/health", lambda r: r.json())
_STATUS = _Call("GET", "/status", _status)
_METRICS = _Call("GET", "/metrics", lambda r: r.text)
_KERNELS = _Call("GET", "/kernels", lambda r: KernelCounts.from_json(r.json()))
_RESTART = _Call("POST", "/restart", _status, token=True)
_STOP = _Call("POST", "/stop", _status, {"timeout": UP_TIMEOUT_S}, token=True)
_SHUTDOWN = _Call("POST", "/shutdown", lambda r: None, {"timeout": UP_TIMEOUT_S}, token=True)


def _up(
    model: str | None = None,
    *,
    profile: str | None = None,
    port: int | None = None,
    overrides: dict[str, str] | None = None,
    demo: bool = False,
) -> _Call:
    req = UpRequest(model, profile, port, overrides or {}, demo)
    return _Call("POST", "/up", _status, {"json": req.to_json(), "timeout": UP_TIMEOUT_S}, token=True)


def _logs(tail: int | None, offset: int | None) -> _Call:
    params = {k: v for k, v in (("tail", tail), ("offset", offset)) if v is not None}
    return _Call("GET", "/logs", lambda r: build(LogChunk, r.json()), {"params": params}, token=True)


UDS_BASE_URL = "http://exl3local"  # the Host of requests over the Unix socket


def _base_url(host: str | None) -> str:
    """The daemon's address: `unix:/path/daemon.sock` (the default), or an http:// URL."""
    host = host or env.HOST.get()
    if not host:
        return f"unix:{paths.daemon_socket()}"
    return host if host.startswith(("http://", "https://", "unix:")) else f"http://{host}"


def check_own_socket(path: str) -> None:
    """Raise DaemonUnavailable unless the socket at path is this user's file (it lives in the
    user-only runtime dir; a socket owned by anyone else was not made by this user's daemon)."""
    try:
        owner = os.stat(path).st_uid
    except OSError:
        return  # nothing there: the request fails to connect and says so
    if owner != os.getuid():
        raise errors.DaemonUnavailable(
            f"{path} belongs to uid {owner}, not to you; the API token was not sent",
            hint="remove that socket; only your own exl3local daemon may create it")


def _read_token() -> str | None:
    try:
        return paths.token_file().read_text().strip() or None
    except FileNotFoundError:
        return None


def check_own_daemon(base_url: str) -> None:
    """Raise DaemonUnavailable unless this user's own daemon listens at base_url: the pid in the
    daemon's lock file (only this user can write the runtime dir) holds the listening socket, which
    also means it runs as this user (another user's sockets are not visible to us)."""
    url = httpx.URL(base_url)
    host, port = url.host, url.port or 80
    try:
        pid: int | None = int(paths.lock_file().read_text())
    except (OSError, ValueError):
        pid = None
    try:
        ips = {ai[4][0] for ai in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    except OSError:
        ips = {host}
    if pid is not None and any(paths.listens(pid, ip, port) for ip in ips):
        return
    found = [listener for ip in ips for listener in paths.port_listeners(ip, port)]
    mine = f"your daemon (pid {pid}) does not listen there" if pid is not None else "your exl3local daemon is not running"
    who = found[0].describe() if found else "nothing"
    raise errors.DaemonUnavailable(
        f"{host}:{port} is answered by {who}, not by your exl3local daemon ({mine}); the API token was not sent",
        hint="another program (maybe another user's) took the daemon's port: stop it, or run your daemon on "
             "another port with EXL3LOCAL_HOST=127.0.0.1:<port>",
    )


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


def _too_slow(base_url: str, call: _Call) -> errors.DaemonTooSlow:
    """Connected, but no answer in time: a busy or hung daemon is as unusable as a missing one."""
    return errors.DaemonTooSlow(
        f"the exl3local daemon at {base_url} did not answer {call.method} {PREFIX}{call.path} in time",
        hint="see `exl3local logs` and the daemon log; `exl3local down` then `up` restarts it",
    )


def _engine_error(st: DaemonStatus) -> errors.EngineError:
    cls = errors.EngineGaveUp if st.state == EngineState.FAILED else errors.EngineError
    tail = "\n".join(st.stderr_tail.rstrip("\n").split("\n")[-ERROR_TAIL_LINES:])
    err = cls(st.state.value, st.exit_status, tail or (st.last_error or ""))
    if st.last_error:
        err.message = f"{st.last_error}\n{err.message}"
        err.args = (err.message,)
    err.hint = "see `exl3local logs` for the whole engine log; `exl3local up` retries"
    return err


class _Core:
    """What both clients share: the address, the token, and turning a _Call into an answer."""

    # the one thing the two clients differ in
    _HTTP: type[httpx.Client] | type[httpx.AsyncClient]
    _UDS: type[httpx.HTTPTransport] | type[httpx.AsyncHTTPTransport]

    def __init__(
        self,
        host: str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        token: str | None = None,
        transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """`transport`: an httpx transport of the client's kind (tests pass a MockTransport, which
        reaches no listener: the own-daemon check before sending the token is then skipped)."""
        self.base_url = _base_url(host)
        self._token = token
        self._check_listener = transport is None
        self._socket = self.base_url.removeprefix("unix:") if self.base_url.startswith("unix:") else None
        url = self.base_url
        if self._socket is not None:
            url = UDS_BASE_URL
            transport = transport or self._UDS(uds=self._socket)
        self._http: Any = self._HTTP(base_url=url, timeout=timeout_s, transport=transport, trust_env=False)

    def _request_args(self, call: _Call) -> tuple[str, str, dict[str, Any]]:
        options = dict(call.options)
        if call.token:
            token = self._token or _read_token()
            if token:
                if self._check_listener and self._socket is not None:
                    check_own_socket(self._socket)
                elif self._check_listener:
                    check_own_daemon(self.base_url)
                options["headers"] = {TOKEN_HEADER: token}
        return call.method, PREFIX + call.path, options

    @contextmanager
    def _transport_errors(self, call: _Call) -> Iterator[None]:
        try:
            yield
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise _unavailable(self.base_url, exc) from exc
        except httpx.TimeoutException as exc:
            raise _too_slow(self.base_url, call) from exc
        except httpx.TransportError as exc:  # reset or cut off mid-answer: e.g. a daemon going down
            raise _unavailable(self.base_url, exc) from exc

    @staticmethod
    def _answer(call: _Call, resp: httpx.Response) -> Any:
        _raise_for(resp)
        return call.read(resp)


class DaemonClient(_Core):
    """Synchronous client (CLI, tray). Every method raises DaemonUnavailable when no daemon
    answers, or the daemon's own Exl3Error subclass."""

    _HTTP = httpx.Client
    _UDS = httpx.HTTPTransport

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, call: _Call) -> Any:
        method, path, options = self._request_args(call)
        with self._transport_errors(call):
            resp = self._http.request(method, path, **options)
        return self._answer(call, resp)

    def heartbeat(self) -> dict[str, Any]:
        """GET /api/health: {"ok", "daemon_pid", "version", "api_version"}."""
        return self._send(_HEARTBEAT)

    def status(self) -> DaemonStatus:
        return self._send(_STATUS)

    def metrics_text(self) -> str:
        """vLLM's Prometheus text, passed through unchanged (raises EngineError unless READY)."""
        return self._send(_METRICS)

    def up(self, model: str | None = None, **options: Any) -> DaemonStatus:
        """Configure and start the engine; options: profile, port, overrides, demo (no arguments:
        keep what is served). Returns once the pre-launch checks passed (state STARTING, or READY
        when the same model already runs); use wait_ready() for the rest."""
        return self._send(_up(model, **options))

    def restart(self) -> DaemonStatus:
        """Restart the engine with its current configuration (also leaves FAILED)."""
        return self._send(_RESTART)

    def stop(self) -> DaemonStatus:
        """Stop the engine; the daemon keeps running (state STOPPED)."""
        return self._send(_STOP)

    def shutdown(self) -> None:
        """Stop the engine and end the daemon (`exl3local down`). Returns once the engine's
        process group is gone; the daemon exits right after answering."""
        self._send(_SHUTDOWN)

    def kernels(self) -> KernelCounts:
        return self._send(_KERNELS)

    def logs(self, *, tail: int | None = None, offset: int | None = None) -> LogChunk:
        """The last `tail` lines of engine.log, or everything after byte `offset`."""
        return self._send(_logs(tail, offset))

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
        """Poll until READY (or IDLE: a short keep-alive already gave the memory back; the next request
        starts it again). FAILED (or STOPPED: someone ran `down`) raises EngineError with the stderr
        tail. There is no deadline here: the daemon's supervisor owns the stall timeout; a daemon that answers
        no status poll for WAIT_PATIENCE_S raises DaemonTooSlow."""
        answered = time.monotonic()
        while True:
            try:
                st = self.status()
            except errors.DaemonTooSlow:
                if time.monotonic() - answered > WAIT_PATIENCE_S:
                    raise
                continue
            answered = time.monotonic()
            if on_progress:
                on_progress(st)
            if st.state in (EngineState.READY, EngineState.IDLE):
                return st
            if st.state in (EngineState.FAILED, EngineState.STOPPED):
                raise _engine_error(st)
            time.sleep(poll_s)


class AsyncDaemonClient(_Core):
    """The same API for asyncio callers (the Textual dashboard's workers)."""

    _HTTP = httpx.AsyncClient
    _UDS = httpx.AsyncHTTPTransport

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncDaemonClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _send(self, call: _Call) -> Any:
        method, path, options = self._request_args(call)
        with self._transport_errors(call):
            resp = await self._http.request(method, path, **options)
        return self._answer(call, resp)

    async def heartbeat(self) -> dict[str, Any]:
        return await self._send(_HEARTBEAT)

    async def status(self) -> DaemonStatus:
        return await self._send(_STATUS)

    async def metrics_text(self) -> str:
        return await self._send(_METRICS)

    async def up(self, model: str | None = None, **options: Any) -> DaemonStatus:
        return await self._send(_up(model, **options))

    async def restart(self) -> DaemonStatus:
        return await self._send(_RESTART)

    async def stop(self) -> DaemonStatus:
        return await self._send(_STOP)

    async def kernels(self) -> KernelCounts:
        return await self._send(_KERNELS)

    async def logs(self, *, tail: int | None = None, offset: int | None = None) -> LogChunk:
        return await self._send(_logs(tail, offset))
