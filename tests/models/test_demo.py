"""The demo model bundled in the package is the tiny fixture, and a valid EXL3 checkpoint."""

from __future__ import annotations

from exl3local import manifest
from exl3local.models import store


def test_demo_model_is_the_tiny_fixture_byte_for_byte(tiny_models):
    fixture = tiny_models["tiny-llama-exl3-4.0bpw"]
    bundled = sorted(p.name for p in store.DEMO_MODEL.iterdir())
    assert bundled == sorted(p.name for p in fixture.iterdir())
    for name in bundled:
        assert (store.DEMO_MODEL / name).read_bytes() == (fixture / name).read_bytes(), name
    assert manifest.read(store.DEMO_MODEL).architecture == "LlamaForCausalLM"
