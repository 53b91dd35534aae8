"""Property-based tests (hypothesis) of every decoder of stored bytes and of the key rule.

Random and adversarial inputs -- arbitrary bytes, arbitrary JSON, valid objects with one field
replaced by anything (and the self-checksum recomputed, so the field checks behind it are
reached), bit flips, truncations -- never crash, hang or allocate past the declared receipt
size: a decoder returns a valid object or rejects with :class:`ManifestError` /
:class:`IntegrityError` (``SerializationError`` for shard containers).

Budget: the ``objckpt-ci`` profile (few examples, derandomized: the same examples every run, no
database written); ``OBJCKPT_HYPOTHESIS=thorough`` runs many more with fresh randomness. A bug
found here gets a regression test below with the failing example (``@example``).
"""

from __future__ import annotations

import json
import os
import posixpath
import struct
import tracemalloc
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from objckpt import layout
from objckpt._json import canonical_json, sha256_of
from objckpt.errors import IntegrityError, ManifestError
from objckpt.manifest import Manifest, ShardReceipt
from objckpt.pointer import Pointer, TimelineClaim
from objckpt.store.base import key_problem

settings.register_profile(
    "objckpt-ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "objckpt-thorough",
    max_examples=2000,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(
    "objckpt-thorough" if os.environ.get("OBJCKPT_HYPOTHESIS") == "thorough" else "objckpt-ci"
)

pytestmark = pytest.mark.timeout(600)

# ------------------------------------------------------------------ strategies

#: JSON scalars, including the awkward ones: huge ints, floats at the edges, unicode
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.sampled_from(["", "..", "/", "../x", "a/../b", "\x00", "manifests/x.json", "data/x", "s3://b/k"]),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=12), inner, max_size=5)
    ),
    max_leaves=30,
)
#: number literals JSON allows but Python turns into something else (1e999 -> inf)
odd_numbers = st.sampled_from(["1e999", "-1e999", "1E400", "123456789" * 600, "-0", "1e-400", "0.1e2"])

ATTEMPT = "0123456789abcdef"


def _manifest(step: int = 20, timeline: int = 0, world: int = 2, with_parent: bool = True) -> Manifest:
    shards = [
        ShardReceipt(
            key=layout.shard_key(step, ATTEMPT, r, name),
            size=100 + r,
            version=f'"etag-{r}-{name}"',
            crc32c="AAAAAA==",
            rank=r,
            name=name,
        )
        for r in range(world)
        for name in ("state.bin", "meta.bin")
    ]
    return Manifest.create(
        step=step,
        attempt=ATTEMPT,
        world_size=world,
        shards=shards,
        timeline=timeline,
        progress={"global_step": step},
        metadata={"note": "x"},
        parent=10 if with_parent else None,
    )


