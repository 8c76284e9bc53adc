"""A bystander for benches on a shared box: a process apart from everything measured that only sleeps 10 ms at a time
and reports each oversleep with the part of it spent runnable but not running (schedstat's run delay). When it wakes
late too, the stall was not the measured path's; its run delay tells a scheduler that left runnable tasks waiting
(the 2-vCPU VM of session 18: all of each stall) from a machine that was paused."""

from __future__ import annotations

import asyncio
import sys

Stall = tuple[float, float, float]  # start and end (time.monotonic, s), the run-queue wait within it (s)

SENTINEL = """
import time
def queued():
    try:
        return int(open("/proc/self/schedstat").read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0
while True:
    t, q = time.monotonic(), queued()
    time.sleep(0.01)
    late = time.monotonic() - t - 0.01
    if late > 0.02:
        print(f"{t + 0.01:.4f} {late:.4f} {queued() - q:.4f}", flush=True)
"""


async def watch(stalls: list[Stall]) -> None:
    """Run the sentinel until cancelled, appending each stall it saw to `stalls`."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", SENTINEL, stdout=asyncio.subprocess.PIPE)
    try:
        async for line in proc.stdout:
            start, late, queued = map(float, line.split())
            stalls.append((start, start + late, queued))
    finally:
        proc.kill()
        await proc.wait()


def longest_overlap(span: tuple[float, float], stalls: list[Stall]) -> float:
    """The longest stall's part inside `span` (s)."""
    return max((min(b, span[1]) - max(a, span[0]) for a, b, _ in stalls if a < span[1] and b > span[0]),
               default=0.0)


def queued_share(stalls: list[Stall], longer_than: float) -> float | None:
    """The part of the stalls over `longer_than` s that the sentinel spent runnable, waiting for a CPU; None: none."""
    long = [(b - a, q) for a, b, q in stalls if b - a > longer_than]
    return sum(q for _, q in long) / sum(d for d, _ in long) if long else None
