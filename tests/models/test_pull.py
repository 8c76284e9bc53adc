"""`exl3local pull/list/rm` with the real huggingface_hub client against the fake hub on 127.0.0.1 (conftest.py)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from exl3local.commands import models as model_commands
from exl3local.models import hub as hub_mod
from exl3local.models import store
from exl3local.errors import BudgetError, CheckpointError, ConfigError, Exl3Error
from exl3local.models.store import ModelRef

TINY = "turboderp-test/tiny-llama-exl3"
PADDED = "turboderp-test/tiny-llama-exl3-padded"  # 27 MB of weights: more than one 10 MiB write chunk
KNOWN = frozenset({"LlamaForCausalLM", "Qwen3MoeForCausalLM"})


def _pull(text: str, **kwargs):
    kwargs.setdefault("architectures", lambda: KNOWN)
    kwargs.setdefault("progress", False)
    return hub_mod.pull(ModelRef.parse(text), **kwargs)


def _cdn_gets(hub) -> list:
    return [e for e in hub.log if e.server == "cdn" and e.method == "GET"]


def _terminal_signals() -> None:
    """Ctrl-C as in a terminal's foreground job: an ignored SIGINT would be inherited through exec (and
    Python keeps it ignored), so a library in this test process that ignores it must not leak into the CLI."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _cli(env: dict[str, str], *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-P", "-m", "exl3local", *args], preexec_fn=_terminal_signals,
        env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs,
    )


# -- REPO[:REVISION] ------------------------------------------------------------------------------


def test_ref_parses_colon_and_at_and_defaults_to_main():
    assert ModelRef.parse("org/m:4.0bpw") == ModelRef("org/m", "4.0bpw")
    assert ModelRef.parse("org/m@2.5bpw") == ModelRef("org/m", "2.5bpw")
    assert ModelRef.parse("org/m") == ModelRef("org/m", "main")
    for bad in ("noslash", "org/m:", "a/b/c", "org/bad name"):
        with pytest.raises(ConfigError):
            ModelRef.parse(bad)


# -- a good pull ------------------------------------------------------------------------------------


def test_pull_pins_the_commit_downloads_each_weight_byte_once_and_records(hub, hub_env, hub_repos):
    model = _pull(f"{TINY}:4.0bpw")
    files = hub_repos.files[TINY]["4.0bpw"]
    commit = hub.repos[TINY]["refs"]["4.0bpw"]
    assert (model.commit, model.bits, model.architecture) == (commit, 4.0, "LlamaForCausalLM")
    snapshot = Path(model.path)
    assert snapshot.name == commit and snapshot.parent.name == "snapshots"
    for name, data in files.items():
        assert (snapshot / name).read_bytes() == data
    weights = len(files["model.safetensors"])
    header_end = 8 + int.from_bytes(files["model.safetensors"][:8], "little")
    assert hub.weight_bytes_sent(TINY) == weights - header_end  # once, no re-download by snapshot_download
    # every request after the first resolve names the commit, never the branch (no moving target)
    resolves = [e.path for e in hub.log if "/resolve/" in e.path]
    assert resolves and all(f"/resolve/{commit}/" in p for p in resolves)
    assert (store.repo_folder(TINY) / "refs" / "4.0bpw").read_text() == commit
    assert [m.name for m in store.records()] == [f"{TINY}:4.0bpw"]
    assert not (store.repo_folder(TINY) / hub_mod.STAGING_DIR).exists()


def test_second_pull_only_resolves_the_revision(hub, hub_env):
    first = _pull(f"{TINY}:4.0bpw")
    hub.log.clear()
    assert _pull(f"{TINY}:4.0bpw") == first
    assert [e.path for e in hub.log if not e.path.startswith("/api/agent")] == [f"/api/models/{TINY}/revision/4.0bpw"]


def test_a_sharded_checkpoint_is_checked_from_every_shard_header_and_pulled(hub, hub_env, hub_repos):
    repo = "turboderp-test/tiny-llama-exl3-sharded"
    files = hub_repos.files[repo]["4.0bpw"]
    model = _pull(f"{repo}:4.0bpw")
    shards = sorted(n for n in files if n.endswith(".safetensors"))
    assert len(shards) == 2
    for name in (*shards, "model.safetensors.index.json"):
        assert (Path(model.path) / name).read_bytes() == files[name]
    header_reads = [e.range for e in _cdn_gets(hub) if (e.range or "").startswith(("bytes=0-7", "bytes=8-"))]
    assert len(header_reads) == 4  # two per shard, before any weight byte
    shard_bytes = sum(len(files[n]) - 8 - int.from_bytes(files[n][:8], "little") for n in shards)
    assert hub.weight_bytes_sent(repo) == shard_bytes  # each shard's weights once


