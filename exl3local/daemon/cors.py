"""Which browser pages may call the OpenAI endpoint (CORS), answered at the front (daemon/front.py).

The profile's `[endpoint] cors_origins` patterns become one regex: vLLM's own `--allowed-origins` compares
origins exactly, so "any port on localhost" (dev servers, editor webviews, browser extensions talking to a local
tool) cannot be said with it. The front answers a preflight itself, so one never wakes an idle engine or waits for
a loading one, and adds the headers to every answer, its own and the engine's alike. The engine keeps vLLM's
default (no origin allowed): its CORS layer only says `Vary: Origin`, which is said once here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from starlette.datastructures import Headers, MutableHeaders
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Send


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
    """starlette's CORS rules (preflight answers, the allowed origin mirrored back) over the profile's patterns;
    any method and header may be asked for (a local tool's API, not a cookie-bearing site)."""

    def __init__(self, app: ASGIApp, patterns: Iterable[str]) -> None:
        self.patterns = tuple(patterns)
        super().__init__(app, allow_origin_regex=origin_regex(self.patterns), allow_methods=["*"],
                         allow_headers=["*"], max_age=600)

    async def send(self, message: Message, send: Send, request_headers: Headers) -> None:
        # vLLM's CORS layer already said `Vary: Origin` on a forwarded answer; say each name once
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
