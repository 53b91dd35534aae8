"""Run-root URIs and store options: parse_uri, parse_size, the declared option specs, the scheme
registry, open_store option handling."""

from __future__ import annotations

import pytest

from objckpt._retry import RetryPolicy
from objckpt.errors import ConfigError
from objckpt.store import open_store, parse_size, parse_uri
from objckpt.store.local import LocalStore
from objckpt.store.memory import MemoryStore


@pytest.mark.parametrize(
    "uri, needle",
    [
        ("no-scheme-here", "not a run-root URI"),
        ("", "not a run-root URI"),
        ("/abs/path/without/scheme", "not a run-root URI"),
        ("ftp://host/x", "unsupported URI scheme 'ftp'"),
        ("s3://", "missing bucket"),
        ("s3:///only/prefix", "missing bucket"),
        ("gs:///only/prefix", "missing bucket"),
        ("s3://Bad_Bucket/x", "invalid bucket name"),
        ("s3://bucket/a/../b", "'..' are not allowed"),
        ("gs://bucket/./b", "'..' are not allowed"),
        ("memory://name/../up", "'..' are not allowed"),
        ("file://relative/path", "absolute path"),
    ],
)
def test_malformed_uri_raises_config_error_naming_the_problem(uri, needle):
    with pytest.raises(ConfigError) as info:
        parse_uri(uri)
    assert needle in str(info.value)
    with pytest.raises(ConfigError):
        open_store(uri)


def test_non_string_uri_is_a_config_error():
    with pytest.raises(ConfigError):
        parse_uri(None)  # type: ignore[arg-type]


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        parse_uri("nope")


def test_parse_uri_splits_bucket_prefix_and_query():
    p = parse_uri("s3://my-bucket/runs/eta/?endpoint_url=http%3A%2F%2F127.0.0.1%3A9000&part_size=8MiB")
    assert (p.scheme, p.bucket, p.prefix) == ("s3", "my-bucket", "runs/eta")
    assert p.options == {"endpoint_url": "http://127.0.0.1:9000", "part_size": "8MiB"}
    f = parse_uri("file:///mnt/ckpt/with%20space/")
    assert (f.scheme, f.bucket, f.prefix) == ("file", "", "/mnt/ckpt/with space")
    assert parse_uri("file://localhost/x").prefix == "/x"
    assert parse_uri("GS://bucket").scheme == "gs"


def test_unknown_option_is_a_config_error_listing_known_ones():
    with pytest.raises(ConfigError) as info:
        open_store("memory://x?bogus=1")
    assert "bogus" in str(info.value) and "part_size" in str(info.value)
    with pytest.raises(ConfigError):
        open_store("memory://x", colour="blue")


def test_file_root_with_dotdot_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError) as info:
        open_store(f"file://{tmp_path}/a/../b")
    assert "'..'" in str(info.value)


def test_query_options_are_parsed_and_keywords_win():
    store = open_store("memory://x?part_size=5MiB&max_in_flight=3&deadline=7&max_attempts=4")
    assert isinstance(store, MemoryStore)
    assert store.part_size == 5 * 1024 * 1024
    assert store.max_in_flight == 3
    assert (store.retry.deadline, store.retry.max_attempts) == (7.0, 4)
    store = open_store("memory://x?part_size=5MiB", part_size=1234)
    assert store.part_size == 1234
    policy = RetryPolicy(max_attempts=2)
    assert open_store("memory://x", retry=policy).retry is policy


def test_bad_option_values_are_config_errors():
    with pytest.raises(ConfigError):
        open_store("memory://x?part_size=lots")
    with pytest.raises(ConfigError):
        open_store("memory://x?part_size=0")
    with pytest.raises(ConfigError):
        open_store("memory://x?retry=fast")  # a RetryPolicy only comes as a keyword
    with pytest.raises(ConfigError) as info:
        open_store("memory://x?max_in_flight=many")
    assert "max_in_flight" in str(info.value) and "'many'" in str(info.value)
    with pytest.raises(ConfigError, match="max_attempts"):
        open_store("memory://x", max_attempts=0)
    with pytest.raises(ConfigError, match="deadline"):
        open_store("memory://x?deadline=-1")


def test_file_uri_opens_a_local_store_on_that_root(tmp_path):
    store = open_store(f"file://{tmp_path}/run?part_size=6MiB")
    assert isinstance(store, LocalStore)
    assert store.root == f"{tmp_path}/run"
    assert store.location == f"file://{tmp_path}/run"
    assert store.part_size == 6 * 1024 * 1024
    with pytest.raises(ConfigError):
        open_store(f"file://{tmp_path}/run?bucket=x")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("16MiB", 16 * 2**20),
        ("8388608", 8388608),
        ("5 MiB", 5 * 2**20),
        ("1k", 1000),
        ("1KiB", 1024),
        ("2G", 2 * 10**9),
        ("1gib", 2**30),
        ("7b", 7),
        ("3Mi", 3 * 2**20),
        (42, 42),
    ],
)
def test_parse_size_understands_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "MiB", "-1", "1.5MiB", "12 parsecs", "0x10"])
def test_parse_size_rejects_garbage_with_config_error(text):
    with pytest.raises(ConfigError) as info:
        parse_size(text)
    assert "not a size" in str(info.value)


