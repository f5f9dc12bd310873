"""A tiny stand-in for the Hugging Face Hub, serving repositories the tests build, over local HTTP.

It answers the routes huggingface_hub calls to resolve and download files: model info
(`/api/models/{repo}/revision/{rev}` with `siblings`, sizes and LFS sha256 when `blobs` is asked)
and `/{repo}/resolve/{rev}/{file}` (HEAD with `X-Repo-Commit`, `ETag`, `Content-Length`; GET with
byte ranges). Faults: a connection dropped part-way through a file, once. Every request is logged
so tests can check what was (not) downloaded."""
from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    commit: str
    files: dict[str, bytes]
    branches: tuple[str, ...] = ("main",)


@dataclass
class Request:
    method: str
    path: str
    range: str | None


@dataclass
class HubState:
    repos: dict[str, Repo] = field(default_factory=dict)
    log: list[Request] = field(default_factory=list)
    drop_after: dict[str, int] = field(default_factory=dict)  # file -> bytes sent before a whole-file GET drops (once)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_folder(self, repo_id: str, folder: Path) -> Repo:
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        commit = hashlib.sha1(repo_id.encode() + b"".join(hashlib.sha256(v).digest() for v in files.values())).hexdigest()
        self.repos[repo_id] = Repo(commit, files)
        return self.repos[repo_id]

    def weight_gets(self) -> list[Request]:
        """GETs of .safetensors files other than header reads (ranges that start at byte 0 and stay small)."""
        out = []
        for r in self.log:
            if r.method != "GET" or not r.path.endswith(".safetensors"):
                continue
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", r.range or "")
            if m and m[2] and int(m[2]) - int(m[1]) <= 100_000 and int(m[1]) < 100_000:
                continue
            out.append(r)
        return out


MODEL_INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?$")
RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_handler(state: HubState):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _send(self, code: int, body: bytes = b"", headers: dict | None = None, *, head: bool = False,
                  length: int | None = None):
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, str(v))
            self.send_header("Content-Length", str(len(body) if length is None else length))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _error(self, code: int, error_code: str, message: str):
            body = json.dumps({"error": message}).encode()
            self._send(code, body, {"Content-Type": "application/json", "X-Error-Code": error_code,
                                    "X-Error-Message": message})

        def _repo(self, repo_id: str, rev: str) -> Repo | None:
            repo = state.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found")
                return None
            if rev not in repo.branches and rev != repo.commit:
                self._error(404, "RevisionNotFound", "Invalid rev id: " + rev)
                return None
            return repo

        def do_HEAD(self):
            self._route(head=True)

        def do_GET(self):
            self._route(head=False)

        def _route(self, *, head: bool):
            url = urlsplit(self.path)
            path = unquote(url.path)
            with state.lock:
                state.log.append(Request("HEAD" if head else "GET", path, self.headers.get("Range")))
            if m := MODEL_INFO.match(path):
                repo = self._repo(m["repo"], m["rev"] or "main")
                if repo is None:
                    return
                blobs = "blobs=" in (url.query or "")
                siblings = []
                for name, data in repo.files.items():
                    entry = {"rfilename": name}
                    if blobs:
                        entry.update(size=len(data), blobId=hashlib.sha1(data).hexdigest())
                        if name.endswith(".safetensors"):
                            entry["lfs"] = {"sha256": _sha256(data), "size": len(data), "pointerSize": 134}
                    siblings.append(entry)
                body = json.dumps({"id": m["repo"], "modelId": m["repo"], "sha": repo.commit, "private": False,
                                   "disabled": False, "gated": False, "tags": [], "siblings": siblings}).encode()
                self._send(200, body, {"Content-Type": "application/json"}, head=head)
                return
            if m := RESOLVE.match(path):
                repo = self._repo(m["repo"], m["rev"])
                if repo is None:
                    return
                data = repo.files.get(m["file"])
                if data is None:
                    self._error(404, "EntryNotFound", "Entry not found")
                    return
                self._file(repo, m["file"], data, head=head)
                return
            self._error(404, "RepoNotFound", "Not found")

        def _file(self, repo: Repo, name: str, data: bytes, *, head: bool):
            headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{_sha256(data)}"', "Accept-Ranges": "bytes",
                       "Content-Type": "application/octet-stream"}
            start, end, code = 0, len(data), 200
            rng = self.headers.get("Range")
            if rng and (m := re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())):
                start = int(m[1])
                end = min(len(data), int(m[2]) + 1) if m[2] else len(data)
                if start >= len(data):
                    self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
                    return
                code = 206
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
            body = data[start:end]
            if head:
                self._send(code, b"", headers, head=True, length=len(body))
                return
            with state.lock:  # the fault hits a whole-file download, not a header read
                drop = state.drop_after.pop(name, None) if rng is None else None
            if drop is None or drop >= len(body):
                self._send(code, body, headers)
                return
            # Announce the whole body, send part of it, then cut the connection.
            self.send_response(code)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[:drop])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)

    return Handler


class HubServer:
    """`with HubServer() as hub:` serves `hub.state.repos` at `hub.url` on a free local port."""

    def __init__(self):
        self.state = HubState()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(self.state))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "HubServer":
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()
