"""The daemon process: one per user (a flock), its own log, serving until shutdown or a signal."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import logging.handlers
import os
from collections.abc import Callable
from pathlib import Path

import uvloop

from exl3local import errors, paths
from exl3local.api.protocol import UpRequest
from exl3local.daemon.server import Listen, serve
from exl3local.daemon.service import Daemon
from exl3local.engine.log import LOG_BACKUPS, LOG_MAX_BYTES


class InstanceLock:
    """flock on the runtime dir's daemon.lock: held for the daemon's life, released by the
    kernel if it dies, so a stale file never blocks the next daemon. The file is never deleted:
    a daemon starting meanwhile may have opened it already and would lock the unlinked file
    while a third one creates and locks a new one (two daemons, each holding "the" lock)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def acquire(self) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self.fd = fd
        return True

    def holder(self) -> str:
        with contextlib.suppress(OSError):
            return self.path.read_text().strip()
        return "?"

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # no pid: clients then know no daemon holds it
            os.close(self.fd)
            self.fd = None


LOG_LINE_MAX_CHARS = 2000
# Libraries whose INFO lines are not the daemon's story: httpx logs one line per request the daemon
# makes (every dashboard poll of /api/metrics scrapes vLLM), which filled daemon.log.
QUIET_LOGGERS = ("httpx", "aiohttp", "uvicorn")  # uvicorn: its start-up lines; warnings still pass


class ClippedFormatter(logging.Formatter):
    """Each line of a record at most LOG_LINE_MAX_CHARS: a request can carry a 900 KB model name,
    and the error quoting it must not copy it into daemon.log."""

    def format(self, record: logging.LogRecord) -> str:
        lines = super().format(record).split("\n")
        return "\n".join(f"{line[:LOG_LINE_MAX_CHARS]}… ({len(line)} characters)" if len(line) > LOG_LINE_MAX_CHARS
                         else line for line in lines)


def setup_logging(foreground: bool) -> None:
    handler = logging.handlers.RotatingFileHandler(paths.daemon_log(), maxBytes=LOG_MAX_BYTES, backupCount=LOG_BACKUPS)
    handlers: list[logging.Handler] = [handler]
    if foreground:
        handlers.append(logging.StreamHandler())
    formatter = ClippedFormatter("%(asctime)s %(name)s %(levelname)s %(message)s")
    for h in handlers:
        h.setFormatter(formatter)
    logging.basicConfig(level=logging.INFO, handlers=handlers, force=True)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def run(*, foreground: bool = False, initial: UpRequest | None = None,
        on_ready: Callable[[Daemon], None] | None = None) -> int:
    """The daemon process: lock, serve until shutdown or a signal. `initial` brings a model
    up at start (`up --foreground`). Refuses (Exl3Error) while another daemon holds the lock."""
    lock = InstanceLock(paths.lock_file())
    if not lock.acquire():
        raise errors.Exl3Error(f"an exl3local daemon is already running (pid {lock.holder()})",
                               hint="talk to it with `exl3local status`, or stop it with `exl3local down`")
    setup_logging(foreground)
    try:
        # uvloop: the endpoint's per-chunk cost is mostly event-loop work (socket reads and writes, wakeups),
        # which uvloop does in C; on a 2-core box every ms of the daemon's CPU is a ms the engine waits for a core
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(_main(Daemon(), Listen(), initial, on_ready))
    finally:
        lock.release()


async def _main(daemon: Daemon, listen: Listen, initial: UpRequest | None,
                on_ready: Callable[[Daemon], None] | None) -> int:
    async def bring_up() -> None:
        if initial is not None:
            try:
                await daemon.up(initial)
            except errors.Exl3Error:
                daemon._stop.set()
                raise
        if on_ready:
            on_ready(daemon)

    task: asyncio.Task[None] | None = None

    def started() -> None:
        nonlocal task
        task = asyncio.get_running_loop().create_task(bring_up())

    await serve(daemon, listen, ready=started)
    if task is not None and task.done() and not task.cancelled() and task.exception():
        raise task.exception()  # type: ignore[misc]
    return 0