# ---------------------------------------------------------------- declared options


def test_every_backend_declares_its_options_once_with_the_common_ones():
    from objckpt.store import COMMON_OPTIONS, options_for

    common = [o.name for o in COMMON_OPTIONS]
    assert common == ["part_size", "max_in_flight", "deadline", "max_attempts", "retry"]
    for scheme in ("memory", "file", "s3", "gs"):
        names = [o.name for o in options_for(scheme)]
        assert names[: len(common)] == common
        assert len(names) == len(set(names)), scheme  # declared once
    assert "create" in [o.name for o in options_for("file")]
    secrets = {o.name for o in options_for("s3") if o.secret}
    assert secrets == {"access_key_id", "secret_access_key", "session_token"}
    assert {o.name for o in options_for("gs") if o.secret} == {"credentials"}


def test_an_option_of_another_scheme_says_which_scheme_takes_it(tmp_path):
    with pytest.raises(ConfigError) as info:
        open_store(f"file://{tmp_path}/run?endpoint_url=http://127.0.0.1:9000")
    message = str(info.value)
    assert "endpoint_url" in message and "s3://" in message and "gs://" in message
    assert "known: create" in message  # and what file:// does take


SECRET = "SECRETMARKER0123456789"


@pytest.mark.parametrize(
    "uri, options",
    [
        (f"s3://bkt/run?secret_access_key={SECRET}&colour=blue", {}),  # unknown option
        (f"s3://bkt/run?secret_access_key={SECRET}&max_in_flight=many", {}),  # bad value
        ("s3://bkt/run", {"session_token": 12345, "access_key_id": SECRET}),  # bad secret value
        (f"s3://Bad_Bucket/run?secret_access_key={SECRET}", {}),  # malformed URI
        (f"gs://bkt/run?credentials={SECRET}", {}),  # keyword-only option in a URI
    ],
)
def test_secret_values_never_appear_in_errors(uri, options):
    with pytest.raises(ConfigError) as info:
        open_store(uri, **options)
    assert SECRET not in str(info.value) and "12345" not in str(info.value)
    assert SECRET not in repr(info.value)
    cause = info.value.__cause__
    assert cause is None or SECRET not in str(cause)


def test_parsed_uri_repr_shows_option_names_not_values():
    parsed = parse_uri(f"s3://bkt/run?secret_access_key={SECRET}&region=eu-west-1")
    assert SECRET not in repr(parsed)
    assert "secret_access_key" in repr(parsed)
    assert parsed.options["secret_access_key"] == SECRET  # still there for the backend


def test_keyword_only_options_cannot_come_from_a_uri():
    with pytest.raises(ConfigError, match="keyword"):
        open_store("memory://x?retry=fast")


# ---------------------------------------------------------------- the scheme registry


class _Recording(MemoryStore):
    scheme = "rec"
    opened: list[tuple[str, dict]] = []

    @classmethod
    def from_uri(cls, parsed, options):
        cls.opened.append((parsed.bucket, dict(options)))
        return cls(parsed.bucket, **options)


@pytest.fixture
def registry():
    from objckpt.store import _registry

    saved = dict(_registry._entries)
    yield _registry
    _registry._entries.clear()
    _registry._entries.update(saved)


def test_a_registered_backend_opens_by_uri_with_the_common_options_converted(registry):
    from objckpt.store import register_backend

    register_backend("rec", _Recording)
    store = open_store("rec://name?part_size=1MiB&max_attempts=3")
    assert isinstance(store, _Recording)
    assert store.part_size == 1024 * 1024 and store.retry.max_attempts == 3
    assert _Recording.opened[-1][0] == "name"
    with pytest.raises(ValueError, match="already registered"):
        register_backend("rec", _Recording)
    register_backend("rec", "tests.store.test_uri:_Recording", replace=True)  # by class path
    assert isinstance(open_store("rec://again"), _Recording)


def test_a_backend_whose_module_is_missing_names_the_extra_to_install(registry):
    from objckpt.store import register_backend

    register_backend("nope", "objckpt_no_such_module:Store", extra="nope")
    with pytest.raises(ConfigError) as info:
        open_store("nope://bucket/run")
    assert "install objckpt[nope] to use nope:// URIs" in str(info.value)
    with pytest.raises(ValueError):
        register_backend("bad scheme", "a:B")
    with pytest.raises(ValueError):
        register_backend("ok", "not-a-class-path")


def test_entry_points_register_third_party_backends_lazily(registry, monkeypatch):
    import importlib.metadata

    seen = []

    class EntryPoint:
        name, value, dist = "ep", "tests.store.test_uri:_Recording", None

    def entry_points(*, group):
        seen.append(group)
        return [EntryPoint()]

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    assert "ep" in registry.known_schemes()
    assert seen == ["objckpt.backends"]
    assert isinstance(open_store("ep://x"), _Recording)


def test_a_registered_class_that_is_not_a_store_is_refused(registry):
    from objckpt.store import register_backend

    register_backend("notastore", "collections:OrderedDict")
    with pytest.raises(ConfigError, match="not a Store"):
        open_store("notastore://x")
