"""The whole buffered engine log on its own screen (`l` opens it, `l`/escape closes). Long lines wrap here, so
every line can be read in full (the main screen's tail cuts them at its edge)."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, RichLog


class LogScreen(Screen):
    BINDINGS = [
        Binding("escape", "app.pop_screen", "back"),
        Binding("l", "app.pop_screen", "back", show=False),
    ]

    def __init__(self, lines: list[str]) -> None:
        super().__init__()
        self._lines = lines

    def compose(self) -> ComposeResult:
        log = RichLog(id="log-full", wrap=True, markup=False, highlight=False, auto_scroll=True)
        log.border_title = "Engine log  (wrapped; l or esc: back)"
        yield log
        yield Footer()

    def on_mount(self) -> None:
        # after the first layout: RichLog wraps at the width it has when written
        self.call_after_refresh(self.append, self._lines, False)

    def append(self, lines: list[str], reset: bool) -> None:
        log = self.query_one(RichLog)
        if reset:
            log.clear()
        if lines:
            # one Text for the batch: RichLog renders (and wraps) each write once; TABs become spaces
            log.write(Text("\n".join(lines).expandtabs(8)), width=log.scrollable_content_region.width or None)