MANIFEST = _manifest()
MANIFEST_OBJ: dict[str, Any] = json.loads(MANIFEST.encode())
POINTER = Pointer.for_manifest(MANIFEST)
POINTER_OBJ: dict[str, Any] = json.loads(POINTER.encode())
CLAIM = TimelineClaim.create(timeline=3, base=MANIFEST, reason="rollback")
CLAIM_OBJ: dict[str, Any] = json.loads(CLAIM.encode())


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path into a JSON object (dict keys and list indices), the root excluded."""
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.append(prefix + (k,))
            out.extend(_paths(v, prefix + (k,)))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.append(prefix + (i,))
            out.extend(_paths(v, prefix + (i,)))
    return out


def _replaced(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    copy = json.loads(json.dumps(obj))
    cur = copy
    for p in path[:-1]:
        cur = cur[p]
    cur[path[-1]] = value
    return copy


def _resealed(obj: dict[str, Any]) -> bytes:
    """``obj`` with its self-checksum recomputed, so the field checks behind it run."""
    body = {k: v for k, v in obj.items() if k != "checksum"}
    try:
        return canonical_json({**body, "checksum": sha256_of(body)})
    except (TypeError, ValueError):
        return json.dumps(obj).encode()


def _mutations(base: dict[str, Any]) -> st.SearchStrategy[bytes]:
    paths = _paths(base)
    encoded = canonical_json(base)
    return st.one_of(
        st.binary(max_size=600),
        json_values.map(lambda v: json.dumps(v).encode()),
        st.tuples(st.sampled_from(paths), json_values).map(lambda pv: _resealed(_replaced(base, *pv))),
        st.tuples(st.sampled_from(paths), odd_numbers).map(
            lambda pv: json.dumps(_replaced(base, pv[0], "@@")).replace('"@@"', pv[1]).encode()
        ),
        st.tuples(st.integers(0, len(encoded) - 1), st.integers(1, 255)).map(
            lambda ib: encoded[: ib[0]] + bytes([encoded[ib[0]] ^ ib[1]]) + encoded[ib[0] + 1 :]
        ),
        st.integers(0, len(encoded)).map(lambda n: encoded[:n]),
        st.sampled_from(sorted(base)).map(lambda k: _resealed({x: v for x, v in base.items() if x != k})),
        st.integers(1, 5000).map(lambda d: b"[" * d + b"]" * d),
        st.integers(1, 5000).map(lambda d: b'{"a":' * d + b"1" + b"}" * d),
    )


# ------------------------------------------------------------------ manifest, pointer, claim


@given(_mutations(MANIFEST_OBJ))
@example(json.dumps(_replaced(MANIFEST_OBJ, ("metadata", "note"), "@@")).replace('"@@"', "1e999").encode())
def test_manifest_decode_accepts_or_rejects_with_manifest_error(data: bytes) -> None:
    try:
        m = Manifest.decode(data, key=MANIFEST.key)
    except ManifestError:
        return
    # what is accepted is valid: it re-encodes and decodes to itself, and stays in its root
    assert Manifest.decode(m.encode(), key=m.key) == m
    for s in m.shards:
        assert key_problem(s.key) is None and s.key.startswith(m.attempt_prefix)


@given(_mutations(POINTER_OBJ))
@example(json.dumps(_replaced(POINTER_OBJ, ("step",), "@@")).replace('"@@"', "1e999").encode())
def test_pointer_decode_accepts_or_rejects_with_manifest_error(data: bytes) -> None:
    try:
        p = Pointer.decode(data)
    except ManifestError:
        return
    assert Pointer.decode(p.encode()) == p
    assert key_problem(p.manifest_key) is None


@given(_mutations(CLAIM_OBJ))
def test_timeline_claim_decode_accepts_or_rejects_with_manifest_error(data: bytes) -> None:
    try:
        c = TimelineClaim.decode(data, key=CLAIM.key)
    except ManifestError:
        return
    assert TimelineClaim.decode(c.encode(), key=c.key) == c


# ------------------------------------------------------------------ keys and layout

keys = st.one_of(
    st.text(max_size=60),
    st.lists(
        st.sampled_from(["a", "b", "..", ".", "", "data", "x.bin", "\\", "\x00", "/", "~", "é", " "]),
        max_size=8,
    ).map("/".join),
)


@given(keys)
def test_a_key_the_rule_accepts_never_leaves_the_root(key: str) -> None:
    problem = key_problem(key)
    assert problem is None or isinstance(problem, str)
    if problem is None:
        joined = posixpath.normpath(posixpath.join("/root/run", key))
        assert joined.startswith("/root/run/") and joined[len("/root/run/") :] == key
        assert "\\" not in key and "\x00" not in key


@given(st.one_of(keys, st.from_regex(r"manifests/(t\d{10}-)?\d{20}\.json", fullmatch=True)))
@example("manifests/0000000000000000000\u0660.json")  # an Arabic-Indic zero parsed as step 0
@example("manifests/00000000000000000020.json\n")  # '$' matched before a trailing newline
@example("data/00000000000000000020-0123456789abcdef/00000/x\n")
@example("manifests/t0000000000-00000000000000000000.json")  # a second key for timeline 0's step 0
def test_layout_parsers_round_trip_or_refuse(key: str) -> None:
    parsed = layout.parse_manifest_key(key)
    if parsed is not None:
        timeline, step = parsed
        assert layout.manifest_key(step, timeline) == key
    shard = layout.parse_shard_key(key)
    if shard is not None:
        step, attempt, rank, name = shard
        assert layout.shard_key(step, attempt, rank, name) == key
    try:
        checked = layout.validate_key_in_root(key)
    except (ValueError, ManifestError):
        return
    assert key_problem(checked) is None


def test_ids_and_names_with_a_trailing_newline_or_unicode_digits_are_refused() -> None:
    """Regression (found by the layout property): the layout regexes used ``$`` (which matches
    before a trailing newline) and ``\\d`` (any Unicode digit)."""
    for bad in ("0123456789abcdef\n", "0123456789abcde\u0660"):
        with pytest.raises(ValueError):
            layout.check_attempt_id(bad)
        body = {k: v for k, v in MANIFEST_OBJ.items() if k != "checksum"}
        with pytest.raises(ManifestError):
            Manifest.decode(_resealed({**body, "attempt": bad}), key=MANIFEST.key)
    with pytest.raises(ValueError):
        layout.shard_key(20, ATTEMPT, 0, "state.bin\n")
    assert layout.parse_manifest_key("manifests/0000000000000000000\u0660.json") is None
    assert layout.parse_timeline_key("timelines/000000000\u0661.json") is None


def test_a_stray_object_with_a_second_key_for_a_checkpoint_cannot_hide_it() -> None:
    """Regression (found by the layout property, thorough run): 'manifests/t0000000000-<step>.json'
    parsed as timeline 0's <step>; it sorts after the real key, so a listing replaced the real
    manifest with the stray object, and resolution rejected the step as damaged (falling back,
    losing it)."""
    from objckpt.coordination import LocalComm, SaveSession
    from objckpt.reader import Reader
    from objckpt.store.memory import MemoryStore

    store = MemoryStore("stray")
    session = SaveSession(store, LocalComm())
    for step in (10, 20):
        session.save(step, lambda t: t.writer.write("state.bin", b"x"))
    store.put("manifests/t0000000000-00000000000000000020.json", b"not a manifest")
    reader = Reader(store)
    assert [m.step for m in reader.candidates()][:1] == [20]
    assert sorted(reader.checkpoints()) == [(0, 10), (0, 20)]


@given(st.integers(), st.integers())
def test_manifest_keys_of_valid_steps_parse_back(step: int, timeline: int) -> None:
    try:
        key = layout.manifest_key(step, timeline)
    except ValueError:
        return
    assert layout.parse_manifest_key(key) == (timeline, step)


# ------------------------------------------------------------------ shard containers (torch)

torch = pytest.importorskip("torch")
from objckpt.training import serialization  # noqa: E402

_STATE = {
    "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "b": torch.zeros(2, dtype=torch.bfloat16),
    "step": 7,
    "nested": {"t": (1, 2.5, "x", None, b"raw"), "l": [torch.ones(3, dtype=torch.int64)]},
}
SHARD = serialization.dumps(_STATE)
_HEADER_LEN = struct.unpack("<8sQ", SHARD[:16])[1]
HEADER_OBJ: dict[str, Any] = json.loads(SHARD[16 : 16 + _HEADER_LEN])
_DATA_START = -(-(16 + _HEADER_LEN) // 64) * 64
PAYLOAD = SHARD[_DATA_START : _DATA_START + HEADER_OBJ["data_size"]]


def _shard_with_header(header: Any) -> bytes:
    """A container with ``header`` and the reference state's array bytes, laid out as the
    encoder does (data at the next 64-byte boundary), so the header's own checks are reached."""
    raw = json.dumps(header).encode()
    head = b"OBJCKPT\x00" + struct.pack("<Q", len(raw)) + raw
    return head + b"\x00" * (-len(head) % 64) + PAYLOAD


