"""bench/front_overhead.py --burn 0 0 --burn-site bench/front_lean_site.py copies this as the daemon's sitecustomize.py:
while $FRONT_BURN_FLAG exists (the bench's third path), the front forwards through a minimal engine reader (an asyncio
Protocol with httptools' response parser, idle connections in a list) instead of aiohttp, to size what aiohttp costs.
A prototype for measurement only: no disconnect abort, no connect timeout, no pool expiry. Not the product's code.
"""
import os, sys
if sys.argv[-2:] == ["daemon", "--detached"] and os.environ.get("FRONT_BURN_FLAG"):
    import asyncio
    import httptools
    from exl3local.daemon import front as F

    _orig = F.Front._forward
    _flag = os.environ["FRONT_BURN_FLAG"]

    class Conn(asyncio.Protocol):
        def __init__(self):
            self.t = None; self.lost = False
        def connection_made(self, t): self.t = t
        def reset(self):
            self.parser = httptools.HttpResponseParser(self); self.headers = []; self.chunks = []; self.done = False
            self.waiter = None; self.head = asyncio.get_running_loop().create_future()
        def data_received(self, d): self.parser.feed_data(d)
        def on_header(self, n, v): self.headers.append((n, v))
        def on_headers_complete(self): self.head.set_result(self.parser.get_status_code())
        def _wake(self):
            w = self.waiter
            if w is not None and not w.done(): w.set_result(None)
        def on_body(self, b): self.chunks.append(b); self._wake()
        def on_message_complete(self): self.done = True; self._wake()
        def connection_lost(self, exc):
            self.lost = self.done = True; self._wake()
            if not self.head.done(): self.head.set_exception(ConnectionError("lost"))

    idle = []

    async def _forward(self, scope, body, ticket):
        if not os.path.exists(_flag):
            return await _orig(self, scope, body, ticket)
        sched = self.daemon.scheduler
        loop = asyncio.get_running_loop()
        while idle and idle[-1].lost:
            idle.pop()
        conn = idle.pop() if idle else (await loop.create_unix_connection(Conn, self.daemon.plan.spec.uds))[1]
        conn.reset()
        head = [f"{scope['method']} {scope['raw_path'].decode('latin-1')} HTTP/1.1\r\nhost: engine\r\n".encode()]
        for k, v in scope["headers"]:
            if k not in F.HOP_BY_HOP and k != b"content-length":
                head.append(k + b": " + v + b"\r\n")
        head.append(b"content-length: %d\r\n\r\n" % len(body))
        conn.t.write(b"".join(head) + body)
        status = await conn.head
        sched.progress(ticket)

        async def answer(scope, receive, send):
            try:
                await send({"type": "http.response.start", "status": status,
                            "headers": [(k.lower(), v) for k, v in conn.headers if k.lower() not in F.HOP_BY_HOP]})
                while True:
                    if conn.chunks:
                        data = b"".join(conn.chunks); conn.chunks.clear()
                        sched.progress(ticket, True)
                        await send({"type": "http.response.body", "body": data, "more_body": True})
                    elif conn.done:
                        break
                    else:
                        conn.waiter = loop.create_future(); await conn.waiter
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                sched.end(ticket)
            if not conn.lost:
                idle.append(conn)
        return answer

    F.Front._forward = _forward
