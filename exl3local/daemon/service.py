"""The Daemon: runs the `up` pipeline (daemon.plan) behind `POST /api/up`, supervises the engine,
answers status, follows GPU hotplug. Its HTTP side is daemon/server.py.

Engine output goes to a rotating engine.log. The running engine is recorded in the state dir, so a
daemon that was killed -9 is cleaned up after by the next one (the launcher also dies with its
daemon: engine.launch._die_with_parent).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import psutil

from exl3local import env, errors, paths
from exl3local.api.protocol import API_VERSION, ENGINE_ALIVE, EngineState, GpuStatus, UpRequest
from exl3local.daemon.front import ENGINE_ERRORS, Front
from exl3local.daemon.scheduler import Scheduler
from exl3local.daemon.plan import ENGINE_HOST, Plan, env_number, plan, port_free
from exl3local.engine import apikey, launch, stats
from exl3local.engine.log import EngineLog
from exl3local.engine.procgroup import Unkillable, end_group, group_alive
from exl3local.engine.supervisor import Policy, Supervisor
from exl3local.machine import hardware

log = logging.getLogger("exl3local.daemon")

MAX_EVENTS = 20
HOTPLUG_SETTLE_S = 1.0  # an eGPU arrives as pci add → bind → drm add: wait for the burst to end

class Daemon:
    def __init__(self, *, sysfs_root: Path | None = None, policy: Policy | None = None) -> None:
        self.sysfs_root = Path(sysfs_root or env.SYSFS.get())
        self.started = time.monotonic()
        self.engine_log = EngineLog(paths.engine_log())
        self.sup = Supervisor(policy=policy or Policy(stall_timeout_s=env_number(env.STALL_TIMEOUT, float),
                                                      hang_timeout_s=env_number(env.HANG_TIMEOUT, float)),
                              on_output=self.engine_log.write, on_spawn=self._record_engine,
                              on_reaped=self._forget_engine)
        self.plan: Plan | None = None
        self.last_request: UpRequest | None = None
        self.events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)
        self.gpus: list[hardware.GpuInfo] = []
        self._lock = asyncio.Lock()  # one pipeline run at a time (two `up` at once → one engine)
        self._stop = asyncio.Event()
        self._hotplug_task: asyncio.Task[None] | None = None
        self.front = Front(self)  # the OpenAI endpoint, forwarding to the engine's socket
        self.scheduler = Scheduler(self)  # keep-alive: idle unload, wake on the next request

    # ---- engine record (orphan clean-up after a daemon crash) ---------------------------
    def _record_engine(self, spec: Any, proc: Any) -> None:
        try:
            created = psutil.Process(proc.pid).create_time()
        except psutil.Error:
            created = None
        rec = {"pid": proc.pid, "create_time": created, "tmpdir": spec.tmpdir}
        # atomic: a daemon killed mid-write must not leave a record the next one cannot read
        paths.write_atomic(paths.engine_record(), json.dumps(rec), mode=0o600)
        self.engine_log.mark(f"engine started, pid {proc.pid}: {' '.join(spec.argv)}")

    def _forget_engine(self, spec: Any, proc: Any) -> None:
        with contextlib.suppress(FileNotFoundError):
            paths.engine_record().unlink()
        self.engine_log.mark(f"engine pid {proc.pid} ended, status {proc.returncode}")

    @staticmethod
    async def reap_stale_engine() -> None:
        """An engine left by a daemon that died without cleaning up (kill -9, power loss)."""
        record = paths.engine_record()
        try:
            rec = json.loads(record.read_text())
        except (OSError, ValueError):
            return
        pid = rec.get("pid")
        try:
            same = isinstance(pid, int) and psutil.Process(pid).create_time() == rec.get("create_time")
        except psutil.Error:
            same = False
        if same and group_alive(pid):
            log.warning("ending engine group %d left by a previous daemon", pid)
            try:
                await end_group(pid, 10.0)
            except Unkillable as exc:  # keep the record: the next start tries again
                log.error("the engine group %d left by a previous daemon: %s", pid, exc)
                return
        if rec.get("tmpdir"):
            shutil.rmtree(rec["tmpdir"], ignore_errors=True)
        record.unlink(missing_ok=True)

    # ---- operations ---------------------------------------------------------------------
    async def up(self, req: UpRequest) -> dict[str, Any]:
        async with self._lock:
            if req == UpRequest() and self.last_request is not None:
                req = self.last_request  # a bare `up`: keep (or bring back) what was served
            loop = asyncio.get_running_loop()
            alive = self.sup.state in ENGINE_ALIVE
            ours = self.front.port  # the endpoint's own port: free for the new plan

            def port_ok(host: str, port: int) -> bool:
                return port == ours or port_free(host, port)

            # First pass: refuse a bad request while the current engine keeps serving. Only a
            # budget refusal may be the old engine's fault (its memory is still in use).
            try:
                new: Plan | None = await loop.run_in_executor(None, self._plan_quietly, req, port_ok)
            except errors.BudgetError:
                if not alive:
                    raise
                new = None
            if new is not None and self.plan is not None and self.plan.key == new.key and alive:
                os.rmdir(new.spec.tmpdir)
                return self.status()
            if alive:
                # The old engine's memory and port are free only once it is gone: plan again.
                if new is not None:
                    os.rmdir(new.spec.tmpdir)
                await self.sup.stop()
                new = await loop.run_in_executor(None, self._plan_quietly, req, port_ok)
            else:
                await self.sup.stop()
            try:
                await self.front.listen(ENGINE_HOST, new.spec.port)
            except errors.Exl3Error:
                os.rmdir(new.spec.tmpdir)
                raise
            self.plan = new
            self.last_request = req
            self.engine_log.mark(f"up: {new.model_label} with profile {new.profile.id}")
            self.scheduler.reset()
            await self.sup.start(new.spec)
            return self.status()

    def _plan_quietly(self, req: UpRequest, check_port: Callable[[str, int], bool]) -> Plan:
        try:
            return plan(req, sysfs_root=self.sysfs_root, check_port=check_port)
        except errors.Exl3Error as exc:
            # The rejected plan goes to engine.log as well, so `exl3local logs` shows it.
            self.engine_log.mark(f"up refused: {exc}")
            raise

    async def restart(self) -> dict[str, Any]:
        async with self._lock:
            if self.plan is None:
                raise errors.ConfigError("nothing to restart: no model was brought up", hint="run `exl3local up`")
            self.scheduler.reset()
            await self.sup.start(self.plan.spec)
            return self.status()

    async def stop_engine(self) -> dict[str, Any]:
        async with self._lock:
            self.scheduler.reset()
            await self.sup.stop()
            return self.status()

    def status(self) -> dict[str, Any]:
        st: dict[str, Any] = {"api_version": API_VERSION, **self.sup.snapshot()}
        p = self.plan
        st.update({
            "model": p.model_label if p else None,
            "served_model_name": p.spec.served_model_name if p else None,
            "profile": p.profile.id if p else None,
            "profile_reason": p.profile_reason if p else "",
            "gpu": asdict(GpuStatus.of(p.gpu)) if p else None,
            "endpoint": p.spec.endpoint if p else None,
            "api_key_required": apikey.required(p.spec.env if p else None),
            "engine_rss_bytes": stats.tree_rss(st["engine_pid"]),
            "kv_budget_bytes": p.budget.kv_budget_bytes if p else None,
            "kv_budget_tokens": p.budget.kv_budget_tokens if p else None,
            "kv_budget_pinned": p.budget.pinned if p else False,
            "kv_budget_explain": list(p.budget.lines) if p else [],
            "max_model_len": p.budget.max_model_len if p else None,
            **self.engine_log.health(),
            "daemon_pid": os.getpid(),
            "daemon_uptime_s": round(time.monotonic() - self.started, 3),
            "events": list(self.events),
        })  # fmt: skip
        st["log_errors"] += self.sup.output_errors
        st["keep_alive_s"] = self.scheduler.keep_alive_s()
        # a request named another model: the engine switches to it once these requests are done
        st["switch_to"], st["requests_waiting"] = self.scheduler.switch_to, self.scheduler.waiting
        st["requests_in_flight"] = self.scheduler.in_flight
        st.update(idle_since=None, idle_freed_bytes=None, idle_unload=None, idle_detail=None)
        if self.scheduler.idle:
            how = self.scheduler.idle_how
            st.update(state=EngineState.IDLE.value, idle_since=self.scheduler.idle_since,
                      idle_freed_bytes=self.scheduler.freed_bytes, idle_unload=how.words, idle_detail=how.why)
        st.update(stats.memory_fields(st["engine_pid"], p.gpu.kind if p else None))
        return st

    def kernels(self) -> dict[str, Any]:
        """GET /api/kernels: the plugin's per-process counter files in this engine's trace dir."""
        if self.plan is None or self.sup.state in (EngineState.STOPPED, EngineState.FAILED):
            raise errors.EngineError(self.sup.state.value, None, "", hint="kernel counters exist only while an engine runs")
        trace_dir = Path(self.plan.spec.env[launch.TRACE_DIR_ENV])
        return stats.kernel_counts(trace_dir, time.time(), self.plan.gpu.kind)

    async def metrics(self) -> str:
        if self.sup.state != EngineState.READY or self.plan is None:
            raise errors.EngineError(self.sup.state.value, None, "", hint="metrics exist only while READY")
        try:
            return await self.front.engine_get("/metrics")
        except ENGINE_ERRORS as exc:
            raise errors.EngineError(self.sup.state.value, None, f"/metrics: {exc!r}") from None

    # ---- hotplug ------------------------------------------------------------------------
    def on_hotplug(self, action: str) -> None:
        if self._hotplug_task is None or self._hotplug_task.done():
            self._hotplug_task = asyncio.get_running_loop().create_task(self._settle_hotplug())

    async def _settle_hotplug(self) -> None:
        await asyncio.sleep(HOTPLUG_SETTLE_S)
        await self.gpus_changed(hardware.probe(self.sysfs_root))

    async def gpus_changed(self, gpus: list[hardware.GpuInfo]) -> None:
        """Record adds/removes; restart the engine only if its own GPU went away."""
        before = {g.slot: g for g in self.gpus}
        after = {g.slot: g for g in gpus}
        self.gpus = gpus
        engine_slot = self.plan.gpu.slot if self.plan else None
        lost_engine_gpu = False
        for action, slots, table in (("remove", before.keys() - after.keys(), before),
                                     ("add", after.keys() - before.keys(), after)):
            for slot in sorted(s for s in slots if s):
                is_engine = action == "remove" and slot == engine_slot
                lost_engine_gpu |= is_engine
                self.events.append({"time": time.time(), "action": action, "slot": slot,
                                    "name": table[slot].name, "engine_gpu": is_engine})
                log.info("GPU %s: %s at %s", action, table[slot].name, slot)
        if lost_engine_gpu and self.plan is not None and self.sup.state != EngineState.STOPPED:
            log.warning("the engine's GPU %s went away: restarting on what is left", engine_slot)
            self.engine_log.mark(f"GPU {engine_slot} removed: restarting the engine")
            # The same request (port, --set overrides, demo) with the profile chosen afresh from
            # what is left; the model as resolved, so a profile default does not change with it.
            last = self.last_request or UpRequest()
            req = replace(last, profile=None, model=last.model or (None if last.demo else str(self.plan.model_dir)))
            try:
                await self.up(req)
            except errors.Exl3Error as exc:
                await self.sup.stop()
                self.sup.last_error = f"GPU {engine_slot} was removed and the model cannot be served without it: {exc}"
