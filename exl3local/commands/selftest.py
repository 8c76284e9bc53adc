"""`exl3local selftest [--json]`: every EXL3 kernel path, codebook and bit width checked against the reference
decoder on this machine's device, as one report.

The checks run in the engine's interpreter (EXL3LOCAL_ENGINE_PYTHON, else this one), where torch, Triton and the
device stack live: `python -P -m exl3local.kernels.selftest` prints the report as JSON on stdout and one line per
check on stderr, which this command turns into a status line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict

from rich.console import Console
from rich.table import Table

from exl3local import env
from exl3local.errors import Exl3Error

SELFTEST_MODULE = "exl3local.kernels.selftest"
PLUGIN_CHECK_MODULE = "exl3local.plugin.check"
PLUGIN_CHECK_MARK = "EXL3CHECK "


def kernel_notes(client) -> list[str]:
    """status' lines for EXL3 kernel paths that are not in service (the kernel self-test took them out, or layers
    fell back to the reference on a GPU), from the daemon's GET /api/kernels; none without a running engine."""
    try:
        counts = client.kernels()
    except Exl3Error:
        return []
    return [f"kernels   {row.path} {row.state.replace('_', ' ')}: {row.reason}" for row in counts.paths
            if row.state != "ok"]


def plugin_check(python: str) -> list[tuple[bool | None, str, str]]:
    """doctor's plugin section: (ok, name, detail) rows from plugin/check.py run in the engine's interpreter (one
    EXL3 linear and one MoE layer built on the engine's device and run against the reference decoder)."""
    with tempfile.TemporaryDirectory(prefix="exl3-doctor-") as trace_dir:
        try:  # its kernel-path counters go to a temp dir, not the runtime dir a running engine's dashboard reads
            proc = subprocess.run([python, "-P", "-m", PLUGIN_CHECK_MODULE], capture_output=True, text=True,
                                  timeout=900, cwd="/", env={**os.environ, "VLLM_NO_USAGE_STATS": "1",
                                                             env.TRACE_DIR.name: trace_dir})
        except (OSError, subprocess.TimeoutExpired) as exc:
            return [(False, "plugin", f"{python}: {exc}")]
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(PLUGIN_CHECK_MARK)), None)
    if line is None:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        return [(False, "plugin", f"the plugin check did not run in {python}: {tail}")]
    got = json.loads(line[len(PLUGIN_CHECK_MARK):])
    ver = got["vllm"]
    rows: list[tuple[bool | None, str, str]] = [
        (bool(ver["supported"]), "vllm", f"vLLM {ver['vllm'] or 'not installed'}; the exl3 plugin serves with "
         f"vLLM {ver['range']}" + ("" if ver["supported"] else ": `up` refuses this one"))]
    for name, what in (("linear", "EXL3 linear"), ("moe", "EXL3 MoE layer")):
        res = got[name]
        if "errors" not in res:
            rows.append((False, f"plugin {name}", f"building an {what} on {got['device']} failed: {res['error']}"))
            continue
        kernels = res.get("kernel") or ", ".join(res["kernels"])
        errors = ", ".join(f"{path} {err:.1e}" for path, err in res["errors"].items())
        extra = f"; grouped Triton MoE off: {res['grouped_refusal']}" if res.get("grouped_refusal") else ""
        rows.append((bool(res["ok"]), f"plugin {name}", f"{what} ({res['bits']:g}-bit {res['codebook']}) on "
                     f"{got['device']} via {kernels}: error vs reference {errors}{extra}"))
    for path, why in got.get("refused", {}).items():
        rows.append((None, "kernel path", f"{path} off: {why}"))
    return rows


