"""The local server launcher (objckpt.testing.s3_servers): a server never outlives the process
that started it, even when that process is killed without running its exit handlers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux-only")

# A server started by a short-lived owner: it serves HTTP and ignores SIGTERM, as LocalStack was
# seen to do with a SIGTERM that arrived after its owner died.
OWNER = textwrap.dedent(
    """
    import sys, time
    from objckpt.testing.s3_servers import _ServerProcess

    class StubbornServer(_ServerProcess):
        name = "stubborn"
        startup_timeout = 30.0

        def _command(self):
            code = (
                "import signal, http.server; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                f"http.server.ThreadingHTTPServer(('127.0.0.1', {self.port}), "
                "http.server.SimpleHTTPRequestHandler).serve_forever()"
            )
            return [sys.executable, "-c", code]

        def _healthy(self):
            status, _ = self._get("/")
            return status < 500

    server = StubbornServer().start()
    print(server.proc.pid, flush=True)
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (a killed orphan may wait to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_a_server_dies_with_an_owner_killed_without_its_exit_handlers(tmp_path):
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    server_pid = None
    try:
        assert owner.stdout is not None
        server_pid = int(owner.stdout.readline())
        assert _alive(server_pid)
        owner.send_signal(signal.SIGTERM)  # Python's default: exit without atexit handlers
        owner.wait(30)
        deadline = time.monotonic() + 30  # liveness wait, not a timing assertion
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(server_pid), f"server {server_pid} outlived its killed owner"
    finally:
        if owner.poll() is None:
            owner.kill()
        if server_pid is not None and _alive(server_pid):
            os.kill(server_pid, signal.SIGKILL)
