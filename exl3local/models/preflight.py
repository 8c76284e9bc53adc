"""Preflight of a hub pull (`exl3local pull`): everything that can be checked before a weight byte moves.

1. resolve REPO:REVISION to a commit; everything after is pinned to that commit;
2. list the tree at the commit, fetch config.json / quantization_config.json / the index into memory and read
   each safetensors header with two HTTP range reads (length, then exactly the header);
3. run `manifest.read` on a header-only replica (sparse files of the real size), then the architecture check
   against the vLLM of the engine's interpreter (EXL3LOCAL_ENGINE_PYTHON, as `doctor` checks it).
The download, the checksums and the record are models.hub's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from exl3local import env
from exl3local.errors import CheckpointError, Exl3Error
from exl3local.manifest import MARKER_VALUES, Manifest
from exl3local.manifest import read as read_manifest
from exl3local.safetensors_files import MAX_HEADER_BYTES
from exl3local.models.store import ModelRef, repo_folder

STAGING_DIR = ".exl3local-staging"  # <repo cache>/STAGING_DIR/<sha256>.part: a download kept for resuming
SMALL_FILES = ("config.json", "quantization_config.json", "model.safetensors.index.json")
ARCH_PROBE_TIMEOUT_S = 300.0
ARCH_PROBE = """
import json
from vllm.model_executor.models.registry import ModelRegistry
print("EXL3LOCAL_ARCHS " + json.dumps(sorted(ModelRegistry.get_supported_archs())))
"""


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    blob_id: str  # git sha1 of the file (of the LFS pointer for LFS files)
    sha256: str | None  # LFS files only

    @property
    def lfs(self) -> bool:
        return self.sha256 is not None


@dataclass(frozen=True)
class Plan:
    """What preflight found: the pinned commit, its files, and the manifest of its headers."""

    ref: ModelRef
    commit: str
    files: tuple[RemoteFile, ...]
    manifest: Manifest
    missing_bytes: int  # what the download still has to transfer (partial .part files count as done)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


# ---------------------------------------------------------------------------------------------
# preflight: everything that can be checked without weights


def _hub_error(ref: ModelRef, err: Exception) -> Exl3Error:
    """Turn huggingface_hub's errors into one clear line with a next step."""
    from huggingface_hub.errors import (
        GatedRepoError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(err, RevisionNotFoundError):
        return Exl3Error(f"{ref.repo_id} has no revision {ref.revision!r}", hint="EXL3 repos keep one branch per bit rate; check the repo's branches")
    if isinstance(err, GatedRepoError):
        return Exl3Error(f"{ref.repo_id} is gated", hint="accept its terms on the hub, then `hf auth login`")
    if isinstance(err, RepositoryNotFoundError):
        return Exl3Error(f"{ref.repo_id}: no such repo on the hub (or it is private)", hint="check the name; for a private repo, `hf auth login`")
    if isinstance(err, OfflineModeIsEnabled):
        return Exl3Error(f"{ref} is not pulled and HF_HUB_OFFLINE is set", hint="unset HF_HUB_OFFLINE to download it")
    return Exl3Error(f"{ref}: the hub could not be reached ({type(err).__name__}: {err})", hint="check the network or HF_ENDPOINT, then pull again")


def _get(url: str, headers: dict[str, str] | None = None) -> bytes:
    from huggingface_hub import get_session, hf_raise_for_status
    from huggingface_hub.utils import build_hf_headers

    response = get_session().get(url, headers={**build_hf_headers(), **(headers or {})}, follow_redirects=True)
    hf_raise_for_status(response)
    return response.content


def _read_remote_header(url: str, name: str, size: int) -> bytes:
    """The 8-byte length and the JSON header of a remote safetensors file, and not one byte more."""
    if size < 8:
        raise CheckpointError(name, None, "a safetensors file of at least 8 bytes", f"{size} bytes")
    length = int.from_bytes(_get(url, {"Range": "bytes=0-7"})[:8], "little")
    if length > min(size - 8, MAX_HEADER_BYTES):
        raise CheckpointError(name, None, f"a header of at most {min(size - 8, MAX_HEADER_BYTES)} bytes", f"a declared header length of {length}")
    header = _get(url, {"Range": f"bytes=8-{7 + length}"})
    if len(header) != length:
        raise CheckpointError(name, None, f"{length} header bytes", f"{len(header)} (the server ignored the Range request?)")
    return length.to_bytes(8, "little") + header


def _write_replica(root: Path, name: str, head: bytes, size: int) -> None:
    """A sparse file of the real size holding only the header, so `manifest.read` sees the true layout.

    manifest.read also reads the 4-byte codebook markers, which are tensor data, not header. The replica
    carries the value each marker's name stands for; the real values are checked after the download,
    by `manifest.read` on the snapshot, before the model is recorded.
    """
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        header = json.loads(head[8:])
    except ValueError:
        header = None  # manifest.read reports it, naming the file
    with path.open("wb") as f:
        f.write(head)
        for tensor, entry in header.items() if isinstance(header, dict) else ():
            codebook = tensor.rpartition(".")[2]
            if codebook in MARKER_VALUES and isinstance(entry, dict) and isinstance(entry.get("data_offsets"), list):
                f.seek(len(head) + int(entry["data_offsets"][0]))
                f.write(MARKER_VALUES[codebook].to_bytes(4, "little"))
        f.truncate(size)


def known_architectures(python: str | None = None) -> frozenset[str]:
    """Model classes the vLLM of the engine's interpreter can serve (EXL3LOCAL_ENGINE_PYTHON, else this one):
    the one that will load the model, which need not be the CLI's. Imports vLLM's registry there (seconds)."""
    python = python or env.ENGINE_PYTHON.get() or sys.executable
    try:
        proc = subprocess.run([python, "-P", "-c", ARCH_PROBE], capture_output=True, text=True, cwd="/",
                              timeout=ARCH_PROBE_TIMEOUT_S, env={**os.environ, "VLLM_NO_USAGE_STATS": "1"})
    except (OSError, subprocess.TimeoutExpired) as exc:
        proc, why = None, str(exc)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("EXL3LOCAL_ARCHS ")), None) if proc else None
    if line is None:
        if proc is not None:
            why = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:]) or f"exit status {proc.returncode}"
        raise Exl3Error(f"could not list the model classes vLLM knows in the engine's Python {python}: {why}",
                        hint=f"`exl3local doctor` checks that interpreter ({env.ENGINE_PYTHON.name}); nothing was "
                        "downloaded")
    return frozenset(json.loads(line.removeprefix("EXL3LOCAL_ARCHS ")))


