"""EXL3 models from the Hugging Face hub (`exl3local pull`), checked before any weight byte moves.

A pull, with the real huggingface_hub client (its cache, token and HF_* variables):
1-3. models.preflight: resolve REPO:REVISION to a commit (everything after is pinned to it), read config and
   safetensors headers with range reads, `manifest.read` them and check the architecture against the vLLM of
   the engine's interpreter; here then the fit check (`--force` skips only this one) and the disk check;
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
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from exl3local import paths
from exl3local.errors import CheckpointError, Exl3Error
from exl3local.machine.select import select
from exl3local.manifest import Manifest
from exl3local.manifest import read as read_manifest
from exl3local.models.preflight import (
    STAGING_DIR,
    Plan,
    RemoteFile,
    known_architectures,
    missing_bytes,
    preflight,
    resolve,
)
from exl3local.models.store import ModelRef, PulledModel, default_ref, find, hub_cache, record_path, repo_folder
from exl3local.units import format_bytes

# Leave room beside the model: the hub cache shares the disk with everything else.
DISK_MARGIN_BYTES = 1 << 30
HASH_CHUNK = 8 << 20


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
    """One LFS file into staging (resuming a kept .part), sha256-checked, then renamed into blobs/.

    Why file_download.http_get and not the public hf_hub_download: in huggingface_hub 2.4 hf_hub_download
    writes into a process-unique temp file that it deletes when the transfer fails, so a pull interrupted
    (Ctrl-C, a dropped laptop connection) would start a many-GB file over; http_get takes the kept prefix's
    size and asks for the rest. tests/models/test_pull.py runs the resume against the installed version."""
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
            done = plan.total_bytes - missing_bytes(ref.repo_id, plan.files)
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
