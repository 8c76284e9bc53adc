"""`exl3local dash`: argparse wiring only, so `exl3local.cli` stays free of textual."""

from __future__ import annotations

import argparse
import os

from exl3local import env


def _cmd_dash(args: argparse.Namespace) -> int:
    from exl3local.tui.app import make_dashboard  # lazy: imports textual, only `dash` needs it

    make_dashboard(args.host, poll_s=args.poll).run()
    return 0


def add_dash(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dash", help="live dashboard: engine state, tokens/s, memory, kernel paths, log")
    default = env.HOST.get() or "the Unix socket in the runtime dir"
    p.add_argument("--host", default=None, help=f"daemon address (default {default}, from {env.HOST.name}"
                   f"{'' if env.HOST.name in os.environ else ' or its default'})")
    p.add_argument("--poll", type=float, default=1.0, metavar="SECONDS", help="refresh interval (default 1)")
    p.set_defaults(handler=_cmd_dash)
