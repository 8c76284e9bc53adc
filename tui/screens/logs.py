"""The whole buffered engine log on its own screen (`l` opens it, `l`/escape closes)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Log


class LogScreen(Screen):
    BINDINGS = [
        Binding("escape", "app.pop_screen", "back"),
        Binding("l", "app.pop_screen", "back", show=False),
    ]

    def __init__(self, lines: list[str]) -> None:
        super().__init__()
        self._lines = lines

    def compose(self) -> ComposeResult:
        log = Log(id="log-full", auto_scroll=True)
        log.border_title = "Engine log"
        yield log
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(Log).write_lines(self._lines)

    def append(self, lines: list[str], reset: bool) -> None:
        log = self.query_one(Log)
        if reset:
            log.clear()
        log.write_lines(lines)
