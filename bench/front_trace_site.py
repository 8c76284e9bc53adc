"""bench/front_steps.py copies this as `sitecustomize.py` into the private directory it puts on PYTHONPATH, so the
daemon it starts (`python -m exl3local daemon`) stamps, for each request the bench names (X-Request-Id), when the
front's app got it (the head parsed by uvicorn), when it was admitted and handed to aiohttp (the write to the engine's
socket follows in the same step, on a pooled connection), and when the engine's answer head came back. One line per
request appended to $FRONT_TRACE_FILE. Other processes (vLLM's, the CLI's) import it and do nothing. Measurement only.
"""

import os
import sys
import time

if sys.argv[-2:] == ["daemon", "--detached"] and os.environ.get("FRONT_TRACE_FILE"):
    from exl3local.daemon import front as _front

    _app, _forward = _front.Front.app, _front.Front._forward
    _entered: dict[int, float] = {}

    def _name(scope: dict) -> str:
        return next((v.decode() for k, v in scope.get("headers", ()) if k == b"x-request-id"), "")

    async def app(self, scope, receive, send):  # type: ignore[no-untyped-def]
        _entered[id(scope)] = time.monotonic()
        try:
            await _app(self, scope, receive, send)
        finally:
            _entered.pop(id(scope), None)

    async def forward(self, scope, body, ticket):  # type: ignore[no-untyped-def]
        out = time.monotonic()
        answer = await _forward(self, scope, body, ticket)
        if name := _name(scope):
            with open(os.environ["FRONT_TRACE_FILE"], "a") as f:
                f.write(f"{name} {_entered.get(id(scope), 0.0)} {out} {time.monotonic()}\n")
        return answer

    _front.Front.app, _front.Front._forward = app, forward
