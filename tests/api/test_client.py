"""DaemonClient against a mock transport: errors keep their class, unknown keys are kept."""

from __future__ import annotations

import os
import socket

import httpx
import pytest

from exl3local import errors, paths
from exl3local.api import client as api
from exl3local.api.protocol import EngineState


def _client(handler) -> api.DaemonClient:
    return api.DaemonClient("127.0.0.1:9", token="t0k", transport=httpx.MockTransport(handler))


def test_status_parses_and_keeps_unknown_keys():
    c = _client(lambda r: httpx.Response(200, json={"state": "READY", "restarts": 2, "future_key": 1,
                                                    "gpu": {"name": "CPU", "vendor": "cpu", "kind": "cpu", "x": 1}}))
    st = c.status()
    assert st.state == EngineState.READY and st.restarts == 2 and st.gpu.name == "CPU"
    assert st.raw["future_key"] == 1


def test_daemon_errors_come_back_as_the_same_class_with_token_sent():
    seen = {}

    def handler(req):
        seen["token"] = req.headers.get(api.TOKEN_HEADER)
        return httpx.Response(422, json={"error": {"type": "CheckpointError", "message": "m.safetensors: bad",
                                                   "hint": "h", "fields": {"file": "m.safetensors"}}})

    with pytest.raises(errors.CheckpointError) as err:
        _client(handler).up("/m")
    assert err.value.exit_code == 3 and err.value.file == "m.safetensors" and err.value.hint == "h"
    assert seen["token"] == "t0k"


def test_no_daemon_and_a_hung_daemon_are_unavailable():
    with pytest.raises(errors.DaemonUnavailable):
        _client(lambda r: (_ for _ in ()).throw(httpx.ConnectError("refused"))).status()
    with pytest.raises(errors.DaemonUnavailable, match="did not answer"):
        _client(lambda r: (_ for _ in ()).throw(httpx.ReadTimeout("slow"))).status()


def test_wait_ready_raises_gave_up_with_the_tail():
    c = _client(lambda r: httpx.Response(200, json={"state": "FAILED", "last_error": "exited 1",
                                                    "stderr_tail": "ValueError: x", "exit_status": 1}))
    with pytest.raises(errors.EngineGaveUp) as err:
        c.wait_ready(poll_s=0)
    assert "ValueError: x" in str(err.value) and "exited 1" in str(err.value)


def test_wait_ready_outlasts_slow_status_answers_but_not_a_silent_daemon(monkeypatch):
    """A start can keep the machine too busy for one status answer to come in time; that is not a failure."""
    answers = iter([httpx.ReadTimeout("busy"), httpx.ReadTimeout("busy"),
                    httpx.Response(200, json={"state": "READY", "engine_pid": 7})])

    def handler(req):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert _client(handler).wait_ready(poll_s=0).state == EngineState.READY
    monkeypatch.setattr(api, "WAIT_PATIENCE_S", 0.05)
    with pytest.raises(errors.DaemonTooSlow, match="did not answer"):
        _client(lambda r: (_ for _ in ()).throw(httpx.ReadTimeout("hung"))).wait_ready(poll_s=0)


def test_the_engine_log_carries_the_token_and_status_does_not():
    seen = {}

    def handler(req):
        seen[req.url.path] = req.headers.get(api.TOKEN_HEADER)
        if req.url.path == "/api/logs":
            return httpx.Response(200, json={"text": "x", "offset": 1})
        return httpx.Response(200, json={"state": "READY"})

    c = _client(handler)
    c.logs(tail=5)
    c.status()
    assert seen == {"/api/logs": "t0k", "/api/status": None}


def test_the_token_is_not_sent_where_the_users_daemon_does_not_listen(xdg, monkeypatch):
    """A real listener that is not the daemon in our lock file: refused before any byte is sent."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(errors.DaemonUnavailable, match="the API token was not sent") as err:
            api.check_own_daemon(f"http://127.0.0.1:{port}")
        assert "your exl3local daemon is not running" in str(err.value) and f"pid {os.getpid()}" in str(err.value)
        paths.lock_file().write_text(str(os.getpid()))  # "our daemon" is this process, which does listen there
        api.check_own_daemon(f"http://127.0.0.1:{port}")
        paths.lock_file().write_text("1")  # a daemon pid that does not hold the socket
        with pytest.raises(errors.DaemonUnavailable, match=r"your daemon \(pid 1\) does not listen there"):
            api.check_own_daemon(f"http://127.0.0.1:{port}")
