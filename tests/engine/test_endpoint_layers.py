"""The ASGI layers exl3local loads into vLLM's API server (`--middleware`), on a real starlette app stacked as
vLLM stacks them (its own CORS layer, no origin allowed, inside ours): the tools-off 400 (issue 24 item 5) and
the warm-up. The same layers in the real engine: tests/models/test_demo_endpoint.py. CORS is the endpoint's
(daemon/cors.py): tests/daemon/test_forward.py."""

from __future__ import annotations

import asyncio
import dataclasses
from types import MappingProxyType

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.routing import Route

from exl3local import profiles
from exl3local.engine import launch, tools_off
from exl3local.machine import budget

# vLLM 0.32's answer to `tools` without --enable-auto-tool-choice (renderers/online_renderer.py), as it sends it
VLLM_TOOLS_400 = {"error": {"message": '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                            "to be set", "type": "BadRequestError", "param": None, "code": 400}}


async def models(request):
    return JSONResponse({"data": [{"id": "m"}]})


async def chat(request):
    body = await request.json()
    if body.get("tools"):
        return JSONResponse(VLLM_TOOLS_400, status_code=400)
    if body.get("bad"):
        return JSONResponse({"error": {"message": "max_tokens must be at least 1", "code": 400}}, status_code=400)
    return JSONResponse({"choices": []})


def _app(*outer: type) -> Starlette:
    # vLLM adds its CORS layer first, then each --middleware class: the last added runs first
    return Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])],
                     middleware=[*(Middleware(m) for m in reversed(outer)), Middleware(CORSMiddleware, allow_origins=[])])


@pytest.fixture
def client():
    def make(*outer: type) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=_app(*outer)), base_url="http://127.0.0.1")

    return make


async def test_the_tools_off_400_names_exl3locals_switch_and_other_400s_pass(client):
    async with client(tools_off.ToolsOffHint) as c:
        r = await c.post("/v1/chat/completions", json={"tools": [{"type": "function"}]})
        assert r.status_code == 400
        error = r.json()["error"]
        assert "--set vllm.tool_call_parser=NAME" in error["message"] and "--enable-auto-tool-choice" not in error["message"]
        assert error["type"] == "BadRequestError" and int(r.headers["content-length"]) == len(r.content)
        other = await c.post("/v1/chat/completions", json={"bad": True})
        assert other.status_code == 400 and other.json()["error"]["message"] == "max_tokens must be at least 1"
        assert (await c.post("/v1/chat/completions", json={})).status_code == 200


def test_launch_loads_the_tools_off_layer_only_when_tools_are_off_and_the_warm_up_always(tiny_models, tmp_path):
    model = tiny_models["tiny-llama-exl3-4.0bpw"]
    bud = budget.Budget(kv_budget_bytes=1, kv_budget_tokens=1, kv_bytes_per_token=1, max_model_len=512, pinned=True)
    for vllm, tools_off in (({"tool_call_parser": "hermes", "enable_auto_tool_choice": True}, False), ({}, True)):
        prof = dataclasses.replace(profiles.load("cpu"), vllm=MappingProxyType(vllm))
        argv = launch.build(model, prof, bud, port=18123, tmpdir=str(tmp_path), uds="engine.sock", base_env={}).argv
        layers = [argv[i + 1] for i, a in enumerate(argv) if a == "--middleware"]
        assert (launch.TOOLS_OFF_MIDDLEWARE in layers) is tools_off
        assert layers[-1] == launch.WARMUP_MIDDLEWARE


async def test_health_says_200_only_after_one_logprobs_completion_went_through_the_app(monkeypatch):
    """Issue 24 item 3, on a starlette app that checks the key as vLLM does; the real engine (over --uds):
    tests/models/test_demo_endpoint.py."""
    from starlette.responses import PlainTextResponse

    from exl3local.engine import warmup

    monkeypatch.setenv(warmup.API_KEY_ENV, "k-123")
    completions: list[dict] = []
    release = asyncio.Event()

    async def health(request):
        return PlainTextResponse("")

    async def complete(request):
        if request.headers.get("authorization") != "Bearer k-123":
            return JSONResponse({"error": "unauthorized"}, status_code=401)
        completions.append(await request.json())
        await release.wait()  # the first logprobs compile
        return JSONResponse({"choices": [{"text": "x"}]})

    app = Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                            Route("/v1/completions", complete, methods=["POST"])],
                    middleware=[Middleware(warmup.WarmUpBeforeReady)])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as c:
        assert (await c.get("/health")).status_code == 503
        for _ in range(100):
            if completions:
                break
            await asyncio.sleep(0.01)
        assert completions == [{"model": "m", "prompt": "Hello", "max_tokens": 1, "temperature": 0, "logprobs": 1}]
        assert (await c.get("/health")).status_code == 503  # still compiling
        release.set()
        for _ in range(100):
            if (await c.get("/health")).status_code == 200:
                break
            await asyncio.sleep(0.01)
        assert (await c.get("/health")).status_code == 200 and len(completions) == 1
