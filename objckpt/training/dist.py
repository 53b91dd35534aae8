"""Collectives for the checkpoint protocol, on dedicated gloo groups with timeouts.

Why dedicated groups: a save's collectives must never interleave with the training group's (a
background save, or a save on some ranks only, would otherwise deadlock or corrupt training
collectives), and gloo works on CPU tensors whatever the training backend is. Why timeouts: a
rank-0-only ``save()`` (the classic ``if rank == 0: save()`` bug) must raise
:class:`DistributedError` instead of hanging the job.

Two groups are created, because they wait for different things:

* the *handshake* group (``handshake_timeout``, default 5 min): the entry of every save/restore,
  where all ranks should arrive within a few seconds of each other;
* the *data* group (``timeout``, default 30 min): gathers after the uploads/downloads, where
  ranks wait for the slowest rank's transfer.

With ``background=True`` a third group (``timeout``) is created for the background thread of
asynchronous saves (:meth:`Comm.background`). Collectives on one gloo group must be issued in
the same order on every rank; a thread that shares a group with another thread cannot promise
that, so the background thread owns its group exclusively, and the training thread never
touches it.

Payloads are JSON bytes sent as uint8 tensors (never pickle). After any collective failure the
groups may hold half-finished messages, so the communicator marks itself broken and every later
call raises at once: restart the job (torchrun does).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch

from ..errors import DistributedError

__all__ = ["Comm", "DistComm", "LocalComm", "make_comm"]

T = TypeVar("T")


class Comm:
    """What the manager needs from the process world. :class:`LocalComm` is the 1-process one."""

    rank: int = 0
    world_size: int = 1

    def gather(self, obj: Any, what: str, *, handshake: bool = False) -> list[Any] | None:
        """Every rank's JSON-able ``obj`` on rank 0 (rank order); None on other ranks."""
        raise NotImplementedError

    def broadcast(self, obj: Any, what: str, *, handshake: bool = False) -> Any:
        """Rank 0's JSON-able ``obj`` on every rank (the argument is ignored elsewhere)."""
        raise NotImplementedError

    def agree(self, obj: Any, decide: Callable[[list[Any]], T], what: str, *, handshake: bool = False) -> T:
        """Gather ``obj`` to rank 0, run ``decide(all_objs)`` there, broadcast the result.

        Every rank returns the same value, or raises the same error: an exception raised by
        ``decide`` is sent to every rank and re-raised there as the same type with the same
        message (for objckpt error types; others become :class:`DistributedError`).
        """
        gathered = self.gather(obj, what, handshake=handshake)
        outcome: dict[str, Any]
        if self.rank == 0:
            assert gathered is not None
            try:
                outcome = {"ok": decide(gathered)}
            except Exception as exc:  # noqa: BLE001 - shipped to every rank, re-raised there
                outcome = {"error": encode_error(exc)}
        else:
            outcome = {}
        outcome = self.broadcast(outcome, what, handshake=handshake)
        if "error" in outcome:
            raise decode_error(outcome["error"])
        return outcome["ok"]

    def background(self) -> Comm:
        """The communicator reserved for the background save thread (its own group)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class LocalComm(Comm):
    """One process: every collective is the identity."""

    def background(self) -> Comm:
        return self

    def gather(self, obj: Any, what: str, *, handshake: bool = False) -> list[Any] | None:
        return [json.loads(json.dumps(obj))]

    def broadcast(self, obj: Any, what: str, *, handshake: bool = False) -> Any:
        return json.loads(json.dumps(obj))


class DistComm(Comm):
    """Collectives over two (with ``background``, three) new gloo groups spanning the default
    group's ranks.

    Construction calls ``torch.distributed.new_group`` twice (three times with ``background``):
    it is itself a collective on the default group, so every rank must construct it, in the
    same order, with the same ``background``.
    """

    def __init__(self, *, timeout: float, handshake_timeout: float, background: bool = False) -> None:
        dist = torch.distributed
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.timeout = timeout
        self.handshake_timeout = handshake_timeout
        self._broken: str | None = None
        try:
            self._handshake = dist.new_group(backend="gloo", timeout=timedelta(seconds=handshake_timeout))
            self._data = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
            self._background: Any = None
            if background:
                self._background = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        except Exception as exc:
            raise DistributedError(
                f"cannot create the checkpoint process groups (gloo) on rank {self.rank}: {exc}"
            ) from exc

    def _group(self, handshake: bool) -> Any:
        return self._handshake if handshake else self._data

    def background(self) -> Comm:
        if self._background is None:
            raise DistributedError("this communicator was created without a background group")
        view = getattr(self, "_background_view", None)
        if view is None:
            view = self._background_view = _BackgroundComm(self)
        return view

    def _run(self, what: str, handshake: bool, fn: Callable[[], T]) -> T:
        if self._broken is not None:
            raise DistributedError(
                f"{what}: the checkpoint process group is unusable after an earlier failure "
                f"({self._broken}); restart the job"
            )
        try:
            return fn()
        except Exception as exc:
            limit = self.handshake_timeout if handshake else self.timeout
            self._broken = f"{what} failed on rank {self.rank}: {exc}"
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise DistributedError(
                f"{what} failed on rank {self.rank}: a rank died, or not every rank called it "
                f"within {limit:g}s (save and restore must be called by all {self.world_size} "
                f"ranks): {type(exc).__name__}: {first}"
            ) from exc

    def gather(self, obj: Any, what: str, *, handshake: bool = False) -> list[Any] | None:
        group = self._group(handshake)
        data = json.dumps(obj, separators=(",", ":")).encode("utf-8")

        def go() -> list[Any] | None:
            dist = torch.distributed
            # gloo gathers equal shapes: agree on the longest payload, then gather padded
            # buffers that carry their own length in the first 8 bytes
            longest = torch.tensor([len(data)], dtype=torch.int64)
            dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
            buf = torch.zeros(8 + int(longest.item()), dtype=torch.uint8)
            buf[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)
            if data:
                buf[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            bufs = [torch.empty_like(buf) for _ in range(self.world_size)] if self.rank == 0 else None
            dist.gather(buf, bufs, dst=0, group=group)
            if bufs is None:
                return None
            out = []
            for b in bufs:
                raw = bytes(b.numpy())
                n = int.from_bytes(raw[:8], "little")
                out.append(json.loads(raw[8 : 8 + n].decode("utf-8")))
            return out

        return self._run(what, handshake, go)

    def broadcast(self, obj: Any, what: str, *, handshake: bool = False) -> Any:
        group = self._group(handshake)

        def go() -> Any:
            dist = torch.distributed
            data = json.dumps(obj, separators=(",", ":")).encode("utf-8") if self.rank == 0 else b""
            size = torch.tensor([len(data)], dtype=torch.int64)
            dist.broadcast(size, src=0, group=group)
            buf = torch.empty(int(size.item()), dtype=torch.uint8)
            if self.rank == 0 and data:
                buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            dist.broadcast(buf, src=0, group=group)
            return json.loads(bytes(buf.numpy()).decode("utf-8"))

        return self._run(what, handshake, go)

    def close(self) -> None:
        dist = torch.distributed
        groups = ("_handshake", "_data", "_background")
        for group in (getattr(self, name, None) for name in groups):
            if group is not None and dist.is_initialized():
                try:
                    dist.destroy_process_group(group)
                except Exception:  # noqa: BLE001 - best effort at shutdown
                    pass


class _BackgroundComm(DistComm):
    """The owner's background group used for every collective (gather, broadcast, agree).

    Its own ``_broken`` state: a failure here says nothing about the owner's groups' message
    order. Closing it is a no-op; the owner destroys the group.
    """

    def __init__(self, owner: DistComm) -> None:  # no new_group: not a collective
        self.rank = owner.rank
        self.world_size = owner.world_size
        self.timeout = owner.timeout
        self.handshake_timeout = owner.timeout
        self._broken = None
        self._handshake = self._data = owner._background
        self._background = None

    def background(self) -> Comm:
        return self

    def close(self) -> None:
        pass


def make_comm(*, timeout: float, handshake_timeout: float, background: bool = False) -> Comm:
    """A :class:`DistComm` when torch.distributed is initialised with more than one rank, else a
    :class:`LocalComm`. ``background``: also create the group of :meth:`Comm.background` (a
    collective on the default group: pass the same value on every rank)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return DistComm(timeout=timeout, handshake_timeout=handshake_timeout, background=background)
    return LocalComm()


