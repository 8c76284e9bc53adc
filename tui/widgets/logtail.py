"""The engine log's last lines on the main screen (`l` opens the whole buffer on its own screen)."""

from __future__ import annotations

from rich.segment import Segment
from textual import events
from textual.strip import Strip
from textual.widgets import Log

ELLIPSIS = "…"


class LogTail(Log):
    """A Log that stays on its newest line when the panels above it grow or shrink (Log itself scrolls to
    the end only when text is written, so a resize would leave it showing old lines), and marks a line cut
    at the right edge with an ellipsis instead of clipping it silently mid-word."""

    def on_resize(self, event: events.Resize) -> None:
        if self.auto_scroll:
            self.scroll_end(animate=False, immediate=True)

    def render_line(self, y: int) -> Strip:
        strip = super().render_line(y)
        scroll_x, scroll_y = self.scroll_offset
        width = self.scrollable_content_region.width  # the scrollbar covers the rest of size.width
        if width < 2 or scroll_y + y >= self.line_count:
            return strip
        if len(self._process_line(self.lines[scroll_y + y])) <= scroll_x + width:
            return strip
        return Strip.join([strip.crop(0, width - 1), Strip([Segment(ELLIPSIS, self.rich_style)])])
