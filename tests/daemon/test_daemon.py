"""The daemon as users run it: `exl3local up/status/down/logs` in subprocesses, with the stand-in
engine. Real vLLM end to end is in test_e2e_vllm.py."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time

import httpx
import pytest

from private_user import free_port, pid_alive

TINY = "tiny-llama-exl3-4.0bpw"


def _status(box) -> dict:
    out = box.cli("status", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _wait(box, pred, timeout: float = 30.0) -> dict:
    return box.wait_status(pred, timeout)


def test_up_serves_restarts_after_kill9_and_down_leaves_nothing(box, tiny_models):
    up = box.cli("up", str(tiny_models[TINY]))
    assert up.returncode == 0, up.stderr
    assert f"http://127.0.0.1:{box.engine_port}/v1" in up.stdout

    st = _status(box)
    for key in ("state", "model", "profile", "endpoint", "engine_pid", "restarts", "kv_budget_bytes",
                "kv_budget_tokens", "uptime_s", "stderr_tail", "gpu"):
        assert key in st
    assert st["state"] == "READY" and st["profile"] == "cpu" and st["restarts"] == 0
    assert st["kv_budget_bytes"] == 8 * 4096 * 2048 and st["kv_budget_tokens"] == 8 * 4096
    assert httpx.get(f"http://127.0.0.1:{box.engine_port}/health").status_code == 200
    text = box.cli("status").stdout
    assert "READY" in text and "tokens" in text and st["endpoint"] in text

    first = st["engine_pid"]
    os.kill(first, signal.SIGKILL)
    st = _wait(box, lambda s: s["state"] == "READY" and s["restarts"] == 1)
    assert st["engine_pid"] != first and st["exit_status"] == -9
    assert httpx.post(f"http://127.0.0.1:{box.engine_port}/v1/completions", json={"prompt": "x"}).status_code == 200
    (old_leader, old_child), _ = box.engines()
    assert not pid_alive(old_child)  # the killed leader's group was swept

    assert "serving on" in box.cli("logs").stdout

    down = box.cli("down")
    assert down.returncode == 0, down.stderr
    assert not any(pid_alive(p) for pair in box.engines() for p in pair)
    assert list(box.tmp.iterdir()) == []  # private TMPDIRs removed
    assert sorted(p.name for p in box.runtime.iterdir()) == ["daemon.lock"]  # token gone; the lock file stays, empty
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT of our own requests
        s.bind(("127.0.0.1", box.engine_port))  # nothing listens there any more
    assert box.cli("status").returncode == 8  # DaemonUnavailable


def test_deterministic_start_error_fails_after_two_starts_with_the_exception_first(box, tiny_models):
    up = box.cli("up", str(tiny_models[TINY]), STANDIN_MODE="crash")
    assert up.returncode == 7, up.stdout + up.stderr  # EngineGaveUp
    assert len(box.engines()) == 2  # the same exception twice: no third start
    error = up.stderr[up.stderr.index("exl3local: error:"):]
    assert error.splitlines()[0] == "exl3local: error: ValueError: boom from stand-in", error
    assert "the same error on 2 starts in a row" in error and len(error.splitlines()) < 40
    st = _status(box)  # the daemon keeps answering
    assert st["state"] == "FAILED" and st["restarts"] == 1 and st["engine_pid"] is None
    assert st["last_error"].splitlines()[0] == "ValueError: boom from stand-in"
    assert "ValueError: boom from stand-in" in st["stderr_tail"]
    assert "boom from stand-in" in box.cli("status").stdout


def test_engine_that_crashes_differently_each_start_gives_up_after_three(box, tiny_models):
    up = box.cli("up", str(tiny_models[TINY]), STANDIN_MODE="crash_varying")
    assert up.returncode == 7, up.stdout + up.stderr
    assert "gave up after 3" in up.stderr and len(box.engines()) == 3
    st = _status(box)
    assert st["state"] == "FAILED" and st["restarts"] == 2
    assert st["last_error"].startswith("ValueError: boom from stand-in on start")


def test_backoff_is_visible_between_crashes(box, tiny_models):
    proc = box.popen("up", str(tiny_models[TINY]), STANDIN_MODE="crash")
    st = _wait(box, lambda s: s["state"] in ("BACKOFF", "FAILED"), timeout=60)
    assert st["state"] == "BACKOFF" and st["retry_in_s"] is not None and st["last_error"]
    proc.communicate(timeout=60)


def test_two_ups_at_once_start_one_daemon_and_one_engine(box, tiny_models):
    procs = [box.popen("up", str(tiny_models[TINY])) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert len(box.engines()) == 1
    assert _status(box)["restarts"] == 0


def test_taken_port_is_refused_naming_the_port(box, tiny_models):
    with socket.socket() as s:
        s.bind(("127.0.0.1", box.engine_port))
        s.listen()
        up = box.cli("up", str(tiny_models[TINY]))
    assert up.returncode == 2 and f"port {box.engine_port}" in up.stderr and f"pid {os.getpid()}" in up.stderr
    assert "Traceback" not in up.stderr
    assert box.engines() == []


def test_second_up_on_another_port_moves_the_engine(box, tiny_models):
    assert box.cli("up", str(tiny_models[TINY])).returncode == 0
    port = free_port()
    up = box.cli("up", str(tiny_models[TINY]), "--port", str(port))
    assert up.returncode == 0, up.stderr
    assert _status(box)["endpoint"] == f"http://127.0.0.1:{port}/v1"
    first, second = box.engines()
    assert not pid_alive(first[0]) and pid_alive(second[0])
    # a bare `up` keeps what is served (not the profile's default demo), without a restart
    assert box.cli("up").returncode == 0
    st = _status(box)
    assert st["endpoint"] == f"http://127.0.0.1:{port}/v1" and st["model"] == str(tiny_models[TINY])
    assert len(box.engines()) == 2


@pytest.mark.parametrize("damage", ["not_exl3", "corrupt_header"])
def test_bad_checkpoint_is_refused_before_any_engine_starts(box, tiny_models, tmp_path, damage):
    model = tmp_path / "model"
    model.mkdir()
    src = tiny_models[TINY]
    for f in src.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    if damage == "not_exl3":
        cfg = json.loads((model / "config.json").read_text())
        del cfg["quantization_config"]
        (model / "config.json").write_text(json.dumps(cfg))
        (model / "quantization_config.json").unlink()
    else:
        data = bytearray((model / "model.safetensors").read_bytes())
        data[8:40] = b"{" * 32
        (model / "model.safetensors").write_bytes(bytes(data))
    up = box.cli("up", str(model))
    assert up.returncode == 3, up.stderr  # CheckpointError
    assert str(model / ("config.json" if damage == "not_exl3" else "model.safetensors")) in up.stderr
    assert "Traceback" not in up.stderr
    assert box.engines() == []


def test_killed_daemon_takes_its_engine_along_and_the_next_up_works(box, tiny_models):
    assert box.cli("up", str(tiny_models[TINY])).returncode == 0
    daemon = box.daemon_pid()
    os.kill(daemon, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while any(pid_alive(p) for pair in box.engines() for p in pair):
        assert time.monotonic() < deadline, "engine outlived its daemon"
        time.sleep(0.1)
    assert box.cli("up", str(tiny_models[TINY])).returncode == 0  # the kernel released the lock
    assert _status(box)["state"] == "READY"


def test_api_refuses_mutations_without_the_token(box, tiny_models):
    assert box.cli("up", str(tiny_models[TINY])).returncode == 0
    base = f"http://127.0.0.1:{box.daemon_port}/api"
    assert httpx.post(f"{base}/shutdown").status_code == 403
    assert httpx.get(f"{base}/metrics").text.startswith("vllm:num_requests_running")
    assert httpx.get(f"{base}/nope").status_code == 404
    kernels = httpx.get(f"{base}/kernels").json()
    assert kernels["processes"] == 0 and {p["path"] for p in kernels["paths"]} >= {"gemv", "reference"}
    assert httpx.get(f"{base}/status").json()["system_memory_total_bytes"] > 0
    token = (box.runtime / "api.token").read_text()
    assert oct((box.runtime / "api.token").stat().st_mode & 0o777) == "0o600"
    r = httpx.post(f"{base}/up", content=b"{not json", headers={"X-Exl3local-Token": token})
    assert r.status_code == 400 and r.json()["error"]["type"] == "ConfigError"


def test_demo_and_profile_pin(box):
    assert box.cli("profile", "claw8", "--force").returncode == 0  # not this machine's backend: pinned anyway
    shown = box.cli("profile").stdout
    assert "active    claw8" in shown and "detected  cpu" in shown
    bad = box.cli("profile", "--set", "vllm.max_num_seqs=lots")
    assert bad.returncode == 2 and "vllm.max_num_seqs" in bad.stderr
    assert box.cli("profile", "--unpin").returncode == 0
    up = box.cli("up", "--demo")
    assert up.returncode == 0, up.stderr
    assert _status(box)["model"].startswith("demo")


def test_up_foreground_serves_until_interrupted(box, tiny_models):
    proc = box.popen("up", str(tiny_models[TINY]), "--foreground")
    st = _wait(box, lambda s: s["state"] == "READY")
    engine = st["engine_pid"]
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "OpenAI endpoint" in out
    assert not pid_alive(engine) and list(box.tmp.iterdir()) == []


def test_doctor_quick_reports_cpu_fit_and_port(box):
    out = box.cli("doctor", "--quick")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no GPU found" in out.stdout and "fits: KV" in out.stdout and f"127.0.0.1:{box.engine_port} is free" in out.stdout
    with socket.socket() as s:
        s.bind(("127.0.0.1", box.engine_port))
        s.listen()
        assert "is in use" in box.cli("doctor", "--quick").stdout


def test_logs_without_a_daemon_read_the_file(box, tiny_models):
    assert box.cli("up", str(tiny_models[TINY]), STANDIN_MODE="crash").returncode == 7
    assert box.cli("down").returncode == 0
    out = box.cli("logs", "-n", "50")
    assert out.returncode == 0 and "boom from stand-in" in out.stdout


def test_taken_daemon_port_is_reported_by_up(box, tiny_models):
    with socket.socket() as s:
        s.bind(("127.0.0.1", box.daemon_port))  # bound, not listening: connect fails, bind fails
        up = box.cli("up", str(tiny_models[TINY]))
    assert up.returncode == 1 and f"127.0.0.1:{box.daemon_port}" in up.stderr, up.stderr
    assert "Traceback" not in up.stderr and box.engines() == []


def test_silent_engine_hits_the_stall_timeout_and_fails(box, tiny_models):
    up = box.cli("up", str(tiny_models[TINY]), STANDIN_MODE="hang", EXL3LOCAL_STALL_TIMEOUT="1")
    assert up.returncode == 7 and "no output and no /health for 1 s" in up.stderr, up.stderr
    # Counted from the daemon's own marks: on a busy machine a stand-in can be ended within its first second,
    # before it logged its start.
    leaders = [int(pid) for pid in re.findall(r"engine started, pid (\d+)", (box.state / "log" / "engine.log").read_text())]
    assert len(leaders) == 3
    assert not any(pid_alive(p) for p in leaders)  # each hung group was ended
    assert not any(pid_alive(p) for pair in box.engines() for p in pair)


def test_bare_up_keeps_the_served_model_without_fetching_the_profile_default(box, tiny_models):
    assert box.cli("profile", "b70", "--force").returncode == 0  # its default is a hub model, not pulled here
    assert box.cli("up", str(tiny_models[TINY])).returncode == 0
    up = box.cli("up")  # no terminal, offline: fetching the default would be refused
    assert up.returncode == 0, up.stderr
    assert _status(box)["model"] == str(tiny_models[TINY]) and len(box.engines()) == 1
