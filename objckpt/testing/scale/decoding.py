"""Every rank parsing the manifest it received: charged to each rank, computed once if asked.

After a commit (and on restore) every rank receives the very same manifest bytes from rank 0 and
parses them: ``Manifest.decode`` (schema, self-checksum, every receipt; the key to check it
against comes with the commit outcome). In a real job each rank does that once, in parallel with the others; in the simulator
the ranks share two cores, so W parses of a manifest that itself grows with W cost O(W^2) real
time (4,096 ranks x a 5 MB manifest: minutes per save). With ``memoize`` the real function runs
once per distinct bytes object (and arguments) and every later caller gets the same result;
*every* caller's virtual clock is still charged the measured CPU time, so modelled times are
those of every rank parsing for itself. Without ``memoize`` every call runs for real (the tests
check that both give the same counts).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ...manifest import Manifest
from . import clock

__all__ = ["charged_parsing"]


class _Once:
    """One memoized call: the first caller computes, concurrent callers wait for it."""

    def __init__(self, data: bytes, args: tuple[Any, ...]) -> None:
        self.data = data
        self.args = args
        self.done = threading.Event()
        self.ok = False
        self.value: Any = None
        self.cpu = 0.0


def _charged(fn: Callable[..., Any], memoize: bool) -> Callable[..., Any]:
    """``fn(data, *args, **kwargs)`` charging its CPU to the caller's timeline (see the module
    doc); with ``memoize``, computed once per (``data`` object, arguments)."""
    cache: dict[int, _Once] = {}
    lock = threading.Lock()

    def real(data: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, float]:
        t0 = time.thread_time()
        value = fn(data, *args, **kwargs)
        return value, time.thread_time() - t0

    def call(data: Any, *args: Any, **kwargs: Any) -> Any:
        tl = clock.current()
        if not (memoize and isinstance(data, bytes)):
            value, cpu = real(data, args, kwargs)
        else:
            key = (*args, *sorted(kwargs.items()))
            with lock:
                entry = cache.get(id(data))
                leader = entry is None or entry.data is not data or entry.args != key
                if leader:
                    entry = cache[id(data)] = _Once(data, key)
                    for old in [k for k, e in cache.items() if e is not entry and e.done.is_set()][:-4]:
                        del cache[old]
            assert entry is not None
            if leader:
                try:
                    entry.value, entry.cpu = real(data, args, kwargs)
                    entry.ok = True
                finally:
                    entry.done.set()
            else:
                with clock.blocked():
                    entry.done.wait()
            if not entry.ok:  # the leader's call raised: raise the same, ourselves
                value, cpu = real(data, args, kwargs)
            else:
                value, cpu = entry.value, entry.cpu
        if tl is not None:
            tl.advance(cpu)
        return value

    return call


@contextlib.contextmanager
def charged_parsing(memoize: bool) -> Iterator[None]:
    """For the block: ``Manifest.decode`` is charged (and optionally memoized) as the module
    doc says."""
    original_decode = Manifest.__dict__["decode"]
    decode = _charged(lambda data, **kw: original_decode.__func__(Manifest, data, **kw), memoize)
    Manifest.decode = classmethod(lambda cls, data, **kw: decode(data, **kw))  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        Manifest.decode = original_decode  # type: ignore[method-assign]
