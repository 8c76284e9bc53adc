"""Which browser pages may call the OpenAI endpoint (CORS), as ASGI middleware loaded into vLLM's API
server with `--middleware`.

vLLM's own `--allowed-origins` compares origins exactly, so "any port on localhost" (dev servers, editor
webviews, browser extensions talking to a local tool) cannot be said with it. The profile's
`[endpoint] cors_origins` patterns reach the engine as JSON in launch.CORS_ORIGINS_ENV and become one
regex here. vLLM adds `--middleware` classes after its own CORS layer, so this one sees requests first and
answers the preflight before vLLM's (empty) origin list refuses it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable

# starlette is vLLM's web framework: this module runs only inside the engine, never in the daemon.
from starlette.datastructures import Headers, MutableHeaders
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Send

from exl3local.engine.launch import CORS_ORIGINS_ENV


def origin_regex(patterns: Iterable[str]) -> str:
    """`http://localhost:*` → any port (or none); `vscode-webview://*` → any host; everything else exactly."""
    alternatives = []
    for pattern in patterns:
        scheme, _, rest = pattern.partition("://")
        if rest == "*":
            body = r"[^/:]+"
        elif rest.endswith(":*"):
            body = re.escape(rest[:-2]) + r"(:[0-9]{1,5})?"
        else:
            body = re.escape(rest)
        alternatives.append(re.escape(scheme) + "://" + body)
    # (?!) never matches: an empty list allows no origin
    return "(" + "|".join(alternatives) + ")" if alternatives else r"(?!)"


class LocalOrigins(CORSMiddleware):
    def __init__(self, app: ASGIApp) -> None:
        patterns = json.loads(os.environ.get(CORS_ORIGINS_ENV) or "[]")
        super().__init__(app, allow_origin_regex=origin_regex(patterns), allow_methods=["*"], allow_headers=["*"],
                         max_age=600)

    async def send(self, message: Message, send: Send, request_headers: Headers) -> None:
        # vLLM's own CORS layer (inside this one) already said `Vary: Origin`; say each name once
        async def vary_once(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                headers = MutableHeaders(scope=msg)
                names: dict[str, str] = {}
                for value in headers.getlist("vary"):
                    for name in filter(None, (n.strip() for n in value.split(","))):
                        names.setdefault(name.lower(), name)
                if names:
                    headers["vary"] = ", ".join(names.values())
            await send(msg)

        await super().send(message, vary_once, request_headers)
