"""The OpenAI endpoint the daemon owns (127.0.0.1:11436 by default), forwarding to vLLM on its private
Unix socket (`--uds` in the engine's 0700 temp dir).

Everything under the endpoint is forwarded: method, path, query, body and headers unchanged (hop-by-hop
headers aside), and the answer streams back chunk by chunk as vLLM writes it (SSE tokens arrive as they
are made). A client that goes away closes the forwarded request, and vLLM aborts a request whose
connection closed, so an abandoned generation stops using the engine.

The front answers by itself only when there is nothing to forward to: no model served, or an engine
that is not READY (503 with Retry-After, in OpenAI's error shape). READY is checked per request against
the leader's state in /proc (Supervisor.snapshot), never a stale flag. The API key is checked here
before anything is forwarded (vLLM, which holds the same key, checks it again). CORS is answered here too
(daemon/cors.py): a browser's preflight never reaches the engine, and every answer to a page gets the headers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Callable
from typing import Any

import aiohttp
from multidict import CIMultiDict
from yarl import URL
from starlette.responses import JSONResponse, PlainTextResponse, Response

from exl3local import errors
from exl3local.api.protocol import ENGINE_ALIVE, EngineState
from exl3local.daemon import asgi, cors
from exl3local.daemon.scheduler import SwitchRefused, UnknownModel
from exl3local.engine.launch import ENGINE_KEEPALIVE_S, VLLM_API_KEY_ENV
from exl3local.models import catalog

log = logging.getLogger("exl3local.front")

# Headers of one connection, not of the request (RFC 9110 §7.6.1), and Host, which names our side.
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                        b"trailer", b"transfer-encoding", b"upgrade", b"host"})
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
# vLLM 0.32's development routes (vllm/entrypoints/serve/dev/, vllm/entrypoints/rl/online/api_router.py), served
# when a sleeping engine runs in its dev mode: sleep, wake, any method on every worker, weight updates. The
# daemon's to call on the engine's socket, never a client's through the endpoint.
ENGINE_PRIVATE = frozenset({
    "/sleep", "/wake_up", "/is_sleeping", "/release_kv_cache_memory", "/collective_rpc", "/server_info",
    "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache", "/pause", "/resume", "/abort_requests",
    "/is_paused", "/init_weight_transfer_engine", "/shutdown_weight_transfer_engine", "/start_weight_update",
    "/start_draft_weight_update", "/update_weights", "/finish_weight_update", "/update_weight_version",
    "/weight_info", "/weight_checker", "/get_world_size"})
# An idle keep-alive connection is closed after this. Longer than common clients keep idle connections in their
# pools (httpx 5 s, aiohttp 15 s, Node's undici 4 s): the client must drop one first, because a request it sends
# on a connection we are closing at that moment fails ("Server disconnected"; a POST is not retried). uvicorn's
# default, 5 s, raced httpx's 5 s (the session-8 bench run). The cost is an idle socket per client, 30 s at most.
IDLE_TIMEOUT_S = 30.0
ENGINE_CONNECT_TIMEOUT_S = 5.0  # a local socket: more is a stuck engine; reads have no limit (long generations)
# an idle engine connection is dropped by us before the engine drops it (launch.ENGINE_KEEPALIVE_S): a request
# never goes out on a connection the engine is closing at that moment (a POST is not retried)
ENGINE_IDLE_S = ENGINE_KEEPALIVE_S - 5.0
# what a failed or broken engine connection raises (a connect timeout is both)
ENGINE_ERRORS = (aiohttp.ClientError, TimeoutError)
# headers aiohttp would add to a request that lacks them: the client's request goes on as it was sent
NOT_ADDED = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")


def openai_error(status: int, message: str, kind: str, retry_after_s: int | None = None,
                 param: str | None = None) -> JSONResponse:
    """An error in the shape OpenAI clients parse ({"error": {"message", "type", "param", "code"}})."""
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status,
                        headers=headers)


def request_fields(method: str, body: bytes) -> dict[str, Any]:
    """The `model` and `keep_alive` (Ollama's per-request field) a JSON request body gives; empty when it gives
    neither or is not JSON (vLLM answers for those)."""
    if method != "POST" or (b'"model"' not in body and b'"keep_alive"' not in body):
        return {}
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return {}
    return {k: data[k] for k in ("model", "keep_alive") if k in data} if isinstance(data, dict) else {}


async def read_body(receive: Any) -> bytes | None:
    """The request's body, whole; None when the client left before sending all of it."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


class _Forwarded:
    """The engine's answer sent on as it arrives, each read passed on as it came (no re-chunking), in plain ASGI
    messages: starlette's StreamingResponse ran an anyio task group per answer to hear the client leave, a third
    of the front's CPU per request. Whatever ends it (the last chunk, the client going away before or during the
    stream, an error), `done` is called once and the answer is released: aiohttp pools a connection whose answer
    was read to its end and closes one whose answer was not, which makes vLLM abort that request."""

    def __init__(self, upstream: aiohttp.ClientResponse, done: Callable[[], None],
                 progress: Callable[[int | None, bool], None], ticket: int) -> None:
        self._upstream = upstream
        self._done = done
        self._progress = progress
        self._ticket = ticket

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        upstream = self._upstream

        async def hear_leave() -> None:
            # the body was read whole: the next message is the client leaving (or the answer's end, which
            # cancels this first); the engine's connection closes, so the read below ends and vLLM aborts
            if (await receive())["type"] == "http.disconnect":
                upstream.close()

        leave = asyncio.ensure_future(hear_leave())
        try:
            await send({"type": "http.response.start", "status": upstream.status, "headers": [
                (k.lower(), v) for k, v in upstream.raw_headers if k.lower() not in HOP_BY_HOP]})
            content = upstream.content
            while chunk := await content.readany():
                self._progress(self._ticket, True)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except ENGINE_ERRORS:
            if not leave.done():  # the engine broke the stream: the client's connection is closed on it
                raise
        finally:
            # in the same step as the last send: the server says "disconnect" once an answer is complete, and the
            # listener must not run on that and close a connection the pool can keep
            leave.cancel()
            self._done()
            upstream.release()


class Front:
    """The endpoint's listener and forwarding; `daemon` gives the current plan and supervisor."""

    def __init__(self, daemon: Any) -> None:
        self.daemon = daemon
        self.host: str | None = None
        self.port: int | None = None
        self._served: asgi.Served | None = None
        self._session: aiohttp.ClientSession | None = None
        self._session_uds: str | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self._cors: cors.LocalOrigins | None = None  # over the profile's patterns, made again when they change

    async def listen(self, host: str, port: int) -> None:
        """Serve the endpoint on host:port (moving it when the port changed)."""
        if self._served is not None and (self.host, self.port) == (host, port):
            return
        try:
            sock = asgi.tcp_socket(host, port)
        except OSError as exc:
            raise errors.ConfigError(f"port {port} on {host} is already in use ({exc.strerror}), so the endpoint "
                                     "cannot listen there",
                                     hint=f"free port {port}, or choose another with `exl3local up --port N`") from None
        await self.close()
        self._served = asgi.Served(self.app, sock, idle_timeout_s=IDLE_TIMEOUT_S, own_headers=False,
                                   http=asgi.FastProtocol)
        await self._served.started()
        self.host, self.port = host, port
        log.info("endpoint listening on http://%s:%d", host, port)

    async def close(self) -> None:
        if self._served is not None:
            await self._served.close()
            self._served = None
        self.host = self.port = None
        if self._session is not None:
            await self._session.close()
            self._session = self._session_uds = None

    def engine(self, uds: str) -> aiohttp.ClientSession:
        """The client of the engine's socket (one per engine socket, its connections kept alive). aiohttp: its
        response parser is C and a read is a wakeup on a future, where httpcore spent ~0.3 ms of Python per
        streamed chunk (an anyio cancel scope per read, h11's events); httpx's request models cost more still.
        No cookie jar: one client's cookies must not reach another's requests; no decompression: bytes pass
        through as the engine sent them."""
        if self._session is None or self._session_uds != uds:
            old, self._session = self._session, aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=uds, limit=0, keepalive_timeout=ENGINE_IDLE_S),
                cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False, skip_auto_headers=NOT_ADDED,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=ENGINE_CONNECT_TIMEOUT_S))
            self._session_uds = uds
            if old is not None:  # the previous engine's client: its streams end on their own
                task = asyncio.get_running_loop().create_task(old.close())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
        return self._session

    def _refusal(self, scope: Any) -> Response | None:
        """The front's own answer when there is no model, or the key is wrong; else None."""
        plan = self.daemon.plan
        if plan is None:
            return openai_error(503, "no model is being served: run `exl3local up`", "service_unavailable")
        key = plan.spec.env.get(VLLM_API_KEY_ENV)
        # OPTIONS carries no Authorization (a browser's preflight never does; the CORS layer answers those before
        # this): vLLM lets OPTIONS through too
        if key and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            sent = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not secrets.compare_digest(sent, f"Bearer {key}".encode()):
                return JSONResponse({"error": "Unauthorized"}, 401)  # vLLM's own answer, so clients see one shape
        return None

    def _not_ready(self) -> Response | None:
        """503 unless the engine is READY (its leader alive, checked in /proc)."""
        state = self.daemon.sup.snapshot()["state"]
        if state != EngineState.READY:
            waiting = state in (EngineState.STARTING, EngineState.BACKOFF)
            return openai_error(503, f"the engine is {state}" + (": loading, try again shortly" if waiting else
                                                                 ": see `exl3local status`"),
                                "service_unavailable", retry_after_s=1 if waiting else None)
        return None

    async def app(self, scope: Any, receive: Any, send: Any) -> None:
        """The endpoint's ASGI app: one handler for every path, without starlette's router and middleware
        stack, which wrapped every streamed chunk's send in two more layers."""
        if scope["type"] != "http":  # a WebSocket: not forwarded (as before, when a router held the one HTTP route)
            await send({"type": "websocket.close", "code": 1000})
            return
        # Only a browser names the page's Origin: other clients' streams skip the CORS layer's send wrapper.
        if any(name == b"origin" for name, _ in scope["headers"]):
            await self._cors_layer()(scope, receive, send)
        else:
            await self._serve(scope, receive, send)

    def _cors_layer(self) -> cors.LocalOrigins:
        plan = self.daemon.plan
        patterns = tuple(plan.profile.endpoint.get("cors_origins", ())) if plan is not None else ()
        if self._cors is None or self._cors.patterns != patterns:
            self._cors = cors.LocalOrigins(self._serve, patterns)
        return self._cors

    async def _serve(self, scope: Any, receive: Any, send: Any) -> None:
        # the scope as uvicorn gives it, without starlette's Request: its URL and header objects were ~10% of the
        # front's CPU per request
        if scope["method"] not in METHODS:
            answer: Response | _Forwarded | None = PlainTextResponse("Method Not Allowed", 405,
                                                                     headers={"Allow": ", ".join(METHODS)})
        else:
            answer = await self.forward(scope, receive)
        if answer is not None:
            await answer(scope, receive, send)

    async def forward(self, scope: Any, receive: Any) -> Response | _Forwarded | None:
        """The answer to one request; None when the client left while sending it."""
        refused = self._refusal(scope)
        if refused is not None:
            return refused
        # the path as the engine's router will read it: percent-escapes decoded, a trailing slash redirected
        path, method = scope["path"], scope["method"]
        if path.rstrip("/") in ENGINE_PRIVATE:
            return openai_error(404, f"{path} is not served by this endpoint", "NotFoundError")
        if method == "GET" and (path.rstrip("/") == "/v1/models" or path.startswith("/v1/models/")):
            return await self._models(path)
        body = await read_body(receive)
        if body is None:
            return None
        scheduler = self.daemon.scheduler
        fields = request_fields(method, body)
        model = fields.get("model") if isinstance(fields.get("model"), str) else None
        if "keep_alive" in fields:
            try:
                keep_alive = scheduler.parse_keep_alive(fields["keep_alive"])
            except ValueError as exc:
                return openai_error(400, f"keep_alive: {exc}", "BadRequestError", param="keep_alive")
        try:
            # another installed model: the engine switches to it; an IDLE engine starts again; either way the
            # request waits for READY, and is in flight from here (a switch asked for later waits for it)
            # the body's length bounds the prompt's tokens: the prefill the engine may take before a first byte
            ticket = await scheduler.admit(model, len(body) if method == "POST" else 0)
        except UnknownModel as exc:
            return openai_error(404, str(exc), "NotFoundError", param="model")
        except SwitchRefused as exc:
            return openai_error(503, str(exc), "service_unavailable", retry_after_s=exc.retry_after_s)
        if "keep_alive" in fields:
            scheduler.keep_alive_from_request(keep_alive)  # after admit: a switch resets it to the profile's
        try:
            refused = self._not_ready()
            if refused is not None:
                scheduler.end(ticket)
                return refused
            return await self._forward(scope, body, ticket)
        except BaseException:
            scheduler.end(ticket)
            raise

    async def _models(self, path: str) -> Response:
        """GET /v1/models: every installed model (the engine knows only its own), marked with which one the
        engine serves; GET /v1/models/NAME: one of them."""
        plan = self.daemon.plan
        found = await asyncio.get_running_loop().run_in_executor(None, catalog.installed, plan.profile)
        state = EngineState.IDLE if self.daemon.scheduler.idle else EngineState(self.daemon.sup.snapshot()["state"])
        current = plan.model_dir.resolve()
        rows = [{"id": m.name, "aliases": list(m.aliases), "source": m.source, "created": m.created,
                 "current": m.path.resolve() == current} for m in found]
        if not any(r["current"] for r in rows):  # served from a directory that is not installed (`up DIR`)
            rows.append({"id": plan.names[0], "aliases": list(plan.names[1:]), "source": "directory",
                         "created": 0, "current": True})
        rows.sort(key=lambda r: not r["current"])  # the served model first
        seen: set[str] = set()  # a name is listed once: the served model's row wins
        rows = [r for r in rows if not (r["id"] in seen or seen.add(r["id"]))]
        data = [{"id": r["id"], "object": "model", "created": r["created"], "owned_by": "exl3local",
                 # loaded: the engine holds (or is loading) it; state: the engine's, for the model it serves
                 "loaded": r["current"] and state in ENGINE_ALIVE, "state": state.value if r["current"] else None,
                 "aliases": r["aliases"], "source": r["source"]} for r in rows]
        name = path.rstrip("/").removeprefix("/v1/models").removeprefix("/")
        if not name:
            return JSONResponse({"object": "list", "data": data})
        one = next((d for d in data if name == d["id"] or name in d["aliases"]), None)
        if one is None:
            return openai_error(404, f"the model `{name}` is not installed; installed: "
                                f"{', '.join(d['id'] for d in data)}", "NotFoundError", param="model")
        return JSONResponse(one)

    async def _forward(self, scope: Any, body: bytes, ticket: int) -> Response | _Forwarded:
        """Forward to the engine; the scheduler's end() comes when the answer is over (or failed)."""
        scheduler = self.daemon.scheduler
        spec = self.daemon.plan.spec
        # the body is whole here: its length is ours to say (a client's chunked upload arrives as one body)
        method = scope["method"]
        headers = CIMultiDict((k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
                              if k not in HOP_BY_HOP and k != b"content-length")
        if body or method in ("POST", "PUT", "PATCH"):
            headers["content-length"] = str(len(body))
        # the path as the client sent it (percent-escapes kept), not the decoded one
        path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
        url = URL.build(scheme="http", host="engine", path=path,
                        query_string=scope.get("query_string", b"").decode("latin-1"), encoded=True)
        try:
            resp = await self.engine(spec.uds).request(method, url, headers=headers, data=body or None,
                                                       allow_redirects=False)
        except ENGINE_ERRORS as exc:
            scheduler.end(ticket)
            # a hung engine killed under a waiting request lands here too
            return openai_error(503, f"the engine did not answer ({type(exc).__name__}); it is being restarted "
                                "if it hung", "service_unavailable", retry_after_s=1)

        scheduler.progress(ticket)  # the headers are a byte too (a stream's come before its prefill)
        return _Forwarded(resp, lambda: scheduler.end(ticket), scheduler.progress, ticket)

    async def engine_get(self, path: str) -> str:
        """GET on the engine itself (the daemon's /api/metrics); raises one of ENGINE_ERRORS."""
        async with self.engine(self.daemon.plan.spec.uds).get(f"http://engine{path}",
                                                               timeout=aiohttp.ClientTimeout(total=5.0)) as resp:
            return await resp.text()
