"""One vLLM child: its states, the /health wait, restart with backoff, stop of the whole group."""

from __future__ import annotations

from enum import StrEnum


class EngineState(StrEnum):
    STOPPED = "STOPPED"  # no engine, none wanted
    STARTING = "STARTING"  # spawned, /health not yet 200
    READY = "READY"  # /health 200: the OpenAI endpoint answers
    BACKOFF = "BACKOFF"  # exited unexpectedly; restarts after a delay
    STOPPING = "STOPPING"  # SIGTERM sent to the group, SIGKILL after a timeout
    FAILED = "FAILED"  # gave up after repeated fast failures; the daemon stays up
