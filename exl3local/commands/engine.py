"""CLI subcommands for the engine: up, down, status, logs, and `daemon` (run one in this process).

They talk to a running daemon only through the API client; `daemon` and `up --foreground` run the
daemon itself in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from typing import TYPE_CHECKING, Any

import psutil

from exl3local import env, paths, profiles
from exl3local.api import lognoise
from exl3local.api.client import DaemonClient
from exl3local.api.protocol import DaemonStatus, EngineState, UpRequest
from exl3local.commands.progress import UpProgress
from exl3local.commands.selftest import kernel_notes
from exl3local.desktop import service
from exl3local.engine import apikey
from exl3local.errors import ConfigError, DaemonUnavailable, Exl3Error
from exl3local.models import catalog, hub, store
from exl3local.units import format_bytes, format_duration

if TYPE_CHECKING:
    from exl3local.daemon.server import Daemon

DAEMON_START_TIMEOUT_S = 20.0
DOWN_TIMEOUT_S = 30.0


# ---- up ---------------------------------------------------------------------------------------


def _resolve_model_arg(model: str | None) -> str | None:
    """Local paths go to the daemon as absolute paths (its cwd differs); a hub repo that is
    not pulled yet is pulled here first, with the pull's own checks and progress."""
    if model is None:
        return None
    if catalog.find(model, None) is not None:  # an installed model's name: the daemon's plan resolves it
        return model
    target = store.parse_argument(model)
    if not isinstance(target, store.ModelRef):
        return str(target.resolve())
    if store.find(target) is None:
        hub.pull(target, confirm=_confirm_download if sys.stdin.isatty() else None)
    return str(target)


def _confirm_download(plan: Any) -> bool:
    answer = input(f"Download {plan.ref} ({format_bytes(plan.missing_bytes)} to fetch)? [Y/n] ")
    return answer.strip().lower() in ("", "y", "yes")


def ensure_daemon(client: Any) -> None:
    """Heartbeat, else start `exl3local daemon` detached and wait for it. Two racing `up`s may
    both spawn one: the lock lets one live, and both then talk to it."""
    try:
        client.heartbeat()
        return
    except DaemonUnavailable:
        pass
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


DEMO_NOTE = ("The demo model is a tiny test checkpoint: it writes nonsense by design, and checks the plumbing (the "
             "endpoint, tool calls, keys, the dashboard).\nFor a real model: `exl3local up` serves this machine's "
             "profile's default model (asking before the download), or `exl3local pull REPO[:REVISION]`, then "
             "`exl3local up REPO`.")


def _print_ready(st: Any) -> None:
    kv = f"KV {format_bytes(st.kv_budget_bytes)} = {st.kv_budget_tokens} tokens" if st.kv_budget_bytes else "KV -"
    print(f"READY  {st.model}  (profile {st.profile}, {st.gpu.name if st.gpu else '?'}, {kv})")
    print(f"OpenAI endpoint: {st.endpoint}  model: {st.served_model_name}")


def _keeps_current_model(req: UpRequest) -> bool:
    """A bare `up` while the daemon serves something keeps that (daemon.server.Daemon.up), so the
    profile's default model is not needed then."""
    if req != UpRequest():
        return False
    try:
        with DaemonClient() as client:
            return client.status().model is not None
    except DaemonUnavailable:
        return False


def _cmd_up(args: argparse.Namespace) -> int:
    if args.keep_alive is not None:
        args.set = [*(args.set or []), f"endpoint.keep_alive={args.keep_alive}"]
    if args.dry_run:  # starts nothing, downloads nothing: commands/machine.py prints the plan
        from exl3local.commands.dry_run import dry_run  # lazy: loads the daemon's planning code only when asked

        return dry_run(args)
    req = UpRequest(model=_resolve_model_arg(args.model), profile=args.profile, port=args.port,
                    overrides=profiles.parse_overrides(args.set), demo=args.demo)
    if req.model is None and not req.demo and not _keeps_current_model(req):
        # the profile's default model: pulled first, after asking
        hub.ensure_default_model(req.profile, req.overrides, confirm=_confirm_download if sys.stdin.isatty() else None)
    if args.foreground:
        return _up_foreground(req)
    if warning := apikey.file_warning(os.environ):
        print(f"exl3local: warning: {warning}", file=sys.stderr)
    with DaemonClient() as client:
        ensure_daemon(client)
        _check_key_state(client)
        client.up(req.model, profile=req.profile, port=req.port, overrides=dict(req.overrides), demo=req.demo)
        progress = UpProgress()
        try:
            st = client.wait_ready(on_progress=progress)
        finally:
            progress.done()
    _print_ready(st)
    if req.demo:
        print(DEMO_NOTE)
    return 0


