"""One vLLM child: its states, the /health wait, restart with backoff, stop of the whole group.

States (after Supervisor's process.py): STOPPED → STARTING → READY; an exit moves to BACKOFF and
back to STARTING after a delay; too many fast failures in a row → FAILED (the daemon stays up and
reports the stderr tail). stop = STOPPING: SIGTERM to the process group, SIGKILL after
`stop_timeout_s`; vLLM forks EngineCore and workers, so the group is signalled, never one pid.

READY is believed only from our own engine: it serves on a Unix socket in its own 0700 temp dir (no
port another process could take; the daemon's endpoint holds the TCP port), and /health must answer
200 there. READY is left the moment the leader is reaped (before its group is); a hang while READY
(engine/liveness.py) kills the group and restarts it (docs/api.md, "When READY is said").

The output pipe is always drained (engine/output.py). The first Python exception of a failed start
is its `cause`; the same cause on two failed starts in a row is deterministic and ends in FAILED at
once, with the cause as the first line of `last_error`.

The decisions (`after_exit`, `backoff_delay_s`) are plain methods over an injected clock; the OS
effects (spawn, health probe, process states) are injected too, so unit tests
drive them without processes (they live in procgroup.py; the start-error finder in cause.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from exl3local.api.protocol import EngineState
from exl3local.engine import liveness
from exl3local.engine.cause import same_cause
from exl3local.engine.output import EngineOutput
from exl3local.engine.procgroup import (
    Health,
    Process,
    Spawn,
    States,
    Unkillable,
    end_group,
    group_states,
    http_health,
    spawn_process,
)

log = logging.getLogger(__name__)


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
    # READY: group process states and /health are checked this often. A stopped member on two
    # checks in a row is a hang; /health failing for hang_timeout_s is one too (a busy engine on a
    # loaded machine answers /health late, not never).
    liveness_poll_s: float = 2.0
    hang_timeout_s: float = 30.0


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
        states: States = group_states,
    ) -> None:
        self.spawn = spawn
        self.health = health
        self.kill_group = kill_group
        self.states = states
        self.clock = clock
        self.policy = policy or Policy()
        self.output = EngineOutput(clock, on_output)
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
        self.unkillable: str | None = None  # members that outlived SIGKILL (D state): why FAILED
        self._hung: str | None = None  # declare_hung(): the reason, until the liveness loop acts on it
        self._previous_cause: str | None = None  # of the last start that failed before READY
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

    def wait_change(self) -> Awaitable[EngineState]:
        """The next state change, counted from this call (not from when the awaitable first runs:
        asyncio.wait_for starts it a loop turn later, and a change in between would be missed)."""
        changed = self._changed

        async def wait() -> EngineState:
            await changed.wait()
            return self.state

        return wait()

    def backoff_delay_s(self, failures: int) -> float:
        """1, 2, 4 ... seconds, capped: failures is the count of fast failures in a row."""
        return min(self.policy.backoff_base_s * 2 ** max(failures - 1, 0), self.policy.backoff_max_s)

    def after_exit(self, status: int | None, reason: str, cause: str | None = None) -> EngineState:
        """Decide what an engine exit leads to; the tick function of the state machine. `cause`:
        the exception line the start printed, if any; the same cause on two starts that both failed
        before READY is deterministic (a bad setting, a broken checkpoint) and gives up at once."""
        now = self.clock()
        never_ready = self.ready_since is None
        fast = never_ready or now - self.ready_since < self.policy.min_uptime_s
        self.fast_failures = self.fast_failures + 1 if fast else 0
        repeated = never_ready and same_cause(cause, self._previous_cause)
        self._previous_cause = cause if never_ready else None
        self.exit_status = status
        self.stderr_tail = self.output.tail_text()
        self.last_error = f"{cause}\n{reason}" if cause else reason
        self.ready_since = None
        if repeated:
            return self.give_up(
                f"{self.last_error}; the same error on {self.fast_failures} starts in a row: not retrying")
        if self.fast_failures >= self.policy.max_fast_failures:
            # BACKOFF/STARTING -> FAILED
            return self.give_up(f"{self.last_error}; gave up after {self.fast_failures} failed starts in a row")
        # STARTING/READY -> BACKOFF
        self.retry_at = now + (self.backoff_delay_s(self.fast_failures) if fast else self.policy.backoff_base_s)
        return EngineState.BACKOFF

    def give_up(self, why: str) -> EngineState:
        self.last_error = why
        self.retry_at = None
        return EngineState.FAILED

    @property
    def progress(self) -> str:
        """The engine's latest output line (shown while STARTING)."""
        return self.output.progress

    @property
    def output_errors(self) -> int:
        return self.output.errors

    def snapshot(self) -> dict[str, Any]:
        now = self.clock()
        pid = self.proc.pid if self.proc is not None and self.proc.returncode is None else None
        state = self.state
        if state == EngineState.READY and (pid is None or pid not in self.states(pid, [pid])):
            # The leader is dead or a zombie not yet reaped (asyncio reaps it a loop turn or more
            # after the kill): _run records it on its next poll, but READY ends now.
            state = EngineState.BACKOFF
        return {
            "state": state.value,
            "engine_pid": pid,
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

    def declare_hung(self, reason: str) -> None:
        """A hang seen from outside (the endpoint: requests in flight get no byte while /health answers):
        the next liveness check kills the group and restarts it, with `reason` in last_error."""
        if self.state == EngineState.READY:
            self._hung = reason

    # ---- control ---------------------------------------------------------------------------
    async def start(self, spec: Any) -> None:
        """(Re)start with `spec`; clears the failure history (a user action)."""
        await self.stop()
        self.spec = spec
        self.restarts = 0
        self.fast_failures = 0
        self._previous_cause = None
        self.last_error = None
        self.exit_status = None
        self.stderr_tail = ""
        self.unkillable = None
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
        if self.unkillable:
            self._set(self.give_up(self.unkillable))
        else:
            self._set(EngineState.STOPPED)

    # ---- the loop --------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            while True:
                proc = await self._launch()
                if proc is None:
                    nxt = self.after_exit(None, "the engine could not be started")
                    self._set(nxt)
                else:
                    nxt = await self._run_once(proc)
                if nxt == EngineState.FAILED:
                    return
                log.warning("%s; restarting in %.1f s", self.last_error, max((self.retry_at or 0) - self.clock(), 0))
                await asyncio.sleep(max((self.retry_at or 0) - self.clock(), 0))
                self.restarts += 1
                self._set(EngineState.STARTING)  # BACKOFF -> STARTING
        except asyncio.CancelledError:
            if self.proc is not None:  # stop(): the group must be gone before STOPPED
                await self._reap(self.proc, self.policy.stop_timeout_s)
            raise

    async def _run_once(self, proc: Process) -> EngineState:
        """One engine's life, from spawn to reaped group; the output is drained throughout."""
        reader = asyncio.create_task(self.output.pump(proc.stdout))
        try:
            outcome, status, detail = await self._watch(proc)
            if self.state == EngineState.READY:  # leave READY the moment it is gone; FAILED may follow
                self.last_error = self._reason(outcome, status, detail)
                self._set(EngineState.BACKOFF)
            await self.output.drain(reader)  # the traceback of a failed start lands in the tail
            nxt = self._decide(outcome, status, detail)
            self._set(nxt)
            await self._reap(proc, 0.0 if outcome == "hung" else self.policy.stop_timeout_s)
            if self.unkillable:  # no restart beside processes that still hold the device
                nxt = self.give_up(self.unkillable)
                self._set(nxt)
            return nxt
        finally:
            reader.cancel()

    def _decide(self, outcome: str, status: int | None, detail: str) -> EngineState:
        return self.after_exit(status, self._reason(outcome, status, detail), self.output.cause.cause)

    def _reason(self, outcome: str, status: int | None, detail: str) -> str:
        return {
            "stall": f"no output and no /health for {self.policy.stall_timeout_s:.0f} s while loading",
            "hung": f"the engine stopped answering: {detail}; its process group was killed",
        }.get(outcome, f"the engine exited with status {status}")

    async def _launch(self) -> Process | None:
        self._hung = None
        self.output.new_start()
        os.makedirs(self.spec.tmpdir, mode=0o700, exist_ok=True)
        try:
            proc = await self.spawn(self.spec)
        except OSError as exc:
            self.output.keep(f"cannot spawn {self.spec.argv[0]}: {exc}\n".encode())
            return None
        self.proc = proc
        if self.on_spawn:
            self.on_spawn(self.spec, proc)
        return proc

    async def _watch(self, proc: Process) -> tuple[str, int | None, str]:
        """STARTING until /health answers from our own group, then READY until the process exits
        or stops answering. Returns (outcome, exit status, detail)."""
        exited = asyncio.ensure_future(self._leader_exit(proc))
        try:
            while self.state == EngineState.STARTING:
                done, _ = await asyncio.wait({exited}, timeout=self.policy.health_poll_s)
                if done:
                    return "exit", proc.returncode, ""
                if await self.health(self.spec):
                    self.ready_since = self.clock()
                    self._set(EngineState.READY)  # STARTING -> READY
                    break
                if self.clock() - self.output.last > self.policy.stall_timeout_s:
                    return "stall", None, ""
            outcome, detail = await liveness.watch(proc.pid, exited, spec=self.spec, policy=self.policy,
                                                   clock=self.clock, states=self.states, health=self.health,
                                                   declared=self._take_hung)
            return outcome, proc.returncode if outcome == "exit" else None, detail
        finally:
            exited.cancel()

    def _take_hung(self) -> str | None:
        reason, self._hung = self._hung, None
        return reason

    async def _leader_exit(self, proc: Process) -> int:
        """The leader's exit status. Not proc.wait(): on Python 3.11 that also waits for every
        pipe to close, and after a kill -9 of the leader its EngineCore and workers still hold
        stdout, so it would never return. returncode is set as soon as the child is reaped
        (snapshot() stops saying READY from then on, before this poll notices)."""
        while proc.returncode is None:
            await asyncio.sleep(self.policy.exit_poll_s)
        return proc.returncode

    async def _reap(self, proc: Process, grace_s: float) -> None:
        """The whole group goes, whatever happened to the leader; then its TMPDIR. Shielded and
        shared, so a stop() arriving mid-reap waits for the same clean-up instead of racing it.
        grace_s: how long SIGTERM may take before SIGKILL (0 for a stopped group: it cannot
        handle SIGTERM)."""
        if self._reaping is None or self._reaping[0] is not proc:
            self._reaping = (proc, asyncio.ensure_future(self._end(proc, grace_s)))
        task = self._reaping[1]
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            await task
            raise
        finally:
            if self.proc is proc and task.done():
                self.proc = None

    async def _end(self, proc: Process, grace_s: float) -> None:
        try:
            killed = await self.kill_group(proc.pid, grace_s)
        except Unkillable as exc:
            # Not waiting on: the leader may never be reaped. The engine record stays, so the
            # next daemon start tries again.
            self.unkillable = f"{exc}; the engine cannot be restarted until they are gone"
            log.error("%s", self.unkillable)
            shutil.rmtree(self.spec.tmpdir, ignore_errors=True)
            return
        await self._leader_exit(proc)
        if killed and grace_s:
            log.warning("engine group %d ignored SIGTERM for %.0f s: killed", proc.pid, grace_s)
        shutil.rmtree(self.spec.tmpdir, ignore_errors=True)
        if self.on_reaped:
            self.on_reaped(self.spec, proc)

    async def close(self) -> None:
        """Daemon shutdown: stop() already waits for the group to be gone."""
        await self.stop()
