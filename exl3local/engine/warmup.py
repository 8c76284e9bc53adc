"""Warm-up before READY, as ASGI middleware loaded into vLLM's API server with `--middleware`.

The first request that asks for logprobs after an engine start compiles vLLM's logprobs op (torch.compile:
tens of seconds on a CPU), so a client with a short timeout failed it while the same request later took
under a second. The daemon says READY when the engine's /health answers 200; this layer answers /health
with 503 until one small completion with logprobs has gone through vLLM's own app, so that cost is paid
during start-up. The request is made in-process, through the app below this layer (vLLM's key check and
routes included), so it does not depend on where the server listens (TCP or `--uds`). A warm-up that fails
is logged and READY follows anyway: it must never keep a working engine from serving.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

API_KEY_ENV = "VLLM_API_KEY"  # set by engine.launch when the endpoint requires a key


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
            self._task = asyncio.get_running_loop().create_task(self.warm_up(scope))
        if self._task.done():
            self._done = True
            if self._task.exception() is not None:
                print(f"exl3local: the warm-up request failed, serving anyway: {self._task.exception()}", flush=True)
            else:
                print(f"exl3local: warm-up done in {self._task.result():.1f} s", flush=True)
            await self.app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", b"10")]})
        await send({"type": "http.response.body", "body": b"warming up"})

    async def warm_up(self, like: Scope) -> float:
        """One completion of one token with logprobs; returns the seconds it took."""
        t0 = time.monotonic()
        models = await self._call(like, "GET", "/v1/models")
        body = {"model": models["data"][0]["id"], "prompt": "Hello", "max_tokens": 1, "temperature": 0, "logprobs": 1}
        await self._call(like, "POST", "/v1/completions", body)
        return time.monotonic() - t0

    async def _call(self, like: Scope, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """A request to the app below, on the connection details of the probe that started the warm-up."""
        payload = json.dumps(body).encode() if body is not None else b""
        headers = [(b"host", b"localhost"), (b"content-type", b"application/json"),
                   (b"content-length", str(len(payload)).encode())]
        if key := os.environ.get(API_KEY_ENV):
            headers.append((b"authorization", f"Bearer {key}".encode()))
        scope = {**like, "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
                 "headers": headers}
        sent = False

        async def receive() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": payload, "more_body": False}
            await asyncio.Event().wait()  # the client stays connected until the answer is complete
            raise AssertionError("unreachable")

        status, chunks = 0, []

        async def send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(scope, receive, send)
        text = b"".join(chunks)
        if status != 200:
            raise RuntimeError(f"{method} {path}: {status} {text[:300]!r}")
        return json.loads(text)
