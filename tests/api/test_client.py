"""DaemonClient against a mock transport: errors keep their class, unknown keys are kept."""

from __future__ import annotations

import httpx
import pytest

from exl3local import errors
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
