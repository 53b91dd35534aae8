"""Local S3 servers for tests, benchmarks and the demo: moto and LocalStack, no Docker.

::

    from objckpt.testing.s3_servers import MotoServer, create_bucket

    with MotoServer() as srv:
        create_bucket(srv.endpoint_url, "demo")
        store = open_store("s3://demo/run", **srv.store_options)

Each server is a subprocess listening on 127.0.0.1 on a free port. Leaving the ``with`` block
(normally or by an exception) stops it; an ``atexit`` hook stops any server a crashed caller
forgot. Children get dummy AWS credentials and none of the caller's real ones.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

#: credentials for local servers; they accept anything, and real ones must never reach them
DUMMY_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_LOCALSTACK_VENV = REPO_ROOT / "build" / "localstack-venv"
LOCALSTACK_INSTALL_HINT = "bash scripts/localstack.sh"

_live: set[_ServerProcess] = set()
_live_lock = threading.Lock()


def _stop_all_at_exit() -> None:
    with _live_lock:
        # a forked child inherits this set; only the process that started a server stops it
        servers = [s for s in _live if s._owner_pid == os.getpid()]
    for server in servers:
        with contextlib.suppress(Exception):
            server.stop()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: SIGKILL the server when the thread that started it dies (even by SIGKILL, which
    skips atexit). Elsewhere a no-op.

    SIGKILL, not SIGTERM: a server whose owner is gone holds only throwaway state, and
    LocalStack (host mode, 4.x) was seen to catch a SIGTERM that came this way and keep
    serving, idle, for over an hour after its benchmark run was killed (2026-12-06). The
    orderly path (:meth:`_ServerProcess.stop`) still sends SIGTERM first."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


atexit.register(_stop_all_at_exit)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (another process may still take it; callers retry)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The caller's environment without its AWS settings, plus dummy credentials and ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AWS_", "OBJCKPT_TEST_")) and k not in ("BOTO_CONFIG",)
    }
    env.update(DUMMY_CREDENTIALS)
    env.update(extra or {})
    return env


def create_bucket(endpoint_url: str, name: str, *, region: str = "us-east-1") -> None:
    """Create bucket ``name`` on a local S3 server; an existing bucket of ours is fine."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import ClientError

    client = boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=region,
        aws_access_key_id=DUMMY_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=DUMMY_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        config=Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 3}),
    )
    try:
        client.create_bucket(Bucket=name)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in (
            "BucketAlreadyOwnedByYou",
            "BucketAlreadyExists",
        ):
            raise
    finally:
        client.close()


class ServerStartError(RuntimeError):
    """A server did not come up; the message ends with the tail of its log."""


