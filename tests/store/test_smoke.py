from objckpt.store import PutMode


def test_put_get_roundtrip(store):
    store.put("a/b", b"hello", mode=PutMode.CREATE)
    assert store.get("a/b") == b"hello"
