"""The engine's output pipe: drained until EOF whatever happens to its consumers (an undrained pipe blocks
vLLM's own writes, and with them every request), keeping what the supervisor reports from it: the last
TAIL_BYTES, the latest line (progress while loading), the start's first exception (its cause) and when
output last came (the stall timeout while loading)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from exl3local.engine.cause import CauseFinder

TAIL_BYTES = 8 * 1024  # Ollama's StatusWriter keeps the same amount of runner stderr


class EngineOutput:
    def __init__(self, clock: Callable[[], float], on_output: Callable[[bytes], None] | None) -> None:
        self.clock = clock
        self.on_output = on_output  # every chunk (the daemon's rotating log)
        self.errors = 0  # chunks on_output failed to take (they still reach the tail)
        self.new_start()

    def new_start(self) -> None:
        """A new engine process: its output starts from nothing."""
        self.progress = ""
        self.cause = CauseFinder()
        self.last = self.clock()
        self._tail: deque[bytes] = deque()
        self._tail_len = 0

    def tail_text(self) -> str:
        return b"".join(self._tail).decode("utf-8", "replace")[-TAIL_BYTES:]

    def keep(self, chunk: bytes) -> None:
        self._tail.append(chunk)
        self._tail_len += len(chunk)
        while self._tail_len - len(self._tail[0]) >= TAIL_BYTES and len(self._tail) > 1:
            self._tail_len -= len(self._tail.popleft())

    async def pump(self, stdout: asyncio.StreamReader | None) -> None:
        """Drain until EOF; a failing on_output (full disk under engine.log) drops the chunk, never the pump."""
        if stdout is None:
            return
        while True:
            try:
                chunk = await stdout.readuntil(b"\n")
            except asyncio.IncompleteReadError as exc:  # EOF: the last line had no newline
                chunk = exc.partial
            except asyncio.LimitOverrunError as exc:
                # A line over the reader's limit (64 KiB): take what is buffered, which readuntil
                # leaves in place (readline would have dropped it), and the rest comes next.
                chunk = await stdout.read(max(exc.consumed, 1))
            if not chunk:
                return
            self.keep(chunk)
            self.last = self.clock()
            line = chunk.decode("utf-8", "replace")
            self.cause.feed(line)
            if line.strip():
                self.progress = line.strip()[-200:]
            if self.on_output:
                try:
                    self.on_output(chunk)
                except Exception:  # noqa: BLE001 — the chunk is dropped, the pump goes on
                    self.errors += 1

    async def drain(self, reader: asyncio.Task[None]) -> None:
        """Let the last output land in the tail (the traceback of a failed start): until the pipe closes or
        stays quiet for a moment. EngineCore and workers may hold it open for seconds."""
        deadline = self.clock() + 1.0
        while not reader.done() and self.clock() < deadline:
            quiet_since = self.last
            await asyncio.wait({reader}, timeout=0.1)
            if self.last == quiet_since and self.clock() - quiet_since > 0.2:
                return
