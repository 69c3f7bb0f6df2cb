"""The viewer's server: loopback only, the token on every request, nothing outside the run
folder or the page's own files, a wrong Host refused; its API answers the data layer's pages."""

from __future__ import annotations

import http.client
import json
import socket

import pytest

from rlkit.view.run_data import RunData
from rlkit.view.server import ViewServer, inside


def get(server: ViewServer, path: str, headers: dict | None = None) -> tuple[int, bytes, dict]:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
    try:
        conn.request("GET", path, headers={"Host": f"127.0.0.1:{server.port}", **(headers or {})})
        r = conn.getresponse()
        return r.status, r.read(), dict(r.getheaders())
    finally:
        conn.close()


@pytest.fixture(scope="module")
def server(sim_run):
    folder, _ = sim_run
    s = ViewServer(RunData(folder)).start()
    yield s
    s.stop()


def test_binds_loopback_only_and_refuses_another_host():
    with pytest.raises(ValueError, match="loopback only"):
        ViewServer.__new__(ViewServer).__init__(None, host="0.0.0.0")  # type: ignore[arg-type]


def test_token_cookie_and_pages(server):
    t = server.token
    assert server.httpd.server_address[0] == "127.0.0.1" and server.url.startswith("http://127.0.0.1:")
    assert get(server, "/")[0] == 401
    assert get(server, "/api/steps?token=wrong")[0] == 401
    status, body, headers = get(server, f"/?token={t}")
    assert status == 200 and b"rlkit view" in body
    cookie = headers["Set-Cookie"].split(";")[0]
    assert "HttpOnly" in headers["Set-Cookie"] and "SameSite=Strict" in headers["Set-Cookie"]
    # the page's later requests carry the cookie only
    for what in ("overview", "steps", "timeline", "advice", "groups?step=1"):
        status, body, _ = get(server, f"/api/{what}", {"Cookie": cookie})
        assert status == 200, (what, body)
        json.loads(body)
    assert get(server, "/api/nothing", {"Cookie": cookie})[0] == 404
    assert get(server, "/static/viewer.js", {"Cookie": cookie})[0] == 200
    assert get(server, "/static/vendor/uPlot.iife.min.js", {"Cookie": cookie})[0] == 200
    status, _, headers = get(server, "/run/timeline.jsonl", {"Cookie": cookie})
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    # a DNS-rebinding page reaches the port under another name: refused
    assert get(server, f"/?token={t}", {"Host": "evil.example:80"})[0] == 403


@pytest.mark.parametrize("path", [
    "/run/../../../../etc/passwd", "/run/%2e%2e/%2e%2e/etc/passwd", "/run//etc/passwd",
    "/static/../server.py", "/static/%2e%2e/server.py", "/run/..%2ftimeline.jsonl",
    "/run/missing.txt", "/run/", "/static/vendor/../../run_data.py", "/run/x%00.jsonl",
])
def test_paths_outside_the_run_folder_are_404(server, path):
    assert get(server, path + ("&" if "?" in path else "?") + f"token={server.token}")[0] == 404


def test_a_link_out_of_the_run_folder_is_not_followed(tmp_path):
    (tmp_path / "secret.txt").write_text("no")
    run = tmp_path / "run"
    run.mkdir()
    (run / "timeline.jsonl").write_text("")
    (run / "out.txt").symlink_to(tmp_path / "secret.txt")
    assert inside(run, "out.txt") is None
    assert inside(run, "timeline.jsonl") == (run / "timeline.jsonl").resolve()


def test_run_files_are_served_as_text_never_as_a_page(tmp_path):
    (tmp_path / "timeline.jsonl").write_text("")
    (tmp_path / "page.html").write_text("<script>fetch('/api/steps')</script>")
    (tmp_path / "chart.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    s = ViewServer(RunData(tmp_path)).start()
    try:
        kinds = {f: get(s, f"/run/{f}?token={s.token}")[2]["Content-Type"] for f in ("page.html", "chart.png")}
    finally:
        s.stop()
    assert kinds["page.html"].startswith("text/plain") and kinds["chart.png"] == "image/png"


def own_address() -> str | None:
    """This machine's address on its default route (a UDP connect sends nothing)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("10.254.254.254", 1))
        address = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return None if address.startswith("127.") else address


def test_nothing_answers_on_another_address(server):
    address = own_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    with pytest.raises(OSError):  # refused: the port is open on 127.0.0.1 only
        socket.create_connection((address, server.port), timeout=2).close()
