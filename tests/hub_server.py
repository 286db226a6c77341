"""A small Hugging Face Hub on 127.0.0.1, speaking the HTTP that huggingface_hub's downloads use.

Endpoints, as huggingface.co answers them:

* ``GET /api/models/{org}/{name}[/revision/{rev}]``: the model info (``sha``: the commit,
  ``siblings``: the file names).
* ``GET /api/models/{org}/{name}/tree/{rev}``: the file listing (path, size, git oid; LFS
  files with their sha256).
* ``HEAD|GET /{org}/{name}/resolve/{rev}/{path}``: a small file answers itself (``ETag``,
  ``X-Repo-Commit``, ``Content-Length``); an LFS file (weights) answers ``302`` to a second
  server standing for the CDN, with ``X-Linked-Etag`` (its sha256) and ``X-Linked-Size``.
  ``GET`` honours ``Range: bytes=N-``.

Errors carry ``X-Error-Code`` the way the Hub does: ``RepoNotFound`` (401, also what a private
repository answers without a token), ``RevisionNotFound`` (404), ``EntryNotFound`` (404),
``GatedRepo`` (401 without a token, 403 with a token that has no access).

Every request is recorded (``requests``), so a test can say which files were fetched.
``cut_short`` makes the next downloads of a file send half of it and drop the connection.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".h5", ".msgpack", ".onnx", ".png")


@dataclasses.dataclass(frozen=True)
class Request:
    server: str  # "hub" or "cdn"
    method: str  # "GET" or "HEAD"
    path: str  # the URL path as sent
    repo: str | None  # the repository a file request names (the CDN's too), else None
    file: str | None  # the file a request fetches or asks about, else None
    status: int


@dataclasses.dataclass
class _Revision:
    commit: str  # 40 hex digits
    files: dict[str, bytes]


@dataclasses.dataclass
class _Repo:
    revisions: dict[str, _Revision]  # "main", "v2", ...
    token: str | None  # gated: the token that has access


class LocalHub:
    def __init__(self):
        self._repos: dict[str, _Repo] = {}
        self._cut: dict[tuple[str, str], int] = {}  # (repo, path) -> downloads still to cut short
        self._lock = threading.Lock()
        self.requests: list[Request] = []
        self._hub = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, "hub"))
        self._cdn = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, "cdn"))
        self.url = f"http://127.0.0.1:{self._hub.server_address[1]}"
        self.cdn_url = f"http://127.0.0.1:{self._cdn.server_address[1]}"
        self._threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in (self._hub, self._cdn)]
        for t in self._threads:
            t.start()

    def close(self) -> None:
        for s in (self._hub, self._cdn):
            s.shutdown()
            s.server_close()

    # ------------------------------------------------------------------ content
    def add(self, repo_id: str, files: dict[str, bytes] | Path, *, revision: str = "main",
            token: str | None = None) -> str:
        """Serve ``files`` (a dict, or every file of a directory) as ``revision`` of ``repo_id``;
        returns the commit. token: the repository is gated, readable with this token only."""
        if isinstance(files, Path):
            files = {p.relative_to(files).as_posix(): p.read_bytes() for p in sorted(files.rglob("*")) if p.is_file()}
        digest = hashlib.sha1(repo_id.encode() + revision.encode())
        for name in sorted(files):
            digest.update(name.encode() + hashlib.sha256(files[name]).digest())
        commit = digest.hexdigest()
        with self._lock:
            repo = self._repos.setdefault(repo_id, _Repo({}, token))
            repo.revisions[revision] = _Revision(commit, dict(files))
        return commit

    def cut_short(self, repo_id: str, path: str, times: int = 1_000) -> None:
        """The next ``times`` downloads of the file send half its bytes, then drop the connection."""
        with self._lock:
            self._cut[(repo_id, path)] = times

    def heal(self) -> None:
        with self._lock:
            self._cut.clear()

    # ------------------------------------------------------------------ what was asked
    def clear(self) -> None:
        with self._lock:
            self.requests.clear()

    def downloaded(self, repo_id: str) -> list[str]:
        """The files of ``repo_id`` whose bytes were sent (a GET answered 200/206), in order."""
        return [r.file for r in self.requests
                if r.repo == repo_id and r.file and r.method == "GET" and r.status in (200, 206)]

    def touched(self, repo_id: str) -> set[str]:
        """Every file of ``repo_id`` any request named (HEAD or GET, whatever the answer)."""
        return {r.file for r in self.requests if r.repo == repo_id and r.file}

    # ------------------------------------------------------------------ lookups
    def _blob(self, repo_id: str, sha256: str) -> tuple[str, str, bytes] | None:
        """(repo, path, content) of a file of ``repo_id`` with that sha256, any revision."""
        for revision in getattr(self._repos.get(repo_id), "revisions", {}).values():
            for name, data in revision.files.items():
                if hashlib.sha256(data).hexdigest() == sha256:
                    return repo_id, name, data
        return None

    def _find(self, repo_id: str, rev: str) -> tuple[_Repo | None, _Revision | None]:
        repo = self._repos.get(repo_id)
        if repo is None:
            return None, None
        if rev in repo.revisions:
            return repo, repo.revisions[rev]
        return repo, next((r for r in repo.revisions.values() if r.commit == rev), None)


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _is_lfs(path: str) -> bool:
    return path.endswith(LFS_SUFFIXES)


_INFO = re.compile(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?")
_TREE = re.compile(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/.*)?")
_RESOLVE = re.compile(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)")
_CDN = re.compile(r"/cdn/([^/]+/[^/]+)/([0-9a-f]{64})")


def _handler(hub: LocalHub, server: str):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet: the record is hub.requests
            pass

        def do_HEAD(self):
            self._answer(head=True)

        def do_GET(self):
            self._answer(head=False)

        # -------------------------------------------------------------- dispatch
        def _answer(self, head: bool):
            path = urlsplit(self.path).path
            self._repo = self._file = None
            if server == "cdn":
                m = _CDN.fullmatch(path)
                blob = hub._blob(m.group(1), m.group(2)) if m else None
                if blob is None:
                    return self._error(404, None, "no such blob")
                self._repo, self._file, data = blob
                return self._send_file(data, head, {"ETag": f'"{m.group(2)}"'})
            if m := _TREE.fullmatch(path):
                return self._tree(m.group(1), unquote(m.group(2)))
            if m := _INFO.fullmatch(path):
                return self._info(m.group(1), unquote(m.group(2) or "main"))
            if m := _RESOLVE.fullmatch(path):
                return self._resolve(m.group(1), unquote(m.group(2)), unquote(m.group(3)), head)
            return self._error(404, None, "not found")

        def _lookup(self, repo_id: str, rev: str):
            repo, revision = hub._find(repo_id, rev)
            if repo is None:  # the Hub answers a private repository the same way without a token
                self._error(401, "RepoNotFound", "Repository not found")
            elif revision is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return repo, revision

        def _info(self, repo_id: str, rev: str):
            repo, revision = self._lookup(repo_id, rev)
            if revision is None:
                return
            self._json({"id": repo_id, "modelId": repo_id, "sha": revision.commit, "private": False,
                        "gated": "manual" if repo.token else False,
                        "siblings": [{"rfilename": f} for f in sorted(revision.files)]})

        def _tree(self, repo_id: str, rev: str):
            _, revision = self._lookup(repo_id, rev)
            if revision is None:
                return
            entries = []
            for name, data in sorted(revision.files.items()):
                e = {"type": "file", "path": name, "size": len(data), "oid": _git_oid(data)}
                if _is_lfs(name):
                    e["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                entries.append(e)
            self._json(entries)

        def _resolve(self, repo_id: str, rev: str, name: str, head: bool):
            self._repo, self._file = repo_id, name
            repo, revision = self._lookup(repo_id, rev)
            if revision is None:
                return
            if repo.token is not None:
                auth = self.headers.get("Authorization")
                if auth is None:
                    return self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have "
                                       "access to it and be authenticated to access it. Please log in.")
                if auth != f"Bearer {repo.token}":
                    return self._error(403, "GatedRepo", f"Access to model {repo_id} is restricted and you are "
                                       "not in the authorized list.")
            data = revision.files.get(name)
            if data is None:
                return self._error(404, "EntryNotFound", f"{name} does not exist on {rev!r}",
                                   {"X-Repo-Commit": revision.commit})
            headers = {"X-Repo-Commit": revision.commit, "ETag": f'"{_git_oid(data)}"'}
            if _is_lfs(name):  # the Hub sends LFS files from its CDN, another host
                sha = hashlib.sha256(data).hexdigest()
                headers |= {"X-Linked-Etag": f'"{sha}"', "X-Linked-Size": str(len(data)),
                            "Location": f"{hub.cdn_url}/cdn/{repo_id}/{sha}", "Content-Length": "0"}
                return self._send(302, b"", headers)
            self._send_file(data, head, headers)

        # -------------------------------------------------------------- replies
        def _send_file(self, data: bytes, head: bool, headers: dict):
            start = 0
            if not head and (rng := re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))):
                start = min(int(rng.group(1)), len(data))
            body = data[start:]
            headers = dict(headers, **{"Accept-Ranges": "bytes", "Content-Length": str(len(body))})
            if start:
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            status = 206 if start else 200
            with hub._lock:
                cut = not head and hub._cut.get((self._repo, self._file), 0) > 0
                if cut:
                    hub._cut[(self._repo, self._file)] -= 1
            if cut:  # half the bytes, then the connection drops
                self._record(status)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self.close_connection = True
                return
            self._send(status, b"" if head else body, headers)

        def _json(self, obj):
            self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json"})

        def _error(self, status: int, code: str | None, message: str, headers: dict | None = None):
            headers = dict(headers or {}, **{"X-Error-Message": message, "Content-Type": "application/json"})
            if code:
                headers["X-Error-Code"] = code
            self._send(status, json.dumps({"error": message}).encode(), headers)

        def _send(self, status: int, body: bytes, headers: dict):
            self._record(status)
            self.send_response(status)
            headers = dict(headers)
            headers.setdefault("Content-Length", str(len(body)))
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _record(self, status: int):
            with hub._lock:
                hub.requests.append(Request(server, self.command, self.path, self._repo, self._file, status))

    return Handler
