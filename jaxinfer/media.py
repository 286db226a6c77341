"""The bytes an ``image_url`` names, as vLLM reads them: ``data:`` URLs (base64), local files
(``file://``) only under ``allowed_local_media_path`` (vLLM's name; off by default), and
``http(s)://`` within a timeout and a size cap.

    data = fetch(url, MediaConfig(allowed_local_media_path="/srv/images"))

Whatever is wrong gets one ``MediaError`` line naming it; the caller fails that request only.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

MiB = 1 << 20


class MediaError(ValueError):
    """A media URL that cannot be read; the message is one line."""


@dataclasses.dataclass(frozen=True)
class MediaConfig:
    allowed_local_media_path: str | None = None  # file:// URLs are read only under this directory
    max_bytes: int = 20 * MiB  # the most one image may take, encoded
    timeout_s: float = 5.0  # http(s) fetches (vLLM's VLLM_IMAGE_FETCH_TIMEOUT)


def _short(url: str, n: int = 80) -> str:
    return url if len(url) <= n else url[: n - 3] + "..."


def fetch(url: str, cfg: MediaConfig = MediaConfig()) -> bytes:
    """The bytes ``url`` names (see the module doc); MediaError if they cannot be had."""
    if not isinstance(url, str) or not url:
        raise MediaError("image_url.url must be a non-empty string")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url, cfg)
    if scheme == "file":
        return _local(url, cfg)
    if scheme in ("http", "https"):
        return _http(url, cfg)
    raise MediaError(f"unsupported image URL {_short(url)!r}: expected data:, file:// or http(s)://")


def _data_url(url: str, cfg: MediaConfig) -> bytes:
    head, sep, payload = url[len("data:"):].partition(",")
    if not sep:
        raise MediaError("malformed data: URL (no comma before the data)")
    media_type, *params = head.split(";")
    if media_type and not media_type.lower().startswith("image/"):
        raise MediaError(f"data: URL of type {media_type!r} is not an image")
    if "base64" not in (p.lower() for p in params):
        raise MediaError("data: URL must be base64-encoded (data:image/...;base64,...)")
    if len(payload) * 3 // 4 > cfg.max_bytes:
        raise MediaError(f"image is larger than {cfg.max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("data: URL holds invalid base64") from None


def _local(url: str, cfg: MediaConfig) -> bytes:
    if not cfg.allowed_local_media_path:
        raise MediaError("local files are not allowed (start with allowed_local_media_path to allow a directory)")
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise MediaError(f"file:// URL names another host: {_short(url)!r}")
    root = Path(cfg.allowed_local_media_path).resolve()
    path = Path(urllib.parse.unquote(parsed.path)).resolve()
    if not path.is_relative_to(root):
        raise MediaError(f"{path} is outside allowed_local_media_path {root}")
    try:
        size = path.stat().st_size
        if size > cfg.max_bytes:
            raise MediaError(f"image is larger than {cfg.max_bytes} bytes")
        return path.read_bytes()
    except OSError as e:
        raise MediaError(f"cannot read {path}: {e.strerror or e}") from None


def _http(url: str, cfg: MediaConfig) -> bytes:
    req = urllib.request.Request(url, headers={"User-Agent": "jaxinfer"})
    try:
        with urllib.request.urlopen(req, timeout=cfg.timeout_s) as r:
            length = r.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > cfg.max_bytes:
                raise MediaError(f"image at {_short(url)} is larger than {cfg.max_bytes} bytes")
            data = r.read(cfg.max_bytes + 1)
    except urllib.error.HTTPError as e:
        raise MediaError(f"could not fetch {_short(url)}: HTTP {e.code}") from None
    except urllib.error.URLError as e:
        raise MediaError(f"could not fetch {_short(url)}: {e.reason}") from None
    except TimeoutError:
        raise MediaError(f"could not fetch {_short(url)}: no answer within {cfg.timeout_s:g} s") from None
    except OSError as e:
        raise MediaError(f"could not fetch {_short(url)}: {e}") from None
    if len(data) > cfg.max_bytes:
        raise MediaError(f"image at {_short(url)} is larger than {cfg.max_bytes} bytes")
    return data
