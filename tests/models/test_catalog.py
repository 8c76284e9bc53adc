"""models/catalog.py: what a request's `model` may name. Pulled records come from a fake store listing (the
hub cache layout is store.py's own tests' business); registrations go to a private config dir."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from exl3local import errors
from exl3local.models import catalog, store

TINY = "tiny-llama-exl3-4.0bpw"


def _pulled(repo: str, revision: str, path: Path, at: float) -> store.PulledModel:
    return store.PulledModel(repo, revision, f"{int(at):040d}", str(path), 1, 4.0, 6.0, "LlamaForCausalLM", at)


@pytest.fixture
def pulls(monkeypatch, tmp_path, xdg):
    found: list[store.PulledModel] = []
    monkeypatch.setattr(store, "records", lambda: list(found))
    return found


def test_names_of_pulled_registered_and_demo_models(pulls, tmp_path, tiny_models):
    old, new, other = tmp_path / "old", tmp_path / "new", tmp_path / "other"
    pulls += [_pulled("org/qwen", "4.0bpw", new, 20), _pulled("org/qwen", "4.0bpw", old, 10),
              _pulled("org/llama", "main", other, 5)]
    profile = SimpleNamespace(model={"repo": "org/qwen", "revision": "4.0bpw", "served_name": "qwen"})
    catalog.register("mine", tiny_models[TINY])
    found = {m.name: m for m in catalog.installed(profile)}
    # the profile's default by its served name (REPO:REVISION an alias), the newest pull of a revision only
    assert found["qwen"].aliases == ("org/qwen:4.0bpw",) and found["qwen"].path == new
    assert found["org/llama:main"].up_model == "org/llama:main" and found["org/llama:main"].source == "pulled"
    assert found["mine"].path == tiny_models[TINY].resolve() and found["mine"].up_model == str(found["mine"].path)
    assert found[TINY].source == "demo" and found[TINY].up_model is None and "demo" in found[TINY].aliases
    assert catalog.find("org/qwen:4.0bpw", profile).name == "qwen" and catalog.find("nope", profile) is None
    # without the profile the default has no served name: it is its REPO:REVISION
    assert catalog.find("qwen", None) is None and catalog.find("org/qwen:4.0bpw", None).aliases == ()
    assert catalog.names_for(new, profile) == ("qwen", "org/qwen:4.0bpw")
    assert catalog.names_for(tmp_path / "plain-dir", profile) == ("plain-dir",)  # `up DIR`: the directory's name


def test_register_refuses_taken_names_bad_names_and_non_checkpoints(pulls, tmp_path, tiny_models):
    pulls.append(_pulled("org/llama", "main", tmp_path / "p", 1))
    with pytest.raises(errors.ConfigError, match="already names the pulled model"):
        catalog.register("org/llama:main", tiny_models[TINY])
    with pytest.raises(errors.ConfigError, match="cannot be a model name"):
        catalog.register("has space", tiny_models[TINY])
    with pytest.raises(errors.Exl3Error):
        catalog.register("empty", tmp_path)  # no checkpoint there
    catalog.register("mine", tiny_models[TINY])
    catalog.register("mine", tiny_models[TINY])  # the same name again: moved, not refused
    data = json.loads(catalog._registry().read_text())
    assert list(data) == ["mine"] and (catalog._registry().stat().st_mode & 0o777) == 0o600
    assert catalog.unregister("mine") and not catalog.unregister("mine")
    assert catalog.find("mine", None) is None
