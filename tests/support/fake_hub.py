"""A small Hugging Face hub on 127.0.0.1 (FakeHub, `serve` starts it on a free port) for the pull tests, spoken to by the real huggingface_hub client.

It serves what huggingface_hub 2.x asks for during a pull (read in its source: hf_api.repo_info/list_repo_tree,
file_download.get_hf_file_metadata/http_get):
- GET /api/models/{repo}[/revision/{rev}]  -> {"id", "sha", "siblings"}
- GET /api/models/{repo}/tree/{rev}?recursive=True -> [{"type", "path", "size", "oid", "lfs"?}]
- HEAD/GET /{repo}/resolve/{rev}/{path}: small files inline with ETag = git blob sha1 and X-Repo-Commit;
  LFS files (*.safetensors) as a 302 to a second server on another port (the "CDN", another origin, so the client
  stops there, as on the hub) with X-Linked-Etag = sha256 and X-Linked-Size.
- The CDN answers Range requests with 206 + Content-Range.
Errors carry X-Error-Code (RepoNotFound is a 401, as on the hub). Every request goes into `log`, with the byte
range of the body actually sent, so tests can prove that no weight byte left before a refusal.
Faults: `corrupt` (CDN flips a byte of that file), `drop_after` (first GET of that file dies after N bytes),
`throttle_bps` (CDN sends slowly, for interrupting a transfer).
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


LFS_SUFFIX = ".safetensors"
CHUNK = 64 * 1024


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Served:
    server: str  # "hub" or "cdn"
    method: str
    path: str
    range: str | None
    status: int
    start: int | None = None  # body bytes actually sent: [start, end)
    end: int | None = None
    auth: bool = False  # the request carried an Authorization header


@dataclass
class FakeHub:
    repos: dict[str, dict] = field(default_factory=dict)  # repo -> {"refs": {name: sha}, "commits": {sha: files}}
    log: list[Served] = field(default_factory=list)
    corrupt: set[str] = field(default_factory=set)
    drop_after: dict[str, int] = field(default_factory=dict)
    ignore_range: set[str] = field(default_factory=set)  # the CDN answers these with 200 + the whole file
    throttle_bps: int | None = None
    private: dict[str, str] = field(default_factory=dict)  # repo -> the token it needs (else 401, as the hub)
    endpoint: str = ""
    cdn: str = ""

    def add(self, repo_id: str, branch: str, files: dict[str, bytes]) -> str:
        repo = self.repos.setdefault(repo_id, {"refs": {}, "commits": {}})
        digest = hashlib.sha1(repo_id.encode() + branch.encode())
        for name in sorted(files):
            digest.update(name.encode() + git_blob_sha1(files[name]).encode())
        commit = digest.hexdigest()
        repo["commits"][commit] = dict(files)
        repo["refs"][branch] = commit
        return commit

    def blobs(self) -> dict[str, tuple[str, bytes]]:
        """sha256 -> (file name, bytes) for every LFS file of every repo."""
        return {
            sha256(data): (name, data)
            for repo in self.repos.values()
            for files in repo["commits"].values()
            for name, data in files.items()
            if name.endswith(LFS_SUFFIX)
        }

    def weight_bytes_sent(self, repo_id: str) -> int:
        """Bytes past the safetensors header (the weights) of any of `repo_id`'s files that the CDN sent."""
        header_end = {
            sha256(data): 8 + int.from_bytes(data[:8], "little")
            for files in self.repos[repo_id]["commits"].values()
            for name, data in files.items()
            if name.endswith(LFS_SUFFIX)
        }
        return sum(
            max(0, e.end - max(e.start, header_end[sha]))
            for e in self.log
            if e.server == "cdn" and e.method == "GET" and e.start is not None
            and (sha := e.path.rsplit("/", 1)[-1]) in header_end
        )


def _parse_range(header: str | None, total: int) -> tuple[int, int] | None:
    if not header or not header.startswith("bytes="):
        return None
    first, _, last = header[6:].split(",")[0].partition("-")
    start = int(first) if first else total - int(last)
    end = int(last) + 1 if (first and last) else total
    return start, min(end, total)


