"""The endpoint's answer to a request with `tools` when the served model has tools off, as ASGI middleware
loaded into vLLM's API server with `--middleware` (only then: engine.launch adds it when no tool-call parser
is chosen).

vLLM refuses such a request with a 400 that names its own command-line flags (`--enable-auto-tool-choice`,
`--tool-call-parser`), which an exl3local user never types: the daemon starts vLLM. This layer keeps vLLM's
status and error shape and replaces the message with exl3local's switch.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

VLLM_FLAGS = (b"--enable-auto-tool-choice", b"--tool-call-parser")
MESSAGE = ("tools are off for this model: exl3local found no tool-call format it knows in its chat template. "
           "Start it with `exl3local up MODEL --set vllm.tool_call_parser=NAME` (NAME: vLLM's tool parser for the "
           "model's format, e.g. hermes for <tool_call> JSON); `exl3local status` says why they are off")
MAX_BODY_BYTES = 64 * 1024  # vLLM's error bodies are small; anything larger passes through untouched


def rewrite(body: bytes) -> bytes | None:
    """vLLM's error body with exl3local's message, or None when it is not the tools-off refusal."""
    if not any(flag in body for flag in VLLM_FLAGS):
        return None
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    error = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(error, dict) or not any(f.decode() in str(error.get("message", "")) for f in VLLM_FLAGS):
        return None
    error["message"] = MESSAGE
    return json.dumps(doc).encode()


class ToolsOffHint:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or not scope.get("path", "").startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def hold_400(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] == 400:
                start = message  # held until the body says which 400 this is
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body") and sum(map(len, chunks)) < MAX_BODY_BYTES:
                return
            body = b"".join(chunks)
            new = None if message.get("more_body") else rewrite(body)
            held, start = start, None  # from here on the rest of the body passes through
            await send(_with_length(held, len(new)) if new is not None else held)
            await send({**message, "body": new if new is not None else body})

        await self.app(scope, receive, hold_400)


def _with_length(start: Message, length: int) -> dict[str, Any]:
    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
    return {**start, "headers": [*headers, (b"content-length", str(length).encode())]}
