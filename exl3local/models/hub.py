"""EXL3 models from the Hugging Face hub (`exl3local pull`), checked before any weight byte moves.

A pull, with the real huggingface_hub client (its cache, token and HF_* variables):
1. resolve REPO:REVISION to a commit; everything after is pinned to that commit;
2. list the tree at the commit, fetch config.json / quantization_config.json / the index into memory and read
   each safetensors header with two HTTP range reads (length, then exactly the header);
3. run `manifest.read` on a header-only replica (sparse files of the real size), then the architecture check
   against the installed vLLM, the fit check (`--force` skips only this one) and the disk check;
4. download each LFS file into `<repo cache>/.exl3local-staging/<etag>.part` (kept on Ctrl-C or a dropped
   connection; the next pull resumes it with a Range request), check its sha256, rename it into `blobs/`;
5. `snapshot_download` at the commit links those blobs and fetches the small files; checksums of every file
   and `manifest.read` of the real snapshot;
6. write `<repo cache>/.exl3local/<commit>.json` atomically. Only this record makes a model pulled: `list`,
   `rm` and `up` read records, so a partial download is never listed or served as complete.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from exl3local import paths
from exl3local.errors import CheckpointError, Exl3Error
from exl3local.machine.select import select
from exl3local.manifest import MARKER_VALUES, MAX_HEADER_BYTES, Manifest
from exl3local.manifest import read as read_manifest
from exl3local.models.store import ModelRef, PulledModel, default_ref, find, hub_cache, record_path, repo_folder
from exl3local.units import format_bytes

STAGING_DIR = ".exl3local-staging"
# Leave room beside the model: the hub cache shares the disk with everything else.
DISK_MARGIN_BYTES = 1 << 30
SMALL_FILES = ("config.json", "quantization_config.json", "model.safetensors.index.json")
HASH_CHUNK = 8 << 20


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


def known_architectures() -> frozenset[str]:
    """Model classes the installed vLLM can serve (imports vLLM's registry: a few seconds, once)."""
    from vllm.model_executor.models.registry import ModelRegistry

    return frozenset(ModelRegistry.get_supported_archs())


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
            "config.json", "architectures", "a model class the installed vLLM knows", manifest.architecture,
            hint="upgrade vLLM, or pick a model of a supported architecture; nothing was downloaded",
        )
    return Plan(ref, commit, files, manifest, _missing_bytes(ref.repo_id, files))


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


def _missing_bytes(repo_id: str, files: tuple[RemoteFile, ...]) -> int:
    folder = repo_folder(repo_id)
    missing = 0
    for f in files:
        key = f.sha256 or f.blob_id
        if (folder / "blobs" / key).exists():
            continue
        part = folder / STAGING_DIR / f"{key}.part"
        missing += f.size - (part.stat().st_size if part.exists() else 0)
    return missing


def fits_this_machine(manifest: Manifest) -> None:
    """BudgetError unless the model fits the profile `up` would pick here now (pinned, else detected)."""
    select().fit(manifest)


def check_disk(plan: Plan, free_bytes: Callable[[Path], int] | None = None) -> None:
    """The download must fit the disk of the hub cache with DISK_MARGIN_BYTES to spare."""
    cache = hub_cache()
    probe = cache if cache.exists() else next(p for p in cache.parents if p.exists())
    free = free_bytes(probe) if free_bytes else shutil.disk_usage(probe).free
    if plan.missing_bytes + DISK_MARGIN_BYTES > free:
        raise Exl3Error(
            f"{plan.ref} needs {format_bytes(plan.missing_bytes)} plus {format_bytes(DISK_MARGIN_BYTES)} to spare, "
            f"but {probe} has {format_bytes(free)} free",
            hint="free some space (`exl3local list`, `exl3local rm NAME`) or set HF_HUB_CACHE to a larger disk",
        )