def _handler(hub: FakeHub, server_name: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet; `hub.log` is the record
            pass

        def do_HEAD(self) -> None:
            self._route(head=True)

        def do_GET(self) -> None:
            self._route(head=False)

        # -- plumbing -------------------------------------------------------------------------------
        def _entry(self, status: int) -> Served:
            e = Served(server_name, self.command, urlsplit(self.path).path, self.headers.get("Range"), status,
                       auth="Authorization" in self.headers)  # fmt: skip
            hub.log.append(e)
            return e

        def _error(self, status: int, code: str, commit: str | None = None) -> None:
            self._entry(status)
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", code)
            if commit:
                self.send_header("X-Repo-Commit", commit)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _json(self, obj: object, head: bool) -> None:
            body = json.dumps(obj).encode()
            self._entry(200)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _body(self, data: bytes, head: bool, headers: dict[str, str], fault_key: str | None = None) -> None:
            rng = _parse_range(self.headers.get("Range"), len(data))
            if rng and rng[1] - rng[0] > 1 << 20 and fault_key in hub.ignore_range:  # not a header read
                rng = None
            if rng and rng[0] >= len(data):
                self._entry(416)
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            start, end = rng or (0, len(data))
            status = 206 if rng else 200
            entry = self._entry(status)
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(end - start))
            if rng:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            self.end_headers()
            if head:
                return
            entry.start = entry.end = start
            drop_at = hub.drop_after.get(fault_key) if fault_key else None
            if drop_at is not None and end - start > drop_at:  # not a header read: this one dies
                del hub.drop_after[fault_key]
            else:
                drop_at = None
            pos = start
            while pos < end:
                stop = min(end, pos + CHUNK)
                if drop_at is not None and stop - start > drop_at:
                    stop = start + drop_at
                try:
                    self.wfile.write(data[pos:stop])
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    return
                entry.end = pos = stop
                if drop_at is not None and pos - start >= drop_at:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if server_name == "cdn" and hub.throttle_bps:
                    time.sleep(CHUNK / hub.throttle_bps)

        # -- routes ---------------------------------------------------------------------------------
        def _route(self, head: bool) -> None:
            parts = [unquote(p) for p in urlsplit(self.path).path.strip("/").split("/")]
            if server_name == "cdn":
                return self._cdn(parts, head)
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                return self._api(parts[2] + "/" + parts[3], parts[4:], head)
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._resolve(parts[0] + "/" + parts[1], parts[3], "/".join(parts[4:]), head)
            self._error(404, "NotFound")

        def _commit(self, repo_id: str, rev: str) -> tuple[str | None, dict | None]:
            repo = hub.repos.get(repo_id)
            token = hub.private.get(repo_id)
            if repo is None or (token and self.headers.get("Authorization") != f"Bearer {token}"):
                self._error(401, "RepoNotFound")
                return None, None
            commit = repo["refs"].get(rev) or (rev if rev in repo["commits"] else None)
            if commit is None:
                self._error(404, "RevisionNotFound")
                return None, None
            return commit, repo["commits"][commit]

        def _api(self, repo_id: str, rest: list[str], head: bool) -> None:
            if not rest or rest[0] == "revision":
                commit, files = self._commit(repo_id, rest[1] if rest else "main")
                if commit is not None:
                    siblings = [{"rfilename": n} for n in sorted(files)]
                    self._json({"id": repo_id, "modelId": repo_id, "sha": commit, "siblings": siblings}, head)
            elif rest[0] == "tree":
                commit, files = self._commit(repo_id, rest[1])
                if commit is not None:
                    self._json([self._tree_entry(n, d) for n, d in sorted(files.items())], head)
            else:
                self._error(404, "NotFound")

        @staticmethod
        def _tree_entry(name: str, data: bytes) -> dict:
            entry = {"type": "file", "path": name, "size": len(data), "oid": git_blob_sha1(data)}
            if name.endswith(LFS_SUFFIX):
                entry["lfs"] = {"oid": sha256(data), "size": len(data), "pointerSize": 134}
            return entry

        def _resolve(self, repo_id: str, rev: str, name: str, head: bool) -> None:
            commit, files = self._commit(repo_id, rev)
            if commit is None:
                return
            if name not in files:
                return self._error(404, "EntryNotFound", commit)
            data = files[name]
            if name.endswith(LFS_SUFFIX):
                self._entry(302)
                self.send_response(302)
                self.send_header("Location", f"{hub.cdn}/blobs/{sha256(data)}?expires=1")
                self.send_header("X-Repo-Commit", commit)
                self.send_header("ETag", f'"{git_blob_sha1(data)}"')
                self.send_header("X-Linked-Etag", f'"{sha256(data)}"')
                self.send_header("X-Linked-Size", str(len(data)))
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self._body(data, head, {"ETag": f'"{git_blob_sha1(data)}"', "X-Repo-Commit": commit})

        def _cdn(self, parts: list[str], head: bool) -> None:
            blobs = hub.blobs()
            if len(parts) != 2 or parts[0] != "blobs" or parts[1] not in blobs:
                return self._error(404, "NotFound")
            name, data = blobs[parts[1]]
            if name in hub.corrupt:
                data = data[:-1] + bytes([data[-1] ^ 0xFF])
            self._body(data, head, {"ETag": f'"{parts[1]}"'}, fault_key=name)

    return Handler


def serve(hub: FakeHub, name: str) -> tuple[ThreadingHTTPServer, str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub, name))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True, name=f"fakehub-{name}").start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"
