"""GCSStore specifics, against fake-gcs-server (tests/backends/gcs.py): error mapping at the
edge, the parallel composite upload (temporaries, compose tree, preconditions on the wire,
lost responses), CRC32C checks, the generation as version token, ranged streaming.

Faults are injected at the HTTP layer (the client's session), below google-cloud-storage, so
they travel through the SDK's own error handling exactly as a server's would.
"""

from __future__ import annotations

import json
import os
import re
import threading
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("google.cloud.storage", reason="google-cloud-storage not installed")

import requests  # noqa: E402
from google.api_core import exceptions as gexc  # noqa: E402
from google.auth.credentials import AnonymousCredentials  # noqa: E402
from google.cloud import storage  # noqa: E402

from objckpt._crc import crc32c_b64  # noqa: E402
from objckpt._retry import RetryPolicy  # noqa: E402
from objckpt.errors import (  # noqa: E402
    AlreadyExistsError,
    BucketNotFoundError,
    ChecksumMismatchError,
    ConfigError,
    InvalidKeyError,
    NotFoundError,
    PermissionDeniedError,
    PreconditionFailedError,
    StoreError,
    TransientError,
)
from objckpt.store import PrefixStore, PutMode, open_store  # noqa: E402
from objckpt.store.gcs import MAX_COMPONENTS, GCSStore  # noqa: E402
from tests.store._locks import SeenLock

FAST = RetryPolicy(max_attempts=4, initial_backoff=0.001, max_backoff=0.005)
ONCE = RetryPolicy(max_attempts=1)


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture
def make_store(backend_gcs) -> Iterator[Callable[..., GCSStore]]:
    made: list[GCSStore] = []

    def make(**options: Any) -> GCSStore:
        options.setdefault("retry", FAST)
        store = open_store(backend_gcs.uri_for(f"t-{uuid.uuid4().hex[:12]}"), **options)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


@pytest.fixture
def gstore(make_store) -> GCSStore:
    return make_store()


@pytest.fixture(scope="module")
def raw(gcs_endpoint: str) -> storage.Client:
    """A plain SDK client, to see what is really in the bucket."""
    return storage.Client(
        project="objckpt-test",
        credentials=AnonymousCredentials(),
        client_options={"api_endpoint": gcs_endpoint},
    )


def raw_names(raw: storage.Client, store: GCSStore) -> list[str]:
    """Every object under the store's prefix, hidden ones included, relative to it."""
    root = store.prefix + "/"
    return sorted(b.name[len(root) :] for b in raw.list_blobs(store.bucket_name, prefix=root))


def _payload(size: int, seed: int = 0) -> bytes:
    return bytes((i * 131 + seed * 7 + (i >> 8)) & 0xFF for i in range(size))


@dataclass
class Rule:
    """What the spy does to the next ``times`` requests that match."""

    method: str
    url: str  # regex searched in the (unquoted) URL
    # "status" (answer without sending), "raise" (do not send), "raise_after" (send, then raise),
    # "corrupt" (send, then flip the first byte of the body the client receives)
    action: str
    status: int = 503
    error: BaseException | None = None
    times: int = 1
    body: str = ""
    skip: int = 0  # matching requests let through before the rule fires


