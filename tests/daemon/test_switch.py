"""Models by name at the endpoint (daemon/scheduler.py, models/catalog.py): a request naming another installed
model switches the engine to it and is answered by it; a switch waits for the streams in flight or refuses with
503 + Retry-After, never cutting them; an unknown name is a 404 naming what is installed; /v1/models lists
every installed model and which one is loaded. Real daemon and stand-in engine processes."""

from __future__ import annotations

import json
import threading
import time

import httpx

TINY_A, TINY_B = "tiny-llama-exl3-4.0bpw", "tiny-llama-exl3-2.5bpw"


def _installed(box, tiny_models) -> None:
    for name, fixture in (("model-a", TINY_A), ("model-b", TINY_B)):
        out = box.cli("register", name, str(tiny_models[fixture]))
        assert out.returncode == 0, out.stderr


class _Stream:
    """A streaming completion read on a thread: `first` is set at its first event, `events` holds them all."""

    def __init__(self, box, model: str, tokens: int) -> None:
        self.events: list[str] = []
        self.first, self.done = threading.Event(), threading.Event()
        self.ended_at = 0.0
        self.stop = False
        url = f"http://127.0.0.1:{box.engine_port}/v1/completions"

        def run() -> None:
            try:
                with httpx.stream("POST", url, json={"model": model, "stream": True, "max_tokens": tokens},
                                  timeout=60) as r:
                    assert r.status_code == 200
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            self.events.append(line[6:])
                            self.first.set()
                        if self.stop:
                            return
            finally:
                self.ended_at = time.monotonic()
                self.done.set()

        threading.Thread(target=run, daemon=True).start()


def _complete(box, model: str) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{box.engine_port}/v1/completions", json={"model": model, "prompt": "x"},
                      timeout=120)


def test_another_installed_model_is_switched_to_after_the_stream_in_flight_ends(box, tiny_models):
    _installed(box, tiny_models)
    up = box.cli("up", "model-a")  # a registered name serves that model
    assert up.returncode == 0, up.stderr
    first = box.wait_status(lambda s: s["state"] == "READY")
    assert first["served_model_name"] == "model-a" and first["model"] == str(tiny_models[TINY_A])
    listed = httpx.get(f"http://127.0.0.1:{box.engine_port}/v1/models").json()["data"]
    rows = {m["id"]: m for m in listed}
    assert listed[0]["id"] == "model-a" and rows["model-a"]["loaded"] and rows["model-a"]["state"] == "READY"
    assert not rows["model-b"]["loaded"] and rows["model-b"]["source"] == "registered"
    assert rows[TINY_A]["source"] == "demo" and "demo" in rows[TINY_A]["aliases"]  # the bundled one
    assert _complete(box, "model-a").json()["model"] == "model-a"

    stream = _Stream(box, "model-a", tokens=120)  # ~6 s of tokens from the stand-in
    assert stream.first.wait(30)
    answer: list[tuple[httpx.Response, float]] = []
    switcher = threading.Thread(target=lambda: answer.append((_complete(box, "model-b"), time.monotonic())))
    switcher.start()
    # while the stream runs, status says what is pending (the dashboard shows the same fields)
    waiting = box.wait_status(lambda s: s["switch_to"] == "model-b" and s["requests_waiting"] == 1)
    assert waiting["state"] == "READY" and waiting["requests_in_flight"] == 1 and not stream.done.is_set()
    assert "switching to model-b once those in flight end" in " ".join(box.cli("status").stdout.split())
    switcher.join(60)
    (switched, answered_at), = answer
    assert stream.done.is_set() and stream.ended_at <= answered_at  # answered after the stream, by the new model
    # the stream was not cut: every token and its end, all from model-a
    assert len(stream.events) == 121 and stream.events[-1] == "[DONE]"
    assert {json.loads(e)["model"] for e in stream.events[:-1]} == {"model-a"}
    assert switched.status_code == 200 and switched.json()["model"] == "model-b", switched.text
    st = box.wait_status(lambda s: s["state"] == "READY")
    assert st["served_model_name"] == "model-b" and st["model"] == str(tiny_models[TINY_B]) and st["switch_to"] is None
    assert len(box.engines()) == 2 and st["engine_pid"] != first["engine_pid"]
    rows = {m["id"]: m for m in httpx.get(f"http://127.0.0.1:{box.engine_port}/v1/models").json()["data"]}
    assert rows["model-b"]["loaded"] and not rows["model-a"]["loaded"] and rows["model-a"]["state"] is None
    one = httpx.get(f"http://127.0.0.1:{box.engine_port}/v1/models/model-a")
    assert one.status_code == 200 and one.json()["id"] == "model-a"

    unknown = _complete(box, "no-such-model")
    error = unknown.json()["error"]
    assert unknown.status_code == 404 and error["type"] == "NotFoundError" and error["param"] == "model"
    assert "`no-such-model` is not installed" in error["message"]
    assert "model-a" in error["message"] and "model-b" in error["message"]
    assert len(box.engines()) == 2  # nothing was loaded for it


def test_a_switch_that_would_cut_a_stream_is_refused_with_503_and_retry_after(box, tiny_models):
    _installed(box, tiny_models)
    assert box.cli("up", "model-a", "--set", "endpoint.switch_wait=1s").returncode == 0
    pid = box.wait_status(lambda s: s["state"] == "READY")["engine_pid"]
    stream = _Stream(box, "model-a", tokens=400)  # ~20 s: longer than the switch may wait
    assert stream.first.wait(30)
    t0 = time.monotonic()
    refused = _complete(box, "model-b")
    waited = time.monotonic() - t0
    assert refused.status_code == 503 and refused.headers["retry-after"] == "5", refused.text
    assert "still running after 1 s" in refused.json()["error"]["message"]
    assert 1 <= waited < 10, waited
    # the stream goes on from the same engine
    seen = len(stream.events)
    box.wait_status(lambda s: len(stream.events) > seen + 5)
    assert not stream.done.is_set() and box.wait_status(lambda s: True)["engine_pid"] == pid
    stream.stop = True  # the client leaves; then nothing holds the switch
    assert stream.done.wait(30)
    switched = _complete(box, "model-b")
    assert switched.status_code == 200 and switched.json()["model"] == "model-b", switched.text
