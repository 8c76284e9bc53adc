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
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp

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
