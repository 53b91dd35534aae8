"""A fault-injecting HTTP reverse proxy for reliability tests (stdlib only).

Why a proxy and not a store wrapper: a wrapper around the store primitives (``FaultInjectingStore``)
tests the retry *policy*, but not the SDK glue underneath it — how a backend maps a reset socket,
a short body or an S3 ``SlowDown`` XML document to ``TransientError``, whether it really disabled
the SDK's own retries, whether a conditional write whose response was lost is resolved correctly.
Those bugs only show up when the bytes on the wire go wrong, so this proxy sits between the SDK
and a real (emulated) server — moto for S3, fake-gcs-server for GCS — and breaks the wire::

    with ChaosProxy(upstream="http://127.0.0.1:5000", fault_rate=0.05, seed=1) as proxy:
        store = open_store(f"s3://bucket/run?endpoint_url={proxy.endpoint_url}")
        ...
        proxy.stats    # {"requests": 412, "forwarded": 398, "slowdown": 5, "reset": 4, ...}

Fault kinds (``kinds=``):

``slowdown``  503 with a proper error body (S3 ``<Error><Code>SlowDown</Code>...``, GCS JSON).
``internal``  500 ``InternalError`` (S3 XML / GCS JSON).
``reset``     the response's headers and part of its body, then an abrupt RST (SO_LINGER 0).
``truncate``  ``Content-Length`` claims more than is sent, then a clean close (FIN).
              For both: an empty body (a PUT's 200) is claimed to have bytes and gets none; a
              response that has no body at all (HEAD, 204, 304) is cut inside its status line
              (cut between header lines, http.client would take it for a complete response).
``latency``   an added delay (``latency=(lo, hi)`` seconds); the request then goes through.

Each fault fires in one of two *phases* (``phases=``):

``before``  the request never reaches the upstream (a ``reset`` here drops the connection before
            even reading the request body; the others answer a synthetic 503).
``after``   the upstream applied the request and answered, but the answer is replaced or broken on
            the way back. This is the dangerous case for conditional writes: the object exists,
            the client does not know it, and its retry meets its own write (412 / NoSuchUpload).

Decisions come from one ``random.Random(seed)`` consumed a fixed amount per request, so a given
request order gives the same faults. Concurrent clients make the order itself vary, which is fine
for the tests: they assert outcomes, not which request failed.

``inject(...)`` queues a one-shot fault for the next request matching a method / path predicate
(e.g. the lost response of the manifest's create-if-absent PUT), independent of ``fault_rate``.

Bodies are streamed in both directions (request bodies with ``Content-Length`` or chunked framing,
trailers included; responses with ``Content-Length``, chunked, or read-to-close), so a 15 MiB
multipart upload never sits whole in the proxy. ``Expect: 100-continue`` is answered by the proxy
right before it reads the body, and stripped towards the upstream. Client connections are kept
alive; each forwarded request uses a fresh upstream connection, so a stale upstream keep-alive
can never be mistaken for an injected fault.

Absolute URLs naming the upstream (``Location`` of a GCS resumable upload, ``mediaLink`` and
``selfLink`` in small JSON bodies) are rewritten to the proxy, or the client would bypass it.

``stop()`` (or leaving the ``with`` block) closes the listener, shuts every open client and
upstream socket so that no handler thread stays blocked, and joins the threads with a bound.
"""

from __future__ import annotations

import http.client
import itertools
import json
import random
import re
import socket
import struct
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

__all__ = ["ALL_KINDS", "ChaosProxy", "Injection", "PHASES"]

ALL_KINDS = ("slowdown", "internal", "reset", "truncate", "latency")
PHASES = ("before", "after")

_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "expect",
}
_CHUNK = 256 * 1024
_REWRITE_LIMIT = 4 * 1024 * 1024  # JSON/XML bodies up to this size get upstream URLs rewritten
_NO_BODY_STATUSES = {204, 304}


@dataclass(frozen=True)
class Injection:
    """One fault that fired: what, when, on which request."""

    kind: str
    phase: str
    method: str
    path: str
    status: int | None = None  # upstream status for 'after' faults


@dataclass
class _Plan:
    kind: str | None
    phase: str
    fraction: float  # how much of the body to let through for reset/truncate
    delay: float


@dataclass
class _OneShot:
    kind: str
    phase: str
    match: Callable[[str, str], bool]
    remaining: int = 1


