"""Object storage: ``gs://`` and ``s3://`` URLs (and local paths) for inputs, outputs and weights.

A thin layer over fsspec (gcsfs for Google Cloud Storage, s3fs for S3), holding the few
operations the batch job and the loaders need: read a whole object or a byte range, stream one,
list a prefix, write an object whole, create one only if it does not exist, replace one only if
it is still the version read, and compose objects into one.

* Credentials come from where each platform keeps them (Application Default Credentials on a
  Cloud TPU VM or after ``gcloud auth application-default login``; ``AWS_*`` variables,
  ``~/.aws`` or an instance role for S3). They are never printed.
* Endpoints: ``STORAGE_EMULATOR_HOST`` points gcsfs at another GCS JSON API server (an emulator;
  without credentials it then goes anonymous), ``AWS_ENDPOINT_URL`` points botocore at another S3
  server. Both are the libraries' own variables, read by them.
* A URL whose library is not installed, a malformed URL, a missing bucket or object and a denied
  request each raise ``StorageError``: one line naming the URL and what to do.

Preconditions: ``create`` sends ``ifGenerationMatch=0`` (GCS) or ``If-None-Match: *`` (S3),
``replace`` ``ifGenerationMatch=<generation>`` or ``If-Match: <ETag>``. The store decides
atomically; callers that must not trust a store that ignores them (some emulators do) read the
object back.
"""

from __future__ import annotations

import dataclasses
import re
from contextlib import contextmanager

from jaxinfer.errors import JaxinferError

# scheme -> (fsspec protocol, the module that implements it, the extra that installs it)
SCHEMES = {"gs": ("gs", "gcsfs", "gcs"), "gcs": ("gs", "gcsfs", "gcs"), "s3": ("s3", "s3fs", "s3")}
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")


class StorageError(JaxinferError):
    """A URL cannot be used: malformed, its library missing, its bucket or object missing, or
    access denied."""


@dataclasses.dataclass(frozen=True)
class Url:
    scheme: str  # "gs" or "s3" ("gcs" is read as "gs")
    bucket: str
    key: str  # may be "" (the bucket itself)

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}" if self.key else f"{self.scheme}://{self.bucket}"

    @property
    def path(self) -> str:
        """bucket/key, as fsspec names objects."""
        return f"{self.bucket}/{self.key}" if self.key else self.bucket

    def child(self, name: str) -> Url:
        return Url(self.scheme, self.bucket, f"{self.key.rstrip('/')}/{name}" if self.key else name)


def is_url(path) -> bool:
    """Whether ``path`` names a URL (``scheme://...``) rather than a local path."""
    return isinstance(path, str) and _URL.match(path) is not None


def parse(url: str) -> Url:
    """A ``gs://bucket/key`` or ``s3://bucket/key`` URL, or StorageError saying what is wrong."""
    m = _URL.match(url)
    if m is None:
        raise StorageError(f"{url!r} is not a URL (gs://BUCKET/KEY or s3://BUCKET/KEY)")
    scheme, rest = m.group(1).lower(), m.group(2)
    if scheme not in SCHEMES:
        raise StorageError(f"unsupported URL scheme {scheme}:// in {url} (jaxinfer reads gs://, s3:// and local paths)")
    bucket, _, key = rest.partition("/")
    if not _BUCKET.match(bucket):
        raise StorageError(f"{url}: {bucket!r} is not a valid bucket name (3-222 characters: lowercase letters, "
                           "digits, '-', '_', '.')")
    return Url("gs" if scheme == "gcs" else scheme, bucket, key)


_FILESYSTEMS: dict[str, object] = {}


def filesystem(u: Url):
    """The fsspec filesystem of a URL's scheme, imported on first use."""
    fs = _FILESYSTEMS.get(u.scheme)
    if fs is None:
        protocol, module, extra = SCHEMES[u.scheme]
        try:
            __import__(module)
        except ImportError:
            raise StorageError(f"{u} needs {module}, which is not installed: pip install 'jaxinfer[{extra}]'") from None
        import fsspec

        fs = _FILESYSTEMS[u.scheme] = fsspec.filesystem(protocol)
    return fs


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _code(e: BaseException) -> str | None:
    """The error code of a botocore ClientError behind an s3fs error, if any."""
    cause = e.__cause__ or e.__context__
    resp = getattr(cause, "response", None)
    return (resp or {}).get("Error", {}).get("Code") if isinstance(resp, dict) else None


def _denied(e: BaseException) -> bool:
    return (isinstance(e, PermissionError) or _code(e) in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch")
            or "Forbidden" in str(e) or "401" in _first_line(e) and "Unauthorized" in str(e))


def _bucket_exists(u: Url) -> bool:
    try:
        fs = filesystem(u)
        fs.invalidate_cache(u.bucket)
        return fs.exists(u.bucket)
    except Exception:  # noqa: BLE001 - the first error is the one to report
        return True


@contextmanager
def errors(u: Url, doing: str):
    """Store errors as one StorageError line: ``cannot {doing} {url}: why``."""
    try:
        yield
    except JaxinferError:  # already one line (a StorageError, or the caller's own)
        raise
    except FileNotFoundError:
        if not _bucket_exists(u):
            raise StorageError(f"cannot {doing} {u}: bucket {u.scheme}://{u.bucket} does not exist") from None
        raise StorageError(f"cannot {doing} {u}: no such object") from None
    except Exception as e:
        if _denied(e):
            raise StorageError(f"cannot {doing} {u}: access denied (check the credentials this process uses for "
                               f"{u.scheme}://)") from None
        if isinstance(e, (OSError, ValueError)) or type(e).__module__.split(".")[0] in ("gcsfs", "s3fs", "botocore",
                                                                                         "aiohttp", "google"):
            raise StorageError(f"cannot {doing} {u}: {_first_line(e)}") from None
        raise


