"""Profiles: every bundled file loads; bad files and --set values are refused, naming file and key."""

from __future__ import annotations

import pytest

from exl3local import profiles, units
from exl3local.errors import ConfigError

MINIMAL = 'description = "x"\nbackend = "cpu"\n[model]\ndemo = true\n'


def test_bundled_profiles_load_with_their_recipes():
    assert {"b70", "claw8", "140v", "xpu", "cuda", "cpu"} <= set(profiles.names())
    b70 = profiles.load("b70")
    assert b70.vllm["kv_cache_dtype"] == "fp8" and b70.vllm["enable_prefix_caching"]
    assert b70.vllm["max_num_batched_tokens"] == 4096
    assert '"num_speculative_tokens": 3' in b70.vllm["speculative_config"]
    # parsers follow the served model (engine.model_fit), never the machine
    for name in profiles.names():
        assert not {"tool_call_parser", "reasoning_parser", "enable_auto_tool_choice"} & set(profiles.load(name).vllm)
    assert b70.model["repo"].endswith("Qwen3.8-27B-exl3") and b70.model["revision"] == "4.00bpw"
    claw = profiles.load("claw8")
    assert claw.memory["policy"] == "pinned" and claw.vllm["enforce_eager"]
    assert claw.model["repo"].endswith("Qwen3.5-35B-A3B-exl3") and claw.model["revision"] == "3.09bpw"
    # the field run that ended the OOM kills pinned 512 MiB of KV: the claw starts there (issue 20 item 7)
    assert claw.memory["kv_start_bytes"] == 512 * 2**20 and claw.vllm["max_num_batched_tokens"] <= 4096
    assert b70.env["ZE_FLAT_DEVICE_HIERARCHY"] == "COMPOSITE"  # as the working B70 compose file
    lnl = profiles.load("140v")
    assert lnl.model["by_memory"][0]["repo"].startswith("turboderp/Qwen3.5-") and lnl.model["weight_bytes"] > \
        lnl.model["by_memory"][0]["weight_bytes"]
    assert profiles.load("cpu").model["demo"] is True


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (MINIMAL + "[vllm]\nmax_num_seq = 4\n", ["vllm.max_num_seq", "unknown"]),
        (MINIMAL + "colour = 1\n", ["colour", "unknown"]),
        (MINIMAL + "[memory]\nos_reserve_bytes = \"lots\"\n", ["memory.os_reserve_bytes", "lots"]),
        (MINIMAL + "[vllm]\nmax_num_seqs = true\n", ["vllm.max_num_seqs", "integer"]),
        (MINIMAL + "[memory]\ngpu_memory_utilization = 1.5\n", ["gpu_memory_utilization", "1.5"]),
        (MINIMAL.replace('"cpu"', '"rocm"'), ["backend", "rocm"]),
        ('description = "x"\nbackend = "cpu"\n', ["repo"]),
        (MINIMAL + "[env]\n\"BAD NAME\" = \"1\"\n", ["BAD NAME"]),
        (MINIMAL + "[endpoint]\ncors_origins = [\"*\"]\n", ["endpoint.cors_origins", "'*'"]),
        (MINIMAL + "[endpoint]\ncors_origins = [\"localhost:3000\"]\n", ["endpoint.cors_origins", "localhost:3000"]),
        ("vllm = 3\n" + MINIMAL, ["vllm", "table"]),
        ("description = ", ["not valid TOML"]),
    ],
)
def test_bad_profile_is_refused_naming_file_and_key(text, words):
    with pytest.raises(ConfigError) as err:
        profiles.parse(text, "mine", "/home/me/.config/exl3local/profiles/mine.toml")
    message = str(err.value)
    assert "mine.toml" in message
    for word in words:
        assert word in message


def test_set_overrides_are_typed_and_checked():
    prof = profiles.with_overrides(profiles.load("cpu"), {"model.max_model_len": "2048", "vllm.enforce_eager": "false",
                                                          "memory.kv_max_bytes": "512MiB", "env.FOO": "bar"})
    assert prof.model["max_model_len"] == 2048 and prof.vllm["enforce_eager"] is False
    assert prof.memory["kv_max_bytes"] == 512 * 2**20 and prof.env["FOO"] == "bar"
    with pytest.raises(ConfigError, match="vllm.max_num_seqs"):
        profiles.with_overrides(prof, {"vllm.max_num_seqs": "many"})
    with pytest.raises(ConfigError, match="section.key"):
        profiles.with_overrides(prof, {"max_model_len": "1"})


def test_user_profile_shadows_bundled_one(tmp_path):
    (tmp_path / "cpu.toml").write_text(MINIMAL.replace('"x"', '"my cpu"'))
    assert profiles.load("cpu", dirs=[tmp_path, profiles.BUNDLED]).description == "my cpu"
    with pytest.raises(ConfigError, match="no profile named 'gone'"):
        profiles.load("gone", dirs=[tmp_path])


@pytest.mark.parametrize(("text", "expected"), [("4GiB", 4 * 2**30), ("512MiB", 512 * 2**20), ("3GB", 3 * 10**9),
                                                 (1024, 1024), ("1.5GiB", 3 * 2**29)])
def test_sizes(text, expected):
    assert units.parse_size(text) == expected


def test_cors_origins_default_to_local_pages_and_a_profile_or_set_changes_them():
    assert profiles.load("cpu").endpoint["cors_origins"] == ("http://localhost:*", "http://127.0.0.1:*",
                                                             "vscode-webview://*")
    own = profiles.parse(MINIMAL + '[endpoint]\ncors_origins = ["https://chat.example.org", "http://[::1]:*"]\n', "x")
    assert own.endpoint["cors_origins"] == ("https://chat.example.org", "http://[::1]:*")
    none = profiles.with_overrides(profiles.load("cpu"), {"endpoint.cors_origins": "[]"})
    assert none.endpoint["cors_origins"] == ()
