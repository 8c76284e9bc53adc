"""The endpoint's forwarding (daemon/front.py) in one process: the real Front on a TCP port, a fake daemon around
it, and an engine that is a raw ASGI app on a Unix socket, so each step waits on an event, not a sleep. What the
client sends reaches the engine as sent (no header added by the front's HTTP client), the engine's stream comes
back chunk by chunk, the client's cookies stay its own, a client that leaves closes the engine request, and CORS
is answered at the front."""

from __future__ import annotations

import asyncio
import re
import socket
from types import SimpleNamespace

import httpx

from exl3local.api.protocol import EngineState
from exl3local.daemon import asgi, cors
from exl3local.daemon.front import Front


class Engine:
    """Streams `data: 1`, then `data: 2` once `go` is set; records each request; `left` is set when the front
    closed a request before its end (what makes vLLM abort it)."""

    def __init__(self) -> None:
        self.seen: list[dict] = []
        self.go = asyncio.Event()
        self.left = asyncio.Event()

    async def __call__(self, scope, receive, send) -> None:
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.seen.append({"path": scope["raw_path"], "query": scope["query_string"], "headers": headers})
        while (await receive()).get("more_body"):
            pass
        # `vary: Origin`: vLLM's own CORS layer (no origin allowed) says it on every answer to a page
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream"), (b"set-cookie", b"session=engine-1"), (b"x-engine", b"yes"),
            *([(b"vary", b"Origin")] if "origin" in headers else [])]})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        go = asyncio.ensure_future(self.go.wait())
        gone = asyncio.ensure_future(receive())
        await asyncio.wait([go, gone], return_when=asyncio.FIRST_COMPLETED)
        if gone.done() and gone.result()["type"] == "http.disconnect":
            self.left.set()
            go.cancel()
            return
        gone.cancel()
        await send({"type": "http.response.body", "body": b"data: 2\n\n"})


class Scheduler:
    idle = False

    def __init__(self) -> None:
        self.ended = 0

    async def admit(self, model, prompt_bytes):
        return 1

    def end(self, ticket=None) -> None:
        self.ended += 1

    def progress(self, ticket=None, body=False) -> None:
        pass


async def serve(tmp_path):
    engine = Engine()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(tmp_path / "engine.sock"))
    sock.listen(8)
    sock.setblocking(False)
    served = asgi.Served(engine, sock, idle_timeout_s=5)
    await served.started()
    daemon = SimpleNamespace(plan=SimpleNamespace(spec=SimpleNamespace(env={}, uds=str(tmp_path / "engine.sock")),
                                                  profile=SimpleNamespace(endpoint={})),
                             sup=SimpleNamespace(snapshot=lambda: {"state": EngineState.READY}), scheduler=Scheduler())
    front = Front(daemon)
    await front.listen("127.0.0.1", 0)
    return engine, served, front, daemon, f"http://127.0.0.1:{front._served.sock.getsockname()[1]}"


async def test_requests_pass_through_as_sent_and_the_stream_chunk_by_chunk(tmp_path):
    engine, served, front, daemon, url = await serve(tmp_path)
    try:
        async with httpx.AsyncClient(base_url=url, trust_env=False) as client:
            request = client.build_request("POST", "/v1/completions?q=%20x", content=b'{"prompt": "hi"}',
                                           headers={"X-Client": "a", "Cookie": "mine=1"})
            resp = await client.send(request, stream=True)
            chunks = resp.aiter_raw()
            assert await anext(chunks) == b"data: 1\n\n"  # before the engine made the second: nothing held back
            engine.go.set()
            assert [c async for c in chunks] == [b"data: 2\n\n"]
            assert resp.headers["x-engine"] == "yes" and resp.headers["set-cookie"] == "session=engine-1"
            first = engine.seen[0]
            assert (first["path"], first["query"]) == (b"/v1/completions", b"q=%20x")
            # the client's headers and no other (its Host and Connection are the hop's)
            sent = {k.lower(): v for k, v in request.headers.items() if k.lower() not in ("host", "connection")}
            assert first["headers"] == sent | {"host": "engine"}
        async with httpx.AsyncClient(base_url=url, trust_env=False) as other:
            await other.post("/v1/completions", content=b"{}")
        # the engine's cookie went to the client that got it, never along with another client's request
        assert "cookie" not in engine.seen[1]["headers"]
        assert daemon.scheduler.ended == 2
    finally:
        await front.close()
        await served.close()


