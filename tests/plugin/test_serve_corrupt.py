"""A broken or mismatched EXL3 checkpoint stops vLLM early, with our CheckpointError in its output."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.slow

MODEL = "tiny-llama-exl3-4.0bpw"
FAIL_WITHIN_S = 120  # the API process reads the manifest before any engine process starts


def drop_tensor(path, name):
    tensors = load_file(path / "model.safetensors")
    del tensors[name]
    save_file(tensors, path / "model.safetensors")
    (path / "quantization_config.json").unlink()
    return name


def mismatch_config(path, _):
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 512  # the checkpoint's MLP trellises are 768 wide
    (path / "config.json").write_text(json.dumps(cfg))
    return "model.layers.0.mlp.down_proj.trellis"


@pytest.mark.parametrize(
    ("corrupt", "arg"),
    [(drop_tensor, "model.layers.1.mlp.up_proj.svh"), (mismatch_config, None)],
    ids=["missing-tensor", "config-mismatch"],
)
def test_corrupt_checkpoint_fails_fast_with_checkpoint_error(serve, tiny_copy, corrupt, arg):
    model = tiny_copy(MODEL)
    tensor = corrupt(model, arg)
    server = serve(model, wait=False)
    rc = server.wait_exit(FAIL_WITHIN_S)
    out = server.tail(200_000)
    assert rc != 0
    assert "CheckpointError" in out and tensor in out, out[-4000:]
    assert "Loading weights" not in out  # refused before any weight was read
