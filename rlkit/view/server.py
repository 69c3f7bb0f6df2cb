"""The viewer's web server: Python's own threading HTTP server on loopback, a random port.

Secure by default, as everything a run starts: it binds 127.0.0.1 only, every request needs
the viewer's token (the URL printed carries it once as ?token=; the page then holds it in a
same-site cookie), a Host header other than the loopback address it serves is refused (a DNS
rebinding page cannot read it), and it serves only

    /                  the page (rlkit/view/static/index.html)
    /static/<file>     the page's scripts and styles, shipped in the package (no CDN)
    /api/<what>        the page's data (rlkit/view/run_data.py), read afresh per request
    /run/<file>        a file of the run folder as it is (a path outside the folder: 404)

A run still writing is read as it stands at each request: the page polls.
"""

from __future__ import annotations

import json
import mimetypes
import secrets
import threading
from http import HTTPStatus
from http.cookies import SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qs, unquote, urlsplit

from rlkit.view.run_data import RunData

STATIC = Path(__file__).parent / "static"
COOKIE = "rlkit_view"


def inside(base: Path, relative: str) -> Path | None:
    """`relative` under `base`, or None when it leads outside (.., an absolute path, a link
    out) or names no file."""
    if "\x00" in relative:
        return None
    base = base.resolve()
    try:
        path = (base / relative.lstrip("/")).resolve()
    except (OSError, RuntimeError, ValueError):
        return None
    if path != base and base not in path.parents:
        return None
    return path if path.is_file() else None


class _Cache:
    """One API answer per page and the run files' state (size, mtime): a 10,000-request
    timeline is parsed once, not at every poll."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[Any, bytes]] = {}

    def get(self, key: str, stamp: Any, make: Callable[[], Any]) -> bytes:
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None and hit[0] == stamp:
                return hit[1]
        body = json.dumps(make(), allow_nan=False, default=str).encode()
        with self._lock:
            self._entries[key] = (stamp, body)
        return body


def folder_stamp(folder: Path) -> tuple:
    stamp = []
    for p in sorted(folder.iterdir()):
        try:
            st = p.stat()
        except OSError:
            continue
        stamp.append((p.name, st.st_size, st.st_mtime_ns))
    samples = folder / "samples"
    if samples.is_dir():
        stamp.append(("samples", len(list(samples.iterdir())), samples.stat().st_mtime_ns))
    return tuple(stamp)


class ViewServer:
    """`ViewServer(run).start()` serves in a thread; `url` carries the token."""

    def __init__(self, run: RunData, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None) -> None:
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"the viewer serves on loopback only, not {host!r}")
        self.run = run
        self.token = token or secrets.token_urlsafe(18)
        self.cache = _Cache()
        handler = type("Handler", (_Handler,), {"view": self})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.host, self.port = host, self.httpd.server_address[1]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/?token={self.token}"

    def start(self) -> "ViewServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="rlkit-view",
                                        daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def api(self, what: str, query: dict[str, list[str]]) -> bytes | None:
        run = self.run
        stamp = folder_stamp(run.folder)
        if run.compare is not None:
            stamp += folder_stamp(run.compare.folder)
        if what == "overview":
            return self.cache.get(what, stamp, run.overview)
        if what == "steps":
            return self.cache.get(what, stamp, run.steps)
        if what == "timeline":
            return self.cache.get(what, stamp, run.timeline)
        if what == "advice":
            return self.cache.get(what, stamp, run.advice)
        if what == "groups":
            step = query.get("step", [""])[0]
            n = int(step) if step.isdecimal() else None
            return self.cache.get(f"groups/{n}", stamp, lambda: run.groups(n))
        return None


class _Handler(BaseHTTPRequestHandler):
    view: ViewServer
    server_version = "rlkit-view"

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the console is the run's
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        parts = urlsplit(self.path)
        query = parse_qs(parts.query)
        if not self._host_ok():
            return self._send(HTTPStatus.FORBIDDEN, b"wrong host", "text/plain")
        given = query.get("token", [None])[0]
        cookie = SimpleCookie(self.headers.get("Cookie", ""))
        name = f"{COOKIE}_{self.view.port}"  # cookies ignore ports: one per viewer
        held = cookie[name].value if name in cookie else None
        if not any(t is not None and secrets.compare_digest(t, self.view.token) for t in (given, held)):
            return self._send(HTTPStatus.UNAUTHORIZED, b"the viewer's URL (with its token) "
                              b"is printed where `rlkit view` started", "text/plain")
        set_cookie = given is not None and held != given
        path = unquote(parts.path)
        try:
            if path in ("/", "/index.html"):
                return self._file(STATIC / "index.html", set_cookie)
            if path.startswith("/static/"):
                return self._file(inside(STATIC, path[len("/static/"):]), set_cookie)
            if path.startswith("/run/"):  # as text (an image as itself): never a page of ours
                return self._file(inside(self.view.run.folder, path[len("/run/"):]), set_cookie,
                                  as_text=True)
            if path.startswith("/api/"):
                body = self.view.api(path[len("/api/"):], query)
                if body is None:
                    return self._send(HTTPStatus.NOT_FOUND, b"no such page", "text/plain")
                return self._send(HTTPStatus.OK, body, "application/json", set_cookie)
        except (BrokenPipeError, ConnectionResetError):
            return
        except Exception as e:  # the page shows it; the server goes on
            return self._send(HTTPStatus.INTERNAL_SERVER_ERROR,
                              f"{type(e).__name__}: {e}".encode(), "text/plain")
        return self._send(HTTPStatus.NOT_FOUND, b"not found", "text/plain")

    def _host_ok(self) -> bool:
        host = (self.headers.get("Host") or "").strip()
        port = self.view.port
        return host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}")

    def _file(self, path: Path | None, set_cookie: bool = False, as_text: bool = False) -> None:
        if path is None:
            return self._send(HTTPStatus.NOT_FOUND, b"not found", "text/plain")
        kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        if as_text and not kind.startswith("image/"):
            kind = "text/plain"
        self._send(HTTPStatus.OK, path.read_bytes(), kind, set_cookie)

    def _send(self, status: HTTPStatus, body: bytes, kind: str, set_cookie: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind + ("; charset=utf-8" if kind.startswith(("text/", "application/json")) else ""))
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy",
                         "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'")
        if set_cookie:
            self.send_header("Set-Cookie", f"{COOKIE}_{self.view.port}={self.view.token}; Path=/; "
                             "HttpOnly; SameSite=Strict")
        self.end_headers()
        self.wfile.write(body)


def serve(run: RunData, *, port: int = 0, announce: Callable[[str], None] = print) -> None:
    """Serve until interrupted (`rlkit view`)."""
    server = ViewServer(run, port=port)
    announce(f"rlkit view: {server.url}  (loopback only; Ctrl-C stops)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.httpd.server_close()
