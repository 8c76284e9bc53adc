"""Keep-alive (daemon/scheduler.py): with no request for the keep-alive time the engine gives its memory
back (IDLE), and the next request through the endpoint starts it again. Real daemon and stand-in engine
processes; the in-flight rule with a fake daemon."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import httpx

from exl3local.api.protocol import EngineState
from exl3local.daemon.scheduler import Scheduler
from exl3local.daemon.unload import STOP

from private_user import pid_alive

TINY = "tiny-llama-exl3-4.0bpw"


def test_an_idle_engine_is_unloaded_and_the_next_request_wakes_it(box, tiny_models):
    up = box.cli("up", str(tiny_models[TINY]), "--set", "endpoint.keep_alive=2s")
    assert up.returncode == 0, up.stderr
    ready = box.wait_status(lambda s: s["state"] == "READY")
    assert ready["keep_alive_s"] == 2
    t0 = time.monotonic()
    idle = box.wait_status(lambda s: s["state"] == "IDLE", timeout=30)
    waited = time.monotonic() - t0
    print(f"IDLE {waited:.1f} s after READY (keep_alive 2 s)")
    assert waited + ready["uptime_s"] >= 1.9  # counted from READY, not from `up` (loading is not idling)
    leader, child = box.engines()[-1]
    assert not pid_alive(leader) and not pid_alive(child) and idle["engine_pid"] is None
    assert idle["idle_freed_bytes"] > 10 * 2**20 and idle["idle_since"] <= time.time()
    assert idle["idle_unload"] == "engine stopped" and "no sleep mode on this backend" in idle["idle_detail"]
    text = box.cli("status").stdout
    assert "IDLE since" in text and "freed; the next request starts it" in text and "unloaded after 2s" in text, text
    # /v1/models is the front's own answer: it lists, and wakes nothing
    listed = httpx.get(f"http://127.0.0.1:{box.engine_port}/v1/models").json()["data"][0]
    assert listed["id"] == TINY and listed["state"] == "IDLE" and not listed["loaded"]
    # the next request starts the same engine again and is answered, not refused
    t0 = time.monotonic()
    answer = httpx.post(f"http://127.0.0.1:{box.engine_port}/v1/completions", json={"model": TINY, "prompt": "x"},
                        timeout=60)
    print(f"woken and answered in {time.monotonic() - t0:.1f} s")
    assert answer.status_code == 200 and answer.json()["model"] == TINY
    st = box.wait_status(lambda s: s["state"] in ("READY", "IDLE"))
    assert len(box.engines()) == 2 and st["restarts"] == 0


def test_a_requests_keep_alive_overrides_the_profiles_and_up_keep_alive_sets_it(box, tiny_models):
    up = box.cli("up", str(tiny_models[TINY]), "--keep-alive", "1h")
    assert up.returncode == 0, up.stderr
    assert box.wait_status(lambda s: s["state"] == "READY")["keep_alive_s"] == 3600
    url = f"http://127.0.0.1:{box.engine_port}/v1/completions"
    bad = httpx.post(url, json={"model": TINY, "prompt": "x", "keep_alive": "soon"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "keep_alive", bad.text
    assert httpx.post(url, json={"model": TINY, "prompt": "x", "keep_alive": "1s"}, timeout=30).status_code == 200
    idle = box.wait_status(lambda s: s["state"] == "IDLE", timeout=30)  # Ollama's field, forwarded unchanged
    assert idle["keep_alive_s"] == 1 and idle["engine_pid"] is None


async def test_no_unload_while_a_request_is_in_flight():
    stopped = []
    clock = SimpleNamespace(now=0.0)

    async def stop():
        stopped.append(True)
        sup.state = EngineState.STOPPED

    sup = SimpleNamespace(state=EngineState.READY, stop=stop, snapshot=lambda: {"engine_pid": None})
    plan = SimpleNamespace(profile=SimpleNamespace(endpoint={"keep_alive": "30s"}), unload=STOP)
    daemon = SimpleNamespace(sup=sup, plan=plan, _lock=asyncio.Lock(), engine_log=SimpleNamespace(mark=print))
    sched = Scheduler(daemon, clock=lambda: clock.now)
    sched.begin()  # a long generation: nothing is sent for longer than the keep-alive
    clock.now = 100.0
    await sched.tick()
    assert stopped == []
    sched.end()
    clock.now = 120.0
    await sched.tick()
    assert stopped == []  # 20 s since the request ended
    clock.now = 131.0
    await sched.tick()
    assert stopped == [True] and sched.idle


def test_requests_that_get_no_byte_while_health_answers_are_a_hang_and_restart(box, tiny_models):
    up = box.cli("up", str(tiny_models[TINY]), "--set", "endpoint.progress_timeout=3s")
    assert up.returncode == 0, up.stderr
    first = box.wait_status(lambda s: s["state"] == "READY")["engine_pid"]
    t0 = time.monotonic()
    stuck = httpx.get(f"http://127.0.0.1:{box.engine_port}/hang", timeout=60)  # /health answers all along
    waited = time.monotonic() - t0
    assert stuck.status_code == 503 and stuck.json()["error"]["code"] == 503, stuck.text
    assert 3 <= waited < 20, waited
    st = box.wait_status(lambda s: s["last_error"] and "no byte" in s["last_error"])
    assert "1 request(s) in flight got no byte for 3 s while /health still answered" in st["last_error"]
    st = box.wait_status(lambda s: s["state"] == "READY" and s["restarts"] == 1)
    print(f"hung request answered 503 after {waited:.1f} s; engine restarted")
    assert st["engine_pid"] != first and not pid_alive(first)


async def test_a_switch_waits_for_requests_in_flight_and_requests_queued_behind_it_do_not_cut_in(monkeypatch):
    """Fake daemon: the order of admissions around a switch, decided by events only."""
    models = {n: SimpleNamespace(name=n, names=(n,), up_model=f"/m/{n}") for n in ("a", "b")}
    monkeypatch.setattr("exl3local.models.catalog.find", lambda name, profile: models.get(name))
    ups: list[str] = []

    async def up(req):
        ups.append(req.model)
        daemon.plan = SimpleNamespace(names=(req.model.rsplit("/", 1)[1],), profile=daemon.plan.profile)

    sup = SimpleNamespace(state=EngineState.READY, ready_since=None, snapshot=lambda: {"engine_pid": None})
    profile = SimpleNamespace(endpoint={"switch_wait": "60s"})
    daemon = SimpleNamespace(sup=sup, plan=SimpleNamespace(names=("a",), profile=profile), _lock=asyncio.Lock(),
                             engine_log=SimpleNamespace(mark=lambda text: None), last_request=None, up=up)
    sched = Scheduler(daemon)
    await sched.admit("a")  # served: in flight at once
    assert sched.in_flight == 1
    async def until(pred) -> None:  # the catalogue is read on a worker thread: wait for the state, not a time
        for _ in range(1000):
            if pred():
                return
            await asyncio.sleep(0.005)
        raise AssertionError("never happened")

    to_b = asyncio.ensure_future(sched.admit("b"))
    await until(lambda: sched.switch_to == "b")
    back_to_a = asyncio.ensure_future(sched.admit("a"))  # the served model, but queued behind the pending switch
    await until(lambda: sched.waiting == 2)
    for _ in range(5):
        await asyncio.sleep(0)
    assert ups == [] and not to_b.done() and not back_to_a.done() and sched.in_flight == 1
    sched.end()  # the request in flight ends: the switch goes on
    await to_b
    assert ups == ["/m/b"] and sched.in_flight == 1  # b's request was admitted before a's could switch back
    await until(lambda: sched.switch_to == "a")
    assert not back_to_a.done()  # a waits for b's request, as b waited for a's
    sched.end()
    await back_to_a
    assert ups == ["/m/b", "/m/a"] and sched.in_flight == 1 and sched.waiting == 0
