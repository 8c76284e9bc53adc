"""Stand-in for the vLLM engine in supervisor/daemon tests (style.md §4): run as the engine's
"python" (EXL3LOCAL_ENGINE_PYTHON), it accepts the argv the daemon builds, and:

- STANDIN_MODE=ok (default): prints loading lines, starts a child process in its group that keeps
  stdout open (as vLLM's EngineCore does), then serves /health, /metrics and /v1/models on
  --uds PATH (or --host/--port). SIGTERM ends it and its child, like vLLM's own handler.
  STANDIN_LOAD_S: seconds of "loading" before the port is bound (default 0.3).
  GET /chatty prints 256 KiB before answering: an engine whose output is not drained blocks there.
  GET /hang never answers (requests are served on threads: /health still answers meanwhile).
  POST /v1/completions answers as the served model (the first --served-model-name; 404 in vLLM's shape for
  a `model` it does not serve); with "stream": true, max_tokens SSE events STANDIN_TOKEN_S apart (default
  0.05), then [DONE].
- STANDIN_MODE=crash: prints a traceback tail and exits 1 at start (the same error every start).
- STANDIN_MODE=crash_varying: the same, with another error message on every start.
- STANDIN_MODE=hang: prints one line, then nothing, and never serves.
Like vLLM, every start first binds a Unix socket "$TMPDIR/<uuid4>" (its ZMQ IPC path), so a TMPDIR
too long for a socket path fails the start as it fails vLLM's.
Each start appends "pid child_pid" to $STANDIN_LOG, so tests count engines and check for orphans.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from http.server import BaseHTTPRequestHandler, HTTPServer
from socketserver import ThreadingMixIn

from exl3local.engine import launch


def main() -> None:
    if sys.argv[1:4] == ["-P", "-m", "exl3local.plugin.version"]:  # `up` asks the engine's interpreter: answer as it
        os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
    launch._die_with_parent()  # the real launcher's first step: die with the daemon
    argv = sys.argv[1:]
    uds = argv[argv.index("--uds") + 1] if "--uds" in argv else None  # vLLM's Unix socket, as the daemon asks
    host = None if uds else argv[argv.index("--host") + 1]
    port = None if uds else int(argv[argv.index("--port") + 1])
    mode = os.environ.get("STANDIN_MODE", "ok")
    at = argv.index("--served-model-name") + 1 if "--served-model-name" in argv else len(argv)
    names = list(itertools.takewhile(lambda a: not a.startswith("--"), argv[at:])) or ["standin"]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    with open(os.environ["STANDIN_LOG"], "a") as log:
        log.write(f"{os.getpid()} {child.pid}\n")
    with open(os.environ["STANDIN_LOG"]) as log:
        start_no = len(log.read().splitlines())
    ipc = socket.socket(socket.AF_UNIX)
    try:
        ipc.bind(f"{tempfile.gettempdir()}/{uuid.uuid4()}")  # as vLLM's ipc:// sockets are named
    except OSError as exc:
        print(f"Traceback (most recent call last):\nzmq.error.ZMQError: {exc}", file=sys.stderr, flush=True)
        child.terminate()
        sys.exit(1)

    def stop(signum, frame):
        child.terminate()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    print("INFO standin: loading weights", flush=True)
    if mode in ("crash", "crash_varying"):
        time.sleep(0.2)
        which = f" on start {'abcdefghij'[start_no % 10]}" if mode == "crash_varying" else ""
        print(f"Traceback (most recent call last):\nValueError: boom from stand-in{which}", file=sys.stderr, flush=True)
        child.terminate()
        sys.exit(1)
    if mode == "hang":  # silent, never healthy: the stall timeout must catch it
        time.sleep(3600)
    time.sleep(float(os.environ.get("STANDIN_LOAD_S", "0.3")))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 — http.server's naming
            if self.path == "/hang":  # a request the engine never answers, while /health still does
                time.sleep(3600)
            if self.path == "/chatty":  # 256 KiB: four times a pipe's buffer
                for _ in range(256):
                    print("INFO standin: chatty " + "x" * 1003, flush=True)
            body = {"/health": b"", "/metrics": b"vllm:num_requests_running{engine=\"0\"} 0.0\n",
                    "/v1/models": b'{"data": [{"id": "standin"}]}', "/chatty": b"ok"}.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
            if self.path != "/v1/completions" or body.get("model", names[0]) not in names:
                self.send_response(404)
                self.end_headers()
                self.wfile.write(json.dumps({"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                                       "type": "NotFoundError", "param": "model", "code": 404}}).encode())
                return
            self.send_response(200)
            if not body.get("stream"):
                self.end_headers()
                self.wfile.write(json.dumps({"model": names[0], "choices": [{"text": "standin"}]}).encode())
                return
            self.send_header("content-type", "text/event-stream")
            self.end_headers()
            for i in range(int(body.get("max_tokens", 16))):
                time.sleep(float(os.environ.get("STANDIN_TOKEN_S", "0.05")))
                self.wfile.write(f"data: {json.dumps({'model': names[0], 'choices': [{'text': str(i)}]})}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args: object) -> None:
            print("INFO standin: request", self.path, flush=True)

    if uds:
        class UnixServer(ThreadingMixIn, HTTPServer):
            address_family = socket.AF_UNIX
            daemon_threads = True
            request_queue_size = 2048  # vLLM's (uvicorn's) backlog: a burst of connects waits, not refused (EAGAIN)

            def server_bind(self) -> None:  # no host/port to record
                self.socket.bind(self.server_address)

        Handler.address_string = lambda self: "unix"  # type: ignore[method-assign]
        print(f"INFO standin: serving on {uds}", flush=True)
        UnixServer(uds, Handler).serve_forever()
    print(f"INFO standin: serving on {host}:{port}", flush=True)
    HTTPServer((host, port), Handler).serve_forever()


if __name__ == "__main__":
    main()
