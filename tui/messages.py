"""Messages from the poll worker to the app. Only the latest status/metrics/kernels matter, so
a newer one replaces a queued older one (`can_replace`); log text is appended, never replaced."""

from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message

from exl3local.api.metrics import MetricsSnapshot
from exl3local.api.protocol import DaemonStatus, KernelCounts


@dataclass
class StatusUpdated(Message):
    status: DaemonStatus

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, (StatusUpdated, DaemonLost))


@dataclass
class DaemonLost(Message):
    """No answer from the daemon (or an error instead of a status); the worker keeps retrying."""

    error: str
    hint: str = ""

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, (StatusUpdated, DaemonLost))


@dataclass
class MetricsUpdated(Message):
    snapshot: MetricsSnapshot
    at_s: float  # the dashboard's monotonic clock when the scrape came back (for rates)

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, MetricsUpdated)  # rates use the newest pair; skipping one is fine


@dataclass
class KernelsUpdated(Message):
    counts: KernelCounts

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, KernelsUpdated)


@dataclass
class LogsAppended(Message):
    text: str
    reset: bool = False  # first chunk, or the log rotated: drop what was shown before
