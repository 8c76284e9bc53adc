"""Throughput panel: prompt/generation tokens per second as sparklines, queue and latency numbers."""

from __future__ import annotations

from collections import deque

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Sparkline, Static

from exl3local.api.metrics import MetricsSnapshot, rate_per_s
from exl3local.units import format_duration

# Two minutes at the default 1 s poll: enough to see a burst of requests and its tail.
HISTORY_SAMPLES = 120
# Latency percentiles cover the last minute of requests; with none in it, everything since start.
LATENCY_WINDOW_S = 60.0
NO_METRICS = Text("no metrics: the engine is not READY", style="dim")


def human_latency(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


class ThroughputPanel(Widget):
    """Feed it scrapes with `record`; it keeps the rate history and redraws."""

    gen_tok_s: reactive[float | None] = reactive(None, init=False)
    prompt_tok_s: reactive[float | None] = reactive(None, init=False)
    snapshot: reactive[MetricsSnapshot | None] = reactive(None, init=False)

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._gen_history: deque[float] = deque(maxlen=HISTORY_SAMPLES)
        self._prompt_history: deque[float] = deque(maxlen=HISTORY_SAMPLES)
        self._history_at: deque[float] = deque(maxlen=HISTORY_SAMPLES + 1)  # scrape times around the rates
        self._last: tuple[MetricsSnapshot, float] | None = None
        self._window: deque[tuple[float, MetricsSnapshot]] = deque()  # scrapes of the last minute

    def compose(self) -> ComposeResult:
        with Horizontal(classes="rate-row"):
            yield Static("Generation", classes="rate-label")
            yield Sparkline([], id="gen-spark")
            yield Static("–", id="gen-rate", classes="rate-value")
        with Horizontal(classes="rate-row"):
            yield Static("Prompt", classes="rate-label")
            yield Sparkline([], id="prompt-spark")
            yield Static("–", id="prompt-rate", classes="rate-value")
        yield Static("", id="spark-span")
        yield Static(NO_METRICS, id="queue")

    def record(self, snapshot: MetricsSnapshot, at_s: float) -> None:
        """One scrape. Rates need two; the first only sets the baseline."""
        if self._last is not None:
            before, before_s = self._last
            elapsed = at_s - before_s
            self._gen_history.append(
                rate_per_s(before.generation_tokens_total, snapshot.generation_tokens_total, elapsed)
            )
            self._prompt_history.append(rate_per_s(before.prompt_tokens_total, snapshot.prompt_tokens_total, elapsed))
            self.gen_tok_s = self._gen_history[-1]
            self.prompt_tok_s = self._prompt_history[-1]
            self.query_one("#gen-spark", Sparkline).data = list(self._gen_history)
            self.query_one("#prompt-spark", Sparkline).data = list(self._prompt_history)
            if not self._history_at:
                self._history_at.append(before_s)
            self._history_at.append(at_s)
            self.query_one("#spark-span", Static).update(_span_text(self._history_at[-1] - self._history_at[0]))
        self._last = (snapshot, at_s)
        self._window.append((at_s, snapshot))
        while self._window and at_s - self._window[0][0] > LATENCY_WINDOW_S:
            self._window.popleft()
        self.snapshot = snapshot

    def watch_gen_tok_s(self, value: float | None) -> None:
        self.query_one("#gen-rate", Static).update(_rate_text(value))

    def watch_prompt_tok_s(self, value: float | None) -> None:
        self.query_one("#prompt-rate", Static).update(_rate_text(value))

    def watch_snapshot(self, snap: MetricsSnapshot | None) -> None:
        if snap is None:
            self.query_one("#queue", Static).update(NO_METRICS)
            return
        ttft, itl, span = snap.ttft, snap.itl, "since start"
        oldest = self._window[0][1] if self._window else snap
        if snap.ttft.since(oldest.ttft).count > 0 or snap.itl.since(oldest.itl).count > 0:
            ttft, itl, span = snap.ttft.since(oldest.ttft), snap.itl.since(oldest.itl), "last minute"
        text = Text.assemble(
            ("requests ", "bold"), f"running {snap.requests_running:.0f} · waiting {snap.requests_waiting:.0f}",
            f" · done {snap.request_success_total:.0f}", (" since start\n", "dim"),
            ("tokens   ", "bold"), f"{snap.prompt_tokens_total:,.0f} prompt · {snap.generation_tokens_total:,.0f} generated",
            (" since start\n", "dim"),
            ("TTFT     ", "bold"), f"p50 {human_latency(ttft.quantile(0.5))} · p95 {human_latency(ttft.quantile(0.95))}",
            (f"  ({span})\n", "dim"),
            ("ITL      ", "bold"), f"p50 {human_latency(itl.quantile(0.5))} · p95 {human_latency(itl.quantile(0.95))}",
            (f"  ({span})", "dim"),
            ("\npreempted", "bold"), f" {snap.preemptions_total:.0f}", (" since start", "dim"),
        )
        self.query_one("#queue", Static).update(text)

    def clear(self) -> None:
        """The engine went away: its counters restart from zero, so drop the baseline too."""
        self._last = None
        self._window.clear()
        self._history_at.clear()
        self.gen_tok_s = None
        self.prompt_tok_s = None
        self.snapshot = None


def _span_text(seconds: float) -> Text:
    """What the sparklines cover: the rates of the last `seconds`, oldest on the left."""
    return Text(f"{'':11}◂ the last {format_duration(seconds)}, newest on the right", style="dim")


def _rate_text(value: float | None) -> Text:
    return Text("–", style="dim") if value is None else Text(f"{value:8.1f} tok/s", style="bold")
