"""`exl3local up --dry-run`: the plan a real `up` would start, printed instead of started."""

from __future__ import annotations

import argparse
import json
import os
import shlex
from pathlib import Path

from exl3local import env, profiles
from exl3local.api.protocol import UpRequest
from exl3local.daemon.plan import plan
from exl3local.models import store
from exl3local.units import format_bytes

def dry_run(args: argparse.Namespace) -> int:
    """`up --dry-run`: the plan a real `up` would start, made by the same code (daemon/plan.py) in this process
    with this shell's environment, printed; no daemon, no engine, no download, no temp dir."""
    model = args.model
    if model is not None and not isinstance(store.parse_argument(model), store.ModelRef):
        model = str(Path(model).resolve())
    req = UpRequest(model=model, profile=args.profile, port=args.port,
                    overrides=profiles.parse_overrides(args.set), demo=args.demo)
    p = plan(req, sysfs_root=Path(env.SYSFS.get()), dry_run=True)
    info = p.describe(os.environ)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print("dry run: nothing was started (no daemon, no engine)")
    print(f"model      {info['model']}")
    print(f"profile    {info['profile']}")
    for reason in info["profile_reasons"]:
        print(f"           {reason}")
    gpu = p.gpu
    print(f"device     {gpu.name} ({gpu.kind}{', ' + gpu.pci_id if gpu.pci_id else ''}, "
          f"{format_bytes(gpu.memory_bytes)}: {gpu.memory_source})")
    for line in info["budget"]["lines"]:
        print(f"budget     {line}")
    for note in info["notes"]:
        print(f"note       {note}")
    print(f"endpoint   {info['endpoint']}")
    print(f"command    (cwd /) {shlex.join(info['argv'])}")
    for key, value in info["env_changed"].items():
        print(f"env        {key}={value}")
    for key in info["env_removed"]:
        print(f"env        {key} (removed)")
    same = len(info["env"]) - len(info["env_changed"])
    print(f"env        + {same} variables as in this shell (secrets hidden; --json lists all)")
    return 0
