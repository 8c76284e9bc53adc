"""`exl3local dash`: argparse wiring only, so `exl3local.cli` stays free of textual."""

from __future__ import annotations

import argparse


def _cmd_dash(args: argparse.Namespace) -> int:
    from exl3local.tui.app import make_dashboard  # lazy: imports textual, only `dash` needs it

    make_dashboard(args.host, poll_s=args.poll).run()
    return 0


def add_dash(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dash", help="live dashboard: engine state, tokens/s, memory, kernel paths, log")
    p.add_argument("--host", default=None, help="daemon address (default: EXL3LOCAL_HOST or 127.0.0.1:11435)")
    p.add_argument("--poll", type=float, default=1.0, metavar="SECONDS", help="refresh interval (default 1)")
    p.set_defaults(handler=_cmd_dash)