# ---------------------------------------------------------------------------------------------
# download, verify, record


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One pull per repo at a time: two writers appending to one .part would corrupt it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Exl3Error(f"another pull of this repo is running (lock {path})", hint="wait for it to finish") from None
        yield


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _git_sha1(path: Path) -> str:
    h = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class _HashingWriter:
    """The .part file as http_get writes it, hashed on the way: no second read of a many-GB file.

    A resumed file's kept prefix is hashed once first. When a server ignores the Range request,
    http_get rewinds and truncates; the hash then restarts from what is left.
    """

    def __init__(self, f: Any) -> None:
        self._f = f
        self._rehash()

    def _rehash(self) -> None:
        self.sha256 = hashlib.sha256()
        end = self._f.tell()
        self._f.seek(0)
        while self._f.tell() < end and (chunk := self._f.read(min(HASH_CHUNK, end - self._f.tell()))):
            self.sha256.update(chunk)
        self._f.seek(end)

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        return self._f.write(data)

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._f.seek(offset, whence)

    def truncate(self, size: int | None = None) -> int:
        result = self._f.truncate(size)
        self._f.seek(result)
        self._rehash()
        return result


def _download_lfs(ref: ModelRef, commit: str, f: RemoteFile, folder: Path) -> None:
    """One LFS file into staging (resuming a kept .part), sha256-checked, then renamed into blobs/."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    meta = get_hf_file_metadata(hf_hub_url(ref.repo_id, f.path, revision=commit))
    blob = folder / "blobs" / meta.etag
    if blob.exists():
        return
    part = folder / STAGING_DIR / f"{meta.etag}.part"
    headers = build_hf_headers()
    if _origin(meta.location) != _origin(hf_hub_url(ref.repo_id, f.path, revision=commit)):
        headers.pop("authorization", None)  # a signed CDN URL: the token stays on the hub
    part.parent.mkdir(parents=True, exist_ok=True)
    with part.open("a+b") as raw:
        raw.seek(0, os.SEEK_END)
        if raw.tell() > f.size:  # longer than the file can be: not a prefix of it
            raw.truncate(0)
            raw.seek(0)
        out = _HashingWriter(raw)
        http_get(meta.location, out, resume_size=out.tell(), headers=headers, expected_size=f.size, displayed_filename=f.path)
    found = out.sha256.hexdigest()
    if found != f.sha256:
        part.unlink()
        raise CheckpointError(
            f.path, None, f"sha256 {f.sha256} (the hub's)", f"sha256 {found}",
            hint="the download was corrupted in transit and has been deleted; run the pull again",
        )
    blob.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(part, 0o644 & ~_umask())
    os.replace(part, blob)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, parts.hostname or "", parts.port


def _verify_snapshot(snapshot: Path, files: tuple[RemoteFile, ...], checked: set[str]) -> None:
    """Every file of the commit is in the snapshot with the hub's checksum (LFS blobs hashed once)."""
    for f in files:
        path = snapshot / f.path
        if not path.is_file():
            raise CheckpointError(f.path, None, "the file in the downloaded snapshot", "missing", hint="run the pull again")
        if f.lfs and path.resolve().name in checked:
            continue
        algorithm, expected = ("sha256", f.sha256) if f.lfs else ("git-sha1", f.blob_id)
        found = _sha256(path) if f.lfs else _git_sha1(path)
        if found != expected:
            blob = path.resolve()
            path.unlink()
            blob.unlink(missing_ok=True)
            raise CheckpointError(
                f.path, None, f"{algorithm} {expected} (the hub's)", f"{algorithm} {found}",
                hint="the download was corrupted and has been deleted; run the pull again",
            )


