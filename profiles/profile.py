"""What a profile is: SCHEMA (every key with its type), DEFAULTS, the Profile record, and
parsing TOML text and `--set section.key=value` overrides into one.

Every key is declared in SCHEMA with its type; an unknown key or a bad value is a ConfigError
naming the file and the key. `--set` overrides go through the same checks.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from exl3local.errors import ConfigError
from exl3local.units import parse_duration, parse_size

ID_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
SECTIONS = ("match", "model", "vllm", "endpoint", "env", "memory")  # the tables of a profile file, in order

def _bool(v: object) -> bool:
    if isinstance(v, bool):
        return v
    raise ValueError(f"expected true or false, got {v!r}")


def _int(lo: int = 0, hi: int = 2**40) -> Callable[[object], int]:
    def check(v: object) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"expected an integer, got {v!r}")
        if not lo <= v <= hi:
            raise ValueError(f"expected {lo}..{hi}, got {v}")
        return v
    return check


def _float(lo: float, hi: float) -> Callable[[object], float]:
    def check(v: object) -> float:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"expected a number, got {v!r}")
        if not lo <= float(v) <= hi:
            raise ValueError(f"expected {lo}..{hi}, got {v}")
        return float(v)
    return check


def _str(v: object) -> str:
    if not isinstance(v, str) or not v or "\x00" in v:
        raise ValueError(f"expected a non-empty string, got {v!r}")
    return v


def _choice(*options: str) -> Callable[[object], str]:
    def check(v: object) -> str:
        if v not in options:
            raise ValueError(f"expected one of {', '.join(options)}, got {v!r}")
        return str(v)
    return check


def _str_list(v: object) -> tuple[str, ...]:
    if not isinstance(v, list):
        raise ValueError(f"expected a list of strings, got {v!r}")
    return tuple(_str(x) for x in v)


def _json_obj(v: object) -> str:
    """vLLM takes --speculative-config as JSON; keep it a TOML table and serialise it here."""
    if not isinstance(v, dict):
        raise ValueError(f"expected a table, got {v!r}")
    return json.dumps(v, sort_keys=True)


def speculative_config(vllm: Mapping[str, Any]) -> dict[str, Any]:
    """A [vllm] table's speculative_config as a table again ({} without one); _json_obj keeps it as JSON."""
    spec = vllm.get("speculative_config")
    return json.loads(spec) if isinstance(spec, str) else dict(spec or {})


def _keep_alive(v: object) -> str:
    seconds = parse_duration(v)
    return "never" if seconds is None else (v if isinstance(v, str) else f"{seconds:g}s")


def _bounded_duration(v: object) -> str:
    seconds = parse_duration(v)
    if seconds is None:
        raise ValueError("must be a duration, not \"never\"")
    return v if isinstance(v, str) else f"{seconds:g}s"


def _origins(v: object) -> tuple[str, ...]:
    """Browser origins allowed to call the endpoint: scheme://host[:port], where the port (or the host after
    a scheme like vscode-webview://) may be `*`. A lone `*` (every web page) is refused."""
    origins = _str_list(v)
    for o in origins:
        if not re.fullmatch(r"[a-z][a-z0-9+.-]*://(\*|[A-Za-z0-9.\[\]:-]+?(:(\*|[0-9]{1,5}))?)", o):
            raise ValueError(f"expected origins like \"http://localhost:*\" or \"https://example.com\", got {o!r}")
    return origins


MODEL_CHOICE_KEYS = {"repo": _str, "revision": _str, "served_name": _str, "weight_bytes": parse_size}


def _model_choices(v: object) -> tuple[dict[str, Any], ...]:
    """[[model.by_memory]] tables: smaller models to serve by default when the default one cannot fit this
    machine's memory, in order of preference; each needs repo and weight_bytes (its weights in memory)."""
    if not isinstance(v, list) or not all(isinstance(t, dict) for t in v):
        raise ValueError(f"expected a list of tables, got {v!r}")
    out = []
    for table in v:
        unknown = set(table) - set(MODEL_CHOICE_KEYS)
        if unknown or not {"repo", "weight_bytes"} <= set(table):
            raise ValueError(f"each entry takes repo, weight_bytes and optionally revision, served_name; got {table!r}")
        out.append({k: MODEL_CHOICE_KEYS[k](x) for k, x in table.items()})
    return tuple(out)


