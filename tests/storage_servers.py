"""Object stores on 127.0.0.1 for the tests: the GCS JSON API emulator (``gcp-storage-emulator``,
read through gcsfs) and moto's S3 server (``moto_server``, read through s3fs), each started on a
free port and stopped at the end of the session.

They are reached the way a user's own endpoint is: ``STORAGE_EMULATOR_HOST`` (gcsfs then goes
anonymous) and ``AWS_ENDPOINT_URL`` with dummy ``AWS_*`` keys. gcsfs asks every bucket for its
layout over gRPC first, which the emulator does not serve (60 s a bucket):
``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` skips that question.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            proc.log.seek(0)
            raise RuntimeError(f"the server for {url} exited with {proc.returncode}: {proc.log.read()[-2000:]}")
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except urllib.error.HTTPError:  # it answers
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"no answer from {url} within {timeout:g} s")


@dataclasses.dataclass
class Store:
    scheme: str  # "gs" or "s3"
    env: dict[str, str]  # what a client (this process or a subprocess) needs to reach it
    proc: subprocess.Popen
    _names = itertools.count()

    def bucket(self) -> str:
        """A new empty bucket; its name."""
        import fsspec

        name = f"jaxinfer-test-{os.getpid()}-{next(self._names)}"
        fs = fsspec.filesystem(self.scheme)
        fs.mkdir(name)
        return name

    def fs(self):
        import fsspec

        return fsspec.filesystem(self.scheme)


def _start(cmd: list[str], env: dict[str, str], probe: str) -> subprocess.Popen:
    # the servers log every request: into a file, since a pipe nobody reads fills and stops them
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log, stderr=log, text=True)
    proc.log = log
    try:
        _wait_http(probe, proc)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc


def start_gcs() -> Store:
    port = free_port()
    proc = _start([sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(port),
                   "--in-memory", "--quiet"], {}, f"http://127.0.0.1:{port}/storage/v1/b")
    env = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    return Store("gs", env, proc)


def start_s3(*, check_credentials: bool = False) -> Store:
    """check_credentials: the server refuses keys it has not issued (moto's IAM checks), as
    AWS refuses a wrong key: every request of this module's dummy keys is denied."""
    port = free_port()
    proc = _start([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                  {"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if check_credentials else {}, f"http://127.0.0.1:{port}/")
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    return Store("s3", env, proc)


def stop(store: Store) -> None:
    store.proc.terminate()
    try:
        store.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        store.proc.kill()
        store.proc.wait()
    store.proc.log.close()


def reset_clients() -> None:
    """Forget cached filesystems: they hold the endpoint they were made with."""
    import fsspec

    from jaxinfer import storage

    storage._FILESYSTEMS.clear()
    for cls in fsspec.registry.values():
        if hasattr(cls, "clear_instance_cache"):
            cls.clear_instance_cache()


@pytest.fixture(scope="session")
def object_stores():
    """{"gs": Store, "s3": Store}, both running, their endpoints in os.environ for the session."""
    stores = {}
    saved = dict(os.environ)
    try:
        stores["gs"] = start_gcs()
        stores["s3"] = start_s3()
        for s in stores.values():
            os.environ.update(s.env)
        # gcsfs reads GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT when imported: only now
        pytest.importorskip("gcsfs")
        pytest.importorskip("s3fs")
        reset_clients()
        yield stores
    finally:
        for s in stores.values():
            stop(s)
        os.environ.clear()
        os.environ.update(saved)
        reset_clients()


@pytest.fixture(params=["gs", "s3"])
def store(request, object_stores) -> Store:
    return object_stores[request.param]
