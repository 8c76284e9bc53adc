"""The daemon's HTTP side (docs/api.md): the JSON API under /api on starlette, served by uvicorn on
a Unix socket in the user-only runtime dir (or on EXL3LOCAL_HOST's TCP address when one is set).
The file system keeps other users off the socket; the per-user token on mutating calls and the
engine log is the second fence (and the only one on TCP).

One HTTP stack holds the limits: a body over 1 MiB is 413, a body that does not arrive within the
idle timeout is 408, request line + headers over 16 KiB end the connection (uvicorn answers 400),
and a connection that sends no request within the idle timeout is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from exl3local import __version__, env, errors, paths
from exl3local.api.protocol import API_VERSION, PREFIX, TOKEN_HEADER, UpRequest, error_body, error_to_json
from exl3local.daemon import asgi
from exl3local.daemon.plan import env_number
from exl3local.daemon.service import Daemon
from exl3local.machine import hardware

__all__ = ["Daemon", "Listen", "api_app", "serve"]

log = logging.getLogger("exl3local.daemon")

MAX_BODY_BYTES = 1 * 2**20
MAX_ERROR_CHARS = 500  # an error that quotes its input (a 900 KB model name) is cut to this in replies
UNIX_PATH_MAX = 107  # sockaddr_un.sun_path without its NUL

_STATUS_CODES: dict[type[errors.Exl3Error], int] = {
    errors.ConfigError: 400,
    errors.CheckpointError: 422,
    errors.BudgetError: 422,
    errors.HardwareError: 422,
    errors.EngineError: 409,
}


def _http_status(err: errors.Exl3Error) -> int:
    for cls in type(err).__mro__:
        if cls in _STATUS_CODES:
            return _STATUS_CODES[cls]
    return 500


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


class _HttpError(Exception):
    def __init__(self, status: int, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.hint = hint


def _query(request: Request) -> dict[str, str]:
    raw = request.url.query
    try:
        return {k: v[-1] for k, v in parse_qs(raw, strict_parsing=bool(raw)).items()}
    except ValueError:
        raise _HttpError(400, "malformed query string") from None


def _int_param(query: dict[str, str], name: str) -> int | None:
    if name not in query:
        return None
    try:
        value = int(query[name])
    except ValueError:
        raise errors.ConfigError(f"query parameter {name} must be an integer") from None
    if value < 0:
        raise errors.ConfigError(f"query parameter {name} must be >= 0")
    return value


async def _body(request: Request, timeout_s: float) -> bytes:
    """The request body, bounded in size and in time (a client that announces 100 bytes and sends
    one would otherwise hold the connection and its task forever)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise _HttpError(413, f"request body of {int(length)} bytes; the limit is {MAX_BODY_BYTES}")
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > MAX_BODY_BYTES:
                    raise _HttpError(413, f"request body over the limit of {MAX_BODY_BYTES} bytes")
    except TimeoutError:
        raise _HttpError(408, "request body timed out") from None
    return bytes(body)


def _parse_json(body: bytes) -> Any:
    try:
        return json.loads(body or b"{}")
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser's stack
        raise errors.ConfigError("POST /api/up: the body is not a JSON object of the documented shape",
                                 hint="see docs/api.md") from None


def api_app(daemon: Daemon, token: str, idle_timeout_s: float) -> Starlette:
    """The /api routes over `daemon`; `token` guards mutations and the engine log."""

    async def health(request: Request) -> Any:
        return {"ok": True, "daemon_pid": os.getpid(), "version": __version__, "api_version": API_VERSION}

    async def status(request: Request) -> Any:
        return daemon.status()

    async def kernels(request: Request) -> Any:
        return daemon.kernels()

    async def metrics(request: Request) -> Any:
        return Response(await daemon.metrics(), media_type="text/plain; version=0.0.4")

    async def logs(request: Request) -> Any:  # engine output may hold prompts and secrets: the user's own only
        query = _query(request)
        tail, offset = _int_param(query, "tail"), _int_param(query, "offset")
        return await run_in_threadpool(daemon.engine_log.read, tail=tail, offset=offset)  # file I/O off the loop

    async def up(request: Request) -> Any:
        req = UpRequest.from_json(_parse_json(await _body(request, idle_timeout_s)))
        return JSONResponse(await daemon.up(req), 202)

    async def restart(request: Request) -> Any:
        return JSONResponse(await daemon.restart(), 202)

    async def stop(request: Request) -> Any:
        return await daemon.stop_engine()

    async def shutdown(request: Request) -> Any:
        await daemon.stop_engine()
        # after the answer is on its way; the engine is already gone
        asyncio.get_running_loop().call_later(0.1, daemon._stop.set)
        return {"ok": True}

    open_routes = {("GET", "/health"): health, ("GET", "/status"): status, ("GET", "/kernels"): kernels,
                   ("GET", "/metrics"): metrics}
    token_routes = {("GET", "/logs"): logs, ("POST", "/up"): up, ("POST", "/restart"): restart,
                    ("POST", "/stop"): stop, ("POST", "/shutdown"): shutdown}

    async def dispatch(request: Request) -> Response:
        path = request.url.path
        key = (request.method, path.removeprefix(PREFIX) if path.startswith(PREFIX + "/") else "")
        try:
            _query(request)
            handler = open_routes.get(key)
            if key in token_routes:
                sent = request.headers.get(TOKEN_HEADER, "").encode()
                if not secrets.compare_digest(sent, token.encode()):
                    raise _HttpError(403, "missing or wrong API token", f"the token is in {paths.token_file()}")
                handler = token_routes[key]
            if handler is None:
                raise _HttpError(404, f"no such endpoint: {request.method} {_clip(path, 100)}", "see docs/api.md")
            answer = await handler(request)
            return answer if isinstance(answer, Response) else JSONResponse(answer)
        except _HttpError as exc:
            return JSONResponse(error_body(str(exc), exc.hint), exc.status)
        except errors.Exl3Error as exc:
            body = error_to_json(exc)
            body["error"]["message"] = _clip(body["error"]["message"], MAX_ERROR_CHARS)
            return JSONResponse(body, _http_status(exc))
        except Exception as exc:  # the API must answer; the traceback goes to daemon.log (lines clipped there)
            log.exception("%s %s failed", request.method, _clip(path, 200))
            return JSONResponse(error_body(_clip(f"internal error: {type(exc).__name__}: {exc}", MAX_ERROR_CHARS),
                                           f"see {paths.daemon_log()}"), 500)

    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
    return Starlette(routes=[Route("/{path:path}", dispatch, methods=methods)])


