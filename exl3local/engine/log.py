"""engine.log: everything the vLLM child prints, with size rotation and byte offsets for `logs -f`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

LOG_MAX_BYTES = 10 * 2**20
LOG_BACKUPS = 3


class EngineLog:
    """engine.log with size rotation. Offsets count every byte written since the daemon started
    (rotated files included), so `logs -f` can tell "nothing new" from "rotated meanwhile"."""

    def __init__(self, path: Path, max_bytes: int = LOG_MAX_BYTES, backups: int = LOG_BACKUPS) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self._f = open(path, "ab")  # noqa: SIM115 — held open for the daemon's life
        self.base = -self._f.tell()  # offset of the current file's byte 0; what was there before counts as 0

    def write(self, chunk: bytes) -> None:
        if self._f.tell() + len(chunk) > self.max_bytes:
            self._rotate()
        self._f.write(chunk)
        self._f.flush()

    def _rotate(self) -> None:
        self.base += self._f.tell()
        self._f.close()
        for i in range(self.backups - 1, 0, -1):
            src = self.path.with_name(f"{self.path.name}.{i}")
            if src.exists():
                src.replace(self.path.with_name(f"{self.path.name}.{i + 1}"))
        self.path.replace(self.path.with_name(f"{self.path.name}.1"))
        self._f = open(self.path, "ab")  # noqa: SIM115

    def mark(self, text: str) -> None:
        self.write(f"--- exl3local {time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n".encode())

    def read(self, *, tail: int | None = None, offset: int | None = None) -> dict[str, Any]:
        data = self.path.read_bytes() if self.path.exists() else b""
        end = self.base + len(data)
        if offset is not None:
            # Below base: rotated away since. Past the end: an offset from an earlier daemon.
            rotated = not self.base <= offset <= end
            start = 0 if rotated else offset - self.base
            return {"text": data[start:].decode("utf-8", "replace"), "offset": end, "rotated": rotated}
        lines = data.splitlines(keepends=True)[-(tail or 200):]
        return {"text": b"".join(lines).decode("utf-8", "replace"), "offset": end, "rotated": False}

    def close(self) -> None:
        self._f.close()