def check_bucket(u: Url) -> None:
    """StorageError unless the URL's bucket exists and can be listed."""
    fs = filesystem(u)
    with errors(u, "reach"):
        fs.invalidate_cache(u.bucket)
        try:
            fs.info(u.bucket)  # (not exists(): it says False when access is denied)
        except FileNotFoundError:
            raise StorageError(f"bucket {u.scheme}://{u.bucket} does not exist (in {u})") from None


def info(u: Url) -> dict | None:
    """The object's metadata (``size``, and ``generation`` or ``ETag``), or None if it does not exist."""
    fs = filesystem(u)
    with errors(u, "read"):
        fs.invalidate_cache(u.path)
        try:
            i = fs.info(u.path)
        except FileNotFoundError:
            if not _bucket_exists(u):
                raise
            return None
    return i if i.get("type") == "file" else {**i, "size": None}


def version(i: dict) -> str:
    """What ``replace`` checks: the generation on GCS, the ETag on S3."""
    return str(i.get("generation") or i.get("ETag") or i.get("etag"))


def read(u: Url) -> bytes:
    with errors(u, "read"):
        return filesystem(u).cat_file(u.path)


def read_ranges(u: Url, ranges: list[tuple[int, int]]) -> list[bytes]:
    """Bytes [start, end) of each range, fetched concurrently (one request each)."""
    fs = filesystem(u)
    with errors(u, "read"):
        return fs.cat_ranges([u.path] * len(ranges), [a for a, _ in ranges], [b for _, b in ranges])


def open_read(u: Url, block_size: int = 8 << 20):
    """A binary file object streaming the object (read-ahead of ``block_size`` bytes)."""
    fs = filesystem(u)
    with errors(u, "read"):
        return fs.open(u.path, "rb", block_size=block_size, cache_type="readahead")


def listing(u: Url) -> dict[str, int]:
    """Object name (below ``u``) -> size, of every object whose key starts with ``u.key + '/'``."""
    fs = filesystem(u)
    prefix = u.path.rstrip("/")
    with errors(u, "list"):
        fs.invalidate_cache(prefix)
        try:
            entries = fs.find(prefix, detail=True, withdirs=False)
        except FileNotFoundError:
            if not _bucket_exists(u):
                raise
            return {}
    return {name[len(prefix) + 1:]: e["size"] for name, e in entries.items() if name.startswith(prefix + "/")}


def put(u: Url, data: bytes) -> None:
    """Write the object whole (replacing any)."""
    fs = filesystem(u)
    with errors(u, "write"):
        fs.pipe_file(u.path, data)
        fs.invalidate_cache(u.path)


def create(u: Url, data: bytes) -> bool:
    """Write the object only if it does not exist (the store decides): False if it did."""
    fs = filesystem(u)
    with errors(u, "create"):
        try:
            fs.pipe_file(u.path, data, mode="create")
        except FileExistsError:
            return False
        finally:
            fs.invalidate_cache(u.path)
    return True


def replace(u: Url, data: bytes, expected: str) -> bool:
    """Overwrite the object only if its version is still ``expected`` (see ``version``): False if not."""
    fs = filesystem(u)
    with errors(u, "replace"):
        try:
            if u.scheme == "gs":
                fs.call("POST", f"{fs._location}/upload/storage/v1/b/{u.bucket}/o", uploadType="media", name=u.key,
                        ifGenerationMatch=expected, data=data, json_out=True)
            else:
                fs.call_s3("put_object", Bucket=u.bucket, Key=u.key, Body=data, IfMatch=expected)
        except FileExistsError:  # gcsfs: 412
            return False
        except OSError as e:
            if _code(e) in ("PreconditionFailed", "ConditionalRequestConflict") or "pre-condition" in str(e):
                return False
            raise
        finally:
            fs.invalidate_cache(u.path)
    return True


def remove(urls: list[Url]) -> None:
    if not urls:
        return
    fs = filesystem(urls[0])
    with errors(urls[0], "delete"):
        fs.rm([u.path for u in urls])
        fs.invalidate_cache()


def compose(u: Url, sources: list[Url]) -> None:
    """``u`` becomes the concatenation of ``sources`` (same bucket; ``u`` may be one of them),
    copied inside the store: GCS composes (32 sources a call, folding the result into the next
    call), S3 copies them as the parts of one multipart upload (every source but the last must
    then hold at least 5 MiB; see ``can_compose``)."""
    fs = filesystem(u)
    with errors(u, "compose"):
        if u.scheme == "gs":
            first, rest = sources[:32], sources[32:]
            fs.merge(u.path, [s.path for s in first])
            while rest:
                fs.merge(u.path, [u.path] + [s.path for s in rest[:31]])
                rest = rest[31:]
        else:
            fs.merge(u.path, [s.path for s in sources])
        fs.invalidate_cache(u.path)


S3_MIN_PART = 5 << 20


def can_compose(u: Url, sizes: list[int]) -> bool:
    """Whether ``compose`` can join objects of these sizes inside the store."""
    return u.scheme == "gs" or all(s >= S3_MIN_PART for s in sizes[:-1]) and len(sizes) <= 10_000