class _ServerProcess:
    """A child process serving HTTP on 127.0.0.1:<port>, started and stopped by its owner."""

    name = "server"
    startup_timeout = 60.0

    def __init__(
        self,
        *,
        port: int | None = None,
        log_path: str | os.PathLike[str] | None = None,
        startup_timeout: float | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.host = "127.0.0.1"
        self.extra_env = dict(env or {})
        #: end the server if the starting thread's process dies without stopping it (Linux);
        #: set False to start a server from a short-lived thread
        self.die_with_parent = True
        self._owner_pid = os.getpid()
        self._fixed_port = port
        self.port = 0
        self.startup_timeout = startup_timeout or self.startup_timeout
        self._log_path = Path(log_path) if log_path else None
        self._log_file: Any = None
        self._temp_log = False
        self.proc: subprocess.Popen[bytes] | None = None
        #: seconds from spawn to the first healthy answer (benchmarks report it)
        self.startup_seconds: float | None = None

    # -- what subclasses define
    def _command(self) -> list[str]:
        raise NotImplementedError

    def _env(self) -> dict[str, str]:
        return child_env(self.extra_env)

    def _healthy(self) -> bool:
        """True once the server answers requests."""
        raise NotImplementedError

    # -- lifecycle
    @property
    def endpoint_url(self) -> str:
        if not self.port:
            raise RuntimeError(f"{self.name} is not running")
        return f"http://{self.host}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """Environment for a subprocess that talks to this server (dummy credentials)."""
        return child_env({"AWS_ENDPOINT_URL_S3": self.endpoint_url})

    def start(self) -> _ServerProcess:
        """Spawn and wait until healthy. Raises :class:`ServerStartError` with the log's tail."""
        tries = 1 if self._fixed_port else 3  # a free port can be taken between probe and bind
        for attempt in range(tries):
            self.port = self._fixed_port or free_port(self.host)
            self._spawn()
            try:
                self._wait_healthy()
                return self
            except ServerStartError:
                log = self.log_tail()
                self.stop()
                if attempt == tries - 1 or "in use" not in log.lower():
                    raise
        raise AssertionError("unreachable")

    def _spawn(self) -> None:
        if self._log_path is None:
            fd, path = tempfile.mkstemp(prefix=f"objckpt-{self.name}-", suffix=".log")
            os.close(fd)
            self._log_path = Path(path)
            self._temp_log = True  # ours: removed by stop()
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self._log_path, "ab")  # a file, not a pipe: a pipe fills and blocks
        self._started_at = time.monotonic()
        self._owner_pid = os.getpid()
        self.proc = subprocess.Popen(
            self._command(),
            env=self._env(),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() ends its children too
            preexec_fn=_die_with_parent if self.die_with_parent and sys.platform == "linux" else None,
        )
        with _live_lock:
            _live.add(self)

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = self._started_at + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"{self.name} exited with code {self.proc.returncode} during startup; "
                    f"log {self._log_path}:\n{self.log_tail()}"
                )
            with contextlib.suppress(OSError, ValueError, urllib.error.URLError):
                if self._healthy():
                    self.startup_seconds = time.monotonic() - self._started_at
                    return
            time.sleep(0.1)
        raise ServerStartError(
            f"{self.name} did not become healthy within {self.startup_timeout:.0f}s; "
            f"log {self._log_path}:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        if self._log_path is None or not self._log_path.exists():
            return ""
        text = self._log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after ``timeout``; idempotent."""
        proc, self.proc = self.proc, None
        with _live_lock:
            _live.discard(self)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._temp_log and self._log_path is not None:
            with contextlib.suppress(OSError):
                self._log_path.unlink()
            self._log_path, self._temp_log = None, False

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _get(self, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"{self.endpoint_url}{path}", timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:  # any HTTP answer means it is serving
            return exc.code, exc.read()

    def uri(self, bucket: str, prefix: str = "") -> str:
        """``s3://bucket/prefix?...`` that opens a store on this server (dummy credentials)."""
        from urllib.parse import urlencode

        path = f"{bucket}/{prefix.strip('/')}" if prefix.strip("/") else bucket
        return f"s3://{path}?{urlencode(self.store_options)}"

    @property
    def store_options(self) -> dict[str, str]:
        """``open_store`` options for this server."""
        return {
            "endpoint_url": self.endpoint_url,
            "access_key_id": DUMMY_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "secret_access_key": DUMMY_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            "region": DUMMY_CREDENTIALS["AWS_DEFAULT_REGION"],
        }


class MotoServer(_ServerProcess):
    """``python -m moto.server`` on 127.0.0.1 (in-memory, gone when stopped).

    moto honours ``If-None-Match``/``If-Match`` but decides them without a lock (two racing
    writers can both win), so :attr:`store_options` declares ``conditional_writes=unsafe`` (and
    ``read_concurrency=1``: a ranged GET costs moto a whole-object copy). It also accepts parts
    whose checksum is wrong (a gap the contract suite records).

    Args:
        min_part_size: moto's smallest accepted non-final part (S3: 5 MiB); tests may lower it
            to exercise multipart with small objects.
        env: extra server environment, e.g. ``{"INITIAL_NO_AUTH_ACTION_COUNT": "0"}`` to make
            moto check credentials (unknown keys then get 403 InvalidAccessKeyId).
    """

    name = "moto"
    startup_timeout = 60.0

    def __init__(self, *, min_part_size: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.min_part_size = min_part_size

    def _command(self) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)]

    def _env(self) -> dict[str, str]:
        extra = {"MOTO_ALLOW_NONEXISTENT_REGION": "true"}
        if self.min_part_size is not None:
            extra["S3_UPLOAD_PART_MIN_SIZE"] = str(self.min_part_size)
        return child_env({**extra, **self.extra_env})

    def _healthy(self) -> bool:
        status, _ = self._get("/moto-api/data.json")
        return status == 200

    def reset(self) -> None:
        """Drop every bucket and object (moto's reset API)."""
        req = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST")
        urllib.request.urlopen(req, timeout=10).close()

    @property
    def store_options(self) -> dict[str, str]:
        # read_concurrency=1: moto answers each ranged GET by copying the whole object under a
        # per-object lock, so parallel ranged reads are slower than one streaming GET there.
        options = {
            **super().store_options,
            "conditional_writes": "unsafe",
            "read_concurrency": "1",
        }
        if self.min_part_size is not None:
            # the limit this server was started with (S3's is 5 MiB): smaller parts are refused
            # when a store is opened, so a store on this server must be told
            options["min_part_size"] = str(self.min_part_size)
        return options


