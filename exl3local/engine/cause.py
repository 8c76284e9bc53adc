"""The first error of a failed engine start, found in its output: a command-line usage error or the
exception line that closes a Python traceback, with vLLM's per-process log prefixes removed."""

from __future__ import annotations

import re

# vLLM prefixes every line of its processes: "(EngineCore pid=12) ERROR 12-01 10:11:12 [core.py:1510] ".
_LINE_PREFIX = re.compile(r"(\([^()\n]* pid=\d+\) )?"
                          r"((?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\] ?)?")
_EXCEPTION = re.compile(r"[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)(: .*)?")
_USAGE_ERROR = re.compile(r"[\w .-]+: error: .+")  # argparse: "vllm: error: unrecognized arguments: --x"
_VARYING = re.compile(r"0x[0-9a-fA-F]+|\d+")  # pids, addresses, sizes: the same error with other numbers is the same
CAUSE_MAX_CHARS = 500


class CauseFinder:
    """The first error of one engine start: a command-line usage error ("vllm: error: ..."), or
    the Python exception line that closes a traceback ("Traceback (most recent call last):",
    indented frames, then `SomeError: message`), per vLLM process, with vLLM's log prefixes
    removed. Chained exceptions and the EngineCore's own traceback come before the API server's
    "Engine core initialization failed. See root cause above", so the first one is the root cause."""

    def __init__(self) -> None:
        self.cause: str | None = None
        self._in_traceback: dict[str, bool] = {}
        self._continue: tuple[str, int] | None = None  # pydantic's message follows on indented lines

    def feed(self, line: str) -> None:
        m = _LINE_PREFIX.match(line)
        source, text = m.group(1) or "", line[m.end():].rstrip("\r\n")
        if self._continue is not None and self._continue[0] == source and text.startswith(" ") and text.strip():
            self.cause = f"{self.cause} {text.strip()}"[:CAUSE_MAX_CHARS]
            left = self._continue[1] - 1
            self._continue = (source, left) if left else None
            return
        self._continue = None
        if text.startswith("Traceback (most recent call last):"):
            self._in_traceback[source] = True
        elif self.cause is None and not source and _USAGE_ERROR.fullmatch(text):
            self.cause = text[:CAUSE_MAX_CHARS]
        elif self._in_traceback.get(source) and not text.startswith((" ", "\t")):
            self._in_traceback[source] = False
            if self.cause is None and _EXCEPTION.fullmatch(text):
                self.cause = text[:CAUSE_MAX_CHARS]
                if re.search(r"validation errors? for \w+$", text):
                    self._continue = (source, 2)


def same_cause(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and _VARYING.sub("#", a) == _VARYING.sub("#", b)