@dataclass
class HttpSpy:
    """Wraps the store client's HTTP session: records every request, injects faults."""

    rules: list[Rule] = field(default_factory=list)
    calls: list[tuple[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, *rules: Rule) -> None:
        self.rules.extend(rules)

    def matching(self, method: str, pattern: str) -> list[str]:
        return [u for m, u in self.calls if m == method and re.search(pattern, u)]

    def wrap(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def request(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
            # Uploads name their object in the body: recorded as "#name=<object name>".
            plain = urllib.parse.unquote(url) + _body_name(kwargs.get("data"))
            with self.lock:
                self.calls.append((method, plain))
                rule = next(
                    (r for r in self.rules if r.times > 0 and r.method == method and re.search(r.url, plain)),
                    None,
                )
                if rule is not None and rule.skip > 0:
                    rule.skip -= 1
                    rule = None
                elif rule is not None:
                    rule.times -= 1
            if rule is None:
                return real(method, url, *args, **kwargs)
            if rule.action == "status":
                return _fake_response(method, url, rule.status, rule.body)
            if rule.action == "corrupt":
                resp = real(method, url, *args, **kwargs)
                body = resp.content  # reads the stream; iter_content then serves _content
                resp._content = bytes([body[0] ^ 0xFF]) + body[1:]
                return resp
            if rule.action == "raise_after":
                real(method, url, *args, **kwargs)
            raise rule.error or requests.exceptions.ConnectionError("injected: connection reset")

        return request


def _body_name(data: Any) -> str:
    if isinstance(data, bytes):
        found = re.search(rb'"name": "((?:[^"\\]|\\.)*)"', data[:4096])
        if found:
            return "#name=" + json.loads(b'"' + found.group(1) + b'"')
    return ""


def _fake_response(method: str, url: str, status: int, body: str = "") -> requests.Response:
    resp = requests.Response()
    resp.status_code = status
    resp._content = (body or f'{{"error":{{"code":{status},"message":"injected {status}"}}}}').encode()
    resp.headers["Content-Type"] = "application/json"
    resp.url = url
    resp.request = requests.Request(method, url).prepare()
    return resp


@pytest.fixture
def spy(monkeypatch) -> Callable[[GCSStore], HttpSpy]:
    def attach(store: GCSStore) -> HttpSpy:
        session = store.client._http
        recorder = HttpSpy()
        monkeypatch.setattr(session, "request", recorder.wrap(session.request))
        return recorder

    return attach


# ---------------------------------------------------------------- error mapping


def test_missing_bucket_is_bucket_not_found_naming_the_bucket(backend_gcs):
    uri = backend_gcs.uri_for("run").replace("gs://objckpt-test-", "gs://no-such-bucket-", 1)
    store = open_store(uri, retry=ONCE)
    bucket = store.bucket_name
    try:
        for call in (
            lambda: store.head("k"),
            lambda: store.get("k"),
            lambda: store.put("k", b"x", mode=PutMode.CREATE),
            lambda: list(store.list("")),
            lambda: store.list_prefixes(""),
            lambda: store.delete(["k"]),
            lambda: store.put_stream("k", b"x" * 3000, part_size=1000),
        ):
            with pytest.raises(BucketNotFoundError) as info:
                call()
            assert type(info.value) is BucketNotFoundError
            assert f"bucket {bucket!r} does not exist" in str(info.value)
            assert f"gs://{bucket}/run" in str(info.value)
    finally:
        store.close()


def test_missing_object_is_not_found_not_a_missing_bucket(gstore):
    for call in (
        lambda: gstore.head("nope"),
        lambda: gstore.get("nope"),
        lambda: b"".join(gstore.get_stream("nope")),
    ):
        with pytest.raises(NotFoundError) as info:
            call()
        assert "no such object" in str(info.value)
        assert f"{gstore.location}/nope" in str(info.value)
        assert isinstance(info.value.__cause__, gexc.NotFound)


def test_412_maps_to_already_exists_or_precondition_failed_keeping_the_cause(gstore):
    first = gstore.put("k", b"1", mode=PutMode.CREATE)
    with pytest.raises(AlreadyExistsError) as created:
        gstore.put("k", b"2", mode=PutMode.CREATE)
    with pytest.raises(PreconditionFailedError) as updated:
        gstore.put("k", b"2", mode=PutMode.update(str(int(first.version) + 1)))
    for info in (created, updated):
        assert isinstance(info.value.__cause__, gexc.PreconditionFailed)
        assert "HTTP 412" in str(info.value)
        assert f"{gstore.location}/k" in str(info.value)
    assert gstore.get("k") == b"1"


@pytest.mark.parametrize(
    "status, expected",
    [
        (503, TransientError),
        (500, TransientError),
        (502, TransientError),
        (504, TransientError),
        (429, TransientError),
        (408, TransientError),
        (401, PermissionDeniedError),
        (403, PermissionDeniedError),
        (400, StoreError),
    ],
)
@pytest.mark.parametrize("op", ["head", "put", "get", "list", "compose"])
def test_http_status_maps_to_the_error_class(make_store, spy, op, status, expected):
    store = make_store(retry=ONCE)
    store.put("obj", b"data")  # before the spy: something to read
    recorder = spy(store)
    pattern = {
        "head": r"/o/[^?]*obj\?",
        "put": r"uploadType=multipart",
        "get": r"alt=media",
        "list": r"/o\?",
        "compose": r"/compose",
    }[op]
    method = {"head": "GET", "put": "POST", "get": "GET", "list": "GET", "compose": "POST"}[op]
    recorder.add(Rule(method, pattern, "status", status=status))
    call = {
        "head": lambda: store.head("obj"),
        "put": lambda: store.put("new", b"x"),
        "get": lambda: store.get("obj"),
        "list": lambda: list(store.list("")),
        "compose": lambda: store.put_stream("multi", b"y" * 2500, part_size=1000),
    }[op]
    with pytest.raises(expected) as info:
        call()
    err = info.value
    assert type(err) is expected or expected is StoreError and not isinstance(err, TransientError)
    assert f"HTTP {status}" in str(err)
    assert store.location in str(err)
    assert err.__cause__ is not None
    assert recorder.matching(method, pattern), "the fault was never injected"


def test_a_checksum_the_server_refuses_is_a_checksum_mismatch_like_on_every_backend(make_store, spy):
    # what real GCS answers when the crc32c sent with an upload does not match the bytes
    body = json.dumps(
        {
            "error": {
                "code": 400,
                "message": 'Provided CRC32C "AAAAAA==" doesn\'t match calculated CRC32C "BBBBBB==".',
            }
        }
    )
    store = make_store(retry=ONCE)
    recorder = spy(store)
    recorder.add(Rule("POST", r"uploadType=multipart", "status", status=400, body=body, times=2))
    for call in (
        lambda: store.put("k", b"x"),
        lambda: store.put_stream("m", b"y" * 2500, part_size=1000),  # the marker upload
    ):
        with pytest.raises(ChecksumMismatchError) as info:
            call()
        assert type(info.value) is ChecksumMismatchError
        assert "HTTP 400" in str(info.value) and store.location in str(info.value)


def test_connection_errors_and_timeouts_are_transient(make_store, spy):
    store = make_store(retry=ONCE)
    store.put("obj", b"data")
    recorder = spy(store)
    recorder.add(
        Rule("GET", r"/o/[^?]*obj\?", "raise"),
        Rule("GET", r"/o/[^?]*obj\?", "raise", error=requests.exceptions.ReadTimeout("injected")),
        Rule("GET", r"alt=media", "raise", error=requests.exceptions.ChunkedEncodingError("cut")),
    )
    for call in (lambda: store.head("obj"), lambda: store.head("obj"), lambda: store.get("obj")):
        with pytest.raises(TransientError) as info:
            call()
        assert isinstance(info.value.__cause__, requests.exceptions.RequestException)


def test_sdk_retries_are_off_and_the_store_policy_retries(make_store, spy):
    store = make_store(retry=ONCE)
    recorder = spy(store)
    recorder.add(Rule("POST", r"uploadType=multipart", "status", status=503, times=5))
    with pytest.raises(TransientError):
        store.put("k", b"x")
    assert len(recorder.matching("POST", r"uploadType=multipart")) == 1  # no hidden SDK retry

    retried: list[int] = []
    store2 = make_store(retry=FAST)
    store2.add_retry_listener(lambda exc, attempt: retried.append(attempt))
    recorder2 = spy(store2)
    recorder2.add(Rule("POST", r"uploadType=multipart", "status", status=503, times=2))
    meta = store2.put("k", b"x", mode=PutMode.CREATE)
    assert retried == [1, 2]
    assert store2.head("k").version == meta.version


def test_error_messages_never_carry_the_access_token(backend_gcs, gcs_endpoint):
    from google.oauth2.credentials import Credentials

    token = "ya29.SECRET-TOKEN-do-not-log"
    store = open_store(
        backend_gcs.uri_for(f"t-{uuid.uuid4().hex[:8]}"), credentials=Credentials(token=token), retry=ONCE
    )
    try:
        store.put("k", b"1", mode=PutMode.CREATE)
        errors = []
        for call in (lambda: store.put("k", b"2", mode=PutMode.CREATE), lambda: store.head("nope")):
            with pytest.raises(StoreError) as info:
                call()
            errors.append(info.value)
        for err in errors:
            assert token not in str(err) and token not in repr(err)
        assert token not in repr(store)
    finally:
        store.close()


# ---------------------------------------------------------------- version token = generation


def test_version_is_the_generation_and_cas_uses_it(gstore, raw):
    meta = gstore.put("ptr", b"1", mode=PutMode.CREATE)
    blob = raw.bucket(gstore.bucket_name).get_blob(f"{gstore.prefix}/ptr")
    assert meta.version == str(blob.generation)
    assert meta.crc32c == blob.crc32c == crc32c_b64(b"1")
    second = gstore.put("ptr", b"2", mode=PutMode.update(meta.version))
    assert int(second.version) != int(meta.version)
    with pytest.raises(PreconditionFailedError):
        gstore.put("ptr", b"3", mode=PutMode.update("not-a-generation"))
    assert gstore.get("ptr") == b"2"


def test_conditional_requests_carry_if_generation_match_on_the_wire(gstore, spy):
    """The emulator ignores the precondition on compose (a declared gap); this checks that we
    send it, on simple uploads and on the publishing compose, which is what real GCS enforces."""
    recorder = spy(gstore)
    first = gstore.put("a", b"1", mode=PutMode.CREATE)
    gstore.put("a", b"2", mode=PutMode.update(first.version))
    gstore.put("a", b"3")
    uploads = recorder.matching("POST", r"uploadType=multipart")
    assert [u.rsplit("#name=", 1)[1] for u in uploads] == [f"{gstore.prefix}/a"] * 3
    assert "ifGenerationMatch=0" in uploads[0]
    assert f"ifGenerationMatch={first.version}" in uploads[1]
    assert "ifGenerationMatch" not in uploads[2]

    multi = gstore.put_stream("m", b"z" * 2500, part_size=1000)
    gstore.put_stream("m", b"w" * 2500, part_size=1000, mode=PutMode.update(multi.version))
    publishes = [u for u in recorder.matching("POST", r"/compose") if f"{gstore.prefix}/m/compose" in u]
    assert len(publishes) == 2
    assert "ifGenerationMatch=0" in publishes[0]
    assert f"ifGenerationMatch={multi.version}" in publishes[1]
    # the marker is created create-if-absent; parts are written unconditionally (private
    # names, and a retry after a lost response must be able to replace one)
    markers = recorder.matching("POST", r"#name=.*/\.objckpt/uploads/")
    parts = recorder.matching("POST", r"#name=.*/\.objckpt/parts/")
    assert len(markers) == 2 and all("ifGenerationMatch=0" in u for u in markers)
    assert len(parts) == 6 and all("ifGenerationMatch" not in u for u in parts)


# ---------------------------------------------------------------- composite upload


def test_composite_upload_of_more_than_32_parts_composes_a_tree(gstore, raw, spy):
    data = _payload(70 * 100 + 37, seed=1)  # 71 parts: composes of 32 + 32 + 7, then 3
    recorder = spy(gstore)
    meta = gstore.put_stream("tree", data, part_size=100, max_in_flight=8)
    assert meta.size == len(data) and meta.crc32c == crc32c_b64(data)
    assert gstore.get("tree") == data
    head = gstore.head("tree")
    assert head.crc32c == crc32c_b64(data) and head.version == meta.version
    composes = recorder.matching("POST", r"/compose")
    assert len(composes) == 3 + 1 + 1  # three intermediates, the staged whole, the publish
    assert raw_names(raw, gstore) == ["tree"]  # no temporaries, no marker
    assert gstore.list_uploads("") == []


def test_composite_upload_leaves_nothing_when_the_source_fails(gstore, raw):
    class Boom(RuntimeError):
        pass

    def source():
        yield _payload(2500)
        raise Boom("source broke mid-stream")

    with pytest.raises(Boom):
        gstore.put_stream("broken", source(), part_size=1000, max_in_flight=2)
    assert raw_names(raw, gstore) == []
    assert gstore.list_uploads("") == []


def test_composite_upload_leaves_nothing_when_a_part_fails(make_store, raw, spy):
    store = make_store(retry=ONCE)
    recorder = spy(store)
    recorder.add(Rule("POST", r"#name=.*/\.objckpt/parts/.*/00003$", "status", status=403))
    with pytest.raises(PermissionDeniedError):
        store.put_stream("denied", _payload(5000), part_size=1000, max_in_flight=2)
    assert recorder.matching("POST", r"/00003$"), "the fault was never injected"
    assert raw_names(raw, store) == []


def test_pending_upload_is_hidden_listed_for_gc_and_aborted(gstore, raw):
    gstore.put("data/visible", b"v")
    handle = gstore._create_upload("data/shard", PutMode.CREATE)
    gstore._upload_part(handle, 1, 0, memoryview(b"abc"), crc32c_b64(b"abc"))
    assert [m.key for m in gstore.list("")] == ["data/visible"]
    assert gstore.list_prefixes("") == ["data/"]
    assert any(n.startswith(".objckpt/") for n in raw_names(raw, gstore))

    pending = gstore.list_uploads("")
    assert [(u.key, u.upload_id) for u in pending] == [("data/shard", handle.upload_id)]
    assert pending[0].initiated is not None and pending[0].initiated.tzinfo is not None
    assert gstore.list_uploads("data/") == pending
    assert gstore.list_uploads("other/") == []

    gstore.abort_upload(pending[0])
    gstore.abort_upload(pending[0])  # idempotent
    assert gstore.list_uploads("") == []
    assert raw_names(raw, gstore) == ["data/visible"]


def test_listing_skips_pages_of_hidden_parts(make_store):
    store = make_store()
    handle = store._create_upload("z", PutMode.CREATE)
    for n in range(1, 6):
        store._upload_part(handle, n, 0, memoryview(b"p"), crc32c_b64(b"p"))
    store.put("zz", b"visible")
    # one object a page: the first pages hold only hidden names
    page, more = store._list_page("", None, 1)
    assert [m.key for m in page] == ["zz"] and more is False
    store._abort_upload(handle)


def test_reserved_private_keys_cannot_be_written(gstore):
    with pytest.raises(InvalidKeyError, match="reserved"):
        gstore.put(".objckpt/parts/x", b"no")
    with pytest.raises(InvalidKeyError, match="reserved"):
        gstore.put_stream(".objckpt/uploads/x", b"no" * 1000, part_size=100)


def test_part_with_wrong_crc32c_is_rejected_and_discarded(gstore, raw):
    handle = gstore._create_upload("bad", PutMode.CREATE)
    with pytest.raises(ChecksumMismatchError, match="checksum mismatch"):
        gstore._upload_part(handle, 1, 0, memoryview(b"these bytes"), crc32c_b64(b"other bytes"))
    assert not [n for n in raw_names(raw, gstore) if "/parts/" in n]  # the bad part is gone
    gstore._abort_upload(handle)
    assert raw_names(raw, gstore) == []


def test_put_with_wrong_crc32c_is_rejected_and_leaves_no_object(gstore):
    with pytest.raises(ChecksumMismatchError, match="checksum mismatch"):
        gstore._put("bad", memoryview(b"these bytes"), PutMode.CREATE, crc32c_b64(b"other"))
    with pytest.raises(NotFoundError):
        gstore.head("bad")


def test_a_staged_object_that_does_not_match_is_never_published(gstore, raw):
    handle = gstore._create_upload("k", PutMode.CREATE)
    parts = [
        gstore._upload_part(handle, n, (n - 1) * 3, memoryview(b"abc"), crc32c_b64(b"abc")) for n in (1, 2)
    ]
    with pytest.raises(ChecksumMismatchError, match="nothing was published"):
        gstore._complete_upload(handle, parts, 6, crc32c_b64(b"abcabX"))
    with pytest.raises(NotFoundError):
        gstore.head("k")
    gstore._abort_upload(handle)
    assert raw_names(raw, gstore) == []


def test_more_than_1024_parts_is_refused_with_advice(gstore):
    handle = gstore._create_upload("huge", PutMode.CREATE)
    try:
        with pytest.raises(StoreError, match="raise part_size"):
            gstore._upload_part(handle, MAX_COMPONENTS + 1, 0, memoryview(b"x"), crc32c_b64(b"x"))
    finally:
        gstore._abort_upload(handle)


def test_lost_publish_response_is_recognised_as_our_own_write(make_store, raw, spy):
    """The publishing compose succeeds but its response is lost; the retry gets 412 (as real
    GCS answers; the emulator would not, so the spy answers it) and must not report a
    conflict with itself."""
    store = make_store(retry=FAST)
    recorder = spy(store)
    target = rf"{store.prefix}/obj/compose"
    recorder.add(Rule("POST", target, "raise_after"))
    recorder.add(Rule("POST", target, "status", status=412))
    data = _payload(2500, seed=3)
    meta = store.put_stream("obj", data, part_size=1000)
    assert len(recorder.matching("POST", target)) == 2
    assert store.get("obj") == data and store.head("obj").version == meta.version
    assert raw_names(raw, store) == ["obj"]


def test_lost_put_response_is_recognised_as_our_own_write(make_store, spy):
    """A create-if-absent put applied by the server, its response lost: the retry meets a real
    412 (simple uploads honour the precondition on the emulator) and finds its own bytes."""
    store = make_store(retry=FAST)
    recorder = spy(store)
    recorder.add(Rule("POST", rf"uploadType=multipart.*#name={store.prefix}/k$", "raise_after"))
    meta = store.put("k", b"mine", mode=PutMode.CREATE)
    assert len(recorder.matching("POST", r"#name=.*/k$")) == 2
    assert store.get("k") == b"mine" and store.head("k").version == meta.version


def test_put_conflicts_are_kept_when_the_object_is_not_ours(make_store, spy):
    store = make_store(retry=FAST)
    store.put("k", b"theirs", mode=PutMode.CREATE)
    # identical bytes, first try: still a conflict (only a retry after a transient error asks)
    with pytest.raises(AlreadyExistsError):
        store.put("k", b"theirs", mode=PutMode.CREATE)
    recorder = spy(store)
    recorder.add(Rule("POST", r"uploadType=multipart", "status", status=503))
    with pytest.raises(AlreadyExistsError):  # a retry meeting other bytes
        store.put("k", b"mine!!", mode=PutMode.CREATE)
    assert len(recorder.matching("POST", r"uploadType=multipart")) == 2
    assert store.get("k") == b"theirs"


def test_a_real_conflict_on_publish_is_still_a_conflict(make_store, raw, spy):
    store = make_store(retry=ONCE)
    store.put("obj", b"someone else's")
    recorder = spy(store)
    recorder.add(Rule("POST", rf"{store.prefix}/obj/compose", "status", status=412))
    with pytest.raises(AlreadyExistsError):
        store.put_stream("obj", _payload(2500), part_size=1000)
    assert store.get("obj") == b"someone else's"
    assert raw_names(raw, store) == ["obj"]


def test_put_larger_than_one_request_uses_a_resumable_upload(gstore, spy):
    data = os.urandom(8 * 1024 * 1024 + 10)
    recorder = spy(gstore)
    meta = gstore.put("big", data)
    assert recorder.matching("POST", r"uploadType=resumable")
    assert meta.crc32c == crc32c_b64(data) and meta.size == len(data)
    assert gstore.get("big", byte_range=(len(data) - 10, len(data) + 5)) == data[-10:]
    # The precondition rides on the session's initiation (the emulator ignores it there: this
    # only shows it is sent; real GCS enforces it).
    gstore.put("big2", data, mode=PutMode.CREATE)
    initiations = recorder.matching("POST", r"uploadType=resumable")
    assert len(initiations) == 2
    assert "ifGenerationMatch" not in initiations[0] and "ifGenerationMatch=0" in initiations[1]


# ---------------------------------------------------------------- reads


def test_get_stream_reads_ranges_and_resumes_after_a_reset(make_store, spy):
    store = make_store(read_chunk=1000)
    data = _payload(4500, seed=5)
    meta = store.put("s", data)
    retried: list[BaseException] = []
    store.add_retry_listener(lambda exc, attempt: retried.append(exc))
    recorder = spy(store)
    # the first range goes through, the second is cut short: the stream resumes at 1,000
    recorder.add(
        Rule("GET", r"alt=media", "raise", skip=1, error=requests.exceptions.ChunkedEncodingError("cut"))
    )
    chunks = list(store.get_stream("s", expected_size=len(data), expected_crc32c=meta.crc32c))
    assert b"".join(chunks) == data
    assert [len(c) for c in chunks] == [1000, 1000, 1000, 1000, 500]
    assert len(retried) == 1 and isinstance(retried[0], TransientError)
    ranged = recorder.matching("GET", r"alt=media")
    assert len(ranged) == 6  # five ranges plus the one that was cut
    assert len([c for c in recorder.calls if c[0] == "GET"]) == 6  # and no HEAD first
    # the first range of each read learns the generation; every later one is pinned to it
    assert ["generation=" in u for u in ranged] == [False, True, False, True, True, True]
    assert all(f"generation={meta.version}" in u for u in ranged if "generation=" in u)


def test_a_bounded_range_is_one_request_and_an_open_ended_read_streams_ranges(make_store, spy):
    store = make_store(read_chunk=1000)
    data = _payload(4500, seed=6)
    store.put("s", data)
    recorder = spy(store)
    assert store.get("s", byte_range=(100, 4000)) == data[100:4000]
    assert len(recorder.matching("GET", r"alt=media")) == 1  # get() returns it whole anyway
    recorder.calls.clear()
    assert store.get("s") == data
    assert len(recorder.matching("GET", r"alt=media")) == 5  # 1000-byte ranges: memory bounded


def test_get_range_past_the_end_is_empty(gstore):
    gstore.put("r", b"0123456789")
    assert gstore.get("r", byte_range=(10, 20)) == b""
    assert gstore.get("r", byte_range=(8, 20)) == b"89"
    gstore.put("e", b"")
    assert gstore.get("e", byte_range=(0, 5)) == b""


def test_a_small_object_is_read_with_one_request_and_checked_against_its_crc32c(make_store, spy):
    store = make_store(retry=FAST)
    store.put("small", b"0123456789")
    recorder = spy(store)
    assert store.get("small") == b"0123456789"
    assert len([c for c in recorder.calls if c[0] == "GET"]) == 1  # no HEAD, one ranged GET
    # flipped in transit: the whole object came in one answer, so its x-goog-hash catches it
    retried: list[BaseException] = []
    store.add_retry_listener(lambda exc, attempt: retried.append(exc))
    recorder.add(Rule("GET", r"alt=media", "corrupt"))
    assert store.get("small") == b"0123456789"  # the retry reads it intact
    assert len(retried) == 1 and isinstance(retried[0], TransientError)
    assert "corrupted in transit" in str(retried[0])


@pytest.mark.parametrize("key", ["../escape", "a/../../b", "a//b", "/abs", "nul\x00", "a\\b"])
def test_keys_that_could_escape_never_reach_the_sdk(make_store, spy, key):
    store = make_store()
    bare = store.inner  # the bucket-level GCSStore refuses them too, not only the prefix
    recorder = spy(store)
    for target in (store, bare):
        calls = (
            lambda t: t.put(key, b"x"),
            lambda t: t.get(key),
            lambda t: t.head(key),
            lambda t: t.get_stream(key),
            lambda t: t.delete([key]),
            lambda t: t.put_stream(key, b"x" * 3000, part_size=1000),
        )
        for call in calls:
            with pytest.raises(InvalidKeyError):
                call(target)
    assert recorder.calls == []


# ---------------------------------------------------------------- URI options


def test_uri_options_and_unknown_ones(gcs_endpoint):
    q = urllib.parse.quote(gcs_endpoint, safe="")
    store = open_store(f"gs://some-bucket/run/a?endpoint_url={q}&timeout=5&read_chunk=1KiB&part_size=2MiB")
    assert isinstance(store, PrefixStore) and isinstance(store.inner, GCSStore)
    assert (store.bucket_name, store.prefix, store.location) == (
        "some-bucket",
        "run/a",
        "gs://some-bucket/run/a",
    )
    assert (store.timeout, store.read_chunk, store.part_size, store.anonymous) == (
        5.0,
        1024,
        2 * 1024 * 1024,
        True,
    )
    store.close()
    with pytest.raises(ConfigError):
        open_store(f"gs://some-bucket/run?endpoint_url={q}&colour=blue")
    with pytest.raises(ConfigError):
        open_store(f"gs://some-bucket/run?endpoint_url={q}&anonymous=maybe")


# ---------------------------------------------------------------- the emulator launcher


def test_fake_gcs_server_stops_when_the_block_raises():
    from objckpt.testing.gcs_server import FakeGcsServer, ServerStartError

    class Boom(Exception):
        pass

    server = FakeGcsServer()
    try:
        with pytest.raises(Boom), server:
            proc = server._proc
            server.create_bucket("launcher-check")
            server.create_bucket("launcher-check")  # existing is fine
            raise Boom
    except ServerStartError as exc:  # pragma: no cover - binary unavailable
        pytest.skip(str(exc))
    assert proc is not None and proc.poll() is not None
    assert server._proc is None
    server.stop()  # idempotent


# ---------------------------------------------------------------- the bucket-existence probe (no server)


class _ProbedBucket:
    """A bucket whose ``exists()`` answers from ``answers`` (an exception is raised) and counts
    the probes; every blob delete is a 404 (the object is absent)."""

    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers
        self.probes = 0
        self.on_probe: Callable[[], None] | None = None

    def exists(self, **_: Any) -> bool:
        self.probes += 1
        if self.on_probe is not None:
            hook, self.on_probe = self.on_probe, None
            hook()
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, BaseException):
            raise answer
        return bool(answer)

    def blob(self, name: str) -> Any:
        def delete(**_: Any) -> None:
            raise gexc.NotFound("Not Found")

        return type("Blob", (), {"delete": staticmethod(delete), "name": name})()


def _probed_store(answers: list[Any]) -> tuple[GCSStore, _ProbedBucket]:
    bucket = _ProbedBucket(answers)
    client = type("Client", (), {"bucket": lambda self, name: bucket})()
    return GCSStore("probed", client=client, retry=RetryPolicy(max_attempts=1)), bucket


def test_a_failed_probe_after_deletes_is_not_remembered_as_the_bucket_existing():
    # The delete path used to take "cannot tell" for "exists" and remember it, so a bucket
    # deleted meanwhile was never reported; now both 404 triages treat a failed probe alike.
    store, bucket = _probed_store([gexc.ServiceUnavailable("down"), False])
    store.delete(["absent"])  # probe fails: cannot tell, the deletes did not fail
    with pytest.raises(BucketNotFoundError):
        store.delete(["absent"])
    assert bucket.probes == 2
    store.close()


def test_concurrent_first_404s_probe_the_bucket_once():
    store, bucket = _probed_store([True])
    tried = threading.Event()

    store._bucket_lock = SeenLock(tried)  # type: ignore[assignment]
    results: list[bool] = []

    def second() -> None:
        results.append(store._bucket_missing(gexc.NotFound("Not Found"), "get"))
        tried.set()

    other = threading.Thread(target=second)

    def during_first_probe() -> None:
        other.start()
        # the other thread either waits for the lock (one probe) or probes itself (a double
        # probe); either sets the event, so no timing is asserted
        assert tried.wait(30)

    bucket.on_probe = during_first_probe
    results.append(store._bucket_missing(gexc.NotFound("Not Found"), "get"))
    other.join(30)
    assert results == [False, False] and bucket.probes == 1
    store.close()
