"""The engine's process group as the OS shows it: spawn in a new session, /health probe, who listens
on the engine port, member states from /proc, and ending the whole group (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from exl3local import paths

# (pgid, only these pids or None for all of /proc) -> pid -> state letter of live members
States = Callable[[int, Sequence[int] | None], dict[int, str]]


# The OS effects the supervisor is given (the functions below are the real ones; tests pass their own).
class Process(Protocol):
    pid: int
    returncode: int | None
    stdout: asyncio.StreamReader | None

    async def wait(self) -> int: ...


Spawn = Callable[[Any], Awaitable[Process]]
Health = Callable[[Any], Awaitable[bool]]


async def spawn_process(spec: Any) -> asyncio.subprocess.Process:
    """The engine in its own session (= process group), cwd = the state dir, output merged."""
    return await asyncio.create_subprocess_exec(
        *spec.argv, env=dict(spec.env), cwd=str(paths.state_dir()), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


async def http_health(spec: Any, timeout_s: float = 2.0) -> bool:
    """GET /health on the engine's Unix socket answers 200. A bare HTTP/1.0 request: this runs every
    `liveness_poll_s` while READY, and an HTTP client per probe costs more than the probe."""
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_unix_connection(spec.uds)
            writer.write(b"GET /health HTTP/1.0\r\nHost: engine\r\n\r\n")
            status_line = await reader.readline()
        return status_line.split(b" ", 2)[1:2] == [b"200"]
    except (OSError, TimeoutError):
        return False
    finally:
        if writer is not None:
            writer.close()


def group_states(pgid: int, among: Sequence[int] | None = None) -> dict[int, str]:
    """pid -> process state letter (R, S, D, T, t, ...) of the live (non-zombie) members of a
    process group, from /proc: all of /proc, or only the pids `among`. A zombie stays in its group
    until reaped, and a container's PID 1 may never reap orphans: killpg(pgid, 0) would then
    report the group alive forever."""
    members = {}
    pids = among if among is not None else (int(e.name) for e in os.scandir("/proc") if e.name.isdigit())
    for pid in pids:
        # os.open/os.read, not open(): the front checks the leader per request, and a buffered file object made
        # that check cost twice as much (~35 µs against ~18 on the CI box); a stat line is well under 4 KiB
        try:
            fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
        except OSError:
            continue
        try:
            stat = os.read(fd, 4096)
        except OSError:
            continue
        finally:
            os.close(fd)
        fields = stat[stat.rindex(b")") + 2 :].split()  # after "pid (comm) "
        if int(fields[2]) == pgid and fields[0] != b"Z":
            members[pid] = fields[0].decode()
    return members


def group_members(pgid: int) -> list[int]:
    return list(group_states(pgid))


def process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def group_alive(pgid: int, states: States | None = None) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return bool((states or group_states)(pgid, None))


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


# After SIGKILL the kernel ends a process within milliseconds unless it sleeps uninterruptibly
# (state D: a GPU or driver hang, a dead NFS mount). Waiting longer would hold the daemon lock
# for every later `up`/`down` until the hang clears, which may be never.
KILL_WAIT_S = 5.0


class Unkillable(Exception):
    """Members of the engine's group outlived SIGKILL by KILL_WAIT_S; `states` maps pid -> state."""

    def __init__(self, pgid: int, states: dict[int, str], waited_s: float) -> None:
        self.pgid = pgid
        self.states = states
        who = ", ".join(f"{process_name(pid)} (pid {pid}, state {st})" for pid, st in sorted(states.items()))
        hint = " (D: uninterruptible sleep, usually a GPU or driver hang)" if "D" in states.values() else ""
        super().__init__(f"engine processes survived SIGKILL for {waited_s:.0f} s: {who}{hint}")


async def end_group(pgid: int, timeout_s: float, *, kill_wait_s: float = KILL_WAIT_S,
                    states: States | None = None) -> bool:
    """SIGTERM the group, wait for every member, SIGKILL what is left. True if it had to kill.
    Raises Unkillable when members are still there kill_wait_s after SIGKILL."""
    states = states or group_states
    signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while group_alive(pgid, states) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if not group_alive(pgid, states):
        return False
    signal_group(pgid, signal.SIGKILL)
    deadline = time.monotonic() + kill_wait_s
    while group_alive(pgid, states):
        if time.monotonic() >= deadline:
            left = states(pgid, None)
            if left:
                raise Unkillable(pgid, left, kill_wait_s)
        await asyncio.sleep(0.05)
    return True