def test_a_private_repo_needs_the_token_and_the_cdn_never_sees_it(hub, hub_env, monkeypatch):
    hub.private["private/tiny-llama-exl3"] = "hf_test_token"
    with pytest.raises(Exl3Error, match="no such repo on the hub \\(or it is private\\)"):
        _pull("private/tiny-llama-exl3")
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")  # huggingface_hub reads it per request
    hub.log.clear()
    assert _pull("private/tiny-llama-exl3").bits == 4.0
    assert all(e.auth for e in hub.log if e.server == "hub" and not e.path.startswith("/api/agent"))
    assert _cdn_gets(hub) and not any(e.auth for e in hub.log if e.server == "cdn")  # signed URL, no token


# -- refusals before download ---------------------------------------------------------------------


def test_non_exl3_repo_is_refused_before_any_safetensors_byte(hub, hub_env):
    with pytest.raises(CheckpointError) as err:
        _pull("other/tiny-llama-bf16")
    assert "exl3" in str(err.value) and "nothing was downloaded" in err.value.hint
    assert _cdn_gets(hub) == []  # not even a header range read
    assert not store.repo_folder("other/tiny-llama-bf16").exists()  # nothing written to the cache


@pytest.mark.parametrize(
    ("repo", "says"),
    [("other/tiny-llama-missing-tensor", ".suh"), ("other/tiny-llama-garbage-header", "JSON")],
)
def test_corrupt_header_is_refused_from_range_reads_alone(hub, hub_env, repo, says):
    with pytest.raises(CheckpointError) as err:
        _pull(repo)
    assert says in str(err.value)
    assert hub.weight_bytes_sent(repo) == 0
    assert all(e.range for e in _cdn_gets(hub))  # header reads only
    assert not store.repo_folder(repo).exists()


def test_architecture_unknown_to_the_installed_vllm_is_refused(hub, hub_env):
    with pytest.raises(CheckpointError) as err:
        _pull("other/tiny-llama-alien-arch", architectures=hub_mod.known_architectures)  # the real registry
    assert "NoSuchModelForCausalLM" in str(err.value)
    assert hub.weight_bytes_sent("other/tiny-llama-alien-arch") == 0


def test_the_architecture_check_asks_the_engines_interpreter_not_the_clis(hub, hub_env, monkeypatch):
    """Issue 24 item 7: the check imported vLLM in the CLI's own interpreter; the engine may run another one
    (EXL3LOCAL_ENGINE_PYTHON). Here that one has no vLLM at all: the pull is refused before any weight byte."""
    base = Path(sys._base_executable)
    if subprocess.run([str(base), "-c", "import vllm"], capture_output=True).returncode == 0:
        pytest.skip(f"{base} has vLLM too")
    monkeypatch.setenv("EXL3LOCAL_ENGINE_PYTHON", str(base))
    with pytest.raises(Exl3Error, match=f"could not list the model classes vLLM knows in the engine's Python {base}"):
        _pull(f"{TINY}:4.0bpw", architectures=hub_mod.known_architectures)
    assert hub.weight_bytes_sent(TINY) == 0 and store.records() == []


def test_fit_check_refuses_and_force_overrides_only_it(hub, hub_env):
    def too_big(manifest):
        raise BudgetError(f"{manifest.architecture} does not fit")

    with pytest.raises(BudgetError):
        _pull(f"{TINY}:4.0bpw", fit_check=too_big)
    assert hub.weight_bytes_sent(TINY) == 0
    with pytest.raises(Exl3Error, match="free"):
        _pull(f"{TINY}:4.0bpw", fit_check=too_big, force=True, free_bytes=lambda path: 1 << 20)
    assert hub.weight_bytes_sent(TINY) == 0
    assert _pull(f"{TINY}:4.0bpw", fit_check=too_big, force=True).bits == 4.0


def test_missing_repo_and_revision_have_clear_errors(hub, hub_env):
    with pytest.raises(Exl3Error, match="no such repo"):
        _pull("nobody/nothing")
    with pytest.raises(Exl3Error, match="no revision '9.0bpw'"):
        _pull(f"{TINY}:9.0bpw")


def test_declined_confirmation_downloads_nothing_and_shows_the_size(hub, hub_env):
    seen = []
    with pytest.raises(Exl3Error, match="declined"):
        _pull(f"{TINY}:4.0bpw", confirm=lambda plan: seen.append(plan.missing_bytes) or False)
    assert seen and seen[0] >= 3_000_000
    assert hub.weight_bytes_sent(TINY) == 0


# -- integrity and resume -------------------------------------------------------------------------


