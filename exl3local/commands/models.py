"""CLI subcommands for models: inspect, pull, list, rm."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from exl3local import manifest
from exl3local.api.client import DaemonClient
from exl3local.api.protocol import ENGINE_ALIVE
from exl3local.errors import BudgetError, ConfigError, DaemonUnavailable, Exl3Error
from exl3local.models import catalog, hub, store
from exl3local.models.store import ModelRef, PulledModel
from exl3local.units import format_bytes


def _cmd_pull(args: argparse.Namespace) -> int:
    ref = ModelRef.parse(args.model)
    model = hub.pull(ref, force=args.force, fit_check=hub.fits_this_machine, progress=not args.quiet)
    print(f"{model.name} ({model.commit[:12]}, {format_bytes(model.size_bytes)}) → {model.path}")
    return 0


def _fits(model_dir: Path | str) -> str:
    try:
        hub.fits_this_machine(manifest.read(model_dir))
    except BudgetError:
        return "no"
    except Exl3Error:
        return "?"
    return "yes"


def _cmd_list(args: argparse.Namespace) -> int:
    models = store.records()
    if args.json:
        print(json.dumps([{**asdict(m), "fits": _fits(m.path)} for m in models], indent=2))
        return 0
    rows = [("NAME", "COMMIT", "BPW", "SIZE", "FITS", "ARCHITECTURE")]
    rows += [
        (m.name, m.commit[:12], f"{m.bits:g}" if m.bits else "?", format_bytes(m.size_bytes), _fits(m.path), m.architecture)
        for m in models
    ]
    for name, rec in sorted(catalog.registered().items()):
        try:
            m = manifest.read(rec["path"])
        except Exl3Error:
            rows.append((name, "-", "?", "?", "?", f"unreadable: {rec['path']}"))
            continue
        bits = m.quantization_config.get("bits")
        rows.append((name, "-", f"{bits:g}" if isinstance(bits, int | float) else "?", format_bytes(m.bytes_on_disk),
                     _fits(rec["path"]), f"{m.architecture} (registered: {rec['path']})"))
    demo = manifest.read(store.DEMO_MODEL)
    bits = demo.quantization_config.get("bits")
    rows.append(("demo (bundled: `up --demo`)", "-", f"{bits:g}" if isinstance(bits, int | float) else "?",
                 format_bytes(demo.bytes_on_disk), _fits(store.DEMO_MODEL), demo.architecture))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    if not models:
        print("\nNothing pulled yet: `exl3local pull REPO[:REVISION]` downloads a model, and `exl3local up` "
              "offers to pull the profile's default one.")
    return 0


def _served(model: PulledModel) -> bool:
    """Is the daemon serving (or starting) this revision? Its files must not vanish under vLLM."""
    try:
        with DaemonClient() as client:
            status = client.status()
    except DaemonUnavailable:
        return False
    label = status.model or ""
    return status.state in ENGINE_ALIVE and (model.path in label or model.commit[:12] in label)


def _cmd_rm(args: argparse.Namespace) -> int:
    if args.model == "demo":
        raise ConfigError("the demo model is bundled in the package, not pulled: there is nothing to remove",
                          hint="`exl3local list` shows what is pulled")
    try:
        ref = ModelRef.parse(args.model)
    except ConfigError:  # not a hub name at all: it cannot have been pulled either
        raise ConfigError(f"{args.model}: not pulled", hint="`exl3local list` shows what is; rm takes REPO[:REVISION]") from None
    every_revision = ":" not in args.model and "@" not in args.model
    matches = [
        m for m in store.records()
        if m.repo_id == ref.repo_id and (every_revision or ref.revision in (m.revision, m.commit))
    ]  # fmt: skip
    if not matches:
        raise ConfigError(f"{args.model}: not pulled", hint="`exl3local list` shows what is")
    for m in matches:
        if _served(m):
            raise ConfigError(f"{m.name} is being served by the daemon", hint="`exl3local down` (or `up` another model) first")
        if not args.yes:
            try:
                answer = input(f"Remove {m.name} ({m.commit[:12]}, {format_bytes(m.size_bytes)})? [y/N] ")
            except EOFError:
                answer = ""
            if answer.strip().lower() not in {"y", "yes"}:
                print(f"kept {m.name}")
                continue
        print(f"removed {m.name}, freed {format_bytes(store.remove(m))}")
    return 0


def _cmd_register(args: argparse.Namespace) -> int:
    if args.remove:
        if not catalog.unregister(args.name):
            raise ConfigError(f"{args.name}: not a registered name", hint="`exl3local list` shows the registered ones")
        print(f"{args.name} is no longer registered (its directory is untouched)")
        return 0
    if args.path is None:
        raise ConfigError("register takes NAME DIR", hint="e.g. `exl3local register my-model ~/models/my-exl3`")
    model = catalog.register(args.name, args.path)
    print(f"{model.name} → {model.path}: requests naming `{model.name}` load it; `exl3local up {model.name}` serves it")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from exl3local.daemon.plan import read_checkpoint  # lazy: the daemon's planning code loads for inspect only

    m = read_checkpoint(Path(args.path).resolve())  # errors name the directory looked in, not just "config.json"
    print(m.to_json() if args.json else m.summary())
    return 0


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="summarise an EXL3 checkpoint without loading its weights")
    p.add_argument("path", help="checkpoint directory")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    p.set_defaults(handler=_cmd_inspect)
    p = sub.add_parser("pull", help="download an EXL3 model from the Hugging Face hub, checked before download")
    p.add_argument("model", metavar="REPO[:REVISION]", help="e.g. turboderp/Qwen3-8B-exl3:4.0bpw")
    p.add_argument("--force", action="store_true", help="pull even if the model does not fit this machine's profile")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.set_defaults(handler=_cmd_pull)
    p = sub.add_parser("list", help="list pulled models; FITS: does it fit the profile `up` would use here")
    p.add_argument("--json", action="store_true", help="print the records as JSON (with FITS as `fits`)")
    p.set_defaults(handler=_cmd_list)
    p = sub.add_parser("register", help="name a local EXL3 checkpoint directory, so requests can ask for it")
    p.add_argument("name", help="the `model` name requests use (and /v1/models lists)")
    p.add_argument("path", nargs="?", metavar="DIR", help="checkpoint directory")
    p.add_argument("--remove", action="store_true", help="forget NAME (the directory stays)")
    p.set_defaults(handler=_cmd_register)
    p = sub.add_parser("rm", help="remove a pulled model from the hub cache")
    p.add_argument("model", metavar="REPO[:REVISION]", help="without a revision: every pulled revision of REPO")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask")
    p.set_defaults(handler=_cmd_rm)
