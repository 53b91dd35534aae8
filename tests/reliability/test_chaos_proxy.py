"""The chaos proxy itself, against a tiny stdlib upstream (fast; no moto, no SDK).

The reliability tests trust the proxy to (a) relay cleanly what it does not break, byte for byte,
chunked and streamed, and (b) break exactly what it says it broke, in the phase it says: a
'before' fault must never reach the upstream, an 'after' fault must have been applied there. If
either were wrong, a green chaos test could mean nothing was exercised, or a red one could be the
proxy's fault rather than the store's.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from objckpt.testing.chaos_proxy import ALL_KINDS, ChaosProxy


class _Upstream:
    """Stores PUT bodies by path, serves them back, counts applied writes; speaks chunked."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.applied: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        owner = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: object) -> None:
                pass

            def _body(self) -> bytes:
                if "chunked" in (self.headers.get("Transfer-Encoding") or ""):
                    out = bytearray()
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b""):
                                pass
                            return bytes(out)
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _reply(
                self,
                status: int,
                body: bytes,
                ctype: str = "application/json",
                extra: dict[str, str] | None = None,
            ) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for k, v in (extra or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_PUT(self) -> None:
                data = self._body()
                with owner.lock:
                    owner.objects[self.path] = data
                    owner.applied.append(("PUT", self.path))
                self._reply(
                    200, json.dumps({"sha": hashlib.sha256(data).hexdigest(), "len": len(data)}).encode()
                )

            def do_POST(self) -> None:  # a resumable-upload start: Location names the upstream
                self._body()
                port = self.server.server_address[1]
                self._reply(
                    200,
                    json.dumps({"mediaLink": f"http://127.0.0.1:{port}/media/x"}).encode(),
                    extra={"Location": f"http://127.0.0.1:{port}/upload?id=1"},
                )

            def do_GET(self) -> None:
                if self.path.startswith("/stream/"):  # chunked response of N bytes
                    n = int(self.path.rsplit("/", 1)[1])
                    self.send_response(200)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for i in range(0, n, 100_000):
                        piece = _pattern(i, min(100_000, n - i))
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    self.wfile.write(b"0\r\n\r\n")
                    return
                with owner.lock:
                    data = owner.objects.get(self.path)
                if data is None:
                    return self._reply(404, b'{"error": "not found"}')
                self._reply(200, data, "application/octet-stream")

            do_HEAD = do_GET

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> _Upstream:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


def _pattern(offset: int, n: int) -> bytes:
    block = bytes(range(251)) * 400  # 100,400 bytes; 251 is prime, so offsets matter
    start = offset % 251
    out = (block[start:] + block) * (n // len(block) + 2)
    return out[:n]


@pytest.fixture
def upstream() -> Iterator[_Upstream]:
    with _Upstream() as up:
        yield up


def _conn(proxy: ChaosProxy) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)


def _put(conn: http.client.HTTPConnection, path: str, body: bytes) -> tuple[int, bytes]:
    conn.request("PUT", path, body=body)
    resp = conn.getresponse()
    return resp.status, resp.read()


def test_clean_relay_keeps_alive_and_streams_large_bodies(upstream: _Upstream) -> None:
    """Without faults the proxy is transparent: bodies identical, one client connection reused."""
    big = _pattern(7, 24 * 1024 * 1024 + 13)
    with ChaosProxy(upstream.url, fault_rate=0.0, seed=0) as proxy:
        conn = _conn(proxy)

        def gen() -> Iterator[bytes]:  # a streamed body with a Content-Length
            for i in range(0, len(big), 1 << 20):
                yield big[i : i + (1 << 20)]

        conn.putrequest("PUT", "/o/big")
        conn.putheader("Content-Length", str(len(big)))
        conn.endheaders()
        for piece in gen():
            conn.send(piece)
        resp = conn.getresponse()
        assert resp.status == 200
        assert json.loads(resp.read())["sha"] == hashlib.sha256(big).hexdigest()

        conn.request("GET", "/o/big")
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read() == big

        conn.request("HEAD", "/o/big")
        resp = conn.getresponse()
        assert resp.getheader("Content-Length") == str(len(big)) and resp.read() == b""

        conn.request("GET", "/stream/3000000")  # chunked upstream response
        resp = conn.getresponse()
        assert resp.read() == _pattern(0, 3_000_000)
        conn.close()
        stats = proxy.stats
    assert stats["connections"] == 1 and stats["requests"] == 4 and stats["forwarded"] == 4
    assert proxy.faults == 0


def test_chunked_request_with_trailer_and_expect_continue(upstream: _Upstream) -> None:
    """Chunked framing and trailers pass through; ``Expect: 100-continue`` is honoured."""
    body = _pattern(3, 3 * 1024 * 1024 + 5)
    with ChaosProxy(upstream.url, fault_rate=0.0) as proxy:
        sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=30)
        sock.sendall(
            b"PUT /o/chunked HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Expect: 100-continue\r\nTrailer: x-amz-checksum-crc32c\r\n\r\n"
        )
        f = sock.makefile("rb")
        assert f.readline().startswith(b"HTTP/1.1 100")
        assert f.readline() == b"\r\n"
        for i in range(0, len(body), 700_001):
            piece = body[i : i + 700_001]
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        sock.sendall(b"0\r\nx-amz-checksum-crc32c: AAAAAA==\r\n\r\n")
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        assert resp.status == 200
        assert json.loads(resp.read())["sha"] == hashlib.sha256(body).hexdigest()
        sock.close()
    assert upstream.objects["/o/chunked"] == body