@dataclass
class _Conns:
    lock: threading.Lock = field(default_factory=threading.Lock)
    sockets: set[socket.socket] = field(default_factory=set)
    threads: set[threading.Thread] = field(default_factory=set)


class ChaosProxy:
    """Reverse proxy on 127.0.0.1 that injects seeded faults between a client and ``upstream``.

    Args:
        upstream: ``http://127.0.0.1:PORT`` of the real server (moto, fake-gcs-server, LocalStack).
        fault_rate: probability that one request gets a fault (0..1), or a mapping
            ``{kind: probability}`` for per-kind rates (their sum must be <= 1).
        seed: seeds the decisions.
        kinds: the kinds drawn from when ``fault_rate`` is a float (uniformly).
        phases: the phases drawn from (uniformly).
        flavor: ``"s3"`` (XML error bodies) or ``"gcs"`` (JSON error bodies).
        latency: ``(lo, hi)`` seconds of added delay for the ``latency`` kind.
        match: optional ``match(method, path) -> bool``; only matching requests may get random
            faults (e.g. skip bucket creation). One-shot ``inject`` faults have their own match.
        port: listen port (0: a free one).
        upstream_timeout: socket timeout towards the upstream, seconds.
        rewrite_origins: extra origins (``http://0.0.0.0:4443``) that mean the upstream in
            ``Location`` headers and small JSON bodies.
    """

    def __init__(
        self,
        upstream: str,
        *,
        fault_rate: float | dict[str, float] = 0.05,
        seed: int = 0,
        kinds: Iterable[str] = ALL_KINDS,
        phases: Iterable[str] = PHASES,
        flavor: str = "s3",
        latency: tuple[float, float] = (0.05, 0.3),
        match: Callable[[str, str], bool] | None = None,
        port: int = 0,
        upstream_timeout: float = 60.0,
        rewrite_origins: Iterable[str] = (),
    ) -> None:
        split = urlsplit(upstream)
        if split.scheme != "http" or not split.hostname or not split.port:
            raise ValueError(f"upstream must be http://HOST:PORT, got {upstream!r}")
        if split.hostname not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"the chaos proxy only talks to loopback upstreams, got {upstream!r}")
        if flavor not in ("s3", "gcs"):
            raise ValueError(f"flavor must be 's3' or 'gcs', got {flavor!r}")
        self.upstream = upstream.rstrip("/")
        self._up_host = split.hostname
        self._up_port = split.port
        self.flavor = flavor
        self.seed = seed
        self.latency = latency
        self.match = match
        self.upstream_timeout = upstream_timeout
        self._phases = tuple(phases)
        for p in self._phases:
            if p not in PHASES:
                raise ValueError(f"unknown phase {p!r}; use {PHASES}")
        self._rates = self._parse_rates(fault_rate, tuple(kinds))
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._counter: Counter[str] = Counter()
        self._oneshots: list[_OneShot] = []
        self.injections: list[Injection] = []
        self._extra_origins = [o.rstrip("/") for o in rewrite_origins]
        self._conns = _Conns()
        self._stopping = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._port = port
        self.enabled = True

    # ------------------------------------------------------------------ configuration

    @staticmethod
    def _parse_rates(rate: float | dict[str, float], kinds: tuple[str, ...]) -> list[tuple[str, float]]:
        if isinstance(rate, dict):
            pairs = list(rate.items())
        else:
            if not kinds:
                raise ValueError("kinds must not be empty")
            pairs = [(k, float(rate) / len(kinds)) for k in kinds]
        for kind, p in pairs:
            if kind not in ALL_KINDS:
                raise ValueError(f"unknown fault kind {kind!r}; use {ALL_KINDS}")
            if p < 0:
                raise ValueError(f"negative rate for {kind!r}")
        if sum(p for _, p in pairs) > 1.0 + 1e-9:
            raise ValueError("fault rates add up to more than 1")
        return pairs

    def set_fault_rate(
        self, fault_rate: float | dict[str, float], kinds: Iterable[str] | None = None
    ) -> None:
        """Change the random fault rate while running (e.g. 0 during setup)."""
        with self._lock:
            if kinds is None:
                kinds = tuple(k for k, _ in self._rates) or ALL_KINDS
            self._rates = self._parse_rates(fault_rate, tuple(kinds))

    def inject(
        self,
        kind: str,
        *,
        phase: str = "after",
        method: str | None = None,
        path_contains: str | None = None,
        path_regex: str | None = None,
        times: int = 1,
    ) -> None:
        """Queue a one-shot fault for the next ``times`` requests matching method and path.

        ``path`` is the raw request target (path and query string), e.g.
        ``/bucket/run/manifests/00000000000000000020.json`` or, for GCS,
        ``/upload/storage/v1/b/bucket/o?uploadType=multipart&ifGenerationMatch=0...`` (the object
        name is then in the query or the body; match on what the request line shows).
        """
        if kind not in ALL_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; use {ALL_KINDS}")
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; use {PHASES}")
        rx = re.compile(path_regex) if path_regex else None

        def match(m: str, p: str) -> bool:
            return (
                (method is None or m.upper() == method.upper())
                and (path_contains is None or path_contains in p)
                and (rx is None or rx.search(p) is not None)
            )

        with self._lock:
            self._oneshots.append(_OneShot(kind, phase, match, times))

    def pending_injections(self) -> int:
        """How many queued one-shot faults have not fired yet."""
        with self._lock:
            return sum(o.remaining for o in self._oneshots)

    # ------------------------------------------------------------------ lifecycle

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("proxy not started")
        return self._server.server_address[1]

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def stats(self) -> dict[str, int]:
        """Counts: ``connections`` (accepted from clients), ``requests``, ``forwarded``,
        ``upstream_errors``, each kind, and ``kind:phase``."""
        with self._lock:
            out = {k: 0 for k in ALL_KINDS}
            out.update({"connections": 0, "requests": 0, "forwarded": 0, "upstream_errors": 0})
            out.update(self._counter)
            return out

    @property
    def faults(self) -> int:
        """Injected faults that break a request (everything but ``latency``)."""
        s = self.stats
        return sum(s[k] for k in ALL_KINDS if k != "latency")

    def start(self) -> ChaosProxy:
        if self._server is not None:
            return self
        proxy = self

        class Handler(_ProxyHandler):
            owner = proxy

        server = _Server(("127.0.0.1", self._port), Handler)
        server.conns = self._conns
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name=f"chaos-proxy-{server.server_address[1]}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting, break every open connection, join the threads (bounded)."""
        server, self._server = self._server, None
        if server is None:
            return
        self._stopping.set()
        server.shutdown()
        server.server_close()
        with self._conns.lock:
            socks = list(self._conns.sockets)
            threads = list(self._conns.threads)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> ChaosProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ decisions

    def _plan(self, method: str, path: str) -> _Plan:
        with self._lock:
            self._counter["requests"] += 1
            # Fixed RNG consumption per request keeps a request order reproducible.
            r_fault, r_phase, fraction, r_delay = (self._rng.random() for _ in range(4))
            for shot in self._oneshots:
                if shot.remaining > 0 and shot.match(method, path):
                    shot.remaining -= 1
                    self._oneshots = [o for o in self._oneshots if o.remaining > 0]
                    return _Plan(shot.kind, shot.phase, fraction, self._delay(r_delay))
            if not self.enabled or (self.match is not None and not self.match(method, path)):
                return _Plan(None, "", fraction, 0.0)
            acc = 0.0
            kind = None
            for k, p in self._rates:
                acc += p
                if r_fault < acc:
                    kind = k
                    break
            if kind is None:
                return _Plan(None, "", fraction, 0.0)
            phase = self._phases[int(r_phase * len(self._phases))]
            return _Plan(kind, phase, fraction, self._delay(r_delay))

    def _delay(self, r: float) -> float:
        lo, hi = self.latency
        return lo + (hi - lo) * r

    def _record(self, plan: _Plan, method: str, path: str, status: int | None = None) -> None:
        assert plan.kind is not None
        with self._lock:
            self._counter[plan.kind] += 1
            self._counter[f"{plan.kind}:{plan.phase}"] += 1
            self.injections.append(Injection(plan.kind, plan.phase, method, path, status))

    def _count(self, name: str) -> None:
        with self._lock:
            self._counter[name] += 1

    # ------------------------------------------------------------------ bodies

    def error_body(self, status: int, path: str) -> tuple[bytes, str]:
        """The synthetic error document for ``status`` (503 SlowDown / 500 InternalError)."""
        request_id = uuid.uuid4().hex[:16].upper()
        if self.flavor == "s3":
            code, msg = (
                ("SlowDown", "Please reduce your request rate.")
                if status == 503
                else ("InternalError", "We encountered an internal error. Please try again.")
            )
            resource = path.split("?", 1)[0]
            body = (
                '<?xml version="1.0" encoding="UTF-8"?>\n'
                f"<Error><Code>{code}</Code><Message>{msg}</Message>"
                f"<Resource>{_xml_escape(resource)}</Resource>"
                f"<RequestId>{request_id}</RequestId><HostId>chaos-proxy</HostId></Error>"
            ).encode()
            return body, "application/xml"
        reason = "backendError" if status == 503 else "internalError"
        msg = "Service unavailable (injected)" if status == 503 else "Internal error (injected)"
        body = json.dumps(
            {
                "error": {
                    "code": status,
                    "message": msg,
                    "errors": [{"message": msg, "domain": "global", "reason": reason}],
                }
            }
        ).encode()
        return body, "application/json; charset=UTF-8"

    def _origins(self) -> list[bytes]:
        port = self._up_port
        found = {f"http://127.0.0.1:{port}", f"http://localhost:{port}", self.upstream}
        found.update(self._extra_origins)
        return [o.encode() for o in sorted(found, key=len, reverse=True)]

    def rewrite(self, data: bytes) -> bytes:
        """Replace upstream origins in ``data`` with the proxy's."""
        mine = self.endpoint_url.encode()
        for origin in self._origins():
            data = data.replace(origin, mine)
        return data


