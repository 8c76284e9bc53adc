"""Fuzz the safetensors header reader and manifest.read: malformed input is a CheckpointError, never a crash."""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exl3local import manifest
from exl3local.errors import CheckpointError

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _read_or_refuse(path: Path) -> None:
    try:
        manifest.read(path)
    except CheckpointError as err:
        assert str(err)  # a message that says something


@pytest.fixture(scope="module")
def llama_dir(tiny_models):
    return tiny_models["tiny-llama-exl3-4.0bpw"]


@pytest.fixture()
def workdir(llama_dir):
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "m"
        shutil.copytree(llama_dir, d)
        yield d


@FUZZ
@given(blob=st.binary(max_size=512))
def test_random_bytes_as_safetensors(workdir, blob):
    (workdir / "model.safetensors").write_bytes(blob)
    _read_or_refuse(workdir)


@FUZZ
@given(length=st.integers(0, 2**64 - 1), body=st.binary(max_size=64))
def test_random_header_lengths(workdir, length, body):
    (workdir / "model.safetensors").write_bytes(struct.pack("<Q", length) + body)
    _read_or_refuse(workdir)


@FUZZ
@given(data=st.data())
def test_mutated_real_headers(workdir, llama_dir, data):
    raw = (llama_dir / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    names = sorted(n for n in header if n != "__metadata__")
    for _ in range(data.draw(st.integers(1, 3))):
        name = data.draw(st.sampled_from(names))
        field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", None]))
        if field is None:
            header.pop(name, None)
        elif name in header:
            header[name][field] = data.draw(json_values)
    new = json.dumps(header).encode()
    (workdir / "model.safetensors").write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + length :])
    _read_or_refuse(workdir)


@FUZZ
@given(config=json_values, qconfig=json_values)
def test_random_configs(workdir, config, qconfig):
    (workdir / "config.json").write_text(json.dumps(config))
    (workdir / "quantization_config.json").write_text(json.dumps(qconfig))
    _read_or_refuse(workdir)


@FUZZ
@given(data=st.data())
def test_mutated_real_configs(workdir, llama_dir, data):
    config = json.loads((llama_dir / "config.json").read_text())
    qfile = json.loads((llama_dir / "quantization_config.json").read_text())
    target = data.draw(st.sampled_from(["config", "qcfg", "storage"]))
    if target == "config":
        config[data.draw(st.sampled_from(sorted(config)))] = data.draw(json_values)
    elif target == "qcfg":
        config["quantization_config"][data.draw(st.sampled_from(sorted(config["quantization_config"])))] = data.draw(
            json_values
        )
    else:
        module = data.draw(st.sampled_from(sorted(qfile["tensor_storage"])))
        qfile["tensor_storage"][module] = data.draw(json_values)
    (workdir / "config.json").write_text(json.dumps(config))
    (workdir / "quantization_config.json").write_text(json.dumps(qfile))
    _read_or_refuse(workdir)
