"""Loaded into vLLM's API server by bench/front_steps.py (`--middleware front_trace_mw.Trace`, this file copied to
a private directory on the engine's PYTHONPATH): a per-request timeline at the engine, on the one clock every
process of the box shares (CLOCK_MONOTONIC: time.monotonic here, vLLM's engine-core event stamps, the bench's).

Per request named by the bench (X-Request-Id `P-ROUND-I`; P: f front, d direct, n front with the daemon reniced):
  arrive  the ASGI call reaches this layer (uvicorn has parsed the request head)
  body    the request's body is read whole
  handed  the API server hands the request to the engine core (vLLM's AsyncMPClient.add_request_async, wrapped)
  sse     the first SSE body chunk leaves for the client
and, from the engine core's outputs as the API server's output handler takes them (vLLM's OutputProcessor, wrapped
here, called unchanged): queued (the engine core's loop took it from its input queue into the scheduler: it does
so right before each schedule(), so a request handed over during a step waits here for that step's end), scheduled (the
schedule() call, i.e. the engine step, that took it; requests taken by one step share that stamp), first_out (the
engine core's stamp on the step output carrying its first token). Every step output the API server took is listed
too (engine-core stamp, local stamp, number of requests), which gives the engine's step boundaries.

GET /_trace on the engine's socket answers all of it as JSON and starts afresh. Measurement only: not shipped.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from vllm.v1.engine.core_client import AsyncMPClient
from vllm.v1.engine.output_processor import OutputProcessor

NAME = re.compile(r"[a-z]-\d+-\d+")
REQUESTS: dict[str, dict[str, Any]] = {}
STEPS: list[tuple[float, float, int]] = []
_process_outputs = OutputProcessor.process_outputs
_add_request_async = AsyncMPClient.add_request_async


def _row(request_id: str) -> dict[str, Any] | None:
    found = NAME.search(request_id)
    return None if found is None else REQUESTS.get(found.group())


async def _traced_add_request_async(self: Any, request: Any) -> None:
    row = _row(request.request_id)
    if row is not None:
        row.setdefault("handed", time.monotonic())
    await _add_request_async(self, request)


def _traced_process_outputs(self: Any, engine_core_outputs: Any, engine_core_timestamp: float | None = None,
                            *args: Any, **kwargs: Any) -> Any:
    now = time.monotonic()
    STEPS.append((engine_core_timestamp or 0.0, now, len(engine_core_outputs)))
    for out in engine_core_outputs:
        row = _row(out.request_id)
        if row is None:
            continue
        for event in out.events or ():
            row.setdefault(event.type.name.lower(), event.timestamp)
        if out.new_token_ids and "first_out" not in row:
            row["first_out"] = engine_core_timestamp
            row["first_taken"] = now
    return _process_outputs(self, engine_core_outputs, engine_core_timestamp, *args, **kwargs)


OutputProcessor.process_outputs = _traced_process_outputs
AsyncMPClient.add_request_async = _traced_add_request_async


class Trace:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        arrive = time.monotonic()
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] == "/_trace":
            body = json.dumps({"requests": REQUESTS, "steps": STEPS}).encode()
            REQUESTS.clear()
            STEPS.clear()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        name = next((v.decode() for k, v in scope["headers"] if k == b"x-request-id"), "")
        if not NAME.fullmatch(name):
            await self.app(scope, receive, send)
            return
        row = REQUESTS[name] = {"arrive": arrive}

        async def traced_receive() -> Any:
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body") and "body" not in row:
                row["body"] = time.monotonic()
            return message

        async def traced_send(message: Any) -> None:
            if message["type"] == "http.response.body" and b"data: " in message.get("body", b"") and "sse" not in row:
                row["sse"] = time.monotonic()
            await send(message)

        await self.app(scope, traced_receive, traced_send)