def _header_with(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    return _replaced(HEADER_OBJ, path, value)  # type: ignore[no-any-return]


shards = st.one_of(
    st.binary(max_size=400),
    st.binary(max_size=400).map(lambda b: b"OBJCKPT\x00" + b),
    st.tuples(st.sampled_from(_paths(HEADER_OBJ)), json_values).map(
        lambda pv: _shard_with_header(_replaced(HEADER_OBJ, *pv))
    ),
    st.tuples(st.integers(0, len(SHARD) - 1), st.integers(1, 255)).map(
        lambda ib: SHARD[: ib[0]] + bytes([SHARD[ib[0]] ^ ib[1]]) + SHARD[ib[0] + 1 :]
    ),
    st.integers(0, len(SHARD)).map(lambda n: SHARD[:n]),
    st.integers(0, 2**64 - 1).map(lambda n: b"OBJCKPT\x00" + struct.pack("<Q", n) + SHARD[16:]),
)


def _decode_bounded(data: bytes, chunk: int) -> Any:
    """decode_stream with the receipt's size, counting what it allocates (Python objects and
    tensor storage): never more than the receipt says the shard holds, plus a small constant."""
    allocated = [0]
    real_empty = torch.empty

    def counting_empty(*args: Any, **kwargs: Any) -> Any:
        t = real_empty(*args, **kwargs)
        allocated[0] += t.numel() * t.element_size()
        return t

    tracemalloc.start()
    serialization.torch.empty = counting_empty  # type: ignore[attr-defined]
    try:
        return serialization.decode_stream(
            (data[i : i + chunk] for i in range(0, len(data), chunk)), total_size=len(data)
        )
    finally:
        serialization.torch.empty = real_empty  # type: ignore[attr-defined]
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        limit = 4 * len(data) + (8 << 20)
        assert allocated[0] <= len(data), (
            f"allocated {allocated[0]} tensor bytes for a {len(data)}-byte shard"
        )
        assert peak <= limit, f"peak {peak} bytes decoding a {len(data)}-byte shard"


@given(shards, st.sampled_from([1, 7, 64, 1 << 20]))
def test_decode_stream_accepts_or_rejects_with_integrity_errors(data: bytes, chunk: int) -> None:
    try:
        _decode_bounded(data, chunk)
    except IntegrityError:
        return


def _array(**entry: Any) -> dict[str, Any]:
    header = json.loads(json.dumps(HEADER_OBJ))
    header["arrays"][0].update(entry)
    return header


# found by the decode_stream property: a dtype that is not a string was looked up in a dict
# (an unhashable one raised TypeError instead of a SerializationError)
@pytest.mark.parametrize(
    "header",
    [
        pytest.param(_array(dtype=[]), id="array-dtype-list"),
        pytest.param(_header_with(("tree", "D", "step"), {"dt": []}), id="dt-node-list"),
        pytest.param(
            {**_header_with(("tree", "D", "step"), {"w": [0, {}, [1], [1], 0]}), "version": 2},
            id="view-dtype-object",
        ),
    ],
)
def test_regression_an_unhashable_dtype_is_a_serialization_error(header: dict[str, Any]) -> None:
    data = _shard_with_header(header)
    with pytest.raises(IntegrityError):
        serialization.decode_stream([data], total_size=len(data))


# found by the decode_stream property: torch.empty/np.empty raised TypeError/ValueError for a
# zero-size array whose other dimensions overflow int64
@pytest.mark.parametrize(
    "entry",
    [
        pytest.param({"shape": [0, 10**30], "nbytes": 0}, id="torch-zero-size-huge-dim"),
        pytest.param(
            {"kind": "numpy", "dtype": "<f4", "shape": [0, 2**62, 2**62], "nbytes": 0}, id="numpy-too-big"
        ),
    ],
)
def test_regression_a_huge_dimension_is_a_serialization_error(entry: dict[str, Any]) -> None:
    data = _shard_with_header(_array(**entry))
    with pytest.raises(IntegrityError):
        serialization.decode_stream([data], total_size=len(data))


@pytest.mark.parametrize("shape", [[0, 10**30], [0, 2**62, 2**62]])
def test_a_view_with_a_huge_dimension_is_a_serialization_error(shape: list[int]) -> None:
    header = {
        **_header_with(("tree", "D", "step"), {"w": [0, "float32", shape, [1] * len(shape), 0]}),
        "version": 2,
    }
    data = _shard_with_header(header)
    with pytest.raises(IntegrityError, match="bad view shape"):
        serialization.decode_stream([data], total_size=len(data))


def test_decode_stream_round_trips_the_reference_state() -> None:
    out = _decode_bounded(SHARD, 64)
    assert torch.equal(out["w"], _STATE["w"]) and out["nested"]["t"] == _STATE["nested"]["t"]


# ------------------------------------------------------------------ DCP metadata (torch)


def _dcp_metadata() -> bytes:
    """The metadata shard of a real DCP save (through save_sharded, one process)."""
    from objckpt.reader import Reader
    from objckpt.store.memory import MemoryStore
    from objckpt.training.dcp import save_sharded
    from objckpt.training.dcp._metadata import METADATA_SHARD

    store = MemoryStore("dcp-properties")
    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(2), "x": {"k": 3}}
    save_sharded(state, store, 1)
    manifest = Reader(store).latest()
    assert manifest is not None
    return Reader(store).read_shard(next(s for s in manifest.shards if s.name == METADATA_SHARD))


DCP_OBJ: dict[str, Any] = json.loads(_dcp_metadata())
_dcp_paths = _paths(DCP_OBJ)
dcp_metadata_inputs = st.one_of(
    st.binary(max_size=400),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.tuples(st.sampled_from(_dcp_paths), json_values).map(
        lambda pv: json.dumps(_replaced(DCP_OBJ, *pv)).encode()
    ),
    st.tuples(st.sampled_from(_dcp_paths), odd_numbers).map(
        lambda pv: json.dumps(_replaced(DCP_OBJ, pv[0], "@@")).replace('"@@"', pv[1]).encode()
    ),
)


@given(dcp_metadata_inputs)
def test_dcp_metadata_decode_accepts_or_rejects_with_manifest_error(data: bytes) -> None:
    from objckpt.errors import ConfigError
    from objckpt.training.dcp._metadata import decode_metadata

    try:
        decode_metadata(data)
    except (ManifestError, ConfigError):
        return