def _pci_ids(v: object) -> tuple[str, ...]:
    ids = _str_list(v)
    for i in ids:
        if not re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{4}", i):
            raise ValueError(f"expected PCI ids like \"8086:e223\" (lower-case hex), got {i!r}")
    return ids


# section → key → checker. vllm keys map to `--key-with-dashes`; booleans are switches.
SCHEMA: dict[str, dict[str, Callable[[object], Any]]] = {
    "": {"description": _str, "backend": _choice("xpu", "cuda", "cpu")},
    "match": {
        "vendor": _choice("intel", "nvidia", "cpu"),
        "kind": _choice("discrete", "integrated", "cpu"),
        "pci_ids": _pci_ids,
        "dmi_product": _str_list,  # case-insensitive substrings of DMI vendor + product
        "priority": _int(0, 1000),
    },
    "model": {
        "repo": _str,  # hub repo of the default model
        "revision": _str,  # branch/commit; `pull` pins it to a commit
        "demo": _bool,  # default model is the tiny one bundled in the package
        "served_name": _str,
        "max_model_len": _int(16, 2**22),
        "weight_bytes": parse_size,  # the default model's weights in memory, to choose by memory before a pull
        "by_memory": _model_choices,
    },
    "vllm": {
        "dtype": _choice("auto", "bfloat16", "float16"),
        "enforce_eager": _bool,
        "kv_cache_dtype": _choice("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"),
        "enable_prefix_caching": _bool,
        "max_num_batched_tokens": _int(16, 2**22),
        "max_num_seqs": _int(1, 4096),
        "block_size": _int(1, 1024),
        "speculative_config": _json_obj,
        "tool_call_parser": _str,
        "reasoning_parser": _str,
        "enable_auto_tool_choice": _bool,
        "attention_backend": _str,
        "language_model_only": _bool,  # multimodal checkpoints: skip the vision tower (less memory, text only)
        "extra_args": _str_list,
    },
    "endpoint": {
        # browser pages allowed to call the OpenAI endpoint (CORS); `*` matches any port, or any host
        # after a non-http scheme such as vscode-webview://
        "cors_origins": _origins,
        # no request for this long: the engine gives its memory back (IDLE) until the next one; "never" keeps it
        "keep_alive": _keep_alive,
        # requests in flight and no byte to any of them for this long (while /health answers): the engine
        # is hung, killed and restarted; long enough for the longest prefill (default 300s)
        "progress_timeout": _keep_alive,
        # a request names another installed model while requests are in flight: they may run this long before
        # the switch; past it the new request gets 503 + Retry-After (default 60s; 0 refuses at once)
        "switch_wait": _bounded_duration,
        # how an idle engine gives memory back: "auto" = vLLM's sleep mode where the backend has it (level 1 on a
        # discrete card, 2 on an iGPU), else a stop; "stop" = always a stop (daemon/unload.py)
        "idle_unload": _choice("auto", "stop"),
        # prompt tokens per second this machine prefills at least: the wait for a request's first byte is
        # progress_timeout + its prompt over this rate (or over a slower rate the endpoint measured)
        "prefill_tokens_per_s": _float(1.0, 1e6),
    },
    "env": {},  # any NAME = "value"; checked by _env_value
    "memory": {
        "policy": _choice("pinned", "utilization"),  # pinned: --kv-cache-memory-bytes from budget.py
        "gpu_memory_utilization": _float(0.05, 0.99),
        "os_reserve_bytes": parse_size,  # left to the OS and desktop (shared-memory machines)
        "engine_overhead_bytes": parse_size,  # runtime, activations, buffers beside weights and KV
        "kv_max_bytes": parse_size,  # cap on the KV cache even when more would fit
        "kv_start_bytes": parse_size,  # a pin proven in the field: the KV grows past it by half the spare headroom
    },
}
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# What a profile that leaves a key out gets.
DEFAULTS: dict[str, dict[str, Any]] = {
    "match": {"priority": 0},
    "model": {"demo": False, "max_model_len": 8192},
    "vllm": {"kv_cache_dtype": "auto", "max_num_seqs": 8, "extra_args": ()},
    # local tools only: editors' webviews and pages served from this machine, never every web page
    "endpoint": {"cors_origins": ("http://localhost:*", "http://127.0.0.1:*", "vscode-webview://*")},
    "memory": {"policy": "pinned", "gpu_memory_utilization": 0.92, "os_reserve_bytes": 2 * 2**30,
               "engine_overhead_bytes": 2 * 2**30},
}


