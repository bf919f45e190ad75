"""A stand-in for the Hugging Face Hub on a local port: the calls huggingface_hub makes
to list a repository (``/api/models/<repo>/tree/<rev>``) and fetch its files (HEAD and
GET ``/<repo>/resolve/<rev>/<path>``), with the hub's error headers for a missing
repository or file, a private one (a token needed) and a gated one; plain files at
``/files/<name>`` for ``-mu``. Every request is logged, so a test can tell what was
fetched, and that nothing was once the files are cached."""
from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Hub:
    """``repos``: repo id -> {path in the repo: local file}; ``private``: repo id -> the
    token that reads it; ``gated``: repo ids no token opens; ``files``: name -> local file."""

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, Path]] = {}
        self.private: dict[str, str] = {}
        self.gated: set[str] = set()
        self.files: dict[str, Path] = {}
        self.log: list[tuple[str, str]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def fetched(self) -> list[str]:
        """The paths of the files sent whole (GET of a file)."""
        return [p for m, p in self.log if m == "GET" and ("/resolve/" in p or p.startswith("/files/"))]


def _handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet
            pass

        def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
                  head: bool = False) -> None:
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _error(self, status: int, code: str | None, message: str = "", head: bool = False) -> None:
            headers = {"X-Repo-Commit": COMMIT}
            if code:
                headers["X-Error-Code"] = code
            if message:
                headers["X-Error-Message"] = message
            self._send(status, json.dumps({"error": message or code}).encode(), headers, head)

        def _access(self, repo: str, head: bool) -> bool:
            """Whether the request may read ``repo``; else the hub's answer is sent."""
            if repo not in hub.repos:
                self._error(404, "RepoNotFound", head=head)
                return False
            auth = self.headers.get("Authorization", "")
            if repo in hub.gated:
                self._error(403, "GatedRepo", "Access to model is restricted", head)
                return False
            if repo in hub.private:
                if not auth:  # the hub's answer to a private repository asked without a token
                    self._error(401, "RepoNotFound", "Repository not found", head)
                    return False
                if auth != f"Bearer {hub.private[repo]}":
                    self._error(401, None, "Invalid credentials in Authorization header", head)
                    return False
            return True

        def _serve(self, head: bool) -> None:
            path = unquote(urlparse(self.path).path)
            hub.log.append(("HEAD" if head else "GET", path))
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "tree":
                repo = "/".join(parts[2:4])
                if self._access(repo, head):
                    tree = [{"type": "file", "path": p, "size": f.stat().st_size, "oid": _sha(f)}
                            for p, f in sorted(hub.repos[repo].items())]
                    self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, head)
                return
            if len(parts) >= 5 and parts[2] == "resolve":
                repo, name = "/".join(parts[:2]), "/".join(parts[4:])
                if not self._access(repo, head):
                    return
                f = hub.repos[repo].get(name)
                if f is None:
                    self._error(404, "EntryNotFound", head=head)
                    return
                data = f.read_bytes()
                self._send(200, data, {"X-Repo-Commit": COMMIT, "ETag": f'"{_sha(f)}"'}, head)
                return
            if parts[0] == "files" and len(parts) == 2 and parts[1] in hub.files:
                self._send(200, hub.files[parts[1]].read_bytes(), {}, head)
                return
            self._error(404, None, "not found", head)

        def do_HEAD(self) -> None:  # noqa: N802
            self._serve(True)

        def do_GET(self) -> None:  # noqa: N802
            self._serve(False)

    return Handler


_shas: dict[Path, str] = {}


def _sha(f: Path) -> str:
    if f not in _shas:
        _shas[f] = hashlib.sha256(f.read_bytes()).hexdigest()
    return _shas[f]
