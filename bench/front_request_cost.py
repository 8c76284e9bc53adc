"""The endpoint's own CPU per forwarded request (daemon/front.py), in one process: what a burst of new requests
queues behind on the daemon's loop (issue 23: at concurrency 8 the last request of a burst starts the others'
cost late).

    cd /tmp && /work/main/.venv/bin/python -P /work/main/bench/front_request_cost.py [--requests 2000] [--tokens 1]
        [--step-ms 0] [--concurrency 1 8] [--profile [tottime|cumulative]]

The real Front (uvicorn + httptools, uvloop, as the daemon runs it) with a stand-in daemon around it (no
scheduler work, a READY engine), forwarding to an engine in another process that is served the way vLLM is
(uvicorn, httptools, keep-alive on a Unix socket) and streams `--tokens` SSE events at once, or one per
`--step-ms` (each then a read of its own at the front, as vLLM's are). Clients are threads
of this process with keep-alive connections (http.client). Per request: the CPU time of the loop's thread alone
(the clients' threads and the engine are not in it) over the requests; at --tokens 1 that is the request's fixed
cost, most of it before its first byte (one event and the end follow). At concurrency 1 it also gives the loop's
CPU from a request's arrival at the app to its first body byte sent (uvicorn's parse before that is not in it).
--profile: cProfile (CPU time) of the loop's thread over one more run, the top functions. The front of another
commit: `git archive COMMIT exl3local | tar -x -C DIR` and PYTHONPATH=DIR.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import http.client
import os
import pstats
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import uvloop

BODY = b'{"model": "m", "prompt": "def fibonacci(n):", "max_tokens": 1, "stream": true}'


def engine(uds: str, tokens: int, step_ms: float) -> None:
    """The engine process: vLLM's server stack (uvicorn with httptools on a Unix socket), no model."""
    import uvicorn

    event = b'data: {"choices": [{"text": "x"}]}\n\n'

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for _ in range(tokens):
            if step_ms:  # one event per engine step, as vLLM writes them: each a read of its own at the front
                await asyncio.sleep(step_ms / 1000)
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    uvicorn.run(app, uds=uds, http="httptools", loop="uvloop", log_level="warning", access_log=False,
                timeout_keep_alive=60)


def client(port: int, n: int, barrier: threading.Barrier, firsts: list[float]) -> None:
    """n requests one after another on one keep-alive connection, each round starting at the barrier."""
    conn = http.client.HTTPConnection("127.0.0.1", port)
    for _ in range(n):
        barrier.wait()
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", BODY, {"content-type": "application/json"})
        resp = conn.getresponse()
        resp.read(1)
        firsts.append(time.perf_counter() - t0)
        resp.read()
        assert resp.status == 200, resp.status
    conn.close()


def timed(app, spent: list[float]):
    """The endpoint's app, noting the loop thread's CPU from a request's arrival at the app to its first body
    byte sent (alone on the loop at concurrency 1: at more, other requests' work falls in between)."""
    async def app_timed(scope, receive, send):
        t0, first = time.thread_time(), True

        async def send_timed(message):
            nonlocal first
            if first and message["type"] == "http.response.body":
                first = False
                spent.append(time.thread_time() - t0)
            await send(message)
        await app(scope, receive, send_timed)
    return app_timed


def thread_ticks() -> tuple[int, int]:
    """(user, system) clock ticks of the calling thread so far (/proc): how much of its CPU is the kernel's."""
    with open(f"/proc/self/task/{threading.get_native_id()}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])


async def run(front_port: int, requests: int, c: int, profile: cProfile.Profile | None
              ) -> tuple[float, list[float], float]:
    """(loop-thread CPU ms per request, each request's time to its first body byte, the kernel's share of that CPU)."""
    barrier = threading.Barrier(c)
    firsts: list[float] = []
    threads = [threading.Thread(target=client, args=(front_port, requests // c, barrier, firsts)) for _ in range(c)]
    cpu0, ticks0 = time.thread_time(), thread_ticks()
    if profile:
        profile.enable()
    for t in threads:
        t.start()
    await asyncio.to_thread(lambda: [t.join() for t in threads])
    if profile:
        profile.disable()
    user, system = (b - a for a, b in zip(ticks0, thread_ticks()))
    return 1000 * (time.thread_time() - cpu0) / (requests // c * c), firsts, system / max(user + system, 1)


async def main_async(args: argparse.Namespace, uds: str) -> None:
    from exl3local.api.protocol import EngineState
    from exl3local.daemon.front import Front

    class Scheduler:
        idle = False

        async def admit(self, model, prompt_bytes):
            return 1

        def end(self, ticket=None):
            pass

        def progress(self, ticket=None, body=False):
            pass

    daemon = SimpleNamespace(plan=SimpleNamespace(spec=SimpleNamespace(env={}, uds=uds),
                                                  profile=SimpleNamespace(endpoint={})),
                             sup=SimpleNamespace(snapshot=lambda: {"state": EngineState.READY}), scheduler=Scheduler())
    front = Front(daemon)
    spent: list[float] = []
    front.app = timed(front.app, spent)  # type: ignore[method-assign]
    await front.listen("127.0.0.1", 0)
    port = front._served.sock.getsockname()[1]
    try:
        for c in args.concurrency:
            await run(port, min(50 * c, args.requests), c, None)  # warm: connections to the front and the engine
            spent.clear()
            ms, firsts, kernel = await run(port, args.requests, c, None)
            print(f"concurrency {c}: {ms:.3f} ms of the loop's CPU per request ({args.requests} requests, "
                  f"{args.tokens} SSE events each, {100 * kernel:.0f} % of it in the kernel); first byte p50 "
                  f"{1000 * statistics.median(firsts):.2f} ms" +
                  (f"; app entry to first body byte p50 {1000 * statistics.median(spent):.3f} ms CPU" if c == 1 else ""))
            if args.profile:
                prof = cProfile.Profile(time.thread_time)  # CPU, not wall: a thread a write wakes may take the core
                await run(port, args.requests, c, prof)
                pstats.Stats(prof).sort_stats(args.profile).print_stats(30)
    finally:
        await front.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--step-ms", type=float, default=0.0,
                    help="the engine sends one event per step of this length (0: all at once)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--profile", nargs="?", const="tottime", choices=["tottime", "cumulative"],
                    help="cProfile of the loop thread over one more run, sorted so")
    ap.add_argument("--engine", help=argparse.SUPPRESS)  # the engine process's own entry: its socket path
    args = ap.parse_args()
    if args.engine:
        engine(args.engine, args.tokens, args.step_ms)
        return
    with tempfile.TemporaryDirectory(prefix="exl3f-") as tmp:
        uds = str(Path(tmp) / "engine.sock")
        proc = subprocess.Popen([sys.executable, "-P", __file__, "--engine", uds, "--tokens", str(args.tokens),
                                 "--step-ms", str(args.step_ms)])
        try:
            while True:  # until the engine accepts
                try:
                    with socket.socket(socket.AF_UNIX) as s:
                        s.connect(uds)
                    break
                except OSError:
                    if proc.poll() is not None:
                        sys.exit("the engine process died")
                    time.sleep(0.05)
            print(f"load average {os.getloadavg()[0]:.1f}")
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runner.run(main_async(args, uds))
            print(f"load average {os.getloadavg()[0]:.1f}")
        finally:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
