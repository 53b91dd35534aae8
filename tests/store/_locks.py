"""A lock for tests of "concurrent first uses make one request": it tells, without timing,
when a second thread finds it held."""

from __future__ import annotations

import threading


class SeenLock:
    """A ``threading.Lock`` that sets ``tried`` when a thread has to wait for it."""

    def __init__(self, tried: threading.Event) -> None:
        self._lock = threading.Lock()
        self._tried = tried

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            self._tried.set()
            self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