def run_report(python: str, every_rate: bool, device: str | None, on_line=None, dtype: str = "float16") -> dict:
    """The self-test report from `python` (a dict, see kernels/selftest.report); on_line(text) per check."""
    argv = [python, "-P", "-m", SELFTEST_MODULE, "--progress"] + (["--all"] if every_rate else [])
    argv += (["--device", device] if device else []) + ["--dtype", dtype]
    # The report (tens of KiB on a GPU) goes to a file: a pipe could fill while stderr is being read.
    with tempfile.TemporaryFile("w+") as report:
        try:
            proc = subprocess.Popen(argv, stdout=report, stderr=subprocess.PIPE, text=True, cwd="/",
                                    env={**os.environ, "VLLM_NO_USAGE_STATS": "1"})
        except OSError as exc:
            raise Exl3Error(f"cannot run {python}: {exc}",
                            hint="EXL3LOCAL_ENGINE_PYTHON names the engine's interpreter") from None
        tail: list[str] = []
        for line in proc.stderr:
            line = line.rstrip()
            tail = (tail + [line])[-5:]
            if on_line is not None and line.startswith("selftest: "):
                on_line(line.removeprefix("selftest: "))
        proc.wait()
        report.seek(0)
        out = report.read()
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise Exl3Error(f"the self-test in {python} ended (exit {proc.returncode}) without a report: "
                        f"{' | '.join(tail[-3:])}",
                        hint="torch must import there; `exl3local doctor` checks the engine's interpreter") from None


def print_report(data: dict, console: Console) -> None:
    """Device, versions, then one row per kernel and rate (checks passed, worst error, µs of its first check)
    and one line per failed check."""
    dev, ver = data["device"], data["versions"]
    extra = ", ".join(f"{k} {v}" for k, v in dev.items() if k not in ("type", "name") and v is not None)
    console.print(f"device    {dev['type']}: {dev['name']}" + (f" ({extra})" if extra else ""), highlight=False)
    console.print("versions  " + ", ".join(f"{k} {v}" for k, v in ver.items()), highlight=False)
    if "direct_launch" in data:
        console.print(f"launches  bound direct launch {data['direct_launch']}", highlight=False)
    rows: dict[tuple, list[dict]] = defaultdict(list)
    for entry in data["results"]:
        rows[(entry["kernel"], entry["codebook"], entry["bits"])].append(entry)
    table = Table("kernel", "codebook", "bits", "checks", "max error", "µs", box=None, pad_edge=False, highlight=False)
    for (kernel, codebook, bits), entries in rows.items():
        passed = sum(e["ok"] for e in entries)
        errors = [e["error"] for e in entries if e["error"] is not None]
        us = entries[-1]["us"] if kernel != "TritonLinearKernel" else next(
            (e["us"] for e in entries if e["path"] == "gemv"), None)
        checks = f"{passed}/{len(entries)} ok" if passed == len(entries) else f"[red]{passed}/{len(entries)} ok[/red]"
        table.add_row(kernel, codebook, f"{bits:g}", checks, f"{max(errors):.1e}" if errors else "-",
                      f"{us:.0f}" if us is not None else "-")
    console.print(table)
    for entry in data["results"]:
        if not entry["ok"]:
            console.print(f"[red]FAIL[/red] {entry['kernel']} {entry['path']} at {entry['bits']:g}-bit "
                          f"{entry['codebook']}: {entry['detail']}", highlight=False)
    for b in data.get("benchmarks", ()):
        what = f"{b['kernel']} {b['path']}, {b['rows']} rows: {b['us']:.0f} µs" if "us" in b else b["error"]
        console.print(f"bench     {b['k']}x{b['n']} 4-bit mul1, {what}", highlight=False)
    for note in data.get("notes", ()):
        console.print(f"note      {note}", highlight=False)
    failed = sum(not e["ok"] for e in data["results"])
    console.print(f"{len(data['results'])} checks, {failed} failed, {data['seconds']} s"
                  + ("" if failed else ": every path matches the reference"), highlight=False)


def _cmd_selftest(args: argparse.Namespace) -> int:
    python = env.ENGINE_PYTHON.get() or sys.executable
    console = Console(stderr=True)
    if args.json:
        data = run_report(python, args.all, args.device, dtype=args.dtype)
        print(json.dumps(data, indent=1))
    else:
        with console.status(f"checking EXL3 kernels in {python}") as status:
            data = run_report(python, args.all, args.device, lambda what: status.update(f"checking {what}"),
                              args.dtype)
        print_report(data, Console())
    return 0 if data["ok"] else 1


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("selftest", help="check every EXL3 kernel path against the reference decoder on this device")
    p.add_argument("--json", action="store_true", help="the report as one JSON object (to send back)")
    p.add_argument("--all", action="store_true", help="every rate under the CPU interpreter too (slow)")
    p.add_argument("--device", help="torch device to check (default: the first CUDA/XPU device, else cpu)")
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"),
                   help="activations of the linear checks (models served in bf16 use bfloat16 kernels)")
    p.set_defaults(handler=_cmd_selftest)
