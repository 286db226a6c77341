"""Reading image_url parts as vLLM does (``jaxinfer.media``): data: URLs, local files only under
allowed_local_media_path, http(s) within a timeout and a size cap; each failure one line."""

import base64
import http.server
import threading

import pytest

from jaxinfer.media import MediaConfig, MediaError, fetch

PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")


def _one_line(e):
    assert "\n" not in str(e.value)
    return str(e.value)


def test_data_url():
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert fetch(url) == PNG


@pytest.mark.parametrize("url, match", [
    ("data:image/png;base64", "no comma"),
    ("data:text/plain;base64,aGVsbG8=", "not an image"),
    ("data:image/png,rawbytes", "base64-encoded"),
    ("data:image/png;base64,@@@", "invalid base64"),
    ("ftp://example.com/a.png", "unsupported image URL"),
    ("", "non-empty"),
])
def test_bad_urls(url, match):
    with pytest.raises(MediaError, match=match) as e:
        fetch(url)
    _one_line(e)


def test_size_cap_on_a_data_url():
    url = "data:image/png;base64," + base64.b64encode(b"x" * 4000).decode()
    with pytest.raises(MediaError, match="larger than 1000 bytes"):
        fetch(url, MediaConfig(max_bytes=1000))


def test_local_files_only_under_the_allowed_directory(tmp_path):
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "a.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    url = (tmp_path / "ok" / "a.png").as_uri()
    with pytest.raises(MediaError, match="local files are not allowed"):
        fetch(url)
    allowed = MediaConfig(allowed_local_media_path=str(tmp_path / "ok"))
    assert fetch(url, allowed) == PNG
    with pytest.raises(MediaError, match="outside allowed_local_media_path"):
        fetch(f"file://{tmp_path}/ok/../secret.png", allowed)
    with pytest.raises(MediaError, match="cannot read"):
        fetch((tmp_path / "ok" / "missing.png").as_uri(), allowed)


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/slow":
            threading.Event().wait(2)
        body = b"y" * 5000 if self.path == "/big" else PNG
        if self.path == "/gone":
            self.send_error(404)
            return
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up: what /big and /slow test
            pass

    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_http(server):
    assert fetch(server + "/a.png") == PNG
    for path, cfg, match in [("/big", MediaConfig(max_bytes=1000), "larger than 1000 bytes"),
                             ("/gone", MediaConfig(), "HTTP 404"),
                             ("/slow", MediaConfig(timeout_s=0.3), "could not fetch")]:
        with pytest.raises(MediaError, match=match) as e:
            fetch(server + path, cfg)
        _one_line(e)


def test_no_network_is_one_clear_error():
    # a port nothing listens on: refused at once, as a host with no network refuses
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(MediaError, match="could not fetch") as e:
        fetch(f"http://127.0.0.1:{port}/a.png", MediaConfig(timeout_s=1))
    _one_line(e)
