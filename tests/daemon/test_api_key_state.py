"""Whether the endpoint requires a key, as `up`, `status` and `doctor` tell it (issue 24 items 1 and 5): a real
daemon subprocess with the stand-in engine (the key itself reaching vLLM is tests/models/test_endpoint.py's)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

KEY = "sk-test-0b1e7c"


def _status(box) -> dict:
    out = box.cli("status", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_up_refuses_a_key_the_running_daemon_does_not_have_and_status_says_none(box, tmp_path):
    up = box.cli("up", "--demo")
    assert up.returncode == 0, up.stderr
    st = _status(box)
    assert st["api_key_required"] is False
    assert "API key     none: every program on this machine may use the endpoint" in box.cli("status").stdout
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    again = box.cli("up", "--demo", EXL3LOCAL_API_KEY_FILE=str(key_file))
    assert again.returncode != 0, again.stdout
    assert "was started without an API key" in again.stderr and "exl3local down" in again.stderr, again.stderr
    assert _status(box)["engine_pid"] == st["engine_pid"]  # nothing restarted
    doctor = box.cli("doctor", "--quick", EXL3LOCAL_API_KEY_FILE=str(key_file))
    assert "[warn] api key      the running daemon's endpoint: none" in doctor.stdout, doctor.stdout


def test_a_daemon_started_with_a_key_says_so_and_a_shell_without_one_gets_a_note(box, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o644)
    up = box.cli("up", "--demo", EXL3LOCAL_API_KEY_FILE=str(key_file))
    assert up.returncode == 0, up.stderr
    assert f"the API key file {key_file} is readable by other users (mode -rw-r--r--)" in up.stderr, up.stderr
    assert _status(box)["api_key_required"] is True
    assert "API key     required" in box.cli("status").stdout
    plain = box.cli("up", "--demo")
    assert plain.returncode == 0, plain.stderr
    assert "requires an API key on its endpoint" in plain.stderr, plain.stderr
    assert KEY not in plain.stderr + plain.stdout + box.cli("status", "--json").stdout


def test_a_refused_plan_leaves_no_engine_temp_dir_behind(box, tmp_path):
    # a TMPDIR short enough for vLLM's socket paths, so the engine temp dir would be made in it
    short = Path(tempfile.mkdtemp(prefix="k", dir="/tmp"))
    try:
        up = box.cli("up", "--demo", EXL3LOCAL_API_KEY_FILE=str(tmp_path / "missing-key"), TMPDIR=str(short))
        assert up.returncode != 0 and "cannot read the API key file" in up.stderr, up.stderr
        assert list(short.iterdir()) == []
    finally:
        box.cli("down", TMPDIR=str(short))
        shutil.rmtree(short)
