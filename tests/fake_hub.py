"""A stand-in for the Hugging Face Hub on 127.0.0.1: the routes huggingface_hub's
client calls to list a repository and download its files, served from folders
(``repos[repo_id] = folder``), one commit each. Point the client at it with
HF_ENDPOINT. Every request is logged in ``requests`` (method, path)."""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


def _commit(folder: Path) -> str:
    digest = hashlib.sha1()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            digest.update(str(path.relative_to(folder)).encode())
            digest.update(str(path.stat().st_size).encode())
    return digest.hexdigest()


@functools.cache
def _etag(path: Path) -> str:
    """A file's content hash (once a file: a benchmark HEADs large ones repeatedly)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


class FakeHub:
    def __init__(self, repos: dict[str, Path]) -> None:
        self.repos = {repo: Path(folder) for repo, folder in repos.items()}
        self.requests: list[tuple[str, str]] = []

    def files(self, repo: str) -> list[str]:
        folder = self.repos[repo]
        return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())

    def handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _json(self, body, status: int = 200) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _not_found(self, what: str) -> None:
                self.send_response(404)
                self.send_header("X-Error-Code", what)
                self.send_header("X-Error-Message", f"{what}: {self.path}")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _route(self, head: bool) -> None:
                path = unquote(urlsplit(self.path).path)
                hub.requests.append(("HEAD" if head else "GET", path))
                if path.startswith("/api/models/"):
                    return self._api(path.removeprefix("/api/models/"))
                for repo, folder in hub.repos.items():
                    prefix = f"/{repo}/resolve/"
                    if path.startswith(prefix):
                        _, _, name = path.removeprefix(prefix).partition("/")
                        return self._file(folder, name, head)
                self._not_found("RepoNotFound")

            def _api(self, rest: str) -> None:
                for repo, folder in hub.repos.items():
                    if rest == repo or rest.startswith(repo + "/"):
                        tail = rest[len(repo) :]
                        commit = _commit(folder)
                        if tail == "" or tail.startswith("/revision/"):
                            siblings = [{"rfilename": f} for f in hub.files(repo)]
                            return self._json({"id": repo, "sha": commit, "siblings": siblings})
                        if tail.startswith("/tree/"):
                            entries = [
                                {"type": "file", "path": f, "oid": _etag(folder / f),
                                 "size": (folder / f).stat().st_size}
                                for f in hub.files(repo)
                            ]  # fmt: skip
                            return self._json(entries)
                self._not_found("RepoNotFound")

            def _file(self, folder: Path, name: str, head: bool) -> None:
                target = folder / name
                if not target.is_file():
                    return self._not_found("EntryNotFound")
                data = target.read_bytes()
                self.send_response(200)
                self.send_header("X-Repo-Commit", _commit(folder))
                self.send_header("ETag", f'"{_etag(target)}"')
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not head:
                    self.wfile.write(data)

            def do_GET(self) -> None:
                self._route(head=False)

            def do_HEAD(self) -> None:
                self._route(head=True)

        return Handler


@contextmanager
def serving(hub: FakeHub):
    """The hub on a free port of 127.0.0.1; yields its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), hub.handler())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