def _xml_escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128
    conns: _Conns

    def process_request(self, request: Any, client_address: Any) -> None:
        t = threading.Thread(
            target=self._run_request,
            args=(request, client_address),
            name="chaos-proxy-conn",
            daemon=True,
        )
        with self.conns.lock:
            self.conns.sockets.add(request)
            self.conns.threads.add(t)
        t.start()

    def _run_request(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001
            pass  # a broken client connection is expected here; never print tracebacks
        finally:
            self.shutdown_request(request)
            with self.conns.lock:
                self.conns.sockets.discard(request)
                self.conns.threads.discard(threading.current_thread())

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


class _Broken(Exception):
    """The connection to the client was deliberately broken; stop handling it."""


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: ChaosProxy
    timeout = 120  # idle keep-alive connections are dropped after this long
    _expect_pending = False

    # --- plumbing

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence stderr
        pass

    def setup(self) -> None:
        super().setup()
        try:  # head and body are separate writes: without this, Nagle + delayed ACK add 40 ms
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        self.owner._count("connections")

    def handle_expect_100(self) -> bool:
        # Answer 100 Continue only when the body is actually wanted (see _body_chunks), so a
        # 'before' reset drops the request without inviting its body.
        self._expect_pending = True
        return True

    def handle_one_request(self) -> None:
        self._expect_pending = False
        try:
            super().handle_one_request()
        except _Broken:
            self.close_connection = True
        except (OSError, ValueError):  # the client went away, or sent malformed chunk framing
            self.close_connection = True

    def __getattr__(self, name: str) -> Any:
        if name.startswith("do_"):
            return self._proxy
        raise AttributeError(name)

    def _send_continue(self) -> None:
        if self._expect_pending:
            self._expect_pending = False
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.wfile.flush()

    def _body_chunks(self) -> Iterator[bytes]:
        """The request body, raw framing preserved for chunked (so trailers pass through)."""
        self._send_continue()
        te = (self.headers.get("Transfer-Encoding") or "").lower()
        if "chunked" in te:
            while True:
                line = self.rfile.readline(65537)
                if not line:
                    raise ConnectionError("client closed mid chunked body")
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                yield line
                if size == 0:
                    while True:  # trailers, then the empty line
                        trailer = self.rfile.readline(65537)
                        if not trailer:
                            raise ConnectionError("client closed in trailers")
                        yield trailer
                        if trailer in (b"\r\n", b"\n"):
                            return
                remaining = size + 2  # data + CRLF
                while remaining:
                    piece = self.rfile.read(min(_CHUNK, remaining))
                    if not piece:
                        raise ConnectionError("client closed mid chunk")
                    remaining -= len(piece)
                    yield piece
        length = int(self.headers.get("Content-Length") or 0)
        while length > 0:
            piece = self.rfile.read(min(_CHUNK, length))
            if not piece:
                raise ConnectionError("client closed mid body")
            length -= len(piece)
            yield piece

    def _drain(self) -> None:
        for _ in self._body_chunks():
            pass

    def _rst(self) -> None:
        """Abort the client connection with a TCP RST (no FIN, unsent data discarded)."""
        sock = self.connection
        try:
            self.wfile.flush()
        except OSError:
            pass
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        for f in (self.wfile, self.rfile):
            try:
                f.close()
            except OSError:
                pass
        try:
            sock.close()
        except OSError:
            pass
        raise _Broken()

    def _fin(self) -> None:
        """Close the client connection cleanly after what was sent (for truncation)."""
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        raise _Broken()

    def _write_head(self, status: int, reason: str, headers: list[tuple[str, str]]) -> bytes:
        lines = [f"HTTP/1.1 {status} {reason}\r\n"]
        lines += [f"{k}: {v}\r\n" for k, v in headers]
        lines.append("\r\n")
        return "".join(lines).encode("latin-1")

    def _broken_response(
        self,
        kind: str,
        fraction: float,
        head: bytes,
        body: Iterator[bytes],
        body_len: int,
    ) -> None:
        """Send part of a response, then RST (``reset``) or FIN (``truncate``)."""
        if body_len <= 0:
            # Nothing to cut in a body (HEAD, 204, 304): cut inside the status line. Cutting
            # later, between header lines, would be accepted by http.client as a complete
            # header block (it stops at EOF) -- a 200 without its ETag, not a lost response.
            status_line = head.split(b"\r\n", 1)[0]
            self.wfile.write(status_line[: max(1, int(len(status_line) * fraction))])
            return self._rst() if kind == "reset" else self._fin()
        self.wfile.write(head)
        keep = min(body_len - 1, int(body_len * fraction))
        sent = 0
        for chunk in body:
            if sent >= keep:
                break
            piece = chunk[: keep - sent]
            self.wfile.write(piece)
            sent += len(piece)
        return self._rst() if kind == "reset" else self._fin()

    # --- the request

    def _proxy(self) -> None:
        owner = self.owner
        method = self.command
        path = self.path
        plan = owner._plan(method, path)
        if plan.kind == "latency":
            owner._record(plan, method, path)
            if plan.phase == "before":
                owner._stopping.wait(plan.delay)
            return self._forward(plan, after_delay=plan.delay if plan.phase == "after" else 0.0)
        if plan.kind is not None and plan.phase == "before":
            owner._record(plan, method, path)
            if plan.kind == "reset":
                return self._rst()  # the request body is never read: it reaches nobody
            self._drain()
            status = 503 if plan.kind in ("slowdown", "truncate") else 500
            return self._send_error_doc(status, plan, method, path)
        return self._forward(plan)

    def _send_error_doc(self, status: int, plan: _Plan, method: str, path: str) -> None:
        body, ctype = self.owner.error_body(status, path)
        reason = "Slow Down" if status == 503 else "Internal Server Error"
        if self.owner.flavor == "gcs":
            reason = "Service Unavailable" if status == 503 else "Internal Server Error"
        headers = [
            ("Content-Type", ctype),
            ("Content-Length", str(len(body))),
            ("x-amz-request-id", "CHAOS"),
            ("Date", self.date_time_string()),
        ]
        if plan.kind == "truncate":
            head = self._write_head(status, reason, headers)
            if method == "HEAD":
                return self._broken_response("truncate", plan.fraction, head, iter(()), 0)
            return self._broken_response("truncate", plan.fraction, head, iter([body]), len(body))
        self.wfile.write(self._write_head(status, reason, headers))
        if method != "HEAD":
            self.wfile.write(body)
        self.wfile.flush()

    def _forward(self, plan: _Plan, after_delay: float = 0.0) -> None:
        owner = self.owner
        method, path = self.command, self.path
        conn = http.client.HTTPConnection(owner._up_host, owner._up_port, timeout=owner.upstream_timeout)
        try:
            try:
                self._send_upstream(conn, method, path)
                if conn.sock is not None:
                    with owner._conns.lock:
                        owner._conns.sockets.add(conn.sock)
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                owner._count("upstream_errors")
                body = f"chaos proxy: upstream error: {exc!r}".encode()
                self.wfile.write(
                    self._write_head(
                        502,
                        "Bad Gateway",
                        [
                            ("Content-Type", "text/plain"),
                            ("Content-Length", str(len(body))),
                            ("Connection", "close"),
                        ],
                    )
                )
                self.wfile.write(body)
                self.close_connection = True
                return
            owner._count("forwarded")
            if after_delay:
                owner._stopping.wait(after_delay)
            self._relay(resp, plan, method, path)
        finally:
            if conn.sock is not None:
                with owner._conns.lock:
                    owner._conns.sockets.discard(conn.sock)
            conn.close()

    def _send_upstream(self, conn: http.client.HTTPConnection, method: str, path: str) -> None:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        chunked = "chunked" in (self.headers.get("Transfer-Encoding") or "").lower()
        has_body = chunked or int(self.headers.get("Content-Length") or 0) > 0
        for k, v in self.headers.items():
            if k.lower() in _HOP_BY_HOP:
                continue
            conn.putheader(k, v)
        if chunked:
            conn.putheader("Transfer-Encoding", "chunked")
            trailer = self.headers.get("Trailer")
            if trailer:
                conn.putheader("Trailer", trailer)
        conn.putheader("Connection", "close")
        conn.endheaders()
        if has_body:
            for piece in self._body_chunks():
                conn.send(piece)

    def _relay(self, resp: http.client.HTTPResponse, plan: _Plan, method: str, path: str) -> None:
        owner = self.owner
        status, reason = resp.status, resp.reason
        headers: list[tuple[str, str]] = []
        length_header: str | None = None
        for k, v in resp.getheaders():
            lk = k.lower()
            if lk in _HOP_BY_HOP:
                continue
            if lk == "content-length":
                length_header = v
                continue
            if lk == "location":
                v = owner.rewrite(v.encode("latin-1")).decode("latin-1")
            headers.append((k, v))
        no_body = method == "HEAD" or status in _NO_BODY_STATUSES or 100 <= status < 200
        ctype = (resp.getheader("Content-Type") or "").lower()

        body_iter: Iterator[bytes]
        body_len: int | None
        if no_body:
            body_iter, body_len = iter(()), 0
        elif (
            resp.length is not None and resp.length <= _REWRITE_LIMIT and ("json" in ctype or "xml" in ctype)
        ):
            data = owner.rewrite(resp.read())
            body_iter, body_len = iter([data]), len(data)
        else:
            body_iter, body_len = _iter_response(resp), resp.length

        if plan.kind in ("slowdown", "internal") and plan.phase == "after":
            owner._record(plan, method, path, status)
            for _ in body_iter:  # the upstream did the work; its answer is dropped
                pass
            return self._send_error_doc(503 if plan.kind == "slowdown" else 500, plan, method, path)

        if plan.kind in ("reset", "truncate") and plan.phase == "after":
            owner._record(plan, method, path, status)
            if body_len is None:  # read-to-close or chunked: take up to 1 MiB to know a length
                buf = b"".join(itertools.islice(body_iter, 4))
                body_iter, body_len = iter([buf]), len(buf)
            if no_body:
                out = headers + ([("Content-Length", length_header)] if length_header else [])
                head = self._write_head(status, reason, out)
                return self._broken_response(plan.kind, plan.fraction, head, iter(()), 0)
            if body_len == 0:
                # An empty body (a PUT's 200): claim some bytes and send none, so the client
                # sees the response cut short instead of a complete success.
                claimed = 1 + int(plan.fraction * 1000)
                head = self._write_head(status, reason, headers + [("Content-Length", str(claimed))])
                self.wfile.write(head)
                return self._rst() if plan.kind == "reset" else self._fin()
            claimed = body_len + (1 + int(plan.fraction * 1000) if plan.kind == "truncate" else 0)
            head = self._write_head(status, reason, headers + [("Content-Length", str(claimed))])
            return self._broken_response(plan.kind, plan.fraction, head, body_iter, body_len)

        # A clean relay.
        if no_body:
            if length_header is not None:
                headers.append(("Content-Length", length_header))
            self.wfile.write(self._write_head(status, reason, headers))
            self.wfile.flush()
            return
        if body_len is not None:
            headers.append(("Content-Length", str(body_len)))
            self.wfile.write(self._write_head(status, reason, headers))
            for chunk in body_iter:
                self.wfile.write(chunk)
        else:
            headers.append(("Transfer-Encoding", "chunked"))
            self.wfile.write(self._write_head(status, reason, headers))
            for chunk in body_iter:
                if chunk:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def _iter_response(resp: http.client.HTTPResponse) -> Iterator[bytes]:
    while True:
        chunk = resp.read(_CHUNK)
        if not chunk:
            return
        yield chunk