def fetch(plan: Plan, *, progress: bool = True) -> PulledModel:
    """Download what preflight approved, verify it, and record it. Resumable; records only when complete."""
    import httpx2
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import disable_progress_bars

    ref, folder = plan.ref, repo_folder(plan.ref.repo_id)
    if not progress:
        disable_progress_bars()
    with _locked(folder / STAGING_DIR / "pull.lock"):
        try:
            for f in plan.files:
                if f.lfs:
                    _download_lfs(ref, plan.commit, f, folder)
            snapshot = Path(snapshot_download(ref.repo_id, revision=plan.commit))
        except (httpx2.HTTPError, OSError) as err:
            done = plan.total_bytes - _missing_bytes(ref.repo_id, plan.files)
            raise Exl3Error(
                f"{ref}: download interrupted after {format_bytes(done)} of {format_bytes(plan.total_bytes)} ({type(err).__name__}: {err})",
                hint=f"run `exl3local pull {ref}` again: it resumes where it stopped",
            ) from None
        _verify_snapshot(snapshot, plan.files, {f.sha256 for f in plan.files if f.lfs})
        read_manifest(snapshot)  # the real headers and codebook markers, before the record exists
        if ref.revision != plan.commit:
            # Documented cache layout: refs/<branch> holds the commit; `hf cache` shows it and won't prune it.
            paths.write_atomic(folder / "refs" / ref.revision, plan.commit)
        q = plan.manifest.quantization_config
        model = PulledModel(
            repo_id=ref.repo_id,
            revision=ref.revision,
            commit=plan.commit,
            path=str(snapshot),
            size_bytes=plan.total_bytes,
            bits=q.get("bits"),
            head_bits=q.get("head_bits"),
            architecture=plan.manifest.architecture,
            pulled_at=time.time(),
        )
        paths.write_atomic(record_path(model), json.dumps(asdict(model), indent=1))
    shutil.rmtree(folder / STAGING_DIR, ignore_errors=True)
    return model


def pull(
    ref: ModelRef,
    *,
    force: bool = False,
    fit_check: Callable[[Manifest], None] | None = None,
    free_bytes: Callable[[Path], int] | None = None,
    architectures: Callable[[], frozenset[str]] = known_architectures,
    confirm: Callable[[Plan], bool] | None = None,
    progress: bool = True,
) -> PulledModel:
    """The whole pull: offline → the record or an error; online → preflight, checks, fetch.

    `fit_check` raises BudgetError when the model cannot fit this machine; `force` skips only it.
    `confirm` sees the plan (sizes) before the download and may decline it.
    """
    from huggingface_hub import constants

    def say(line: str) -> None:  # the steps before the progress bars, which can take seconds
        if progress:
            print(f"{ref}: {line}", file=sys.stderr)

    if constants.is_offline_mode():
        model = find(ref)
        if model is None:
            raise Exl3Error(f"{ref} is not pulled and HF_HUB_OFFLINE is set", hint="unset HF_HUB_OFFLINE to download it")
        return model
    commit = resolve(ref)
    existing = find(ModelRef(ref.repo_id, commit))
    if existing is not None:
        say(f"commit {commit[:12]} is already pulled")
        return existing
    say(f"commit {commit[:12]}; reading config and safetensors headers")
    plan = preflight(ref, commit, architectures=architectures)
    m = plan.manifest
    say(f"EXL3 {m.quantization_config.get('bits', '?')} bpw, {m.architecture}, {len(m.quantized)} quantized linears, "
        f"{format_bytes(plan.total_bytes)} in {len(plan.files)} files: checks passed")  # fmt: skip
    if fit_check is not None and not force:
        fit_check(plan.manifest)
    check_disk(plan, free_bytes)
    if confirm is not None and not confirm(plan):
        raise Exl3Error(f"{ref}: download declined", hint=f"run `exl3local pull {ref}` when ready")
    say(f"downloading {format_bytes(plan.missing_bytes)} into {repo_folder(ref.repo_id)}")
    return fetch(plan, progress=progress)


def ensure_default_model(
    profile_id: str | None = None,
    overrides: Mapping[str, str] | None = None,
    *,
    confirm: Callable[[Plan], bool] | None,
    architectures: Callable[[], frozenset[str]] = known_architectures,
) -> PulledModel | None:
    """`up` without a model: the profile's default repo, pulled first when missing.

    The download is shown (`confirm` gets the plan with its size) before it starts; without a way to
    ask (`confirm` None: no terminal) a missing default is refused with the size, never fetched silently.
    None when the profile's default is the bundled demo model.
    """
    machine = select(profile_id, overrides)
    ref = default_ref(machine.profile)
    if ref is None:
        return None
    if (model := find(ref)) is not None:
        return model

    def ask(plan: Plan) -> bool:
        if confirm is None:
            raise Exl3Error(
                f"profile {machine.profile.id}'s default model {ref} is not pulled ({format_bytes(plan.missing_bytes)} to download)",
                hint=f"run `exl3local pull {ref}` first, or `exl3local up` in a terminal to be asked",
            )
        return confirm(plan)

    return pull(ref, fit_check=machine.fit, confirm=ask, architectures=architectures)
