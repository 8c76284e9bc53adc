"""The command line as a new user meets it: --version, help that shows what is in effect, profiles viewed
without pinning and pins that would not run here refused, `list` with nothing pulled, `inspect` errors."""

from __future__ import annotations

import json
import re

import pytest

from exl3local import __version__
from private_user import clean_box, make_box


@pytest.fixture
def box(tmp_path):
    b = make_box(tmp_path)
    b.env["HF_HUB_CACHE"] = str(tmp_path / "hub")  # nothing pulled
    yield b
    clean_box(b)


def test_version_and_help_name_the_environment_in_effect(box):
    out = box.cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"exl3local {__version__}"
    top = box.cli("--help").stdout
    assert f"EXL3LOCAL_HOST=127.0.0.1:{box.daemon_port}\n" in top  # set by the box: no "(default)"
    assert f"EXL3LOCAL_ENGINE_PORT={box.engine_port}\n" in top and "EXL3LOCAL_STALL_TIMEOUT=300 (default)" in top
    up = " ".join(box.cli("up", "--help").stdout.split())
    assert f"(default {box.engine_port}, from EXL3LOCAL_ENGINE_PORT)" in up
    assert f"The daemon listens on 127.0.0.1:{box.daemon_port} (EXL3LOCAL_HOST)" in up
    dash = " ".join(box.cli("dash", "--help").stdout.split())
    assert f"(default 127.0.0.1:{box.daemon_port}, from EXL3LOCAL_HOST)" in dash
    changed = box.cli("--help", EXL3LOCAL_DECODE_ONCE="1").stdout
    assert "EXL3LOCAL_DECODE_ONCE=1\n" in changed


def test_profile_show_views_without_pinning(box):
    shown = box.cli("profile", "b70", "--show")
    assert shown.returncode == 0, shown.stderr
    assert "profile   b70: Arc Pro B70 desktop" in shown.stdout and "this machine serves on cpu" in shown.stdout
    assert "kv_cache_dtype=fp8" in shown.stdout and "(shown only" in shown.stdout
    as_json = json.loads(box.cli("profile", "b70", "--show", "--json").stdout)
    assert as_json["id"] == "b70" and as_json["endpoint"]["cors_origins"][0] == "http://localhost:*"
    assert "active    cpu" in box.cli("profile").stdout  # nothing was pinned


def test_pinning_a_profile_this_machine_cannot_run_is_refused_without_a_terminal_unless_forced(box):
    refused = box.cli("profile", "b70")
    assert refused.returncode != 0
    assert "not pinned: profile b70 is for xpu, and this machine serves on cpu" in refused.stderr
    assert "--force" in refused.stderr and "--show" in refused.stderr
    assert "active    cpu" in box.cli("profile").stdout
    forced = box.cli("profile", "b70", "--force")
    assert forced.returncode == 0 and "active    b70" in forced.stdout
    assert box.cli("profile", "cpu").returncode == 0  # this machine's own backend: no question


def test_list_shows_the_bundled_demo_and_how_to_get_more(box):
    out = box.cli("list")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["NAME", "COMMIT", "BPW", "SIZE", "FITS", "ARCHITECTURE"]
    assert lines[1].startswith("demo (bundled: `up --demo`)") and lines[1].split()[-2:] == ["yes", "LlamaForCausalLM"]
    assert "Nothing pulled yet: `exl3local pull REPO[:REVISION]`" in out.stdout


def test_inspect_names_the_directory_it_looked_in(box):
    empty = box.root / "not-a-model"
    empty.mkdir()
    out = box.cli("inspect", "not-a-model")  # relative to the box's cwd
    assert out.returncode != 0 and f"{empty}/config.json" in out.stderr, out.stderr


def test_a_bare_command_prints_the_help_and_every_option_says_what_it_does(box):
    """Issue 24 item 5: `exl3local` alone was a usage error; `profile --json`, `list --json`, `down` had no help."""
    bare = box.cli()
    assert bare.returncode == 0 and "usage: exl3local" in bare.stdout and "COMMAND" in bare.stdout, bare.stderr
    assert "print the profile as JSON" in box.cli("profile", "--help").stdout
    assert "print the records as JSON" in box.cli("list", "--help").stdout
    assert re.search(r"^ +down +stop the engine and the daemon$", bare.stdout, re.M), bare.stdout
    assert "wait until both are gone" in " ".join(box.cli("down", "--help").stdout.split())


def test_rm_says_the_demo_is_bundled_and_an_unknown_name_is_not_pulled(box):
    demo = box.cli("rm", "demo")
    assert demo.returncode != 0 and "the demo model is bundled in the package, not pulled" in demo.stderr, demo.stderr
    for name in ("nothing", "org/nothing"):
        out = box.cli("rm", name)
        assert out.returncode != 0 and f"{name}: not pulled" in out.stderr and "not a hub repo" not in out.stderr