class LocalStackServer(_ServerProcess):
    """LocalStack (S3 only) in host mode, from the virtualenv ``scripts/localstack.sh`` builds.

    Runs ``python -m localstack.runtime.main`` with ``GATEWAY_LISTEN=127.0.0.1:<port>``,
    ``GATEWAY_SERVER=hypercorn``, ``SERVICES=s3``; its filesystem root (state, temp files) and
    config dir live under ``build/localstack-run/<port>/`` and are deleted on stop; the log
    (``localstack.log`` there) is kept for inspection. No DNS server, no
    analytics, no downloads.

    Args:
        venv: the LocalStack virtualenv (default ``build/localstack-venv`` or
            ``$OBJCKPT_LOCALSTACK_VENV``).
        init_dir: a folder with ``ready.d/`` hooks (e.g. ``localstack/init``) to run at startup,
            as the Docker image does; startup then also waits for them.
    """

    name = "localstack"
    startup_timeout = 180.0

    def __init__(
        self,
        *,
        venv: str | os.PathLike[str] | None = None,
        init_dir: str | os.PathLike[str] | None = None,
        work_dir: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.venv = Path(venv or os.environ.get("OBJCKPT_LOCALSTACK_VENV") or DEFAULT_LOCALSTACK_VENV)
        self.init_dir = Path(init_dir) if init_dir else None
        self._work_root = Path(work_dir) if work_dir else REPO_ROOT / "build" / "localstack-run"

    @classmethod
    def available(cls, venv: str | os.PathLike[str] | None = None) -> bool:
        """Whether the LocalStack virtualenv exists (see ``scripts/localstack.sh``)."""
        path = Path(venv or os.environ.get("OBJCKPT_LOCALSTACK_VENV") or DEFAULT_LOCALSTACK_VENV)
        return (path / "bin" / "python").exists()

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def _spawn(self) -> None:
        if not self.python.exists():
            raise ServerStartError(
                f"no LocalStack virtualenv at {self.venv}; install it with: {LOCALSTACK_INSTALL_HINT}"
            )
        self.work_dir = self._work_root / str(self.port)
        for sub in ("fs", "config"):
            (self.work_dir / sub).mkdir(parents=True, exist_ok=True)
        if self.init_dir is not None:
            target = self.work_dir / "fs" / "etc" / "localstack" / "init"
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.is_symlink() or target.exists():
                target.unlink()
            target.symlink_to(self.init_dir.resolve(), target_is_directory=True)
        if self._log_path is None:
            self._log_path = self.work_dir / "localstack.log"
        super()._spawn()

    def _command(self) -> list[str]:
        return [str(self.python), "-m", "localstack.runtime.main"]

    def stop(self, timeout: float = 20.0) -> None:
        """Stop LocalStack and delete its state (objects can be large); the log stays."""
        super().stop(timeout)
        work_dir = getattr(self, "work_dir", None)
        if work_dir is not None:
            import shutil

            for sub in ("fs", "config"):
                shutil.rmtree(work_dir / sub, ignore_errors=True)

    def _env(self) -> dict[str, str]:
        listen = f"{self.host}:{self.port}"
        return child_env(
            {
                "PATH": f"{self.venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
                "GATEWAY_LISTEN": listen,
                "GATEWAY_SERVER": "hypercorn",
                "LOCALSTACK_HOST": listen,
                "SERVICES": "s3",
                "EAGER_SERVICE_LOADING": "1",  # load S3 at startup, not on the first request
                # This machine may itself be a container, which LocalStack would take as "running in
                # its Docker image" and then use /var/lib/localstack, /etc/localstack, /tmp/localstack.
                "OVERRIDE_IN_DOCKER": "0",
                "FILESYSTEM_ROOT": str(self.work_dir / "fs"),
                "CONFIG_DIR": str(self.work_dir / "config"),
                "PERSISTENCE": "0",
                "DNS_ADDRESS": "0",  # no DNS server on port 53
                "DISABLE_EVENTS": "1",  # no analytics calls home
                "SKIP_SSL_CERT_DOWNLOAD": "1",
                "OBJCKPT_TEST_BUCKET": os.environ.get("OBJCKPT_TEST_BUCKET", "objckpt-test"),
                **self.extra_env,
            }
        )

    def _healthy(self) -> bool:
        status, body = self._get("/_localstack/health")
        if status != 200:
            return False
        services = json.loads(body or b"{}").get("services", {})
        if services.get("s3") not in ("available", "running"):
            return False
        if self.init_dir is None:
            return True
        status, body = self._get("/_localstack/init/ready")
        return status == 200 and bool(json.loads(body or b"{}").get("completed"))


__all__ = [
    "DUMMY_CREDENTIALS",
    "LocalStackServer",
    "MotoServer",
    "ServerStartError",
    "child_env",
    "create_bucket",
    "free_port",
]
