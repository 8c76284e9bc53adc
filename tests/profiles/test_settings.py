"""The persisted choice (`exl3local profile NAME`, `--set`) and how it ranks against detection."""

from __future__ import annotations

import pytest

from exl3local import paths, profiles
from exl3local.errors import ConfigError
from exl3local.machine import hardware


def test_pinned_profile_wins_over_detection_and_mismatch_is_said(xdg):
    paths.pinned_profile().write_text('{"pinned": "b70", "set": {"vllm.max_num_seqs": "2"}}')
    prof, why = profiles.select(None, {}, hardware.cpu_device(8 * 2**30), "")
    assert prof.id == "b70" and prof.vllm["max_num_seqs"] == 2
    assert "pinned" in why and "this machine serves on cpu" in why
    prof, why = profiles.select("cpu", {"vllm.max_num_seqs": "3"}, hardware.cpu_device(8 * 2**30), "")
    assert prof.id == "cpu" and prof.vllm["max_num_seqs"] == 3 and why.startswith("--profile cpu")


def test_broken_settings_are_config_errors(xdg):
    paths.pinned_profile().write_text('{"pinned": 7}')
    with pytest.raises(ConfigError, match="profile --unpin|expected"):
        profiles.read_settings()
    paths.pinned_profile().write_text("not json")
    with pytest.raises(ConfigError, match="unreadable"):
        profiles.read_settings()
