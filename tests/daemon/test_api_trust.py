"""The daemon API trusts no one else (issue 16): the engine log needs the token, the token never
goes to a listener that is not the user's own daemon, odd input gets short 4xx answers, and
half-open connections are closed. Real daemon processes and raw sockets."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from private_user import free_port

TINY = "tiny-llama-exl3-4.0bpw"
TOKEN = "X-Exl3local-Token"

# Answers every request like a daemon would (200, JSON) and prints each request's headers, as a
# program that took the daemon's port (another user's) could.
IMPOSTOR = """
import http.server, json, sys

class H(http.server.BaseHTTPRequestHandler):
    def _answer(self):
        print(json.dumps({"path": self.path, "headers": dict(self.headers)}), flush=True)
        body = json.dumps({"ok": True, "daemon_pid": 1, "version": "0", "api_version": 1, "state": "READY",
                           "endpoint": "http://evil.example/v1", "text": "", "offset": 0}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    do_GET = do_POST = _answer
    def log_message(self, *a): pass

server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
print("bound", flush=True)
server.serve_forever()
"""


def _impostor(port: int) -> subprocess.Popen:
    """As another user (nobody, with the system Python it may run) when the tests run as root;
    else as this user: the check is on the listener's pid, so a same-user impostor is refused the
    same way."""
    if os.geteuid() == 0 and os.access("/usr/bin/python3", os.X_OK):
        python, drop = "/usr/bin/python3", (lambda: os.setuid(65534))
    else:
        python, drop = sys.executable, None
    proc = subprocess.Popen([python, "-c", IMPOSTOR, str(port)], stdout=subprocess.PIPE, text=True, cwd="/",
                            preexec_fn=drop)  # noqa: PLW1509 — setuid only, before exec
    assert proc.stdout.readline() == "bound\n"
    return proc


@pytest.fixture
def served(box, tiny_models):
    assert box.cli("up", str(tiny_models[TINY])).returncode == 0
    return box


def test_engine_log_needs_the_token(served):
    base = f"http://127.0.0.1:{served.daemon_port}/api"
    assert httpx.get(f"{base}/logs").status_code == 403
    assert httpx.get(f"{base}/logs?tail=5", headers={TOKEN: "wrong"}).status_code == 403
    ok = httpx.get(f"{base}/logs?tail=50", headers={TOKEN: served.token()})
    assert ok.status_code == 200 and "serving on" in ok.json()["text"]
    logs = served.cli("logs", "-n", "50")  # the client sends the token itself
    assert logs.returncode == 0 and "serving on" in logs.stdout, logs.stderr
    assert httpx.get(f"{base}/status").status_code == 200  # status stays open


def test_token_is_never_sent_to_a_listener_that_is_not_the_users_daemon(served):
    other = free_port()
    impostor = _impostor(other)
    try:
        # the CLI pointed at the impostor's address, with the real daemon's token in the runtime dir
        down = served.cli("down", EXL3LOCAL_HOST=f"127.0.0.1:{other}")
        up = served.cli("up", "--demo", EXL3LOCAL_HOST=f"127.0.0.1:{other}")
    finally:
        impostor.kill()
    seen = [json.loads(line) for line in impostor.communicate()[0].splitlines()]
    assert any(r["path"] == "/api/health" for r in seen)  # it was asked, so it could have been told
    assert all(TOKEN.lower() not in {k.lower() for k in r["headers"]} for r in seen), seen
    assert up.returncode == 8 and "not by your exl3local daemon" in up.stderr, up.stdout + up.stderr
    assert f"pid {impostor.pid}" in up.stderr and "the API token was not sent" in up.stderr
    assert down.returncode != 0 or "not running" in down.stdout, down.stdout + down.stderr
    assert served.wait_status(lambda s: True)["state"] == "READY"  # the real daemon was not stopped


def _raw(port: int, data: bytes, timeout: float = 30.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_odd_input_gets_short_4xx_answers(served, tmp_path):
    base = f"http://127.0.0.1:{served.daemon_port}/api"
    auth = {TOKEN: served.token()}
    huge_name = httpx.post(f"{base}/up", json={"model": "m" * 900_000}, headers=auth)
    assert huge_name.status_code == 400 and len(huge_name.content) < 1000, huge_name.content[:300]
    long_component = httpx.post(f"{base}/up", json={"model": "/x/" + "m" * 300}, headers=auth)
    assert long_component.status_code == 400 and "255" in long_component.json()["error"]["message"]
    deep = httpx.post(f"{base}/up", content=b"[" * 100_000 + b"]" * 100_000, headers=auth)
    assert deep.status_code == 400 and deep.json()["error"]["type"] == "ConfigError"
    demo_no = httpx.post(f"{base}/up", json={"demo": "no"}, headers=auth)
    assert demo_no.status_code == 400 and "`demo` must be true or false" in demo_no.json()["error"]["message"]
    unknown = httpx.post(f"{base}/up", json={"modle": "x"}, headers=auth)
    assert unknown.status_code == 400 and "modle" in unknown.json()["error"]["message"]
    big = httpx.post(f"{base}/up", content=b"x" * (50 * 2**20), headers=auth, timeout=60)
    assert big.status_code == 413
    # headers past 16 KiB and still not complete: refused before the rest arrives
    header = _raw(served.daemon_port, b"GET /api/status HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40_000)
    assert header.startswith(b"HTTP/1.1 400 "), header[:200]
    garbage = _raw(served.daemon_port, b"\x16\x03\x01 not http at all\r\n\r\n")
    assert garbage.startswith(b"HTTP/1.1 400 "), garbage[:200]
    # the engine still serves, and no line the daemon logged quotes the 900 KB name
    assert served.wait_status(lambda s: True)["state"] == "READY"
    daemon_log = Path(served.env["XDG_STATE_HOME"]) / "exl3local" / "log" / "daemon.log"
    assert max(map(len, daemon_log.read_text().splitlines())) < 2100
    engine_log = Path(served.env["XDG_STATE_HOME"]) / "exl3local" / "log" / "engine.log"
    assert max(map(len, engine_log.read_text().splitlines())) < 2100


def test_half_open_connections_are_closed_after_the_idle_timeout(box, tiny_models):
    box.env["EXL3LOCAL_API_IDLE_TIMEOUT"] = "2"
    assert box.cli("up", str(tiny_models[TINY])).returncode == 0
    t0 = time.monotonic()
    silent = _raw(box.daemon_port, b"", timeout=60)  # connects, sends nothing
    partial = _raw(box.daemon_port, b"POST /api/up HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                   + f"{TOKEN}: {box.token()}\r\n\r\n{{".encode(), timeout=60)
    waited = time.monotonic() - t0
    assert silent == b"" and partial.startswith(b"HTTP/1.1 408 "), (silent, partial[:200])
    assert waited < 50  # closed by the daemon (2 s each), not by this test's 60 s socket timeout
    # keep-alive between requests still works within the timeout
    with httpx.Client() as client:
        for _ in range(3):
            assert client.get(f"http://127.0.0.1:{box.daemon_port}/api/health").status_code == 200


def test_daemon_log_keeps_no_http_client_request_lines(served):
    """Each /api/metrics makes the daemon scrape vLLM with httpx; its INFO line per request filled daemon.log."""
    for _ in range(5):
        assert httpx.get(f"http://127.0.0.1:{served.daemon_port}/api/metrics").status_code == 200
    daemon_log = Path(served.env["XDG_STATE_HOME"]) / "exl3local" / "log" / "daemon.log"
    text = daemon_log.read_text()
    assert "listening on" in text and "HTTP Request:" not in text