class Listen:
    """Where the API listens: a Unix socket path, or a TCP host and port (EXL3LOCAL_HOST)."""

    def __init__(self, value: str | None = None) -> None:
        value = env.HOST.get() if value is None else value
        self.uds: Path | None = None
        self.host, self.port = "", 0
        if not value:
            self.uds = paths.daemon_socket()
            return
        host, _, port = value.removeprefix("http://").rpartition(":")
        try:
            self.host, self.port = host or "127.0.0.1", int(port)
        except ValueError:
            raise errors.ConfigError(f"{env.HOST.name}={value!r} is not HOST:PORT", hint=env.HOST.doc) from None

    def __str__(self) -> str:
        return str(self.uds) if self.uds else f"{self.host}:{self.port}"

    def bind(self) -> socket.socket:
        if self.uds is None:
            try:
                return asgi.tcp_socket(self.host, self.port)
            except OSError as exc:
                raise errors.ConfigError(
                    f"the daemon cannot listen on {self}: {exc.strerror}",
                    hint=f"another program uses port {self.port}; set {env.HOST.name}=127.0.0.1:<port>") from None
        else:
            if len(os.fsencode(self.uds)) > UNIX_PATH_MAX:
                raise errors.ConfigError(f"the daemon's socket path {self.uds} is over {UNIX_PATH_MAX} bytes",
                                         hint="set XDG_RUNTIME_DIR to a shorter directory")
            # We hold the instance lock: a socket file here is a dead daemon's.
            self.uds.unlink(missing_ok=True)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old = os.umask(0o177)  # created 0600, never briefly open to others
            try:
                sock.bind(str(self.uds))
            finally:
                os.umask(old)
        sock.listen(128)
        sock.setblocking(False)
        return sock

    def remove(self) -> None:
        if self.uds is not None:
            self.uds.unlink(missing_ok=True)


async def serve(daemon: Daemon, listen: Listen, ready: Callable[[], None] | None = None) -> None:
    """Serve the API until POST /api/shutdown or a signal; then stop the engine and clean up."""
    idle_timeout_s = env_number(env.API_IDLE_TIMEOUT, float)
    await daemon.reap_stale_engine()
    sock = listen.bind()
    token = secrets.token_urlsafe(32)
    token_path = paths.token_file()
    token_path.unlink(missing_ok=True)
    fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    api = asgi.Served(api_app(daemon, token, idle_timeout_s), sock, idle_timeout_s=idle_timeout_s)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, daemon._stop.set)
    daemon.gpus = hardware.probe(daemon.sysfs_root)
    watch = hardware.HotplugWatch(daemon.on_hotplug)
    watching = daemon.sysfs_root == hardware.SYSFS and watch.start(loop)
    await api.started()
    daemon.scheduler.start()
    log.info("daemon %d listening on %s (hotplug watch %s)", os.getpid(), listen, "on" if watching else "off")
    if ready:
        ready()
    try:
        await asyncio.wait({api.task, asyncio.ensure_future(daemon._stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.stop()
        await daemon.scheduler.close()
        await api.close()
        listen.remove()
        await daemon.front.close()
        await daemon.sup.close()
        token_path.unlink(missing_ok=True)
        if daemon.plan is not None:
            with contextlib.suppress(OSError):
                os.rmdir(daemon.plan.spec.tmpdir)
        daemon.engine_log.close()
        log.info("daemon %d stopped", os.getpid())
