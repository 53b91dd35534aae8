"""Which checkpoint rank 0 proposes next during a restore: :class:`_Sources`, the candidates of
the primary run root and (when the primary cannot give one) of the mirror, newest step first.

:class:`~objckpt.coordination.restore.RestoreSession` owns the protocol (handshake, proposal,
staging, agreement); this module only decides, on rank 0, what it proposes: the primary's head
and its candidates, the switch to the mirror on a non-damage store error of the primary, the
merge of both roots' candidates once a primary checkpoint is damaged, and the
:class:`~objckpt.errors.NoCheckpointError` raised when none is left. It makes no collective call
and modifies nothing; its errors are raised inside the proposal so every rank raises them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..errors import NoCheckpointError, StoreError, is_damage
from ..history import Head
from ..manifest import Manifest

if TYPE_CHECKING:
    from .restore import RestoreSession

# the restore's logger: messages read the same as when this lived in restore.py
log = logging.getLogger("objckpt.restore")


_UNSET: object = object()


class _Sources:
    """Rank 0's candidates, from the primary and (when it cannot give one) the mirror."""

    def __init__(self, session: RestoreSession, step: int | None) -> None:
        self.session = session
        self.step = step
        self.primary = session.primary_reader
        self.mirror = session.mirror_reader
        self.head: Head | None = None
        #: the primary's non-damage error when it could not be read (only with a mirror)
        self.primary_down: BaseException | None = None
        self._primary: Iterator[Manifest] | None = None
        self._mirror: Iterator[Manifest] | None = None
        self._p: Any = _UNSET  # the peeked candidate (None: exhausted)
        self._q: Any = _UNSET
        self._line: Any = None  # the primary's head line (for mirror candidates)
        self._announced = False
        self._resolved = False
        self._explicit_tried: set[str] = set()

    def _resolve_primary(self) -> None:
        """The primary's head (and, for the newest usable, its candidates); once, lazily, inside
        the proposal, so an error reaches every rank."""
        if self._resolved:
            return
        self._resolved = True
        known, self.session.primary_down = self.session.primary_down, None
        if known is not None and self.mirror is not None:
            self._primary_failed(known)
            return
        try:
            self.head = self.primary.head()
            if self.step is None:
                self._primary = self.primary.manifests(self.head)
        except Exception as exc:  # noqa: BLE001 - classified: only a non-damage store error switches
            self._primary_failed(exc)

    def _primary_failed(self, exc: BaseException) -> None:
        if self.mirror is None or not isinstance(exc, StoreError) or is_damage(exc):
            raise exc
        self.primary_down = exc
        self._primary = None
        self._p = None
        log.warning(
            "the primary run root %s cannot be read (%s); asking the mirror %s instead",
            self.session.store.location,
            exc,
            self.mirror.store.location,
        )

    # -- explicit step

    def _next_explicit(self, fallbacks: list[tuple[int, str]]) -> tuple[Manifest, str] | None:
        """``step`` from the primary; its mirror copy when the primary cannot be read, has no
        intact manifest for it, or its shards turned out damaged (once)."""
        assert self.step is not None
        if "primary" not in self._explicit_tried:
            self._explicit_tried.add("primary")
            self._resolve_primary()
            if self.primary_down is None:
                try:
                    return self.primary.load(self.step), "primary"  # NoCheckpointError / ManifestError
                except Exception as exc:  # noqa: BLE001 - classified
                    if self.mirror is None or not (is_damage(exc) or isinstance(exc, NoCheckpointError)):
                        self._primary_failed(exc)  # raises without a mirror
                    else:
                        self._explicit_error = exc
        if self.mirror is not None and "mirror" not in self._explicit_tried:
            self._explicit_tried.add("mirror")
            try:
                found = self.mirror.load(self.step)
            except Exception as exc:  # noqa: BLE001 - the primary's error says more
                primary = self.primary_down or getattr(self, "_explicit_error", None)
                if primary is not None:
                    log.warning("the mirror has no usable step %d either: %s", self.step, exc)
                    raise primary from None
                if fallbacks:
                    raise NoCheckpointError(
                        f"checkpoint step {self.step} is damaged under {self.session.store.location} "
                        f"({fallbacks[0][1]}) and the mirror has no usable copy: {exc}"
                    ) from None
                raise
            log.warning(
                "RESTORING FROM THE MIRROR %s: step %d, because the primary %s",
                self.mirror.store.location,
                self.step,
                f"cannot be read ({self.primary_down})"
                if self.primary_down is not None
                else "has no intact copy",
            )
            return found, "mirror"
        return None

    # -- newest usable

    def next(self, fallbacks: list[tuple[int, str]]) -> tuple[Manifest, str] | None:
        if self.step is not None:
            return self._next_explicit(fallbacks)
        self._resolve_primary()
        p = self._peek_primary()
        if self.mirror is None:
            if p is not None:
                self._p = _UNSET
                return p, "primary"
            self._exhausted(fallbacks)
            return None
        if p is not None and not fallbacks and self.primary_down is None:
            self._p = _UNSET
            return p, "primary"  # the healthy path: the mirror is not asked
        q = self._peek_mirror()
        if p is not None and (q is None or p.step >= q.step):
            self._p = _UNSET
            return p, "primary"
        if q is not None:
            self._q = _UNSET
            if not self._announced:
                self._announced = True
                why = (
                    f"the primary cannot be read ({self.primary_down})"
                    if self.primary_down is not None
                    else "the primary has no intact checkpoint as new as the mirror's"
                    + (f" (damaged there: {', '.join(str(s) for s, _ in fallbacks)})" if fallbacks else "")
                )
                log.warning(
                    "RESTORING FROM THE MIRROR %s: step %d, because %s",
                    self.mirror.store.location,
                    q.step,
                    why,
                )
            return q, "mirror"
        if self.primary_down is not None:
            log.error(
                "the primary %s cannot be read and the mirror %s holds no usable checkpoint",
                self.session.store.location,
                self.mirror.store.location,
            )
            raise self.primary_down
        self._exhausted(fallbacks)
        return None

    def _peek_primary(self) -> Manifest | None:
        if self._p is _UNSET:
            if self._primary is None:
                self._p = None
            else:
                try:
                    self._p = next(self._primary, None)
                except Exception as exc:  # noqa: BLE001 - a non-damage store error switches to the mirror
                    self._primary_failed(exc)
        return self._p  # type: ignore[no-any-return]

    def _peek_mirror(self) -> Manifest | None:
        assert self.mirror is not None
        if self._q is not _UNSET:
            return self._q  # type: ignore[no-any-return]
        from .mirror import source_ref

        self._q = None
        try:
            if self._mirror is None:
                self._mirror = self.mirror.manifests()
            for q in self._mirror:
                src = source_ref(q)
                if self.primary_down is None and src is not None and not self._on_primary_line(src):
                    log.info(
                        "skipping mirror step %d: its source %s is not on the primary's line", q.step, src
                    )
                    continue
                self._q = q
                break
        except Exception as exc:  # noqa: BLE001 - the mirror is the fallback: its failure is logged
            log.warning("the mirror %s cannot be read either: %s", self.mirror.store.location, exc)
            self._mirror = iter(())
        return self._q  # type: ignore[no-any-return]

    def _on_primary_line(self, ref: tuple[int, int]) -> bool:
        if self._line is None:
            try:
                head = self.head or self.primary.head()
                self._line = self.primary.history.line(head.timeline)
            except Exception as exc:  # noqa: BLE001 - cannot tell: take the mirror's candidates as they are
                log.warning(
                    "cannot read the primary's line (%s): taking the mirror's checkpoints as they are", exc
                )
                self._line = False
        return True if self._line is False else bool(self._line.contains(ref))

    def _exhausted(self, fallbacks: list[tuple[int, str]]) -> None:
        steps = self.primary.steps()
        if fallbacks or steps:
            detail = "; ".join(f"step {s}: {why}" for s, why in fallbacks) or (
                "see the warnings logged by objckpt.reader"
            )
            where = self.session.store.location + (
                f" (and the mirror {self.mirror.store.location})" if self.mirror is not None else ""
            )
            raise NoCheckpointError(
                f"{len(steps)} committed checkpoint(s) under {where} but none is usable ({detail})"
            )
        return None
