"""bench/front_overhead.py --burn copies this as `sitecustomize.py` into a private directory on the daemon's
PYTHONPATH. While the file $FRONT_BURN_FLAG exists, the daemon's front spends extra CPU: $FRONT_BURN_REQUEST_US
before it forwards each request and $FRONT_BURN_EVENT_US per streamed read (busy on the thread's own CPU clock, so a
contended core stretches it as it stretches the front's real work). The bench creates the flag for the rounds of its
"burn" path only: how much the front's TTFT and decode move per extra ms of the daemon's CPU, in one run with the
plain front and the direct path. Other processes (vLLM's, the CLI's) import it and do nothing. Measurement only.
"""

import os
import sys
import time

if sys.argv[-2:] == ["daemon", "--detached"] and os.environ.get("FRONT_BURN_FLAG"):
    from exl3local.daemon import front as _front

    _forward = _front.Front._forward
    _flag = os.environ["FRONT_BURN_FLAG"]
    _per_request = float(os.environ.get("FRONT_BURN_REQUEST_US", "0")) / 1e6
    _per_event = float(os.environ.get("FRONT_BURN_EVENT_US", "0")) / 1e6

    def _burn(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    async def forward(self, scope, body, ticket):  # type: ignore[no-untyped-def]
        if not os.path.exists(_flag):
            return await _forward(self, scope, body, ticket)
        _burn(_per_request)
        answer = await _forward(self, scope, body, ticket)
        if isinstance(answer, _front._Forwarded):
            progress = answer._progress

            def burning(ticket, body=False):  # type: ignore[no-untyped-def]
                _burn(_per_event)
                progress(ticket, body)
            answer._progress = burning
        return answer

    _front.Front._forward = forward