# ---------------------------------------------------------------------------------- errors


def encode_error(exc: BaseException) -> dict[str, Any]:
    """A JSON description of an error, so every rank can raise the same one."""
    out: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)}
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        out["failures"] = {str(k): str(v) for k, v in failures.items()}
    return out


def decode_error(d: dict[str, Any]) -> Exception:
    """Rebuild an error sent by :func:`encode_error`: objckpt's own types and ValueError /
    TypeError by name (an allow-list, nothing is imported or evaluated); anything else becomes a
    :class:`DistributedError` carrying the original type name and message."""
    from .. import errors
    from . import serialization, staging, state

    allowed: dict[str, type[Exception]] = {name: getattr(errors, name) for name in errors.__all__}
    allowed["TrainingStateError"] = state.TrainingStateError
    allowed["SerializationError"] = serialization.SerializationError
    allowed["UnsupportedStateError"] = serialization.UnsupportedStateError
    allowed["StagingBudgetError"] = staging.StagingBudgetError
    allowed["SaveAbandonedError"] = staging.SaveAbandonedError
    allowed["ValueError"] = ValueError  # e.g. an invalid step number
    allowed["TypeError"] = TypeError
    cls = allowed.get(d.get("type", ""), None)
    message = str(d.get("message", ""))
    if cls is None:
        return DistributedError(f"{d.get('type')}: {message}")
    if issubclass(cls, errors.CommitError):
        exc = cls.__new__(cls)
        failures = {int(k): v for k, v in (d.get("failures") or {}).items()}
        # keep the exact message rank 0 produced (it already lists the failures)
        errors.ObjckptError.__init__(exc, message)
        exc.failures = failures
        return exc
    if issubclass(cls, errors.StoreError):
        exc = cls.__new__(cls)
        errors.ObjckptError.__init__(exc, message)
        exc.key, exc.location, exc.operation = "", "", ""
        return exc
    if issubclass(cls, errors.ChecksumMismatchError) or issubclass(cls, errors.ManifestError):
        exc = cls.__new__(cls)
        errors.ObjckptError.__init__(exc, message)
        exc.key, exc.location = "", ""
        return exc
    try:
        return cls(message)
    except Exception:  # noqa: BLE001
        return DistributedError(f"{d.get('type')}: {message}")