def _check_key_state(client: DaemonClient) -> None:
    """The running daemon (started by another shell, or by systemd) may not have the key this shell asks for."""
    st = client.status()
    found = apikey.mismatch(st.api_key_required, os.environ, st.daemon_pid)
    if found is None:
        return
    refuse, message = found
    if refuse:
        raise ConfigError(message, hint=apikey.HOW_TO_CHANGE)
    print(f"exl3local: {message}", file=sys.stderr)


def _up_foreground(req: UpRequest) -> int:
    from exl3local.daemon import main as daemon_main  # lazy: the server stack loads only where a daemon runs

    async def announce(d: Daemon) -> None:
        while d.sup.state not in (EngineState.READY, EngineState.FAILED):
            await d.sup.wait_change()
        st = DaemonStatus.from_json(d.status())
        if st.state == EngineState.READY:
            _print_ready(st)
            print("(foreground: Ctrl-C stops the engine and the daemon)")
        else:
            print(f"FAILED: {st.last_error}\n{st.stderr_tail}", file=sys.stderr)

    return daemon_main.run(foreground=True, initial=req,
                      on_ready=lambda d: asyncio.get_running_loop().create_task(announce(d)))


def _add_up(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="serve a model (starts the daemon if needed); returns once it is READY",
                       description=f"Serve a model. The daemon listens on {env.HOST.get() or 'its Unix socket in the runtime dir'} "
                       f"({env.HOST.name}); "
                       "a daemon started here inherits this environment (EXL3LOCAL_API_KEY_FILE: the endpoint's "
                       "API key).")
    p.add_argument("model", nargs="?", help="checkpoint directory or hub REPO[:REVISION] (default: the profile's)")
    p.add_argument("--profile", help="use this profile instead of the detected/pinned one")
    p.add_argument("--port", type=int, help=f"port of the OpenAI endpoint on 127.0.0.1 (default {env.ENGINE_PORT.get()}"
                   f"{', from ' if env.ENGINE_PORT.name in os.environ else ': set '}{env.ENGINE_PORT.name})")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override one profile setting (repeatable)")
    p.add_argument("--keep-alive", metavar="DURATION", help="unload the engine after this long without a request "
                   "(15s, 5m, 1h, never; the same as --set endpoint.keep_alive=DURATION); a request's own "
                   "keep_alive field overrides it until the next up")
    p.add_argument("--demo", action="store_true", help="serve the tiny EXL3 demo model bundled in the package (it writes "
                   "nonsense by design: a plumbing check)")
    p.add_argument("--foreground", action="store_true", help="run the daemon in this terminal; Ctrl-C stops all")
    p.add_argument("--dry-run", action="store_true", help="print the engine command line, environment, KV budget "
                   "and profile reasons; start nothing (EXL3LOCAL_SYSFS may point at another machine's tree)")
    p.add_argument("--json", action="store_true", help="with --dry-run: the plan as one JSON object")
    p.set_defaults(handler=_cmd_up)


# ---- down / status / logs ------------------------------------------------------------------------


def _cmd_down(args: argparse.Namespace) -> int:
    with DaemonClient() as client:
        try:
            pid = client.heartbeat().get("daemon_pid")
            client.shutdown()
        except DaemonUnavailable:
            print("exl3local: the daemon is not running")
            return 0
        deadline = time.monotonic() + DOWN_TIMEOUT_S
        # The API closes before the daemon has released its lock and token: wait for the process too,
        # so a `down` that returns means everything is gone.
        while not (_unreachable(client) and _exited(pid)):
            if time.monotonic() > deadline:
                raise Exl3Error(f"the daemon (pid {pid}) did not exit within {DOWN_TIMEOUT_S:.0f} s")
            time.sleep(0.1)
    print("stopped")
    return 0


def _unreachable(client: DaemonClient) -> bool:
    try:
        client.heartbeat()
    except DaemonUnavailable:
        return True
    return False


