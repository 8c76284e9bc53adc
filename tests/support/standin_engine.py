"""Stand-in for the vLLM engine in supervisor/daemon tests (style.md §4): run as the engine's
"python" (EXL3LOCAL_ENGINE_PYTHON), it accepts the argv the daemon builds, and:

- STANDIN_MODE=ok (default): prints loading lines, starts a child process in its group that keeps
  stdout open (as vLLM's EngineCore does), then serves /health, /metrics and /v1/models on
  --host/--port. SIGTERM ends it and its child, like vLLM's own handler.
- STANDIN_MODE=crash: prints a traceback tail and exits 1 at start.
- STANDIN_MODE=hang: prints one line, then nothing, and never serves.
Each start appends "pid child_pid" to $STANDIN_LOG, so tests count engines and check for orphans.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

from exl3local.engine import launch


def main() -> None:
    launch._die_with_parent()  # the real launcher's first step: die with the daemon
    argv = sys.argv[1:]
    host = argv[argv.index("--host") + 1]
    port = int(argv[argv.index("--port") + 1])
    mode = os.environ.get("STANDIN_MODE", "ok")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    with open(os.environ["STANDIN_LOG"], "a") as log:
        log.write(f"{os.getpid()} {child.pid}\n")

    def stop(signum, frame):
        child.terminate()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    print("INFO standin: loading weights", flush=True)
    if mode == "crash":
        time.sleep(0.2)
        print("Traceback (most recent call last):\nValueError: boom from stand-in", file=sys.stderr, flush=True)
        child.terminate()
        sys.exit(1)
    if mode == "hang":  # silent, never healthy: the stall timeout must catch it
        time.sleep(3600)
    time.sleep(float(os.environ.get("STANDIN_LOAD_S", "0.3")))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 — http.server's naming
            body = {"/health": b"", "/metrics": b"vllm:num_requests_running{engine=\"0\"} 0.0\n",
                    "/v1/models": b'{"data": [{"id": "standin"}]}'}.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: object) -> None:
            print("INFO standin: request", self.path, flush=True)

    print(f"INFO standin: serving on {host}:{port}", flush=True)
    HTTPServer((host, port), Handler).serve_forever()


if __name__ == "__main__":
    main()