def test_checksum_mismatch_is_detected_deleted_and_not_recorded(hub, hub_env):
    hub.corrupt.add("model.safetensors")
    with pytest.raises(CheckpointError, match="sha256") as err:
        _pull(f"{TINY}:4.0bpw")
    assert "deleted" in err.value.hint
    folder = store.repo_folder(TINY)
    assert store.records() == []
    assert not any((folder / "blobs").glob("*")) and not any((folder / hub_mod.STAGING_DIR).glob("*.part"))
    hub.corrupt.clear()
    assert _pull(f"{TINY}:4.0bpw").bits == 4.0


def _weight_gets(hub) -> list:
    """CDN GETs that are not the two header range reads."""
    return [e for e in _cdn_gets(hub) if not (e.range or "").startswith(("bytes=0-7", "bytes=8-"))]


def test_dropped_connection_resumes_with_a_range_request(hub, hub_env, hub_repos):
    data = hub_repos.files[PADDED]["main"]["model.safetensors"]
    hub.drop_after["model.safetensors"] = 15_000_000
    model = _pull(PADDED)
    # huggingface_hub writes in 10 MiB chunks; the part of a chunk in flight when the connection died is re-sent
    written = 10 << 20
    assert [e.range for e in _weight_gets(hub)] == [None, f"bytes={written}-"]
    assert sum(e.end - e.start for e in _weight_gets(hub)) == len(data) + 15_000_000 - written
    assert (Path(model.path) / "model.safetensors").read_bytes() == data


def test_a_server_that_ignores_the_range_request_gets_a_clean_restart(hub, hub_env, hub_repos):
    data = hub_repos.files[PADDED]["main"]["model.safetensors"]
    staging = store.repo_folder(PADDED) / hub_mod.STAGING_DIR
    staging.mkdir(parents=True)
    (staging / f"{hashlib.sha256(data).hexdigest()}.part").write_bytes(data[:5_000_000])  # a kept partial
    hub.ignore_range.add("model.safetensors")
    model = _pull(PADDED)
    assert [(e.range, e.status) for e in _weight_gets(hub)] == [("bytes=5000000-", 200)]
    assert (Path(model.path) / "model.safetensors").read_bytes() == data  # rewound, re-hashed, verified


def test_interrupted_pull_is_not_listed_and_resumes_after_ctrl_c(hub, hub_env, hub_repos):
    data = hub_repos.files[PADDED]["main"]["model.safetensors"]
    hub.throttle_bps = 2_000_000  # ~14 s for the 27 MB: the Ctrl-C lands mid-download even on a loaded box
    proc = _cli(hub_env, "pull", PADDED, "--quiet")
    # The weights' own .part (named by their sha256, the LFS etag): Ctrl-C lands mid-transfer of them,
    # not during the small files before, whatever the box's load.
    weights_part = store.repo_folder(PADDED) / hub_mod.STAGING_DIR / f"{hashlib.sha256(data).hexdigest()}.part"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (weights_part.exists() and weights_part.stat().st_size > 0):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, f"{stderr}\n(this process's SIGINT handler: {signal.getsignal(signal.SIGINT)})"
    kept = weights_part.stat().st_size
    assert 0 < kept < len(data) and weights_part.read_bytes() == data[:kept]
    assert store.records() == []
    listed = _cli(hub_env, "list").communicate(timeout=60)[0]
    assert PADDED not in listed

    hub.throttle_bps = None
    hub.log.clear()
    model = _pull(PADDED)
    (resumed,) = _weight_gets(hub)
    assert resumed.range == f"bytes={kept}-" and resumed.end - resumed.start == len(data) - kept
    assert (Path(model.path) / "model.safetensors").read_bytes() == data


def test_concurrent_pull_of_the_same_repo_is_refused(hub, hub_env):
    lock = store.repo_folder(TINY) / hub_mod.STAGING_DIR / "pull.lock"
    with hub_mod._locked(lock), pytest.raises(Exl3Error, match="another pull"):
        _pull(f"{TINY}:4.0bpw")


# -- offline, list, rm ------------------------------------------------------------------------------


def test_offline_mode_serves_pulled_models_without_a_request(hub, hub_env, monkeypatch):
    from huggingface_hub import constants

    pulled = _pull(f"{TINY}:4.0bpw")
    hub.log.clear()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert _pull(f"{TINY}:4.0bpw") == pulled
    assert _pull(f"{TINY}:{pulled.commit}") == pulled
    with pytest.raises(Exl3Error, match="HF_HUB_OFFLINE"):
        _pull(f"{TINY}:2.5bpw")
    assert hub.log == []


