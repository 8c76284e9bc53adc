"""`await wait_until(pilot, lambda: ...)`: let a Textual app run until a condition holds (for dashboard tests)."""

from __future__ import annotations

import asyncio


async def wait_until(pilot, predicate, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await pilot.pause(0.05)
