"""The Hugging Face Hub, emulated for tests: a cache laid out as huggingface_hub lays it, and a local
HTTP server answering the endpoints huggingface_hub calls to list and download a model.

    put_in_cache(cache, "org/name", folder)          # models--org--name/{refs,snapshots,blobs}
    with FakeHub({"org/name": folder}) as hub:       # HF_ENDPOINT=hub.url
        ...

The server answers what `snapshot_download`, `list_repo_tree` and `hf_hub_download` ask: the repo
info (`/api/models/{id}/revision/{rev}`: its commit), the recursive tree (`/api/models/{id}/tree/{rev}`),
and each file's HEAD (commit, ETag, size) and GET at `/{id}/resolve/{rev}/{path}`. A repository listed
in `gated` answers as a gated one (401, X-Error-Code GatedRepo); an unknown id as missing (404,
RepoNotFound). Every request is recorded (`hub.requests`).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


def repo_files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def commit_of(files: dict[str, bytes]) -> str:
    digest = hashlib.sha1()
    for name, data in sorted(files.items()):
        digest.update(name.encode() + b"\0" + hashlib.sha1(data).digest())
    return digest.hexdigest()


def etag_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def put_in_cache(cache: Path, repo_id: str, folder: Path, revision: str = "main",
                 only: list[str] | None = None) -> Path:
    """Lay `folder`'s files (or those named in `only`) into the hub cache `cache` as huggingface_hub
    does: blobs by hash, a snapshot of symlinks under the commit, refs/<revision>. Returns the snapshot."""
    files = repo_files(folder)
    commit = commit_of(files)
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for name, data in files.items():
        if only is not None and name not in only:
            continue
        blob = repo / "blobs" / etag_of(data)
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snapshot


class FakeHub:
    """A local HTTP server answering the Hub's endpoints for the given repositories (module doc)."""

    def __init__(self, repos: dict[str, Path], gated: tuple[str, ...] = ()):
        self.repos = {repo_id: repo_files(Path(folder)) for repo_id, folder in repos.items()}
        self.gated = set(gated)
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub.answer(self, body=True)

            def do_HEAD(self) -> None:
                hub.answer(self, body=False)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def find(self, path: str) -> tuple[str, str] | None:
        """(repo id, rest of the path) for a path naming a known or unknown `org/name`."""
        parts = path.strip("/").split("/")
        if len(parts) < 2:
            return None
        return "/".join(parts[:2]), "/".join(parts[2:])

    def answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(handler.path).path)
        self.requests.append((handler.command, path))
        api = path.startswith("/api/models/")
        found = self.find(path.removeprefix("/api/models") if api else path)
        if found is None:
            return self.send(handler, 404, b"{}", body, {"X-Error-Code": "RepoNotFound"})
        repo_id, rest = found
        if repo_id in self.gated:
            return self.send(handler, 401, b'{"error": "gated"}', body, {"X-Error-Code": "GatedRepo"})
        files = self.repos.get(repo_id)
        if files is None:
            return self.send(handler, 404, b'{"error": "Repository not found"}', body, {"X-Error-Code": "RepoNotFound"})
        commit = commit_of(files)
        if api and (rest == "" or rest.startswith("revision/")):
            info = {"id": repo_id, "modelId": repo_id, "sha": commit, "private": False, "gated": False,
                    "siblings": [{"rfilename": name} for name in files]}
            return self.send(handler, 200, json.dumps(info).encode(), body)
        if api and rest.startswith("tree/"):
            tree = [{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for name, data in files.items()]
            return self.send(handler, 200, json.dumps(tree).encode(), body)
        if rest.startswith("resolve/"):
            name = rest.split("/", 2)[2]
            if name not in files:
                return self.send(handler, 404, b"{}", body, {"X-Error-Code": "EntryNotFound"})
            data = files[name]
            return self.send(handler, 200, data, body, {"X-Repo-Commit": commit, "ETag": f'"{etag_of(data)}"'},
                             "application/octet-stream")
        return self.send(handler, 404, b"{}", body)

    @staticmethod
    def send(handler: BaseHTTPRequestHandler, status: int, data: bytes, body: bool,
             headers: dict[str, str] | None = None, content_type: str = "application/json") -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            handler.send_header(key, value)
        handler.end_headers()
        if body:
            handler.wfile.write(data)
