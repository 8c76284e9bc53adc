"""CPU that `exl3local dash` uses while idle, measured with psutil over a window.

    .venv/bin/python -P bench/dash_idle_cpu.py stub      # the tests' stub daemon, recorded READY status
    .venv/bin/python -P bench/dash_idle_cpu.py nodaemon  # nothing listens: the reconnect loop
    .venv/bin/python -P bench/dash_idle_cpu.py real      # the running daemon (EXL3LOCAL_HOST, else its socket)

The dashboard runs in a real pty (`script`), 120x40, polling once a second; the first 8 s (imports,
first frames) are skipped, then its user+system CPU time is sampled over --window seconds.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
WARMUP_S = 8.0


def serve_stub(port: int) -> None:
    """Child mode: the stub daemon of tests/tui (recorded answers) until killed."""
    sys.path.insert(0, str(REPO / "tests" / "tui"))
    from conftest import StubDaemon  # the tests' stub, so the bench and the tests see the same daemon

    stub = StubDaemon()
    stub.port = port
    stub.start()
    print("ready", flush=True)
    while True:
        time.sleep(3600)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("stub", "nodaemon", "real", "_serve"))
    parser.add_argument("--window", type=float, default=30.0)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    if args.mode == "_serve":
        serve_stub(args.port)
        return
    stub = None
    host = os.environ.get("EXL3LOCAL_HOST")  # unset: the dashboard's own default, the daemon's Unix socket
    if args.mode in ("stub", "nodaemon"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        host = f"127.0.0.1:{port}"
    if args.mode == "stub":
        stub = subprocess.Popen([sys.executable, "-P", __file__, "_serve", "--port", str(port)], stdout=subprocess.PIPE)
        stub.stdout.readline()
    exe = Path(sys.executable).with_name("exl3local")
    dash = subprocess.Popen(
        ["script", "-qfc", f"stty cols 120 rows 40; exec {exe} dash" + (f" --host {host}" if host else ""), "/dev/null"],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env={**os.environ, "TERM": "xterm-256color"}, cwd="/tmp",
    )  # fmt: skip
    try:
        time.sleep(WARMUP_S)
        app = next(p for p in psutil.Process(dash.pid).children(recursive=True) if "dash" in p.cmdline())
        cpu0, t0 = sum(app.cpu_times()[:2]), time.monotonic()
        time.sleep(args.window)
        cpu1, t1 = sum(app.cpu_times()[:2]), time.monotonic()
        load = os.getloadavg()[0]
        print(f"{args.mode}: {100 * (cpu1 - cpu0) / (t1 - t0):.2f}% of one core over {t1 - t0:.0f} s, "
              f"RSS {app.memory_info().rss / 2**20:.0f} MiB (load average {load:.1f} on {os.cpu_count()} CPUs)")
        app.terminate()
    finally:
        dash.terminate()
        if stub is not None:
            stub.terminate()


if __name__ == "__main__":
    main()
