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

import json
import random
import re
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from urllib.parse import urlsplit

from ._chaos_relay import _ProxyHandler, _Server

__all__ = ["ALL_KINDS", "ChaosProxy", "Injection", "PHASES"]

ALL_KINDS = ("slowdown", "internal", "reset", "truncate", "latency")
PHASES = ("before", "after")


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