@dataclass(frozen=True)
class Profile:
    id: str
    description: str
    backend: str
    source: str  # the TOML file it came from
    match: Mapping[str, Any] = field(default_factory=dict)
    model: Mapping[str, Any] = field(default_factory=dict)
    vllm: Mapping[str, Any] = field(default_factory=dict)
    endpoint: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    memory: Mapping[str, Any] = field(default_factory=dict)

    def get(self, dotted: str) -> Any:
        section, _, key = dotted.partition(".")
        return getattr(self, section).get(key)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "description": self.description, "backend": self.backend, "source": self.source,
                **{s: dict(getattr(self, s)) for s in SECTIONS}}


def _env_value(source: str, key: str, value: object) -> str:
    if not _ENV_NAME.match(key):
        raise ConfigError(f"{source}: [env] {key!r} is not an environment variable name")
    if not isinstance(value, str | int | float) or isinstance(value, bool):
        raise ConfigError(f"{source}: [env] {key} must be a string, got {value!r}")
    return str(value)


def _check(source: str, section: str, key: str, value: object) -> Any:
    where = f"{section}.{key}" if section else key
    if section == "env":
        return _env_value(source, key, value)
    checker = SCHEMA[section].get(key)
    if checker is None:
        known = ", ".join(sorted(SCHEMA[section])) or "(none)"
        raise ConfigError(f"{source}: unknown key {where!r}", hint=f"keys allowed there: {known}")
    try:
        return checker(value)
    except ValueError as exc:
        raise ConfigError(f"{source}: bad value for {where!r}: {exc}") from None


def parse(text: str, profile_id: str, source: str = "<string>") -> Profile:
    """One profile from TOML text. Raises ConfigError (never another exception) on bad input."""
    if not ID_RE.match(profile_id):
        raise ConfigError(f"{source}: profile id {profile_id!r} must be lower-case letters, digits, - or _")
    try:
        data = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, UnicodeError, ValueError) as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    sections: dict[str, dict[str, Any]] = {s: dict(DEFAULTS.get(s, {})) for s in SCHEMA}
    for key, value in data.items():
        if key in SCHEMA and key:
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: {key!r} must be a table ([{key}]), got {value!r}")
            for sub, sub_value in value.items():
                sections[key][sub] = _check(source, key, sub, sub_value)
        elif key in SCHEMA[""]:
            sections[""][key] = _check(source, "", key, value)
        else:
            known = ", ".join(sorted([*SCHEMA[""], *(f"[{s}]" for s in SCHEMA if s)]))
            raise ConfigError(f"{source}: unknown key {key!r}", hint=f"allowed: {known}")
    for required in ("description", "backend"):
        if required not in sections[""]:
            raise ConfigError(f"{source}: missing key {required!r}")
    model = sections["model"]
    if not model["demo"] and "repo" not in model:
        raise ConfigError(f"{source}: [model] needs `repo` (a hub repository) or `demo = true`")
    return Profile(
        id=profile_id, description=sections[""]["description"], backend=sections[""]["backend"], source=source,
        **{s: MappingProxyType(sections[s]) for s in SECTIONS},
    )


def with_overrides(profile: Profile, overrides: Mapping[str, str], source: str = "--set") -> Profile:
    """`--set section.key=value`: the value is read as TOML (8192, true, "x", 0.9) and, failing
    that, as a plain string; then it meets the same checks as the file."""
    sections = {s: dict(getattr(profile, s)) for s in SECTIONS}
    for dotted, raw in overrides.items():
        section, dot, key = dotted.partition(".")
        if not dot or section not in sections or not key:
            raise ConfigError(f"{source}: {dotted!r} is not section.key",
                              hint=f"sections: {', '.join(sections)}; e.g. --set model.max_model_len=8192")
        try:
            value: object = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        sections[section][key] = _check(source, section, key, value)
    return Profile(id=profile.id, description=profile.description, backend=profile.backend, source=profile.source,
                   **{s: MappingProxyType(v) for s, v in sections.items()})


def parse_overrides(items: list[str] | None) -> dict[str, str]:
    """The repeatable `--set KEY=VALUE` flag into {section.key: raw value} for with_overrides()."""
    out = {}
    for item in items or ():
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--set {item!r}: expected section.key=value", hint="e.g. --set model.max_model_len=8192")
        out[key.strip()] = value.strip()
    return out
