"""Whether the OpenAI endpoint requires a key, as the daemon, `up`, `status`, `doctor` and the dashboard
tell it. The key itself is read only by launch.api_key, at each engine start; nothing here reads it.

A daemon keeps the environment it started with: a shell that sets a key file later does not change a
running daemon, so `up` compares the two states (`mismatch`) before serving.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

from exl3local import env
from exl3local.engine.launch import VLLM_API_KEY_ENV


def requested(environ: Mapping[str, str]) -> bool:
    """This environment asks for a key (a key file or the key itself is set); the file is not read."""
    return bool(environ.get(env.API_KEY_FILE.name) or environ.get(env.API_KEY.name))


def required(engine_env: Mapping[str, str] | None, daemon_env: Mapping[str, str] = os.environ) -> bool:
    """Whether the daemon's endpoint requires a key: the planned engine's environment when there is a
    plan, else what the daemon's own environment asks for (the next engine gets that)."""
    if engine_env is not None:
        return VLLM_API_KEY_ENV in engine_env
    return requested(daemon_env)


def file_warning(environ: Mapping[str, str]) -> str | None:
    """A warning when the key file can be read (or written) by other users; None when fine or unset."""
    path = environ.get(env.API_KEY_FILE.name)
    if not path:
        return None
    try:
        mode = Path(path).expanduser().stat().st_mode
    except OSError:
        return None  # launch.api_key reports an unreadable file at start-up
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        return (f"the API key file {path} is readable by other users (mode {stat.filemode(mode)}): "
                f"`chmod 600 {path}`")
    return None


def mismatch(daemon_required: bool | None, environ: Mapping[str, str], daemon_pid: int | None) -> tuple[bool, str] | None:
    """(refuse, message) when the running daemon's key state differs from what this shell asks for; None
    when they agree or the daemon does not say (an older one). Refuse: the shell wants a key and the
    endpoint has none, so serving would leave it open while the user believes it is closed."""
    wanted = requested(environ)
    if daemon_required is None or daemon_required == wanted:
        return None
    who = f"the running daemon (pid {daemon_pid})" if daemon_pid else "the running daemon"
    if wanted:
        return True, (f"{who} was started without an API key, so its endpoint answers without one, but this shell "
                      f"sets {env.API_KEY_FILE.name if environ.get(env.API_KEY_FILE.name) else env.API_KEY.name}: "
                      "a running daemon keeps the key state it started with")
    return False, (f"note: {who} requires an API key on its endpoint (it was started with one) although this shell "
                   "sets none; clients send `Authorization: Bearer <key>`")


HOW_TO_CHANGE = ("`exl3local down`, then `exl3local up …` again from this shell (it starts the daemon with this "
                 "environment); for the systemd unit, add Environment=" + env.API_KEY_FILE.name +
                 "=… with `systemctl --user edit exl3local` and restart it")
