"""The `exl3local` command line: the groups of subcommands (exl3local.commands) and the error exit codes."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from exl3local import __version__, env
from exl3local.commands import desktop, engine, machine, models, selftest
from exl3local.errors import Exl3Error
from exl3local.tui.command import add_dash

Handler = Callable[[argparse.Namespace], int]


# One entry per group of subcommands; each group's module keeps its handlers beside their parsers.
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    models.add_subcommands,  # inspect, pull, list, rm
    engine.add_subcommands,  # up, down, status, logs, daemon
    machine.add_subcommands,  # profile, doctor
    selftest.add_subcommands,  # selftest: every kernel path against the reference, in the engine's interpreter
    desktop.add_subcommands,  # service install|uninstall|status, tray ([tray] extra)
    add_dash,  # dash: the Textual dashboard (exl3local.tui), which imports textual only when run
]


def environment_help() -> str:
    """The EXL3LOCAL_* variables a user may set, with the value in effect now (set, or the default)."""
    rows = []
    for var in env.ALL:
        if var.doc.startswith("internal:") or not var.name.startswith("EXL3LOCAL_"):
            continue
        if not var.get():
            now = " not set"
        elif var.name.endswith("_KEY"):
            now = " set (not shown)"  # a secret
        else:
            now = f"={var.get()}" + ("" if var.name in os.environ else " (default)")
        rows.append(f"  {var.name}{now}\n      {var.doc}")
    return "environment (the value in effect now):\n" + "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="exl3local", description="Serve EXL3 models locally through vLLM.",
                                     epilog=environment_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"exl3local {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # a bare `exl3local`: the help, not a usage error
        parser.print_help()
        return 0
    handler: Handler = args.handler
    try:
        return handler(args)
    except Exl3Error as err:
        print(f"exl3local: error: {err}", file=sys.stderr)
        if err.hint:
            print(f"hint: {err.hint}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`exl3local status | head`): stop quietly, as shell tools do, and
        # point stdout at /dev/null so the interpreter's final flush cannot raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
