"""What a model argument means (a directory or a hub repo), decided once for `up`, `doctor` and the daemon."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from exl3local.errors import CheckpointError, ConfigError
from exl3local.models import store
from exl3local.models.store import ModelRef


def _profile(**model):
    return SimpleNamespace(model=model)


def test_paths_are_checkpoints_and_the_rest_are_hub_repos(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "model").mkdir()
    assert store.parse_argument("org/model") == Path("org/model")  # it exists here: a directory wins
    assert store.parse_argument("./gone") == Path("./gone")  # spelled as a path, even when missing
    assert store.parse_argument("~/m") == Path("~/m").expanduser()
    assert store.parse_argument("other/model:4.0bpw") == ModelRef("other/model", "4.0bpw")
    assert store.parse_argument("other/model@main") == ModelRef("other/model", "main")
    with pytest.raises(ConfigError, match="not a hub repo"):
        store.parse_argument("justaname")


def test_resolve_gives_the_demo_a_directory_or_a_pulled_revision(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    demo_dir, label = store.resolve(None, False, _profile(demo=True))
    assert demo_dir == store.DEMO_MODEL and demo_dir.is_dir() and label.startswith("demo")
    assert store.resolve(str(tmp_path), True, _profile(repo="org/m"))[0] == store.DEMO_MODEL  # --demo wins
    assert store.resolve(str(tmp_path), False, _profile(demo=True)) == (tmp_path.resolve(), str(tmp_path.resolve()))
    with pytest.raises(CheckpointError, match="no such directory"):
        store.resolve(str(tmp_path / "missing"), False, _profile(demo=True))
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="a checkpoint directory"):
        store.resolve(str(tmp_path / "file"), False, _profile(demo=True))


def test_the_profiles_default_model_must_be_pulled_first(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    profile = _profile(repo="org/model", revision="4.0bpw")
    assert store.default_ref(profile) == ModelRef("org/model", "4.0bpw")
    assert store.default_ref(_profile(repo="org/model")) == ModelRef("org/model", "main")
    assert store.default_ref(_profile(demo=True, repo="org/model")) is None
    with pytest.raises(ConfigError, match=r"org/model:4\.0bpw is not downloaded") as err:
        store.resolve(None, False, profile)
    assert "exl3local pull org/model:4.0bpw" in err.value.hint
