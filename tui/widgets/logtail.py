"""The engine log's last lines on the main screen (`l` opens the whole buffer on its own screen)."""

from __future__ import annotations

from textual import events
from textual.widgets import Log


class LogTail(Log):
    """A Log that stays on its newest line when the panels above it grow or shrink: Log itself
    scrolls to the end only when text is written, so a resize would leave it showing old lines."""

    def on_resize(self, event: events.Resize) -> None:
        if self.auto_scroll:
            self.scroll_end(animate=False, immediate=True)
