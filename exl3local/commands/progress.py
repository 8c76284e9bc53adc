"""What `up` shows while the engine starts: the phase vLLM is in, read from its output, on one status line
that rich fits to the terminal's width (never a raw log line cut by characters: vLLM's lines hold TABs and
box-drawing characters that break a hand-made redraw).

The daemon reports the engine's latest output line (status `progress`); a poll may miss lines, so the phase
only moves forward and may skip one.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.status import Status
from rich.text import Text


@dataclass(frozen=True)
class Phase:
    label: str
    starts: re.Pattern[str]  # the first output line of this phase


# In the order vLLM goes through them (vLLM 0.32's messages, on the CPU and GPU engines alike).
PHASES = (
    Phase("importing vLLM", re.compile(r"")),
    # any line of vLLM's API server process: vLLM is imported and reads the model's config
    Phase("reading the model config", re.compile(r"APIServer pid=|non-default args|Resolved architecture")),
    Phase("starting the engine process", re.compile(r"Initializing a V1 LLM engine|EngineCore pid")),
    Phase("loading weights", re.compile(r"Starting to load model|checkpoint shards|Loading weights took")),
    # the plugin's load-time kernel self-test (kernels/selftest.py): its first compiles can take minutes on an iGPU
    Phase("checking EXL3 kernels", re.compile(r"exl3local: self-test")),
    Phase("allocating the KV cache", re.compile(r"KV cache size|for KV cache|Available KV cache memory|"
                                                r"num_gpu_blocks")),
    Phase("warming up / compiling", re.compile(r"[Ww]arming up|Compiling a graph|torch\.compile takes|"
                                               r"Capturing CUDA graphs|create kv cache, warmup model")),
    Phase("starting the HTTP server", re.compile(r"Supported tasks|Scale-out endpoints|Starting vLLM (API )?server|"
                                                 r"Available routes|Route: |Application startup")),
)
SHARDS = re.compile(r"checkpoint shards:\s*\d+%[^|]*\|\s*(\d+)/(\d+)")


class StartupPhases:
    """Feed it output lines; `label` is where start-up is now."""

    def __init__(self) -> None:
        self.index = 0
        self.shards = ""

    def feed(self, line: str) -> str:
        for i in range(len(PHASES) - 1, self.index, -1):
            if PHASES[i].starts.search(line):
                self.index = i
                break
        if (m := SHARDS.search(line)) and PHASES[self.index].label == "loading weights":
            self.shards = f" {m[1]}/{m[2]} shards"
        return self.label

    @property
    def label(self) -> str:
        phase = PHASES[self.index].label
        return phase + self.shards if phase == "loading weights" else phase


def printable(line: str) -> str:
    """One log line as plain text on one row: TABs and other control characters become spaces."""
    return re.sub(r"[\x00-\x1f\x7f]+", " ", line).strip()


class UpProgress:
    """`up`'s wait for READY: a spinner line with the state, the phase, the elapsed time and the latest
    output (cropped to the terminal by rich) on a terminal; one line per state or phase change otherwise."""

    def __init__(self, console: Console | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.console = console or Console(stderr=True)
        self.clock = clock
        self.t0 = clock()
        self.phases = StartupPhases()
        self.last = ("", "")
        self.status: Status | None = None

    def line(self, st: Any) -> Text:
        elapsed = self.clock() - self.t0
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append(f"{st.state.value:<8}", style="bold")
        text.append(f" {elapsed:4.0f} s  ")
        if st.state.value == "STARTING":
            text.append(self.phases.label, style="cyan")
            detail = printable(st.progress)
        else:
            detail = printable(st.last_error or "")
        if st.retry_in_s:
            text.append(f"  retry in {st.retry_in_s:.0f} s", style="yellow")
        if detail:
            text.append("  " + detail, style="dim")
        # cut in cells (wide and box-drawing characters count right), leaving room for the spinner
        text.truncate(max(self.console.width - 2, 20), overflow="ellipsis")
        return text

    def __call__(self, st: Any) -> None:
        if st.state.value == "STARTING" and st.progress:
            self.phases.feed(st.progress)
        now = (st.state.value, self.phases.label if st.state.value == "STARTING" else "")
        if self.console.is_terminal:
            if self.status is None:
                self.status = self.console.status(self.line(st), spinner="dots")
                self.status.start()
            else:
                self.status.update(self.line(st))
        elif now != self.last:
            elapsed = self.clock() - self.t0
            self.console.print(f"{now[0]} after {elapsed:.0f} s" + (f": {now[1]}" if now[1] else ""),
                               markup=False, highlight=False, soft_wrap=True)
        self.last = now

    def done(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None
