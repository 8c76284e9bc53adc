"""While READY: is the engine still alive? A member of its process group stopped (SIGSTOP, state T) on two
checks in a row, or /health unanswered for `hang_timeout_s`, is a hang; so is one declared from outside (the
endpoint saw no progress). The supervisor kills and restarts a hung group."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from exl3local.engine.procgroup import States, process_name


async def watch(pid: int, exited: asyncio.Future[int], *, spec: Any, policy: Any, clock: Callable[[], float],
                states: States, health: Callable[[Any], Awaitable[bool]],
                declared: Callable[[], str | None]) -> tuple[str, str]:
    """Until the leader `pid` exits ("exit", "") or the engine hangs ("hung", why). `declared()` takes a hang
    declared from outside, if any. The members are listed once (a /proc scan) and re-listed every 15 checks;
    in between only their own stat files are read."""
    members: list[int] = []
    stopped: set[int] = set()  # members seen stopped at the previous check
    unanswered_since: float | None = None
    check = 0
    while True:
        done, _ = await asyncio.wait({exited}, timeout=policy.liveness_poll_s)
        if done:
            return "exit", ""
        reason = declared()
        if reason is not None:
            return "hung", reason
        seen = states(pid, None if check % 15 == 0 or not members else members)
        members, check = list(seen), check + 1
        now_stopped = {p for p, st in seen.items() if st in "Tt"}
        if now_stopped & stopped:
            return "hung", ", ".join(f"{process_name(p)} (pid {p}) is stopped (state {seen[p]})"
                                     for p in sorted(now_stopped & stopped))
        stopped = now_stopped
        if await health(spec):
            unanswered_since = None
        elif exited.done():  # it failed /health because it just died
            return "exit", ""
        elif unanswered_since is None:
            unanswered_since = clock()
        elif clock() - unanswered_since >= policy.hang_timeout_s:
            return "hung", f"/health has not answered for {policy.hang_timeout_s:.0f} s"