def resolve(ref: ModelRef) -> str:
    """The commit REVISION names now (one API call). Everything after is pinned to it."""
    import httpx2
    from huggingface_hub import HfApi

    try:
        commit = HfApi().repo_info(ref.repo_id, revision=ref.revision).sha
    except (httpx2.HTTPError, OSError) as err:
        raise _hub_error(ref, err) from None
    if commit is None:
        raise Exl3Error(f"{ref}: the hub named no commit for this revision", hint="check that HF_ENDPOINT points at a hub")
    return commit


def preflight(
    ref: ModelRef,
    commit: str,
    *,
    architectures: Callable[[], frozenset[str]] = known_architectures,
) -> Plan:
    """List, read the headers and check them. Transfers no weight bytes; writes nothing to the cache."""
    import httpx2
    from huggingface_hub import HfApi, hf_hub_url
    from huggingface_hub.hf_api import RepoFile

    try:
        files = tuple(
            RemoteFile(f.path, f.size, f.blob_id, f.lfs.sha256 if f.lfs else None)
            for f in HfApi().list_repo_tree(ref.repo_id, recursive=True, revision=commit)
            if isinstance(f, RepoFile)
        )
    except (httpx2.HTTPError, OSError) as err:
        raise _hub_error(ref, err) from None
    by_name = {f.path: f for f in files}
    if "config.json" not in by_name:
        raise CheckpointError(
            "config.json", None, "a model config in the repo", "none", hint=f"{ref} is not a model checkpoint; nothing was downloaded"
        )

    def url(name: str) -> str:
        return hf_hub_url(ref.repo_id, name, revision=commit)

    with tempfile.TemporaryDirectory(prefix="exl3local-preflight-") as tmp:
        root = Path(tmp)
        try:
            for name in SMALL_FILES:
                if name in by_name:
                    (root / name).write_bytes(_get(url(name)))
            _check_config(root / "config.json")
            for f in files:
                if f.path.endswith(".safetensors"):
                    _write_replica(root, f.path, _read_remote_header(url(f.path), f.path, f.size), f.size)
        except (httpx2.HTTPError, OSError) as err:
            raise _hub_error(ref, err) from None
        try:
            manifest = read_manifest(root)
        except CheckpointError as err:
            err.hint = err.hint or f"{ref} was refused before download; nothing was downloaded"
            raise
    if manifest.architecture not in architectures():
        raise CheckpointError(
            "config.json", "architectures", "a model class the engine's vLLM knows", manifest.architecture,
            hint="upgrade vLLM, or pick a model of a supported architecture; nothing was downloaded",
        )
    return Plan(ref, commit, files, manifest, missing_bytes(ref.repo_id, files))


def _check_config(path: Path) -> None:
    """Refuse a non-EXL3 repo from its config alone, before any safetensors header is read."""
    try:
        qcfg = json.loads(path.read_text()).get("quantization_config")
    except (ValueError, AttributeError) as err:
        raise CheckpointError("config.json", None, "a JSON object", f"unreadable ({err})") from None
    method = qcfg.get("quant_method") if isinstance(qcfg, dict) else None
    if method != "exl3":
        raise CheckpointError(
            "config.json", "quantization_config.quant_method", '"exl3"', repr(method) if method else "no quantization_config",
            hint="this is not an EXL3 checkpoint (exl3local serves EXL3 only); nothing was downloaded",
        )


def missing_bytes(repo_id: str, files: tuple[RemoteFile, ...]) -> int:
    folder = repo_folder(repo_id)
    missing = 0
    for f in files:
        key = f.sha256 or f.blob_id
        if (folder / "blobs" / key).exists():
            continue
        part = folder / STAGING_DIR / f"{key}.part"
        missing += f.size - (part.stat().st_size if part.exists() else 0)
    return missing
