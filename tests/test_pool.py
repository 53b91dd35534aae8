"""objckpt._pool.run_all: results in call order, and the first failing call's error in call order
(the same error whatever order the threads ran in)."""

from __future__ import annotations

import threading

import pytest

from objckpt._pool import run_all


def test_results_come_in_call_order_whatever_order_the_calls_finish_in() -> None:
    gates = [threading.Event() for _ in range(5)]

    def call(k: int) -> int:
        if k + 1 < len(gates):
            assert gates[k + 1].wait(30)  # each call finishes only after the next one did
        gates[k].set()
        return k * k

    assert run_all([lambda k=k: call(k) for k in range(5)], 5, "t") == [0, 1, 4, 9, 16]
    assert run_all([lambda k=k: k for k in range(3)], 1, "t") == [0, 1, 2]  # in line


def test_the_first_failing_call_in_call_order_is_raised_not_the_first_to_fail() -> None:
    running = 0
    lock = threading.Lock()
    later_failed = threading.Event()

    def call(k: int) -> int:
        nonlocal running
        with lock:
            running += 1
        try:
            if k == 1:
                assert later_failed.wait(30)  # call 2 fails first; call 1's error is the one raised
                raise ValueError("call 1")
            if k == 2:
                later_failed.set()
                raise KeyError("call 2")
            return k
        finally:
            with lock:
                running -= 1

    with pytest.raises(ValueError, match="call 1"):
        run_all([lambda k=k: call(k) for k in range(6)], 3, "t")
    assert running == 0
