"""The HTTP relay of :class:`~objckpt.testing.chaos_proxy.ChaosProxy`: the listener
(:class:`_Server`, one thread per client connection, every socket and thread tracked so
``stop()`` can shut them) and :class:`_ProxyHandler`, which streams each request to the upstream
and its answer back, and carries out the fault the proxy planned for it (a synthetic error
document, an RST after part of the body, a short body then FIN, a delay).

The fault *decisions* (rates, seeds, one-shot injections, statistics) stay in
:mod:`objckpt.testing.chaos_proxy`, the public entry; this module only executes them. A broken
client connection ends the handler quietly (:class:`_Broken`); nothing here raises to the caller.
"""

from __future__ import annotations

import http.client
import itertools
import socket
import struct
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .chaos_proxy import ChaosProxy, _Conns, _Plan

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
