"""Fixtures for the plugin tests: EXL3 configs over the tiny fixtures, and real vLLM servers.

A served model costs ~25 s and ~2 GiB, so each test module that needs one shares it through a
module-scoped fixture, and modules stop their server before the next one starts.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from exl3local.engine import launch

from engine_env import IN_PROCESS_ENGINE
from oracle import OracleMatch, vocab_size
from private_user import free_port
from torchvision_stand_in import torchvision_stand_in

READY_TIMEOUT_S = 300  # a cold first start of a new architecture adds a registry subprocess (~10 s)
KV_BYTES = "64M"
MAX_MODEL_LEN = 256


class Server:
    """vLLM's OpenAI server for one checkpoint, started through exl3local's launcher module."""

    def __init__(
        self, model: Path, log: Path, trace_dir: Path, extra_env: dict[str, str] | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        self.model = model
        self.name = model.name
        self.port = free_port()
        self.log = log
        self.trace_dir = trace_dir
        self.tmpdir = tempfile.mkdtemp(prefix="exl3-vllm-")
        vocab = vocab_size(model)
        self.vocab_size = vocab
        self.argv = [
            sys.executable, "-P", "-m", "exl3local.engine.launch", "serve", str(model),
            "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", self.name,
            "--quantization", "exl3", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
            "--kv-cache-memory-bytes", KV_BYTES, "--max-logprobs", str(vocab),
        ]  # fmt: skip
        self.argv += extra_args or []
        if not launch.has_chat_template(model):  # as the daemon does: a plain ChatML for base models
            self.argv += ["--chat-template", str(launch.FALLBACK_CHAT_TEMPLATE)]
        self.env = {
            **os.environ,
            "VLLM_PLUGINS": "exl3",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TMPDIR": self.tmpdir,
            "EXL3LOCAL_TRACE_DIR": str(trace_dir),
            "EXL3LOCAL_TRACE_PATHS": "1",
            "TORCHDYNAMO_DISABLE": "1",  # an eager CPU engine, as engine.launch starts one: no sampler compile
            **(extra_env or {}),
        }
        if "--tensor-parallel-size" not in self.argv:
            self.env = {**IN_PROCESS_ENGINE, **self.env}
        self.proc: subprocess.Popen | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Server:
        self._out = self.log.open("wb")
        self.proc = subprocess.Popen(
            self.argv, env=self.env, cwd=self.tmpdir, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self

    def wait_ready(self) -> Server:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM not ready after {READY_TIMEOUT_S} s:\n{self.tail()}")

    def wait_exit(self, timeout_s: float) -> int:
        return self.proc.wait(timeout=timeout_s)

    def tail(self, size: int = 8000) -> str:
        self._out.flush()
        return self.log.read_bytes()[-size:].decode(errors="replace")

    def stop(self) -> None:
        if self.proc is None or self._out.closed:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._out.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def post(self, path: str, body: dict) -> dict:
        r = httpx.post(f"{self.base}{path}", json={"model": self.name, **body}, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory):
    """Start one server per (module, model); returns a function model_dir -> ready Server."""
    started: list[Server] = []

    def start(
        model: Path, extra_env: dict[str, str] | None = None, extra_args: list[str] | None = None, wait: bool = True
    ) -> Server:
        root = tmp_path_factory.mktemp(f"serve-{model.name}")
        server = Server(model, root / "vllm.log", root / "trace", extra_env, extra_args).start()
        started.append(server)
        return server.wait_ready() if wait else server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def tiny_copy(tmp_path_factory: pytest.TempPathFactory, tiny_models):
    """A writable copy of a tiny model, to corrupt."""

    def copy(name: str) -> Path:
        dst = tmp_path_factory.mktemp("copy") / name
        shutil.copytree(tiny_models[name], dst)
        return dst

    return copy


@pytest.fixture(scope="session")
def oracle_match_cls() -> type[OracleMatch]:
    return OracleMatch


@pytest.fixture(scope="session")
def vllm_dist():
    """vLLM's process groups for world size 1 (gloo), so layers can be built in the test process."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    from exl3local.plugin import register

    register()
    # The CPU model runner swaps this no-op in too: with no accelerator, vLLM's loader would fail on it.
    torch.accelerator.empty_cache = lambda *args, **kwargs: None
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{free_port()}", backend="gloo"
        )
        initialize_model_parallel(1, 1)
    yield


@pytest.fixture(scope="module")
def load_vllm_model(vllm_dist):
    """model_dir -> vLLM's model object, built and loaded in this process as the CPU worker does."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model

    def load(model_dir: Path, **kwargs):
        args = EngineArgs(
            model=str(model_dir), quantization="exl3", enforce_eager=True, max_model_len=MAX_MODEL_LEN,
            kv_cache_memory_bytes=64 * 2**20, **kwargs,
        )  # fmt: skip
        with torchvision_stand_in():  # Qwen3.5 model code imports torchvision (here and in vLLM's inspect subprocess)
            vllm_config = args.create_engine_config()
            with set_current_vllm_config(vllm_config):
                return get_model(vllm_config=vllm_config)

    return load


@pytest.fixture(scope="module", autouse=True)
def _trace_dir(tmp_path_factory: pytest.TempPathFactory):
    """Counters written by in-process tests land in a temp dir, not the user's runtime dir (module
    scope: the variable is restored before other test directories run)."""
    path = tmp_path_factory.mktemp("kernel-paths")
    old = os.environ.get("EXL3LOCAL_TRACE_DIR")
    os.environ["EXL3LOCAL_TRACE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("EXL3LOCAL_TRACE_DIR", None)
    else:
        os.environ["EXL3LOCAL_TRACE_DIR"] = old
