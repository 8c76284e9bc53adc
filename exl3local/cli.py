"""The `exl3local` command line. Heavy modules are imported inside each handler."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from exl3local import control, pull, service, tray
from exl3local.errors import Exl3Error
from exl3local.tui.command import add_dash

Handler = Callable[[argparse.Namespace], int]


def _cmd_inspect(args: argparse.Namespace) -> int:
    from exl3local import manifest

    m = manifest.read(args.path)
    print(m.to_json() if args.json else m.summary())
    return 0


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="summarise an EXL3 checkpoint without loading its weights")
    p.add_argument("path", help="checkpoint directory")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    p.set_defaults(handler=_cmd_inspect)


# Each entry adds one subcommand; the owning module keeps its handler beside it.
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_inspect,
    pull.add_subcommands,  # pull, list, rm
    control.add_subcommands,  # up, down, status, logs, profile, doctor, daemon
    service.add_subcommands,  # service install|uninstall|status
    tray.add_subcommands,  # tray: status icon + menu ([tray] extra)
    add_dash,  # dash: the Textual dashboard (exl3local.tui)
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="exl3local", description="Serve EXL3 models locally through vLLM.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
