"""The daemon's HTTP side: one per user, a JSON API on 127.0.0.1 (docs/api.md) over h11, and the
Daemon that runs the `up` pipeline (daemon.plan) behind `POST /api/up` and supervises the engine.

Engine output goes to a rotating engine.log. The running engine is recorded in the state dir, so a
daemon that was killed -9 is cleaned up after by the next one (the launcher also dies with its
daemon: engine.launch._die_with_parent).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import h11
import httpx
import psutil

from exl3local import __version__, env, errors, paths
from exl3local.api.protocol import (
    API_VERSION,
    ENGINE_ALIVE,
    PREFIX,
    TOKEN_HEADER,
    EngineState,
    GpuStatus,
    UpRequest,
    error_body,
    error_to_json,
)
from exl3local.daemon.plan import Plan, env_number, plan, port_free
from exl3local.engine import apikey, launch, stats
from exl3local.engine.log import EngineLog
from exl3local.engine.procgroup import Unkillable, end_group, group_alive
from exl3local.engine.supervisor import Policy, Supervisor
from exl3local.machine import hardware

log = logging.getLogger("exl3local.daemon")

MAX_BODY_BYTES = 1 * 2**20
MAX_HEADER_BYTES = 16 * 1024  # request line + headers; more is answered 431
MAX_ERROR_CHARS = 500  # an error that quotes its input (a 900 KB model name) is cut to this in replies
LINGER_S = 2.0  # after refusing a body, read and drop what the client still sends, so it sees the answer
MAX_EVENTS = 20
HOTPLUG_SETTLE_S = 1.0  # an eGPU arrives as pci add → bind → drm add: wait for the burst to end

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


class Daemon:
    def __init__(self, *, host: str = "127.0.0.1", port: int = 11435, sysfs_root: Path | None = None,
                 policy: Policy | None = None) -> None:
        self.host = host
        self.port = port
        self.idle_timeout_s = env_number(env.API_IDLE_TIMEOUT, float)
        self.sysfs_root = Path(sysfs_root or env.SYSFS.get())
        self.started = time.monotonic()
        self.engine_log = EngineLog(paths.engine_log())
        self.sup = Supervisor(policy=policy or Policy(stall_timeout_s=env_number(env.STALL_TIMEOUT, float),
                                                      hang_timeout_s=env_number(env.HANG_TIMEOUT, float)),
                              on_output=self.engine_log.write, on_spawn=self._record_engine,
                              on_reaped=self._forget_engine)
        self.plan: Plan | None = None
        self.last_request: UpRequest | None = None
        self.events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)
        self.token = secrets.token_urlsafe(32)
        self.gpus: list[hardware.GpuInfo] = []
        self._lock = asyncio.Lock()  # one pipeline run at a time (two `up` at once → one engine)
        self._stop = asyncio.Event()
        self._hotplug_task: asyncio.Task[None] | None = None

    # ---- engine record (orphan clean-up after a daemon crash) ---------------------------
    def _record_engine(self, spec: Any, proc: Any) -> None:
        try:
            created = psutil.Process(proc.pid).create_time()
        except psutil.Error:
            created = None
        rec = {"pid": proc.pid, "create_time": created, "tmpdir": spec.tmpdir}
        # atomic: a daemon killed mid-write must not leave a record the next one cannot read
        paths.write_atomic(paths.engine_record(), json.dumps(rec), mode=0o600)
        self.engine_log.mark(f"engine started, pid {proc.pid}: {' '.join(spec.argv)}")

    def _forget_engine(self, spec: Any, proc: Any) -> None:
        with contextlib.suppress(FileNotFoundError):
            paths.engine_record().unlink()
        self.engine_log.mark(f"engine pid {proc.pid} ended, status {proc.returncode}")

    @staticmethod
    async def reap_stale_engine() -> None:
        """An engine left by a daemon that died without cleaning up (kill -9, power loss)."""
        record = paths.engine_record()
        try:
            rec = json.loads(record.read_text())
        except (OSError, ValueError):
            return
        pid = rec.get("pid")
        try:
            same = isinstance(pid, int) and psutil.Process(pid).create_time() == rec.get("create_time")
        except psutil.Error:
            same = False
        if same and group_alive(pid):
            log.warning("ending engine group %d left by a previous daemon", pid)
            try:
                await end_group(pid, 10.0)
            except Unkillable as exc:  # keep the record: the next start tries again
                log.error("the engine group %d left by a previous daemon: %s", pid, exc)
                return
        if rec.get("tmpdir"):
            shutil.rmtree(rec["tmpdir"], ignore_errors=True)
        record.unlink(missing_ok=True)

    # ---- operations ---------------------------------------------------------------------
    async def up(self, req: UpRequest) -> dict[str, Any]:
        async with self._lock:
            if req == UpRequest() and self.last_request is not None:
                req = self.last_request  # a bare `up`: keep (or bring back) what was served
            loop = asyncio.get_running_loop()
            alive = self.sup.state in ENGINE_ALIVE
            ours = self.plan.spec.port if self.plan is not None and alive else None

            def port_ok(host: str, port: int) -> bool:
                return port == ours or port_free(host, port)

            # First pass: refuse a bad request while the current engine keeps serving. Only a
            # budget refusal may be the old engine's fault (its memory is still in use).
            try:
                new: Plan | None = await loop.run_in_executor(None, self._plan_quietly, req, port_ok)
            except errors.BudgetError:
                if not alive:
                    raise
                new = None
            if new is not None and self.plan is not None and self.plan.key == new.key and alive:
                os.rmdir(new.spec.tmpdir)
                return self.status()
            if alive:
                # The old engine's memory and port are free only once it is gone: plan again.
                if new is not None:
                    os.rmdir(new.spec.tmpdir)
                await self.sup.stop()
                new = await loop.run_in_executor(None, self._plan_quietly, req, port_free)
            else:
                await self.sup.stop()
            self.plan = new
            self.last_request = req
            self.engine_log.mark(f"up: {new.model_label} with profile {new.profile.id}")
            await self.sup.start(new.spec)
            return self.status()

    def _plan_quietly(self, req: UpRequest, check_port: Callable[[str, int], bool]) -> Plan:
        try:
            return plan(req, sysfs_root=self.sysfs_root, check_port=check_port)
        except errors.Exl3Error as exc:
            # The rejected plan goes to engine.log as well, so `exl3local logs` shows it.
            self.engine_log.mark(f"up refused: {exc}")
            raise

    async def restart(self) -> dict[str, Any]:
        async with self._lock:
            if self.plan is None:
                raise errors.ConfigError("nothing to restart: no model was brought up", hint="run `exl3local up`")
            await self.sup.start(self.plan.spec)
            return self.status()

    async def stop_engine(self) -> dict[str, Any]:
        async with self._lock:
            await self.sup.stop()
            return self.status()

    def status(self) -> dict[str, Any]:
        st: dict[str, Any] = {"api_version": API_VERSION, **self.sup.snapshot()}
        p = self.plan
        st.update({
            "model": p.model_label if p else None,
            "served_model_name": p.spec.served_model_name if p else None,
            "profile": p.profile.id if p else None,
            "profile_reason": p.profile_reason if p else "",
            "gpu": asdict(GpuStatus.of(p.gpu)) if p else None,
            "endpoint": p.spec.endpoint if p else None,
            "api_key_required": apikey.required(p.spec.env if p else None),
            "engine_rss_bytes": stats.tree_rss(st["engine_pid"]),
            "kv_budget_bytes": p.budget.kv_budget_bytes if p else None,
            "kv_budget_tokens": p.budget.kv_budget_tokens if p else None,
            "kv_budget_pinned": p.budget.pinned if p else False,
            "kv_budget_explain": list(p.budget.lines) if p else [],
            "max_model_len": p.budget.max_model_len if p else None,
            **self.engine_log.health(),
            "daemon_pid": os.getpid(),
            "daemon_uptime_s": round(time.monotonic() - self.started, 3),
            "events": list(self.events),
        })  # fmt: skip
        st["log_errors"] += self.sup.output_errors
        st.update(stats.memory_fields(st["engine_pid"], p.gpu.kind if p else None))
        return st

    def kernels(self) -> dict[str, Any]:
        """GET /api/kernels: the plugin's per-process counter files in this engine's trace dir."""
        if self.plan is None or self.sup.state in (EngineState.STOPPED, EngineState.FAILED):
            raise errors.EngineError(self.sup.state.value, None, "", hint="kernel counters exist only while an engine runs")
        trace_dir = Path(self.plan.spec.env[launch.TRACE_DIR_ENV])
        return stats.kernel_counts(trace_dir, time.time(), self.plan.gpu.kind)

    async def metrics(self) -> str:
        if self.sup.state != EngineState.READY or self.plan is None:
            raise errors.EngineError(self.sup.state.value, None, "", hint="metrics exist only while READY")
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            try:
                resp = await client.get(self.plan.spec.metrics_url)
            except httpx.HTTPError as exc:
                raise errors.EngineError(self.sup.state.value, None, f"/metrics: {exc}") from None
        return resp.text

    # ---- hotplug ------------------------------------------------------------------------
    def on_hotplug(self, action: str) -> None:
        if self._hotplug_task is None or self._hotplug_task.done():
            self._hotplug_task = asyncio.get_running_loop().create_task(self._settle_hotplug())

    async def _settle_hotplug(self) -> None:
        await asyncio.sleep(HOTPLUG_SETTLE_S)
        await self.gpus_changed(hardware.probe(self.sysfs_root))

    async def gpus_changed(self, gpus: list[hardware.GpuInfo]) -> None:
        """Record adds/removes; restart the engine only if its own GPU went away."""
        before = {g.slot: g for g in self.gpus}
        after = {g.slot: g for g in gpus}
        self.gpus = gpus
        engine_slot = self.plan.gpu.slot if self.plan else None
        lost_engine_gpu = False
        for action, slots, table in (("remove", before.keys() - after.keys(), before),
                                     ("add", after.keys() - before.keys(), after)):
            for slot in sorted(s for s in slots if s):
                is_engine = action == "remove" and slot == engine_slot
                lost_engine_gpu |= is_engine
                self.events.append({"time": time.time(), "action": action, "slot": slot,
                                    "name": table[slot].name, "engine_gpu": is_engine})
                log.info("GPU %s: %s at %s", action, table[slot].name, slot)
        if lost_engine_gpu and self.plan is not None and self.sup.state != EngineState.STOPPED:
            log.warning("the engine's GPU %s went away: restarting on what is left", engine_slot)
            self.engine_log.mark(f"GPU {engine_slot} removed: restarting the engine")
            # The same request (port, --set overrides, demo) with the profile chosen afresh from
            # what is left; the model as resolved, so a profile default does not change with it.
            last = self.last_request or UpRequest()
            req = replace(last, profile=None, model=last.model or (None if last.demo else str(self.plan.model_dir)))
            try:
                await self.up(req)
            except errors.Exl3Error as exc:
                await self.sup.stop()
                self.sup.last_error = f"GPU {engine_slot} was removed and the model cannot be served without it: {exc}"

    # ---- HTTP -----------------------------------------------------------------------------
    async def route(self, method: str, target: str, headers: Mapping[str, str], body: bytes
                    ) -> tuple[int, str, bytes]:
        url = urlsplit(target)
        path = url.path.removeprefix(PREFIX) if url.path.startswith(PREFIX + "/") else None
        try:
            query = {k: v[-1] for k, v in parse_qs(url.query, strict_parsing=bool(url.query)).items()}
        except ValueError:
            return _json(error_body("malformed query string"), 400)
        try:
            if (method, path) in TOKEN_REQUIRED and not secrets.compare_digest(
                    headers.get(TOKEN_HEADER.lower(), "").encode(), self.token.encode()):
                return _json(error_body("missing or wrong API token", f"the token is in {paths.token_file()}"), 403)
            if method == "GET":
                if path == "/health":
                    return _json({"ok": True, "daemon_pid": os.getpid(), "version": __version__,
                                  "api_version": API_VERSION})
                if path == "/status":
                    return _json(self.status())
                if path == "/kernels":
                    return _json(self.kernels())
                if path == "/metrics":
                    return 200, "text/plain; version=0.0.4", (await self.metrics()).encode()
                if path == "/logs":  # engine output may hold prompts and secrets: the user's own only
                    tail = _int_param(query, "tail")
                    offset = _int_param(query, "offset")
                    return _json(self.engine_log.read(tail=tail, offset=offset))
            elif method == "POST":
                if path == "/up":
                    return _json(await self.up(UpRequest.from_json(_parse_json(body))), 202)
                if path == "/restart":
                    return _json(await self.restart(), 202)
                if path == "/stop":
                    return _json(await self.stop_engine())
                if path == "/shutdown":
                    await self.stop_engine()
                    # after the answer is on its way; the engine is already gone
                    asyncio.get_running_loop().call_later(0.1, self._stop.set)
                    return _json({"ok": True})
            return _json(error_body(f"no such endpoint: {method} {_clip(url.path, 100)}", "see docs/api.md"), 404)
        except errors.Exl3Error as exc:
            body_json = error_to_json(exc)
            body_json["error"]["message"] = _clip(body_json["error"]["message"], MAX_ERROR_CHARS)
            return _json(body_json, _http_status(exc))
        except Exception as exc:  # the API must answer; the traceback goes to daemon.log (lines clipped there)
            log.exception("%s %s failed", method, _clip(target, 200))
            return _json(error_body(_clip(f"internal error: {type(exc).__name__}: {exc}", MAX_ERROR_CHARS),
                                    f"see {paths.daemon_log()}"), 500)

    async def _serve_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """HTTP/1.1 with keep-alive. Each request (headers and body) must arrive within the idle
        timeout of the previous answer, so a half-open or trickling connection is closed; too
        large a header or body is answered 431/413 and the connection closed."""
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        try:
            while True:
                try:
                    async with asyncio.timeout(self.idle_timeout_s):
                        request, body = await _read_request(conn, reader)
                except TimeoutError:
                    if conn.their_state is h11.SEND_BODY:  # mid-request: say why before closing
                        await _answer(conn, writer, *_json(error_body("request body timed out"), 408), close=True)
                    return
                except _TooLarge as exc:
                    await _answer(conn, writer, *_json(error_body(str(exc)), 413), close=True)
                    await _linger(reader)
                    return
                if request is None:
                    return
                headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers}
                status, ctype, payload = await self.route(request.method.decode("latin-1"),
                                                          request.target.decode("latin-1"), headers, body)
                await _answer(conn, writer, status, ctype, payload)
                if conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except h11.RemoteProtocolError as exc:  # garbage, or a header too large: say so, then close
            if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                message = _clip(str(exc), 200) or "malformed HTTP request"
                with contextlib.suppress(ConnectionError, h11.LocalProtocolError):
                    await _answer(conn, writer, *_json(error_body(message), exc.error_status_hint), close=True)
        except ConnectionError:
            pass  # the client hung up
        except asyncio.CancelledError:
            pass  # daemon shutdown with the connection open: nothing awaits this task
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def serve(self, ready: Callable[[], None] | None = None) -> None:
        await self.reap_stale_engine()
        try:
            server = await asyncio.start_server(self._serve_conn, self.host, self.port)
        except OSError as exc:
            raise errors.ConfigError(
                f"the daemon cannot listen on {self.host}:{self.port}: {exc.strerror}",
                hint=f"another program uses port {self.port}; set EXL3LOCAL_HOST=127.0.0.1:<port>",
            ) from None
        token = paths.token_file()
        token.unlink(missing_ok=True)
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.token)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, self._stop.set)
        self.gpus = hardware.probe(self.sysfs_root)
        watch = hardware.HotplugWatch(self.on_hotplug)
        watching = self.sysfs_root == hardware.SYSFS and watch.start(loop)
        log.info("daemon %d listening on %s:%d (hotplug watch %s)", os.getpid(), self.host, self.port,
                 "on" if watching else "off")
        if ready:
            ready()
        try:
            await self._stop.wait()
        finally:
            watch.stop()
            server.close()
            await self.sup.close()
            token.unlink(missing_ok=True)
            if self.plan is not None:
                with contextlib.suppress(OSError):
                    os.rmdir(self.plan.spec.tmpdir)
            self.engine_log.close()
            log.info("daemon %d stopped", os.getpid())


TOKEN_REQUIRED = frozenset({("GET", "/logs"), ("POST", "/up"), ("POST", "/restart"), ("POST", "/stop"),
                            ("POST", "/shutdown")})


class _TooLarge(Exception):
    pass


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def _parse_json(body: bytes) -> Any:
    try:
        return json.loads(body or b"{}")
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser's stack
        raise errors.ConfigError("POST /api/up: the body is not a JSON object of the documented shape",
                                 hint="see docs/api.md") from None


def _int_param(query: Mapping[str, str], name: str) -> int | None:
    if name not in query:
        return None
    try:
        value = int(query[name])
    except ValueError:
        raise errors.ConfigError(f"query parameter {name} must be an integer") from None
    if value < 0:
        raise errors.ConfigError(f"query parameter {name} must be >= 0")
    return value


def _json(obj: Any, status: int = 200) -> tuple[int, str, bytes]:
    return status, "application/json", json.dumps(obj).encode()


async def _next_event(conn: h11.Connection, reader: asyncio.StreamReader) -> Any:
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        conn.receive_data(await reader.read(65536))


async def _read_request(conn: h11.Connection, reader: asyncio.StreamReader) -> tuple[h11.Request | None, bytes]:
    """The next request and its body; (None, b"") when the client closed the connection."""
    event = await _next_event(conn, reader)
    if not isinstance(event, h11.Request):
        return None, b""
    length = dict(event.headers).get(b"content-length")
    if length is not None and int(length) > MAX_BODY_BYTES:
        raise _TooLarge(f"request body of {int(length)} bytes; the limit is {MAX_BODY_BYTES}")
    body = bytearray()
    while True:
        ev = await _next_event(conn, reader)
        if isinstance(ev, h11.Data):
            body += ev.data
            if len(body) > MAX_BODY_BYTES:
                raise _TooLarge(f"request body over the limit of {MAX_BODY_BYTES} bytes")
        elif isinstance(ev, h11.EndOfMessage):
            return event, bytes(body)
        else:
            return None, b""


async def _answer(conn: h11.Connection, writer: asyncio.StreamWriter, status: int, ctype: str, payload: bytes,
                  *, close: bool = False) -> None:
    headers = [("content-type", ctype), ("content-length", str(len(payload)))]
    if close:
        headers.append(("connection", "close"))
    writer.write(conn.send(h11.Response(status_code=status, headers=headers)))
    writer.write(conn.send(h11.Data(data=payload)))
    writer.write(conn.send(h11.EndOfMessage()))
    await writer.drain()


async def _linger(reader: asyncio.StreamReader) -> None:
    """Read and drop what a refused client still sends (for a moment), so closing does not reset
    the connection before it has read the answer."""
    with contextlib.suppress(TimeoutError, ConnectionError):
        async with asyncio.timeout(LINGER_S):
            while await reader.read(2**20):
                pass
