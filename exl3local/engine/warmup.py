"""Warm-up before READY, as ASGI middleware loaded into vLLM's API server with `--middleware`.

The first request that asks for logprobs after an engine start compiles vLLM's logprobs op (torch.compile:
tens of seconds on a CPU), so a client with a short timeout failed it while the same request later took
under a second. The daemon says READY when the engine's /health answers 200; this layer answers /health
with 503 until one small completion with logprobs has gone through the engine's own endpoint, so that cost
is paid during start-up. A warm-up that fails is logged and READY follows anyway: it must never keep a
working engine from serving.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import httpx
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("exl3local.warmup")

WARMUP_TIMEOUT_S = 600.0  # a first compile on a slow, busy machine; the daemon's stall timer sees our log line
API_KEY_ENV = "VLLM_API_KEY"  # set by engine.launch when the endpoint requires a key


async def warm_up(base_url: str, api_key: str | None = None, timeout_s: float = WARMUP_TIMEOUT_S,
                  transport: httpx.AsyncBaseTransport | None = None) -> float:
    """One completion of one token with logprobs through the endpoint; returns the seconds it took."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout_s, trust_env=False,
                                 transport=transport) as client:
        models = (await client.get("/v1/models")).raise_for_status().json()
        model = models["data"][0]["id"]
        body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0, "logprobs": 1}
        (await client.post("/v1/completions", json=body)).raise_for_status()
    return time.monotonic() - t0


def _own_address(scope: Scope) -> tuple[str, httpx.AsyncBaseTransport | None]:
    """This API server's base URL and transport: host:port, or the Unix socket it serves on (`--uds`, as
    the daemon starts it; uvicorn then gives (path, None) as the server address)."""
    host, port = scope["server"]
    if port is None:
        return "http://engine", httpx.AsyncHTTPTransport(uds=host)
    return f"http://{host}:{port}", None


class WarmUpBeforeReady:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._task: asyncio.Task[float] | None = None
        self._done = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._done or scope["type"] != "http" or scope.get("path") != "/health":
            await self.app(scope, receive, send)
            return
        if self._task is None:
            print("exl3local: warming up the logprobs path before READY (first compile)", flush=True)
            url, transport = _own_address(scope)
            self._task = asyncio.get_running_loop().create_task(
                warm_up(url, os.environ.get(API_KEY_ENV), transport=transport))
        if self._task.done():
            self._done = True
            if self._task.exception() is not None:
                log.warning("exl3local: the warm-up request failed (serving anyway): %r", self._task.exception())
            else:
                print(f"exl3local: warm-up done in {self._task.result():.1f} s", flush=True)
            await self.app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", b"10")]})
        await send({"type": "http.response.body", "body": b"warming up"})