def test_rm_frees_one_revision_and_keeps_the_other(hub, hub_env):
    four = _pull(f"{TINY}:4.0bpw")
    two = _pull(f"{TINY}:2.5bpw")
    proc = _cli(hub_env, "rm", f"{TINY}:4.0bpw", stdin=subprocess.PIPE)
    out, err = proc.communicate("y\n", timeout=60)
    assert proc.returncode == 0, err
    assert "freed 3.0 MiB" in out  # 4.0bpw weights + configs; the shared tokenizer stays
    assert not Path(four.path).exists() and (Path(two.path) / "model.safetensors").is_file()
    assert not (store.repo_folder(TINY) / "refs" / "4.0bpw").exists()
    assert [m.name for m in store.records()] == [f"{TINY}:2.5bpw"]


def test_rm_asks_and_keeps_on_no(hub, hub_env):
    _pull(f"{TINY}:4.0bpw")
    proc = _cli(hub_env, "rm", TINY, stdin=subprocess.PIPE)
    out, _ = proc.communicate("n\n", timeout=60)
    assert "kept" in out and len(store.records()) == 1


def test_list_shows_name_bpw_and_size(hub, hub_env):
    _pull(f"{TINY}:2.5bpw")
    _pull("turboderp-test/tiny-qwen3moe-exl3:4.0bpw")
    out, err = _cli(hub_env, "list").communicate(timeout=60)
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "COMMIT", "BPW", "SIZE", "FITS", "ARCHITECTURE"], err
    assert lines[1].split()[0::2] == [f"{TINY}:2.5bpw", "2.5", "MiB", "LlamaForCausalLM"]
    assert lines[1].split()[5] == "yes"  # a 3 MB model fits any profile's budget
    assert "Qwen3MoeForCausalLM" in lines[2]
    as_json = json.loads(_cli(hub_env, "list", "--json").communicate(timeout=60)[0])
    assert {(m["revision"], m["fits"]) for m in as_json} == {("2.5bpw", "yes"), ("4.0bpw", "yes")}


# -- up without a model: the profile's default ------------------------------------------------------


@pytest.fixture
def hub_profile(tmp_path, monkeypatch) -> str:
    """A user profile (CPU-matching, like the bundled cpu.toml) whose default model is a fake-hub repo."""
    from importlib import resources

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    folder = tmp_path / "config" / "exl3local" / "profiles"
    folder.mkdir(parents=True)
    cpu = (resources.files("exl3local.profiles") / "cpu.toml").read_text()
    assert "demo = true" in cpu
    (folder / "hubtest.toml").write_text(cpu.replace("demo = true", f'repo = "{TINY}"\nrevision = "4.0bpw"'))
    return "hubtest"


def test_profile_default_is_pulled_after_a_confirmation_that_shows_the_size(hub, hub_env, hub_profile):
    seen = []
    model = hub_mod.ensure_default_model(hub_profile, confirm=lambda plan: seen.append(plan.missing_bytes) or True,
                                          architectures=lambda: KNOWN)  # fmt: skip
    assert model.name == f"{TINY}:4.0bpw" and seen and seen[0] >= 3_000_000
    hub.log.clear()
    assert hub_mod.ensure_default_model(hub_profile, confirm=None) == model  # there: no question, no request
    assert hub.log == []


def test_profile_default_is_never_fetched_without_asking(hub, hub_env, hub_profile):
    with pytest.raises(Exl3Error, match=r"hubtest's default model .* is not pulled \(3\.\d MiB to download\)"):
        hub_mod.ensure_default_model(hub_profile, confirm=None, architectures=lambda: KNOWN)
    assert hub.weight_bytes_sent(TINY) == 0


def test_the_demo_profile_needs_no_pull(hub, hub_env):
    assert hub_mod.ensure_default_model("cpu", confirm=None) is None
    assert hub.log == []


def test_rm_refuses_the_model_the_daemon_serves(hub, hub_env, monkeypatch):
    from exl3local.api.protocol import DaemonStatus

    model = _pull(f"{TINY}:4.0bpw")
    label = f"{model.repo_id}:{model.revision}@{model.commit[:12]}"  # how the daemon names a pulled model

    class Serving:  # DaemonClient's surface that rm uses: a daemon serving this revision
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def __enter__(self) -> Serving:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def status(self) -> DaemonStatus:
            return DaemonStatus.from_json({"state": "READY", "model": label})

    monkeypatch.setattr(model_commands, "DaemonClient", Serving)
    from exl3local import cli

    assert cli.main(["rm", f"{TINY}:4.0bpw", "--yes"]) == ConfigError.exit_code
    assert Path(model.path).is_dir() and store.records() == [model]
