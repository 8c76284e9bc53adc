"""The daemon API on its default address: a Unix socket, 0600 in the 0700 runtime dir, so the file
system keeps other users off it; the token stays as the second fence. Real daemon processes."""

from __future__ import annotations

import os
import socket
import stat
import threading

import httpx
import psutil
import pytest

from exl3local import errors, paths
from exl3local.api.client import DaemonClient

TINY = "tiny-llama-exl3-4.0bpw"


def test_the_api_listens_on_a_user_only_unix_socket_and_not_on_tcp(box, tiny_models):
    del box.env["EXL3LOCAL_HOST"]  # the default a user gets
    up = box.cli("up", str(tiny_models[TINY]))
    assert up.returncode == 0, up.stderr
    sock = box.runtime / "daemon.sock"
    assert stat.S_ISSOCK(sock.stat().st_mode) and oct(sock.stat().st_mode & 0o777) == "0o600"
    assert oct(box.runtime.stat().st_mode & 0o777) == "0o700"
    daemon = psutil.Process(box.daemon_pid())
    listening = {c.laddr.port for c in daemon.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    assert listening == {box.engine_port}  # the OpenAI endpoint only
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://exl3local") as raw:
        assert raw.get("/api/status").json()["state"] == "READY"
        assert raw.get("/api/logs").status_code == 403  # the token is still asked for
    # all of this short engine log: a health probe that gave up under load leaves a 15-line traceback in the stand-in's
    # log, which pushed "serving on" out of the last 20 lines once (session 9's last full run)
    logs = box.cli("logs", "-n", "500")
    assert logs.returncode == 0 and "serving on" in logs.stdout, logs.stderr
    assert box.cli("down").returncode == 0
    assert not sock.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a socket owned by another user")
def test_the_token_is_not_sent_to_a_socket_of_another_user(xdg):
    paths.token_file().write_text("secret-token")
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(paths.daemon_socket()))
    os.chown(paths.daemon_socket(), 65534, 65534)
    server.listen()
    received: list[bytes] = []

    def accept() -> None:
        server.settimeout(10)
        try:
            conn, _ = server.accept()
        except OSError:
            return
        received.append(conn.recv(65536))
        conn.close()

    thread = threading.Thread(target=accept)
    thread.start()
    try:
        with DaemonClient() as client, pytest.raises(errors.DaemonUnavailable, match="belongs to uid 65534"):
            client.logs(tail=5)
    finally:
        server.close()
        thread.join()
    assert not any(b"secret-token" in r for r in received)
