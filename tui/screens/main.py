"""The main screen: engine, throughput, memory and kernel-path panels over the engine log tail."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Grid
from textual.screen import Screen
from textual.widgets import Footer, Header

from exl3local.tui.widgets.engine import EnginePanel
from exl3local.tui.widgets.kernels import KernelPanel
from exl3local.tui.widgets.logtail import LogTail
from exl3local.tui.widgets.memory import MemoryPanel
from exl3local.tui.widgets.throughput import ThroughputPanel

# Lines kept in the main screen's tail; the log screen (`l`) holds the app's whole buffer.
TAIL_LINES = 200


class MainScreen(Screen):
    def compose(self) -> ComposeResult:
        yield Header()
        with Grid(id="panels"):
            yield _titled(EnginePanel(id="engine"), "Engine")
            yield _titled(ThroughputPanel(id="throughput"), "Throughput")
            yield _titled(MemoryPanel(id="memory"), "Memory")
            yield _titled(KernelPanel(id="kernels"), "EXL3 kernel paths")
        yield _titled(LogTail(id="log-tail", max_lines=TAIL_LINES), "Engine log  (l: expand)")
        yield Footer()


def _titled(widget, title: str):
    widget.border_title = title
    return widget
