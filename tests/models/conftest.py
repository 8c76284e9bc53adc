"""Fixtures for the model tests: the fake Hugging Face hub (tests/support/fake_hub.py) with the tiny fixture
models as its repos, and the environment that points huggingface_hub at it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fake_hub import FakeHub
from fake_hub import serve as serve_fake

PADDING_BYTES = 24 << 20  # the padded repo's extra weight bytes (see hub_repos)

@dataclass(frozen=True)
class HubRepos:
    """The repos every test hub serves, built once per session from the tiny fixture models."""

    files: dict[str, dict[str, dict[str, bytes]]]  # repo -> branch -> files


def _model_files(tiny_models: dict[str, Path], name: str) -> dict[str, bytes]:
    root = tiny_models[name]
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.is_file()}


def _safetensors_split(data: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _sharded(files: dict[str, bytes]) -> dict[str, bytes]:
    """The same checkpoint as two shards + model.safetensors.index.json, split by layer as converters do."""
    header, payload = _safetensors_split(files["model.safetensors"])

    def shard_of(tensor: str) -> int:  # embedding and layers 0-1 first; layers 2-3, norm and lm_head second
        if tensor.startswith("model.layers."):
            return int(int(tensor.split(".")[2]) >= 2)
        return int(not tensor.startswith("model.embed_tokens"))

    out = {k: v for k, v in files.items() if k != "model.safetensors"}
    weight_map: dict[str, str] = {}
    for shard in (0, 1):
        name = f"model-0000{shard + 1}-of-00002.safetensors"
        part_header, data = {}, bytearray()
        for tensor in sorted(t for t in header if t != "__metadata__" and shard_of(t) == shard):
            begin, end = header[tensor]["data_offsets"]
            part_header[tensor] = {**header[tensor], "data_offsets": [len(data), len(data) + end - begin]}
            data += payload[begin:end]
            weight_map[tensor] = name
        out[name] = _safetensors_join(part_header, bytes(data))
    index = {"metadata": {"total_size": len(payload)}, "weight_map": weight_map}
    out["model.safetensors.index.json"] = json.dumps(index, indent=2).encode()
    return out


def _safetensors_join(header: dict, payload: bytes) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + payload


@pytest.fixture(scope="session")
def hub_repos(tiny_models: dict[str, Path]) -> HubRepos:
    llama4 = _model_files(tiny_models, "tiny-llama-exl3-4.0bpw")
    llama25 = _model_files(tiny_models, "tiny-llama-exl3-2.5bpw")
    moe = _model_files(tiny_models, "tiny-qwen3moe-exl3-4.0bpw")

    config = json.loads(llama4["config.json"])
    plain = dict(config)
    del plain["quantization_config"]
    bf16 = {k: v for k, v in llama4.items() if k != "quantization_config.json"}
    bf16["config.json"] = json.dumps(plain).encode()

    header, payload = _safetensors_split(llama4["model.safetensors"])
    dropped = next(k for k in header if k.endswith(".suh"))
    missing = dict(llama4)
    missing["model.safetensors"] = _safetensors_join({k: v for k, v in header.items() if k != dropped}, payload)
    garbage = dict(llama4)
    raw = bytearray(llama4["model.safetensors"])
    raw[8:40] = b"\x00{not json at all" + b"!" * 15
    garbage["model.safetensors"] = bytes(raw)

    alien = dict(llama4)
    alien["config.json"] = json.dumps({**config, "architectures": ["NoSuchModelForCausalLM"]}).encode()

    # Weights larger than huggingface_hub's 10 MiB write chunk, so that an interrupted transfer leaves bytes on disk.
    padded = dict(llama4)
    pad = bytes(range(256)) * (PADDING_BYTES // 256)
    padded["model.safetensors"] = _safetensors_join(
        {**header, "model.padding": {"dtype": "U8", "shape": [len(pad)], "data_offsets": [len(payload), len(payload) + len(pad)]}},
        payload + pad,
    )

    readme = {"README.md": b"# tiny-llama-exl3\nOne branch per bit rate.\n", ".gitattributes": b"*.safetensors filter=lfs\n"}
    return HubRepos(
        {
            "turboderp-test/tiny-llama-exl3": {"main": readme, "4.0bpw": llama4, "2.5bpw": llama25},
            "turboderp-test/tiny-qwen3moe-exl3": {"4.0bpw": moe},
            "turboderp-test/tiny-llama-exl3-padded": {"main": padded},
            "turboderp-test/tiny-llama-exl3-sharded": {"4.0bpw": _sharded(llama4)},
            "private/tiny-llama-exl3": {"main": llama4},
            "other/tiny-llama-bf16": {"main": bf16},
            "other/tiny-llama-missing-tensor": {"main": missing},
            "other/tiny-llama-garbage-header": {"main": garbage},
            "other/tiny-llama-alien-arch": {"main": alien},
        }
    )


@pytest.fixture
def hub(hub_repos: HubRepos) -> Iterator[FakeHub]:
    fake = FakeHub()
    for repo_id, branches in hub_repos.files.items():
        for branch, files in branches.items():
            fake.add(repo_id, branch, files)
    hub_server, fake.endpoint = serve_fake(fake, "hub")
    cdn_server, fake.cdn = serve_fake(fake, "cdn")
    yield fake
    for server in (hub_server, cdn_server):
        server.shutdown()
        server.server_close()


@pytest.fixture
def hub_env(hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Point huggingface_hub at the fake hub and a private cache, in this process and for child processes.

    huggingface_hub reads HF_ENDPOINT/HF_HUB_CACHE/HF_HUB_OFFLINE once at import into `constants`, so in-process
    tests patch those attributes too; subprocesses get the environment only, as a user's shell would.
    """
    from huggingface_hub import constants

    env = {
        "HF_ENDPOINT": hub.endpoint,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"),
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", env["HF_HUB_CACHE"])
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return env