@pytest.mark.parametrize("kind", [k for k in ALL_KINDS if k != "latency"])
@pytest.mark.parametrize("phase", ["before", "after"])
def test_each_fault_breaks_the_response_in_its_phase(upstream: _Upstream, kind: str, phase: str) -> None:
    """'before': the upstream never sees the write; 'after': it applied it, the answer is lost."""
    body = _pattern(1, 200_000)
    with ChaosProxy(upstream.url, fault_rate=0.0) as proxy:
        proxy.inject(kind, phase=phase, method="PUT", path_contains="/o/x")
        conn = _conn(proxy)
        outcome: object
        try:
            status, data = _put(conn, "/o/x", body)
            outcome = (status, data)
        except (http.client.HTTPException, ConnectionError) as exc:
            outcome = exc
        conn.close()
        assert proxy.stats[f"{kind}:{phase}"] == 1 and proxy.pending_injections() == 0
    applied = ("PUT", "/o/x") in upstream.applied
    assert applied == (phase == "after")
    if kind in ("slowdown", "internal"):
        status, data = outcome  # type: ignore[misc]
        code = {
            "slowdown": (503, b"<Code>SlowDown</Code>"),
            "internal": (500, b"<Code>InternalError</Code>"),
        }[kind]
        assert status == code[0] and code[1] in data
    else:
        # never a clean, complete success: a reset or a short read, whatever the client sees first
        assert isinstance(outcome, (http.client.HTTPException, ConnectionError)), outcome


def test_reset_and_truncate_cut_a_download_mid_body(upstream: _Upstream) -> None:
    """A GET gets its headers and part of its body, then an RST / a short body."""
    data = _pattern(0, 4 * 1024 * 1024)
    upstream.objects["/o/d"] = data
    with ChaosProxy(upstream.url, fault_rate=0.0, seed=5) as proxy:
        for kind in ("reset", "truncate"):
            proxy.inject(kind, phase="after", method="GET")
            conn = _conn(proxy)
            conn.request("GET", "/o/d")
            resp = conn.getresponse()
            assert resp.status == 200  # the headers arrived...
            got = bytearray()
            with pytest.raises((http.client.IncompleteRead, ConnectionError)):
                while True:  # ...the body does not
                    piece = resp.read(65536)
                    if not piece:
                        # http.client returns b'' on EOF only for unknown lengths; force the check
                        raise http.client.IncompleteRead(bytes(got))
                    got += piece
            assert len(got) < len(data) and data.startswith(bytes(got))
            conn.close()


def test_gcs_flavor_and_url_rewriting(upstream: _Upstream) -> None:
    """GCS errors are JSON; upstream URLs in Location and JSON bodies point back at the proxy."""
    with ChaosProxy(upstream.url, fault_rate=0.0, flavor="gcs") as proxy:
        conn = _conn(proxy)
        conn.request("POST", "/upload/storage/v1/b/b/o?uploadType=resumable", body=b"{}")
        resp = conn.getresponse()
        body = json.loads(resp.read())
        assert resp.getheader("Location").startswith(proxy.endpoint_url + "/upload")
        assert body["mediaLink"].startswith(proxy.endpoint_url)
        proxy.inject("slowdown", phase="before")
        conn.request("GET", "/storage/v1/b/b/o/x")
        resp = conn.getresponse()
        assert resp.status == 503
        err = json.loads(resp.read())
        assert err["error"]["code"] == 503 and err["error"]["errors"][0]["reason"] == "backendError"
        conn.close()


def test_seeded_decisions_repeat(upstream: _Upstream) -> None:
    """Same seed, same request order -> the same faults (so a failing run can be replayed)."""

    def run(seed: int) -> list[tuple[str, str, str]]:
        with ChaosProxy(
            upstream.url,
            fault_rate=0.4,
            seed=seed,
            kinds=("slowdown", "internal", "latency"),
            latency=(0.0, 0.001),
        ) as proxy:
            conn = _conn(proxy)
            for i in range(40):
                _put(conn, f"/o/s{i}", b"x")
            conn.close()
            return [(i.kind, i.phase, i.path) for i in proxy.injections]

    first = run(11)
    assert first == run(11)
    assert first != run(12)
    assert len(first) > 0


def test_stop_breaks_idle_and_busy_connections(upstream: _Upstream) -> None:
    """stop() returns with no handler thread left, even with an idle keep-alive connection and a
    client stuck sending a body the proxy is waiting for."""
    proxy = ChaosProxy(upstream.url, fault_rate=0.0).start()
    idle = _conn(proxy)
    _put(idle, "/o/idle", b"1")  # leaves the connection open and idle
    stuck = socket.create_connection(("127.0.0.1", proxy.port), timeout=30)
    stuck.sendall(b"PUT /o/stuck HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\npartial")
    # make sure the proxy is inside that request before stopping
    for _ in range(200):
        if proxy.stats["requests"] >= 2:
            break
        threading.Event().wait(0.01)
    threads = set(proxy._conns.threads)
    proxy.stop()
    assert not any(t.is_alive() for t in threads)
    assert not proxy._conns.threads
    idle.close()
    stuck.close()


def test_rejects_non_loopback_upstreams() -> None:
    with pytest.raises(ValueError):
        ChaosProxy("http://10.0.0.1:9000")
    with pytest.raises(ValueError):
        ChaosProxy("http://127.0.0.1:9000", fault_rate={"bogus": 0.1})
