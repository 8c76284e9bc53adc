"""Engine output a user cannot act on, folded when `exl3local logs` shows engine.log (the file keeps every line).

vLLM and the libraries under it print warnings about their own build and environment on every start on a
CPU (no Triton CPU backend, tcmalloc/libiomp not preloaded, the ulimit, deprecations inside vLLM, nanobind's
leak report at exit, xgrammar's regex notes). None of them is about the user's model or setup, and they
made up a third of a start's log. Each run of such lines becomes one marker line naming what was folded.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# vLLM's per-process prefix, "(EngineCore pid=12) WARNING 12-01 10:11:12 [core.py:1510] "
_PREFIX = re.compile(r"^(\([^()\n]* pid=\d+\) )?((DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\] ?)?")
NOISE: tuple[tuple[str, re.Pattern[str]], ...] = tuple((what, re.compile(pattern)) for what, pattern in (
    ("Triton's CPU backend", r"^Triton is installed, but doesn't include CPU backend|^Triton is not installed\. "
                             r"triton-cpu is expected|^Model Runner V2 requires Triton"),
    ("tcmalloc/libiomp", r"^lib(tcmalloc|iomp) is not found in LD_PRELOAD"),
    ("ulimit", r"^Found ulimit of \d+ and failed to automatically increase"),
    ("Python warnings", r"^\S+\.py:\d+: (FutureWarning|DeprecationWarning|UserWarning): "),
    ("nanobind's leak report", r"^nanobind: |^ - leaked |^ - \.\.\. skipped remainder|^See https://nanobind"),
    ("NUMA binding", r"^\[W\d{4} [\d:.]+ utils\.cpp:\d+\] Warning: NUMA binding"),
    ("xgrammar regex notes", r"^\[[\d:]+\] \S+regex_converter\.cc:\d+: Warning: Regex parsing warning"),
    ("vLLM's argument parser", r"^Found duplicate keys --"),
))
HOW_TO_SEE = "`exl3local logs --all` shows them"


def noise(line: str) -> str | None:
    """What kind of noise the line is (see NOISE), or None for a line worth showing."""
    text = line[_PREFIX.match(line).end():]
    return next((what for what, pattern in NOISE if pattern.search(text)), None)


def fold(lines: Iterable[str]) -> list[str]:
    """The lines with each run of noise replaced by one marker line. A Python warning's source line (indented,
    right after it) goes with it."""
    out: list[str] = []
    run: list[str] = []  # kinds of the noise lines in the current run
    after_warning = False
    for line in lines:
        kind = noise(line)
        if kind is None and after_warning and line.startswith("  ") and line.strip():
            kind = "Python warnings"
        after_warning = kind == "Python warnings"
        if kind is not None:
            run.append(kind)
            continue
        if run:
            out.append(_marker(run))
            run = []
        out.append(line)
    if run:
        out.append(_marker(run))
    return out


def _marker(kinds: list[str]) -> str:
    named = ", ".join(dict.fromkeys(kinds))
    return f"[exl3local: {len(kinds)} line{'s' if len(kinds) > 1 else ''} of library noise folded ({named}); {HOW_TO_SEE}]"
