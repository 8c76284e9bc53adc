"""Faults around a serving engine (issues 16, 23), with real daemon and stand-in engine processes, real
signals and sockets: a squatter waiting for the endpoint port, a dead leader, a stopped engine process,
a full disk under engine.log, a TMPDIR too long for vLLM's IPC sockets."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from private_user import pid_alive

TINY = "tiny-llama-exl3-4.0bpw"

# Waits for the port to be free, then listens and answers every GET with 200, as another
# program that grabs a port the moment it is released would. Prints "bound" once it listens.
SQUATTER = """
import http.server, socket, sys, time
port = int(sys.argv[1])
print("waiting", flush=True)
while True:
    try:
        server = http.server.HTTPServer(("127.0.0.1", port), type("H", (http.server.BaseHTTPRequestHandler,), {
            "do_GET": lambda self: (self.send_response(200), self.end_headers()),
            "log_message": lambda self, *a: None}))
        break
    except OSError:
        time.sleep(0.005)
print("bound", flush=True)
server.serve_forever()
"""


@pytest.fixture
def squatter(box):
    procs: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", SQUATTER, str(box.engine_port)], stdout=subprocess.PIPE,
                                text=True)
        procs.append(proc)
        assert proc.stdout.readline() == "waiting\n"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def _never_binds(proc: subprocess.Popen, within_s: float) -> None:
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    with pytest.raises(queue.Empty):
        got = lines.get(timeout=within_s)
        raise AssertionError(f"another process took the endpoint port: {got!r}")


def test_the_endpoint_port_stays_the_daemons_across_an_engine_crash(box, tiny_models, squatter):
    """vLLM listens on a Unix socket in its private temp dir; the daemon holds the endpoint port
    throughout, so a crash never frees it for another program to collect users' prompts."""
    assert box.cli("up", str(tiny_models[TINY])).returncode == 0
    engine = box.wait_status(lambda s: s["state"] == "READY")["engine_pid"]
    other = squatter()
    os.kill(engine, signal.SIGKILL)
    box.wait_status(lambda s: s["state"] == "READY" and s["restarts"] == 1)
    _never_binds(other, within_s=2)
    answer = httpx.post(f"http://127.0.0.1:{box.engine_port}/v1/completions", json={"prompt": "x"}, timeout=30)
    assert answer.status_code == 200 and answer.json()["model"] == TINY  # the restarted engine answered


def test_requests_while_loading_get_503_with_retry_after_from_the_daemon(box, tiny_models, squatter):
    up = box.popen("up", str(tiny_models[TINY]), STANDIN_LOAD_S="600")
    box.wait_status(lambda s: s["state"] == "STARTING" and s["engine_pid"] is not None)
    other = squatter()
    answer = httpx.post(f"http://127.0.0.1:{box.engine_port}/v1/completions", json={"prompt": "x"}, timeout=30)
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
    assert answer.json()["error"]["message"].startswith("the engine is STARTING"), answer.text
    _never_binds(other, within_s=1)
    up.kill()


def test_ready_is_left_the_moment_the_leader_dies(box, tiny_models):
    assert box.cli("up", str(tiny_models[TINY])).returncode == 0
    engine = box.wait_status(lambda s: s["state"] == "READY")["engine_pid"]
    seen: list[dict] = []
    killed = time.monotonic()
    os.kill(engine, signal.SIGKILL)
    box.wait_status(lambda s: seen.append({**s, "t": time.monotonic() - killed}) or s["state"] != "READY")
    stale = [s for s in seen if s["state"] == "READY" and s["engine_pid"] is None]
    assert stale == [], f"READY without an engine for {stale[-1]['t']:.2f} s"
    print(f"left READY {seen[-1]['t']:.2f} s after kill -9 of the leader ({len(seen)} polls)")
    assert seen[-1]["t"] < 5.0  # pidfd: the moment it dies; 5 s of slack for a loaded 2-core box
    box.wait_status(lambda s: s["state"] == "READY" and s["restarts"] == 1)


@pytest.mark.parametrize("which", ["child", "leader"])
def test_stopped_engine_process_is_noticed_and_restarted(box, tiny_models, which):
    """SIGSTOP of an engine process (vLLM's EngineCore is the child; /health still answers then)."""
    assert box.cli("up", str(tiny_models[TINY])).returncode == 0
    box.wait_status(lambda s: s["state"] == "READY")
    leader, child = box.engines()[0]
    stopped_at = time.monotonic()
    os.kill(child if which == "child" else leader, signal.SIGSTOP)
    st = box.wait_status(lambda s: s["state"] != "READY", timeout=60)
    print(f"stopped {which}: left READY after {time.monotonic() - stopped_at:.1f} s")
    assert "stopped" in st["last_error"] and str(child if which == "child" else leader) in st["last_error"], st
    st = box.wait_status(lambda s: s["state"] == "READY" and s["restarts"] == 1, timeout=60)
    print(f"stopped {which}: READY again after {time.monotonic() - stopped_at:.1f} s")
    assert not pid_alive(leader) and not pid_alive(child)  # the stopped group was killed, not left behind


def test_full_disk_under_engine_log_never_blocks_the_engine(box, tiny_models):
    log_dir = Path(box.env["XDG_STATE_HOME"]) / "exl3local" / "log"
    log_dir.mkdir(parents=True, mode=0o700)
    (log_dir / "engine.log").symlink_to("/dev/full")  # every write: ENOSPC, as on a full file system
    up = box.cli("up", str(tiny_models[TINY]))
    assert up.returncode == 0, up.stderr
    engine = f"http://127.0.0.1:{box.engine_port}"
    for _ in range(3):  # 768 KiB of output, 12 pipe buffers: hangs unless it is drained
        assert httpx.get(f"{engine}/chatty", timeout=30).text == "ok"
    assert httpx.get(f"{engine}/health", timeout=30).status_code == 200
    st = box.wait_status(lambda s: s["log_errors"] > 256)
    assert st["state"] == "READY" and st["log_dropped_bytes"] > 3 * 256 * 1024
    assert "No space left on device" in st["log_last_error"]
    down = box.cli("down", timeout=60)
    assert down.returncode == 0, down.stderr


def test_long_tmpdir_still_serves(box, tiny_models, tmp_path):
    long_tmp = tmp_path / ("t" * 70)
    long_tmp.mkdir()
    box.env["TMPDIR"] = str(long_tmp)
    up = box.cli("up", str(tiny_models[TINY]))
    assert up.returncode == 0, up.stderr
    record = json.loads((box.state / "engine.json").read_text())
    assert len(record["tmpdir"]) + 37 <= 107 and oct(os.stat(record["tmpdir"]).st_mode & 0o777) == "0o700"
    assert box.cli("down").returncode == 0
    assert not os.path.exists(record["tmpdir"])