def _exited(pid: int | None) -> bool:
    """A zombie has exited too: a detached daemon's parent may never reap it."""
    try:
        return pid is None or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _add_down(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("down", help="stop the engine and the daemon", description="Stop the engine and the "
                       "daemon, and wait until both are gone (a daemon started by systemd is started again by it).")
    p.set_defaults(handler=_cmd_down)


def format_status(st: DaemonStatus) -> str:
    gpu = st.gpu
    rows = [
        ("state", st.state.value + (f" (retry in {st.retry_in_s:.0f}s)" if st.retry_in_s else "")
         + (f" since {time.strftime('%H:%M:%S', time.localtime(st.idle_since))}, "
            f"{format_bytes(st.idle_freed_bytes, 'memory')} freed; the next request "
            f"{'wakes' if (st.idle_unload or '').startswith('sleep') else 'starts'} it"
            + (f" ({st.idle_detail})" if st.idle_detail else "") if st.idle_since else "")),
        ("model", st.model or "-"),
        ("served as", st.served_model_name or "-"),
        ("profile", st.profile or "-"),
        *(("", part) for part in st.profile_reason.split("; ") if part),
        ("GPU", f"{gpu.name} ({gpu.kind}{', ' + gpu.pci_id if gpu.pci_id else ''}, {format_bytes(gpu.memory_bytes)})"
         if gpu else "-"),
        ("KV budget", f"{format_bytes(st.kv_budget_bytes)} = {st.kv_budget_tokens} tokens"
         f" ({'pinned' if st.kv_budget_pinned else 'estimate'}), max_model_len {st.max_model_len}"
         if st.kv_budget_bytes is not None else "-"),
        ("endpoint", st.endpoint or "-"),
        ("API key", _key_state(st.api_key_required)),
        ("engine pid", f"{st.engine_pid}  RSS {format_bytes(st.engine_rss_bytes)}" if st.engine_pid else "-"),
        ("uptime", format_duration(st.uptime_s)),
        ("restarts", str(st.restarts)),
        ("requests", f"{st.requests_in_flight} in flight, {st.requests_waiting} waiting"
         + (f"; switching to {st.switch_to} once those in flight end" if st.switch_to else "")),
        ("keep-alive", "never unloaded" if st.keep_alive_s is None else f"unloaded after {format_duration(st.keep_alive_s)} "
         "without a request"),
        ("daemon", f"pid {st.daemon_pid}, up {format_duration(st.daemon_uptime_s)}"),
    ]
    if st.last_error:
        rows.append(("last error", st.last_error))
    if st.log_errors:
        rows.append(("engine log", f"{st.log_errors} writes failed, {format_bytes(st.log_dropped_bytes)} of engine output "
                                   f"dropped (serving goes on); last: {st.log_last_error or '?'}"))
    width = max(shutil.get_terminal_size().columns, 60)
    # long values wrap at words under their column, not at the terminal's edge mid-word
    out = "\n".join(textwrap.fill(v, width, initial_indent=f"{k:<11} ", subsequent_indent=" " * 12,
                                   break_long_words=False, break_on_hyphens=False) for k, v in rows)
    if st.stderr_tail and st.state.value in ("FAILED", "BACKOFF"):
        tail = "\n".join(st.stderr_tail.rstrip().splitlines()[-15:])
        out += "\n--- engine output (last lines) ---\n" + tail
    return out


def _key_state(required: bool | None) -> str:
    if required is None:
        return "? (the daemon does not say)"
    return ("required: clients send `Authorization: Bearer <key>`" if required
            else "none: every program on this machine may use the endpoint")


def _cmd_status(args: argparse.Namespace) -> int:
    with DaemonClient() as client:
        st = client.status()
        off = [] if args.json else kernel_notes(client)  # #20 self-check: kernel paths out of service, and why
    print(json.dumps(st.raw, indent=2) if args.json else format_status(st))
    for line in off:
        print(line)
    return 0


def _add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="engine state, model, profile, GPU, KV budget, endpoint")
    p.add_argument("--json", action="store_true", help="the daemon's status object (docs/api.md)")
    p.set_defaults(handler=_cmd_status)


def _shown(text: str, show_all: bool) -> str:
    """Engine output with library noise folded (lognoise), unless --all; a last partial line stays as it is."""
    if show_all:
        return text
    lines = text.split("\n")
    last = lines.pop()
    return "".join(f"{line}\n" for line in lognoise.fold(lines)) + last


def _cmd_logs(args: argparse.Namespace) -> int:
    with DaemonClient() as client:
        try:
            if args.follow:
                for text in client.follow_logs(tail=args.lines):
                    sys.stdout.write(_shown(text, args.all))
                    sys.stdout.flush()
            sys.stdout.write(_shown(client.logs(tail=args.lines).text, args.all))
            return 0
        except DaemonUnavailable:
            if args.follow:
                raise
    # No daemon: the file is still there, and most useful right after a crash.
    log = paths.engine_log()
    lines = log.read_text(errors="replace").splitlines(keepends=True)[-args.lines:] if log.exists() else []
    sys.stdout.write(_shown("".join(lines), args.all))
    return 0


def _add_logs(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("logs", help="the engine's log")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    p.add_argument("-n", "--lines", type=int, default=200, help="how many lines to start with (default 200)")
    p.add_argument("--all", action="store_true", help="show library noise too (Triton CPU backend, tcmalloc, ulimit, "
                   "Python warnings...), which is otherwise folded into one line per run; engine.log has every line")
    p.set_defaults(handler=_cmd_logs)


# ---- daemon -------------------------------------------------------------------------------------------


def _cmd_daemon(args: argparse.Namespace) -> int:
    from exl3local.daemon import main as daemon_main  # lazy: as in _up_foreground

    return daemon_main.run(foreground=not args.detached)


def _add_daemon(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("daemon", help="run the daemon in the foreground (systemd, or started by `up`)")
    p.add_argument("--detached", action="store_true", help="log to the log file only (how `up` starts it)")
    p.set_defaults(handler=_cmd_daemon)


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    for add in (_add_up, _add_down, _add_status, _add_logs, _add_daemon):
        add(sub)
