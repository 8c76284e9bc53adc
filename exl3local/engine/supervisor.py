"""One vLLM child: its states, the /health wait, restart with backoff, stop of the whole group.

States (after Supervisor's process.py): STOPPED → STARTING → READY; an exit moves to BACKOFF and
back to STARTING after a delay; too many fast failures in a row → FAILED (the daemon stays up and
reports the stderr tail). stop = STOPPING: SIGTERM to the process group, SIGKILL after
`stop_timeout_s`; vLLM forks EngineCore and workers, so the group is signalled, never one pid.

The decisions (`after_exit`, `backoff_delay_s`) are plain methods over an injected clock; the OS
effects (spawn, health probe) are injected too, so unit tests drive them without processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from exl3local import paths
from exl3local.api.protocol import EngineState

log = logging.getLogger(__name__)

TAIL_BYTES = 8 * 1024  # Ollama's StatusWriter keeps the same amount of runner stderr


@dataclass(frozen=True)
class Policy:
    # A start fails "fast" when it never reached READY or died within min_uptime_s of it.
    max_fast_failures: int = 3
    min_uptime_s: float = 10.0
    backoff_base_s: float = 1.0
    backoff_max_s: float = 30.0
    # Loading shows progress in the log; only silence this long counts as a hang. A 27B load on
    # Arc keeps logging; first-time Triton/SYCL compiles can be quiet for a minute or two.
    stall_timeout_s: float = 300.0
    health_poll_s: float = 0.25  # while STARTING; each poll is one local HTTP request
    exit_poll_s: float = 0.5  # how often the leader's returncode is checked (idle cost: ~0.05 % CPU)
    stop_timeout_s: float = 10.0  # XPU needs ~5 s to release Level Zero/oneCCL resources


class Process(Protocol):
    pid: int
    returncode: int | None
    stdout: asyncio.StreamReader | None

    async def wait(self) -> int: ...


Spawn = Callable[[Any], Awaitable[Process]]
Health = Callable[[Any], Awaitable[bool]]


async def spawn_process(spec: Any) -> Process:
    """The engine in its own session (= process group), cwd = the state dir, output merged."""
    return await asyncio.create_subprocess_exec(
        *spec.argv, env=dict(spec.env), cwd=str(paths.state_dir()), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


async def http_health(spec: Any) -> bool:
    try:
        async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
            return (await client.get(spec.health_url)).status_code == 200
    except httpx.HTTPError:
        return False


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, from /proc. A zombie stays in its group
    until reaped, and a container's PID 1 may never reap orphans: killpg(pgid, 0) would then
    report the group alive forever."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()  # after "pid (comm) "
        if int(fields[2]) == pgid and fields[0] != b"Z":
            members.append(int(entry.name))
    return members


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return bool(group_members(pgid))


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def end_group(pgid: int, timeout_s: float) -> bool:
    """SIGTERM the group, wait for every member, SIGKILL what is left. True if it had to kill."""
    signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while group_alive(pgid) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if not group_alive(pgid):
        return False
    signal_group(pgid, signal.SIGKILL)
    while group_alive(pgid):
        await asyncio.sleep(0.05)
    return True


class Supervisor:
    def __init__(
        self,
        *,
        spawn: Spawn = spawn_process,
        health: Health = http_health,
        clock: Callable[[], float] = time.monotonic,
        policy: Policy | None = None,
        on_output: Callable[[bytes], None] | None = None,
        on_spawn: Callable[[Any, Process], None] | None = None,
        on_reaped: Callable[[Any, Process], None] | None = None,
        kill_group: Callable[[int, float], Awaitable[bool]] = end_group,
    ) -> None:
        self.spawn = spawn
        self.health = health
        self.kill_group = kill_group
        self.clock = clock
        self.policy = policy or Policy()
        self.on_output = on_output  # every chunk of engine output (the daemon's rotating log)
        self.on_spawn = on_spawn  # engine record for orphan clean-up
        self.on_reaped = on_reaped
        self.state = EngineState.STOPPED
        self.state_since = clock()
        self.spec: Any = None
        self.proc: Process | None = None
        self.restarts = 0
        self.fast_failures = 0
        self.ready_since: float | None = None
        self.retry_at: float | None = None
        self.last_error: str | None = None
        self.exit_status: int | None = None
        self.stderr_tail = ""
        self.progress = ""
        self._tail: deque[bytes] = deque()
        self._tail_len = 0
        self._last_output = clock()
        self._task: asyncio.Task[None] | None = None
        self._reaping: tuple[Process, asyncio.Future[None]] | None = None
        self._changed = asyncio.Event()

    # ---- state ---------------------------------------------------------------------------
    def _set(self, state: EngineState) -> None:
        if state != self.state:
            log.info("engine %s -> %s", self.state, state)
            self.state = state
            self.state_since = self.clock()
            self._changed.set()
            self._changed = asyncio.Event()

    async def wait_change(self) -> EngineState:
        await self._changed.wait()
        return self.state

    def backoff_delay_s(self, failures: int) -> float:
        """1, 2, 4 ... seconds, capped: failures is the count of fast failures in a row."""
        return min(self.policy.backoff_base_s * 2 ** max(failures - 1, 0), self.policy.backoff_max_s)

    def after_exit(self, status: int | None, reason: str) -> EngineState:
        """Decide what an engine exit leads to; the tick function of the state machine."""
        now = self.clock()
        fast = self.ready_since is None or now - self.ready_since < self.policy.min_uptime_s
        self.fast_failures = self.fast_failures + 1 if fast else 0
        self.exit_status = status
        self.stderr_tail = self.tail_text()
        self.last_error = reason
        self.ready_since = None
        if self.fast_failures >= self.policy.max_fast_failures:
            # BACKOFF/STARTING -> FAILED
            self.last_error = f"{reason}; gave up after {self.fast_failures} failed starts in a row"
            self.retry_at = None
            return EngineState.FAILED
        # STARTING/READY -> BACKOFF
        self.retry_at = now + (self.backoff_delay_s(self.fast_failures) if fast else self.policy.backoff_base_s)
        return EngineState.BACKOFF

    def tail_text(self) -> str:
        return b"".join(self._tail).decode("utf-8", "replace")[-TAIL_BYTES:]

    def snapshot(self) -> dict[str, Any]:
        now = self.clock()
        return {
            "state": self.state.value,
            "engine_pid": self.proc.pid if self.proc is not None and self.proc.returncode is None else None,
            "restarts": self.restarts,
            "uptime_s": round(now - self.ready_since, 3) if self.ready_since is not None else None,
            "state_age_s": round(now - self.state_since, 3),
            "retry_in_s": round(max(self.retry_at - now, 0.0), 3)
            if self.state == EngineState.BACKOFF and self.retry_at
            else None,
            "progress": self.progress if self.state == EngineState.STARTING else "",
            "last_error": self.last_error,
            "exit_status": self.exit_status,
            "stderr_tail": self.stderr_tail,
        }

    # ---- control ---------------------------------------------------------------------------
    async def start(self, spec: Any) -> None:
        """(Re)start with `spec`; clears the failure history (a user action)."""
        await self.stop()
        self.spec = spec
        self.restarts = 0
        self.fast_failures = 0
        self.last_error = None
        self.exit_status = None
        self.stderr_tail = ""
        self._set(EngineState.STARTING)  # STOPPED/FAILED -> STARTING
        self._task = asyncio.create_task(self._run(), name="engine")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        if self.proc is not None and self.proc.returncode is None:
            self._set(EngineState.STOPPING)  # any -> STOPPING
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        self.ready_since = None
        self.retry_at = None
        self._set(EngineState.STOPPED)

    # ---- the loop --------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            while True:
                proc = await self._launch()
                if proc is None:
                    outcome, status = "spawn", None
                else:
                    outcome, status = await self._watch(proc)
                    await self._reap(proc)
                reason = {
                    "spawn": "the engine could not be started",
                    "stall": f"no output and no /health for {self.policy.stall_timeout_s:.0f} s while loading",
                }.get(outcome, f"the engine exited with status {status}")
                nxt = self.after_exit(status, reason)
                self._set(nxt)
                if nxt == EngineState.FAILED:
                    return
                log.warning("%s; restarting in %.1f s", reason, (self.retry_at or 0) - self.clock())
                await asyncio.sleep(max((self.retry_at or 0) - self.clock(), 0))
                self.restarts += 1
                self._set(EngineState.STARTING)  # BACKOFF -> STARTING
        except asyncio.CancelledError:
            if self.proc is not None:  # stop(): the group must be gone before STOPPED
                await self._reap(self.proc)
            raise

    async def _launch(self) -> Process | None:
        self._tail.clear()
        self._tail_len = 0
        self.progress = ""
        self._last_output = self.clock()
        os.makedirs(self.spec.tmpdir, mode=0o700, exist_ok=True)
        try:
            proc = await self.spawn(self.spec)
        except OSError as exc:
            self._keep(f"cannot spawn {self.spec.argv[0]}: {exc}\n".encode())
            return None
        self.proc = proc
        if self.on_spawn:
            self.on_spawn(self.spec, proc)
        return proc

    async def _watch(self, proc: Process) -> tuple[str, int | None]:
        """STARTING until /health answers, then READY until the process exits."""
        reader = asyncio.create_task(self._pump(proc))
        exited = asyncio.ensure_future(self._leader_exit(proc))
        try:
            while self.state == EngineState.STARTING:
                done, _ = await asyncio.wait({exited}, timeout=self.policy.health_poll_s)
                if done:
                    await asyncio.wait({reader}, timeout=1.0)  # let the last output land in the tail
                    return "exit", proc.returncode
                if await self.health(self.spec):
                    self.ready_since = self.clock()
                    self._set(EngineState.READY)  # STARTING -> READY
                    break
                if self.clock() - self._last_output > self.policy.stall_timeout_s:
                    return "stall", None
            status = await exited  # READY until it exits
            await asyncio.wait({reader}, timeout=1.0)
            return "exit", status
        finally:
            exited.cancel()
            reader.cancel()

    async def _leader_exit(self, proc: Process) -> int:
        """The leader's exit status. Not proc.wait(): on Python 3.11 that also waits for every
        pipe to close, and after a kill -9 of the leader its EngineCore and workers still hold
        stdout, so it would never return. returncode is set as soon as the child is reaped."""
        while proc.returncode is None:
            await asyncio.sleep(self.policy.exit_poll_s)
        return proc.returncode

    async def _pump(self, proc: Process) -> None:
        if proc.stdout is None:
            return
        while chunk := await proc.stdout.readline():
            self._keep(chunk)
            self._last_output = self.clock()
            line = chunk.decode("utf-8", "replace").strip()
            if line:
                self.progress = line[-200:]
            if self.on_output:
                self.on_output(chunk)

    def _keep(self, chunk: bytes) -> None:
        self._tail.append(chunk)
        self._tail_len += len(chunk)
        while self._tail_len - len(self._tail[0]) >= TAIL_BYTES and len(self._tail) > 1:
            self._tail_len -= len(self._tail.popleft())

    async def _reap(self, proc: Process) -> None:
        """The whole group goes, whatever happened to the leader; then its TMPDIR. Shielded and
        shared, so a stop() arriving mid-reap waits for the same clean-up instead of racing it."""
        if self._reaping is None or self._reaping[0] is not proc:
            self._reaping = (proc, asyncio.ensure_future(self._end(proc)))
        task = self._reaping[1]
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            await task
            raise
        finally:
            if self.proc is proc and task.done():
                self.proc = None

    async def _end(self, proc: Process) -> None:
        killed = await self.kill_group(proc.pid, self.policy.stop_timeout_s)
        await self._leader_exit(proc)
        if killed:
            log.warning("engine group %d ignored SIGTERM for %.0f s: killed", proc.pid, self.policy.stop_timeout_s)
        shutil.rmtree(self.spec.tmpdir, ignore_errors=True)
        if self.on_reaped:
            self.on_reaped(self.spec, proc)

    async def close(self) -> None:
        """Daemon shutdown: stop() already waits for the group to be gone."""
        await self.stop()
