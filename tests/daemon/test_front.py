"""The endpoint the daemon owns (daemon/front.py), with real daemon and stand-in engine processes: the
API key is checked at the front before anything reaches the engine, and the front answers in OpenAI's
error shape when there is no READY engine behind it."""

from __future__ import annotations

import httpx

TINY = "tiny-llama-exl3-4.0bpw"
KEY = "sk-front-3b9d0c"


def test_the_api_key_is_enforced_at_the_front(box, tiny_models, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    box.env["EXL3LOCAL_API_KEY_FILE"] = str(key_file)
    assert box.cli("up", str(tiny_models[TINY])).returncode == 0
    url = f"http://127.0.0.1:{box.engine_port}/v1/models"
    # the stand-in engine checks no key: a refusal can only come from the daemon's front
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
    ok = httpx.get(url, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == TINY  # the front's own list, served first
    # its own answers carry the CORS headers (daemon/cors.py; the profile's default local origins)
    local = httpx.get(url, headers={"Authorization": f"Bearer {KEY}", "Origin": "http://localhost:3000"})
    assert local.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert local.headers.get_list("vary") == ["Origin"]
    web = httpx.get(url, headers={"Authorization": f"Bearer {KEY}", "Origin": "https://example.com"})
    assert web.status_code == 200 and "access-control-allow-origin" not in web.headers
    completion = "http://127.0.0.1:%d/v1/completions" % box.engine_port
    assert httpx.post(completion, json={"prompt": "x"}).status_code == 401
    ok = httpx.post(completion, json={"prompt": "x"}, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.json()["model"] == TINY  # forwarded: the stand-in answered
    assert httpx.get(f"http://127.0.0.1:{box.engine_port}/health").status_code == 200  # open, as in vLLM
    # vLLM's dev routes (a sleeping engine's /sleep, /wake_up, /collective_rpc) are the daemon's, not forwarded:
    # also spelled with a percent-escape or a trailing slash, which the engine's router reads as the same path
    auth = {"Authorization": f"Bearer {KEY}"}
    for path in ("/sleep?level=1", "/%77ake_up", "/collective_rpc/", "/is_sleeping"):
        private = httpx.post(f"http://127.0.0.1:{box.engine_port}{path}", headers=auth)
        assert private.status_code == 404 and "is not served by this endpoint" in private.json()["error"]["message"]
    # a browser's CORS preflight carries no key: the front answers it (the stand-in has no OPTIONS: it would say 501)
    preflight = httpx.options(url, headers={"Origin": "http://localhost:5173", "Access-Control-Request-Method": "GET"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "http://localhost:5173"


def test_a_stopped_engine_is_a_503_in_openai_shape_and_the_port_stays_held(box, tiny_models):
    assert box.cli("up", str(tiny_models[TINY])).returncode == 0
    # forwarded as sent: the path's percent-escapes and the query reach the engine unchanged
    assert httpx.get(f"http://127.0.0.1:{box.engine_port}/v1/a%2Fb?q=%20x").status_code == 404  # the stand-in's
    assert "INFO standin: request /v1/a%2Fb?q=%20x" in box.cli("logs", "-n", "50").stdout
    base = f"http://127.0.0.1:{box.daemon_port}/api"
    assert httpx.post(f"{base}/stop", headers={"X-Exl3local-Token": box.token()}, timeout=60).status_code == 200
    answer = httpx.post(f"http://127.0.0.1:{box.engine_port}/v1/completions", json={"model": TINY, "prompt": "x"})
    assert answer.status_code == 503 and "retry-after" not in answer.headers
    error = answer.json()["error"]
    assert error["message"].startswith("the engine is STOPPED") and error["code"] == 503 and error["type"]
