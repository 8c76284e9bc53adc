"""engine.log: everything the vLLM child prints, with size rotation and byte offsets for `logs -f`.

Writing must never stop the engine: the supervisor drains vLLM's stdout pipe into `write`, and a
pipe that is not drained blocks vLLM itself (completions and /health hang). So a write that fails
(full disk, quota, a removed directory) drops that chunk, counts it and keeps the error for
`status`; the next chunk tries again, so logging resumes once there is room.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

LOG_MAX_BYTES = 10 * 2**20
LOG_BACKUPS = 3
MARK_MAX_CHARS = 2000  # a mark quotes user input (model names, errors): keep each line bounded
READ_MAX_BYTES = 2**20  # of one `logs` answer from an offset
TAIL_MAX_BYTES = 2**20  # how far back `tail` looks for its lines


class EngineLog:
    """engine.log with size rotation. Offsets count every byte written since the daemon started
    (rotated files included), so `logs -f` can tell "nothing new" from "rotated meanwhile"."""

    def __init__(self, path: Path, max_bytes: int = LOG_MAX_BYTES, backups: int = LOG_BACKUPS) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self.errors = 0  # writes dropped since the daemon started
        self.dropped_bytes = 0
        self.last_error: str | None = None
        # Unbuffered: a failed write leaves nothing behind in a buffer to be retried forever.
        self._f: Any = None  # held open for the daemon's life; None while it cannot be opened
        self._size = 0
        try:
            self._open()
        except OSError as exc:
            self._failed(exc, 0)
        self.base = -self._size  # offset of the current file's byte 0; what was there before counts as 0

    def write(self, chunk: bytes) -> None:
        try:
            if self._f is None or self._f.closed:  # opening or a rotation failed earlier: try again
                self._open()
            if self._size + len(chunk) > self.max_bytes:
                self._rotate()
            view = memoryview(chunk)
            while view:
                n = self._f.write(view)
                self._size += n
                view = view[n:]
        except OSError as exc:
            self._failed(exc, len(chunk))

    def _failed(self, exc: OSError, dropped: int) -> None:
        self.errors += 1
        self.dropped_bytes += dropped
        self.last_error = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {self.path}: {exc.strerror or exc}"

    def _open(self) -> None:
        self._f = open(self.path, "ab", buffering=0)  # noqa: SIM115
        self._size = os.fstat(self._f.fileno()).st_size

    def _rotate(self) -> None:
        self._f.close()
        try:
            for i in range(self.backups - 1, 0, -1):
                src = self.path.with_name(f"{self.path.name}.{i}")
                if src.exists():
                    src.replace(self.path.with_name(f"{self.path.name}.{i + 1}"))
            self.path.replace(self.path.with_name(f"{self.path.name}.1"))
            self.base += self._size
        finally:
            self._open()

    def mark(self, text: str) -> None:
        if len(text) > MARK_MAX_CHARS:
            text = f"{text[:MARK_MAX_CHARS]}… ({len(text)} characters)"
        self.write(f"--- exl3local {time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n".encode())

    def read(self, *, tail: int | None = None, offset: int | None = None) -> dict[str, Any]:
        """Only what is asked for is read: from `offset` at most READ_MAX_BYTES (the answer's
        offset says where to go on), or the last `tail` lines from a few blocks before the end;
        never the whole file on every `logs -f` poll."""
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                end = self.base + size
                if offset is None:
                    return {"text": _last_lines(f, size, tail or 200).decode("utf-8", "replace"),
                            "offset": end, "rotated": False}
                # Below base: rotated away since. Past the end: an offset from an earlier daemon.
                rotated = not self.base <= offset <= end
                start = 0 if rotated else offset - self.base
                f.seek(start)
                data = f.read(READ_MAX_BYTES)
        except OSError:
            return {"text": "", "offset": self.base, "rotated": offset is not None and offset != self.base}
        if len(data) == READ_MAX_BYTES and b"\n" in data:
            data = data[: data.rindex(b"\n") + 1]  # whole lines: no character split between two answers
        return {"text": data.decode("utf-8", "replace"), "offset": self.base + start + len(data), "rotated": rotated}

    def health(self) -> dict[str, Any]:
        """For /api/status: writes dropped since the daemon started, and the latest error."""
        return {"log_errors": self.errors, "log_dropped_bytes": self.dropped_bytes, "log_last_error": self.last_error}

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


def _last_lines(f: Any, size: int, n: int) -> bytes:
    """The last n lines of an open file, read backwards in blocks (at most TAIL_MAX_BYTES)."""
    data = b""
    pos = size
    while pos > 0 and data.count(b"\n") <= n and len(data) < TAIL_MAX_BYTES:
        step = min(64 * 1024, pos)
        pos -= step
        f.seek(pos)
        data = f.read(step) + data
    lines = data.splitlines(keepends=True)
    if pos > 0:
        lines = lines[1:]  # it may start mid-line
    return b"".join(lines[-n:])