async def test_a_client_leaving_mid_stream_closes_its_engine_request(tmp_path):
    engine, served, front, daemon, url = await serve(tmp_path)
    try:
        async with httpx.AsyncClient(base_url=url, trust_env=False) as client:
            async with client.stream("POST", "/v1/completions", content=b"{}") as resp:
                assert await anext(resp.aiter_raw()) == b"data: 1\n\n"
        await asyncio.wait_for(engine.left.wait(), 10)
        assert daemon.scheduler.ended == 1
    finally:
        await front.close()
        await served.close()


async def test_a_client_leaving_while_it_sends_its_body_ends_its_request_quietly(tmp_path):
    engine, served, front, daemon, url = await serve(tmp_path)
    over, raised = asyncio.Event(), []
    serve_one = front._serve

    async def watched(scope, receive, send):  # the app's end, and what it raised (uvicorn would log it as an error)
        try:
            await serve_one(scope, receive, send)
        except BaseException as exc:
            raised.append(exc)
            raise
        finally:
            over.set()

    front._serve = watched
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        writer.write(b'POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{"model"')
        await writer.drain()
        writer.close()
        await asyncio.wait_for(over.wait(), 10)
        assert raised == [] and engine.seen == [] and daemon.scheduler.ended == 0
    finally:
        await front.close()
        await served.close()


async def test_cors_is_answered_at_the_front_by_the_profiles_patterns(tmp_path):
    engine, served, front, daemon, url = await serve(tmp_path)
    daemon.plan.profile.endpoint = {"cors_origins": ("http://localhost:*", "vscode-webview://*")}
    engine.go.set()
    try:
        async with httpx.AsyncClient(base_url=url, trust_env=False) as client:
            async def preflight(origin: str) -> httpx.Response:
                return await client.options("/v1/chat/completions", headers={
                    "Origin": origin, "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "authorization, content-type"})

            ok = await preflight("http://localhost:5173")
            assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://localhost:5173"
            assert ok.headers["access-control-allow-headers"] == "authorization, content-type"
            assert ok.headers["access-control-max-age"] == "600" and "POST" in ok.headers["access-control-allow-methods"]
            for origin in ("https://example.com", "http://localhost.example.com", "null"):
                refused = await preflight(origin)
                assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers, origin
            assert engine.seen == []  # answered by the front: vLLM's own layer would refuse every origin
            # forwarded answers: the allowed origin mirrored, and `Vary: Origin` once (the engine said it too)
            page = await client.post("/v1/completions", content=b"{}", headers={"Origin": "vscode-webview://1a2b"})
            assert page.text == "data: 1\n\ndata: 2\n\n"
            assert page.headers["access-control-allow-origin"] == "vscode-webview://1a2b"
            assert page.headers.get_list("vary") == ["Origin"]
            web = await client.post("/v1/completions", content=b"{}", headers={"Origin": "https://example.com"})
            assert "access-control-allow-origin" not in web.headers and web.headers.get_list("vary") == ["Origin"]
            plain = await client.post("/v1/completions", content=b"{}")
            assert "access-control-allow-origin" not in plain.headers and "vary" not in plain.headers
            # the front's own answers carry them too
            daemon.sup.snapshot = lambda: {"state": EngineState.STARTING}
            own = await client.post("/v1/completions", content=b"{}", headers={"Origin": "http://localhost:8080"})
            assert own.status_code == 503 and own.headers["access-control-allow-origin"] == "http://localhost:8080"
            assert len(engine.seen) == 3
    finally:
        await front.close()
        await served.close()


def test_origin_patterns_take_any_port_or_host_where_they_say_so_and_nothing_else():
    regex = cors.origin_regex(["http://localhost:*", "http://127.0.0.1:*", "vscode-webview://*"])
    allowed = ["http://localhost", "http://localhost:5173", "http://127.0.0.1:65535", "vscode-webview://0abc"]
    refused = ["https://localhost:1", "http://localhost.evil.org", "http://localhost:80/x", "http://evil.org",
               "vscode-webview://a/b", "null", "*"]
    assert all(re.fullmatch(regex, o) for o in allowed)
    assert not any(re.fullmatch(regex, o) for o in refused)
    assert not re.fullmatch(cors.origin_regex([]), "http://localhost")
