"""bench/front_overhead.py --burn 0 0 --burn-site bench/front_lean_site.py copies this as the daemon's sitecustomize.py:
while $FRONT_BURN_FLAG exists (the bench's third path), the front forwards through a minimal engine reader (an asyncio
Protocol with httptools' response parser, idle connections in a list) instead of aiohttp, to size what aiohttp costs.
A prototype for measurement only: no disconnect abort, no connect timeout, no pool expiry. Not the product's code.
"""

import os
import sys

if sys.argv[-2:] == ["daemon", "--detached"] and os.environ.get("FRONT_BURN_FLAG"):
    import asyncio

    import httptools

    from exl3local.daemon import front as _front

    _aiohttp_forward = _front.Front._forward
    _flag = os.environ["FRONT_BURN_FLAG"]

    class _EngineConnection(asyncio.Protocol):
        """One keep-alive connection to the engine; `reset` before each request."""

        def __init__(self) -> None:
            self.transport: asyncio.Transport | None = None
            self.lost = False

        def connection_made(self, transport) -> None:  # type: ignore[no-untyped-def]
            self.transport = transport

        def reset(self) -> None:
            self.parser = httptools.HttpResponseParser(self)
            self.headers: list[tuple[bytes, bytes]] = []
            self.chunks: list[bytes] = []
            self.done = False
            self.waiter: asyncio.Future | None = None
            self.head = asyncio.get_running_loop().create_future()

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def on_header(self, name: bytes, value: bytes) -> None:
            self.headers.append((name, value))

        def on_headers_complete(self) -> None:
            self.head.set_result(self.parser.get_status_code())

        def _wake(self) -> None:
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_result(None)

        def on_body(self, body: bytes) -> None:
            self.chunks.append(body)
            self._wake()

        def on_message_complete(self) -> None:
            self.done = True
            self._wake()

        def connection_lost(self, exc) -> None:  # type: ignore[no-untyped-def]
            self.lost = self.done = True
            self._wake()
            if not self.head.done():
                self.head.set_exception(ConnectionError("engine connection lost"))

    _idle: list[_EngineConnection] = []

    def _request_head(scope: dict, body: bytes) -> bytes:
        lines = [f"{scope['method']} {scope['raw_path'].decode('latin-1')} HTTP/1.1\r\nhost: engine\r\n".encode()]
        lines += [name + b": " + value + b"\r\n" for name, value in scope["headers"]
                  if name not in _front.HOP_BY_HOP and name != b"content-length"]
        lines.append(b"content-length: %d\r\n\r\n" % len(body))
        return b"".join(lines)

    async def _lean_forward(self, scope, body, ticket):  # type: ignore[no-untyped-def]
        if not os.path.exists(_flag):
            return await _aiohttp_forward(self, scope, body, ticket)
        scheduler = self.daemon.scheduler
        loop = asyncio.get_running_loop()
        while _idle and _idle[-1].lost:
            _idle.pop()
        if _idle:
            conn = _idle.pop()
        else:
            _, conn = await loop.create_unix_connection(_EngineConnection, self.daemon.plan.spec.uds)
        conn.reset()
        conn.transport.write(_request_head(scope, body) + body)
        status = await conn.head
        scheduler.progress(ticket)

        async def answer(scope, receive, send):  # type: ignore[no-untyped-def]
            try:
                await send({"type": "http.response.start", "status": status, "headers": [
                    (name.lower(), value) for name, value in conn.headers if name.lower() not in _front.HOP_BY_HOP]})
                while True:
                    if conn.chunks:
                        data = b"".join(conn.chunks)
                        conn.chunks.clear()
                        scheduler.progress(ticket, True)
                        await send({"type": "http.response.body", "body": data, "more_body": True})
                    elif conn.done:
                        break
                    else:
                        conn.waiter = loop.create_future()
                        await conn.waiter
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                scheduler.end(ticket)
            if not conn.lost:
                _idle.append(conn)

        return answer

    _front.Front._forward = _lean_forward
