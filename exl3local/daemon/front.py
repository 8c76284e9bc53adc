"""The OpenAI endpoint the daemon owns (127.0.0.1:11436 by default), forwarding to vLLM on its private
Unix socket (`--uds` in the engine's 0700 temp dir).

Everything under the endpoint is forwarded: method, path, query, body and headers unchanged (hop-by-hop
headers aside), and the answer streams back chunk by chunk as vLLM writes it (SSE tokens arrive as they
are made). A client that goes away closes the forwarded request, and vLLM aborts a request whose
connection closed, so an abandoned generation stops using the engine.

The front answers by itself only when there is nothing to forward to: no model served, or an engine
that is not READY (503 with Retry-After, in OpenAI's error shape). READY is checked per request against
the leader's state in /proc (Supervisor.snapshot), never a stale flag. The API key is checked here
before anything is forwarded (vLLM, which holds the same key, checks it again); the CORS rules stay in
the engine's middleware (engine/cors.py), whose headers pass through unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from exl3local import errors
from exl3local.api.protocol import EngineState
from exl3local.daemon import asgi
from exl3local.engine.launch import VLLM_API_KEY_ENV

log = logging.getLogger("exl3local.front")

# Headers of one connection, not of the request (RFC 9110 §7.6.1), and Host, which names our side.
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                        b"trailer", b"transfer-encoding", b"upgrade", b"host"})
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
IDLE_TIMEOUT_S = 5.0  # between requests on a keep-alive connection (uvicorn's default)
ENGINE_CONNECT_TIMEOUT_S = 5.0  # a local socket: more is a stuck engine; reads have no limit (long generations)


def openai_error(status: int, message: str, kind: str, retry_after_s: int | None = None) -> JSONResponse:
    """An error in the shape OpenAI clients parse ({"error": {"message", "type", "param", "code"}})."""
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}}, status,
                        headers=headers)


class _Forwarded(StreamingResponse):
    """The engine's answer streamed as it arrives. Whatever ends it (the last chunk, the client going away
    before or during the stream, an error), the engine connection is closed, which makes vLLM abort a
    request still running, and `done` is called once."""

    def __init__(self, upstream: httpx.Response, done: Callable[[], None], progress: Callable[[], None]) -> None:
        async def chunks() -> Any:
            async for chunk in upstream.aiter_raw():
                progress()
                yield chunk

        super().__init__(chunks(), upstream.status_code)
        self.raw_headers = [(k.lower(), v) for k, v in upstream.headers.raw if k.lower() not in HOP_BY_HOP]
        self._upstream = upstream
        self._done = done

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._done()
            await self._upstream.aclose()


class Front:
    """The endpoint's listener and forwarding; `daemon` gives the current plan and supervisor."""

    def __init__(self, daemon: Any) -> None:
        self.daemon = daemon
        self.host: str | None = None
        self.port: int | None = None
        self._served: asgi.Served | None = None
        self._client: httpx.AsyncClient | None = None
        self._client_uds: str | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self.app = Starlette(routes=[Route("/{path:path}", self.forward, methods=METHODS)])

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
        self._served = asgi.Served(self.app, sock, idle_timeout_s=IDLE_TIMEOUT_S, own_headers=False, http="auto")
        await self._served.started()
        self.host, self.port = host, port
        log.info("endpoint listening on http://%s:%d", host, port)

    async def close(self) -> None:
        if self._served is not None:
            await self._served.close()
            self._served = None
        self.host = self.port = None
        if self._client is not None:
            await self._client.aclose()
            self._client = self._client_uds = None

    def engine(self, uds: str) -> httpx.AsyncClient:
        """The HTTP client to the engine's socket (one pool per engine socket)."""
        if self._client is None or self._client_uds != uds:
            old, self._client = self._client, httpx.AsyncClient(
                transport=httpx.AsyncHTTPTransport(uds=uds), base_url="http://engine", trust_env=False,
                timeout=httpx.Timeout(None, connect=ENGINE_CONNECT_TIMEOUT_S),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=32))
            self._client_uds = uds
            if old is not None:  # the previous engine's pool: its streams end on their own
                task = asyncio.get_running_loop().create_task(old.aclose())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
        return self._client

    def _refusal(self, request: Request) -> Response | None:
        """The front's own answer when there is no model, or the key is wrong; else None."""
        plan = self.daemon.plan
        if plan is None:
            return openai_error(503, "no model is being served: run `exl3local up`", "service_unavailable")
        key = plan.spec.env.get(VLLM_API_KEY_ENV)
        # a CORS preflight carries no Authorization (browsers never send it there): vLLM lets OPTIONS through too
        if key and request.url.path.startswith("/v1") and request.method != "OPTIONS":
            sent = request.headers.get("authorization", "").encode()
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

    async def forward(self, request: Request) -> Response:
        refused = self._refusal(request)
        if refused is not None:
            return refused
        scheduler = self.daemon.scheduler
        await scheduler.admit()  # an IDLE engine starts again; the request waits for it
        refused = self._not_ready()
        if refused is not None:
            return refused
        scheduler.begin()
        try:
            return await self._forward(request)
        except BaseException:
            scheduler.end()
            raise

    async def _forward(self, request: Request) -> Response:
        """Forward to the engine; the scheduler's end() comes when the answer is over (or failed)."""
        scheduler = self.daemon.scheduler
        spec = self.daemon.plan.spec
        headers = [(k, v) for k, v in request.headers.raw if k.lower() not in HOP_BY_HOP]
        # the path as the client sent it (percent-escapes kept), not starlette's decoded one
        path = request.scope.get("raw_path", b"").decode("latin-1") or request.url.path
        target = path + (f"?{request.url.query}" if request.url.query else "")
        client = self.engine(spec.uds)
        upstream = client.build_request(request.method, target, headers=headers, content=await request.body())
        try:
            resp = await client.send(upstream, stream=True)
        except httpx.TransportError as exc:
            scheduler.end()
            # a hung engine killed under a waiting request lands here too
            return openai_error(503, f"the engine did not answer ({type(exc).__name__}); it is being restarted "
                                "if it hung", "service_unavailable", retry_after_s=1)

        scheduler.progress()  # the headers are a byte too
        return _Forwarded(resp, scheduler.end, scheduler.progress)

    async def engine_get(self, path: str) -> httpx.Response:
        """GET on the engine itself (the daemon's /api/metrics)."""
        return await self.engine(self.daemon.plan.spec.uds).get(path, timeout=5.0)
