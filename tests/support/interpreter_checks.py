"""Triton's CPU interpreter without its overflow checks, where they can change nothing.

With the default options the interpreter checks every integer add, sub and mul of a kernel for overflow: it redoes
the operation in int64 and builds the bounds test, then hands it to `device_assert`, which drops it unless the
`debug` option is on (triton/language/semantic.py, Triton 3.x). So with debug off each check is work whose result
is thrown away, and the trellis decode is integer arithmetic: cProfile of the model-step smoke run put ~45 % of
its time there. Turning the checks off while debug is off gives the same results, faster.

    python -P interpreter_checks.py SCRIPT [ARGS...]   run SCRIPT as __main__ with the checks off (subprocesses)
"""

from __future__ import annotations

import dataclasses
import runpy
import sys


def drop_unused_overflow_checks() -> None:
    try:
        from triton.runtime.interpreter import interpreter_builder
    except ImportError:  # no Triton, or a Triton whose interpreter is laid out otherwise: only slower
        return
    options = interpreter_builder.options
    if not options.debug and getattr(options, "sanitize_overflow", False):
        interpreter_builder.options = dataclasses.replace(options, sanitize_overflow=False)


if __name__ == "__main__":
    drop_unused_overflow_checks()
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
