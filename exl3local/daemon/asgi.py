"""uvicorn inside the daemon's own event loop, for its two listeners (the API and the endpoint): on a
socket the daemon bound itself, without uvicorn's signal handling (the daemon owns SIGTERM/SIGINT),
its access log, its proxy-headers middleware (no proxy stands in front of either listener), or a
connection that may stay silent forever."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEADER_BYTES = 16 * 1024  # request line + headers still incomplete past this: 400, connection closed


class _ArmedOnConnect:
    """uvicorn's keep-alive timer also armed on a new connection: uvicorn arms it only after an
    answer, so a client that connects and sends nothing would hold the connection forever."""

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self.timeout_keep_alive_task = self.loop.call_later(  # type: ignore[attr-defined]
            self.timeout_keep_alive, self.timeout_keep_alive_handler)  # type: ignore[attr-defined]


class _Protocol(_ArmedOnConnect, H11Protocol):
    """h11 (pure Python): the API's protocol, whose requests are few."""


class FastProtocol(_ArmedOnConnect, HttpToolsProtocol):
    """httptools (llhttp, in C): the endpoint's protocol, which parses every client request and writes
    every streamed chunk."""


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Served:
    """One app served on one bound, listening socket until close()."""

    def __init__(self, app: Any, sock: socket.socket, *, idle_timeout_s: float, own_headers: bool = True,
                 http: Any = _Protocol) -> None:
        """own_headers=False: no Server/Date headers of ours (the endpoint passes vLLM's on unchanged).
        http: uvicorn's protocol class (FastProtocol for the endpoint)."""
        config = uvicorn.Config(app, http=http, interface="asgi3", lifespan="off", access_log=False, log_config=None,
                                server_header=own_headers, date_header=own_headers, proxy_headers=False,
                                timeout_keep_alive=max(int(idle_timeout_s), 1),
                                h11_max_incomplete_event_size=MAX_HEADER_BYTES, timeout_graceful_shutdown=2)
        self.sock = sock
        self.server = _Server(config)
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]))

    async def started(self) -> None:
        while not self.server.started and not self.task.done():
            await asyncio.sleep(0.01)
        if self.task.done():
            self.task.result()  # its error, if it failed to start

    async def close(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await self.task
        self.sock.close()


def tcp_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port; OSError when it is taken."""
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted sockets only for that protocol number, and
    # without it Nagle holds an answer's body behind its headers until the client's delayed ACK (~40 ms)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are fine
        sock.bind((host, port))
        sock.listen(512)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock
