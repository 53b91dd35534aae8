"""The timeline structure of one run root, as ``ls``, ``show``, ``verify``, ``gc`` and ``rm``
see it (metadata only: ``manifests/``, ``timelines/``, ``quarantine/`` and ``LATEST``; never
``data/``).

* the **head** and its **line** (:mod:`objckpt.history`): checkpoints off the line are
  **abandoned**, since the claim of the first timeline of the line newer than their own (the
  rollback or fallback that went on without them; the same rule retention applies);
* the **tree**: every timeline, its base and the timelines branching from it;
* **bases** still needed: the base of every timeline that holds checkpoints (itself or below);
* **quarantined** checkpoints: one LIST of ``quarantine/`` (and, for their reasons, one GET of
  each marker: there are few).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from .. import layout
from ..history import Head, Line
from ..pointer import TimelineClaim

log = logging.getLogger("objckpt.cli")

Ref = tuple[int, int]


def list_quarantined(store: Any, keys: dict[Ref, str], *, reasons: bool = False) -> dict[Ref, str]:
    """Quarantined checkpoints (one LIST of ``quarantine/``), ref -> reason (``""`` when not
    read or not given). Markers of checkpoints that are gone are left out."""
    out: dict[Ref, str] = {}
    for meta in store.list(layout.QUARANTINE_PREFIX):
        ref = layout.parse_quarantine_key(meta.key)
        if ref is None or ref not in keys:
            continue
        out[ref] = read_reason(store, meta.key) if reasons else ""
    return out


def read_reason(store: Any, key: str) -> str:
    """The reason recorded in a quarantine marker (``""`` when unreadable: it still counts)."""
    from ..errors import NotFoundError, StoreError

    try:
        doc = json.loads(store.get(key))
    except (NotFoundError, ValueError):
        return ""
    except StoreError as exc:
        log.debug("could not read quarantine marker %s: %s", key, exc)
        return ""
    reason = doc.get("reason") if isinstance(doc, dict) else None
    return reason if isinstance(reason, str) else ""


def claim_time(claim: TimelineClaim | None) -> datetime | None:
    if claim is None:
        return None
    try:
        return datetime.fromisoformat(claim.created_at.replace("Z", "+00:00"))
    except ValueError:
        return None


@dataclass
class RootView:
    """What the run root's metadata says about its timelines (see the module doc)."""

    head: Head
    claims: dict[int, TimelineClaim]
    line: Line
    keys: dict[Ref, str]
    quarantined: dict[Ref, str] = field(default_factory=dict)

    @classmethod
    def read(cls, reader: Any, *, head: Head | None = None, reasons: bool = False) -> RootView:
        """Resolve the head (unless given), LIST ``manifests/``, ``timelines/`` (GET each claim)
        and ``quarantine/``."""
        history = reader.history
        head = head or history.resolve()
        keys = history.manifest_keys()
        claims = history.claims()
        line = history.line(head.timeline, claims)
        quarantined = list_quarantined(reader.store, keys, reasons=reasons)
        return cls(head, claims, line, keys, quarantined)

    # ------------------------------------------------------------------ checkpoints

    def on_line(self, ref: Ref) -> bool:
        return self.line.contains(ref)

    def abandoned_by(self, ref: Ref) -> int | None:
        """The timeline whose claim left ``ref`` behind (None: on the line, or unknown)."""
        if self.on_line(ref):
            return None
        for timeline in sorted(t for t in self.line.timelines if t > ref[0]):
            if timeline in self.claims:
                return timeline
        return None

    def abandoned_at(self, ref: Ref) -> datetime | None:
        """When ``ref`` was abandoned (None: on the line, or unknown)."""
        by = self.abandoned_by(ref)
        return None if by is None else claim_time(self.claims.get(by))

    @property
    def pointer_target(self) -> Ref | None:
        """The checkpoint ``LATEST`` names (its manifest key; after a rollback that is the base,
        on an older timeline than the pointer's)."""
        p = self.head.pointer
        return None if p is None else layout.parse_manifest_key(p.manifest_key)

    # ------------------------------------------------------------------ timelines

    def timelines(self) -> list[int]:
        """Every timeline that is claimed or holds checkpoints (0 whenever anything exists)."""
        found = set(self.claims) | {t for t, _ in self.keys}
        if found:
            found.add(0)
        return sorted(found)

    def children(self, timeline: int) -> list[int]:
        """Timelines whose base lies on ``timeline``, ascending."""
        return sorted(n for n, c in self.claims.items() if c.base_timeline == timeline)

    def roots(self) -> list[int]:
        """Timelines drawn at the top of the tree: 0, and any whose claim is missing or whose
        base timeline is unknown."""
        known = set(self.timelines())
        return [
            t for t in known if t == 0 or t not in self.claims or self.claims[t].base_timeline not in known
        ]

    def live_timelines(self) -> set[int]:
        """Timelines that hold checkpoints, themselves or through a timeline branching from
        them, plus the head's (a rollback that has not saved yet)."""
        live = {t for t, _ in self.keys} | {self.head.timeline}
        changed = True
        while changed:
            changed = False
            for n in list(live):
                claim = self.claims.get(n)
                if claim is not None and claim.base_timeline not in live:
                    live.add(claim.base_timeline)
                    changed = True
        return live

    def bases(self) -> dict[Ref, list[int]]:
        """Base checkpoint -> the live timelines continuing from it (see :meth:`live_timelines`)."""
        live = self.live_timelines()
        out: dict[Ref, list[int]] = {}
        for n, claim in sorted(self.claims.items()):
            if n in live and claim.base_ref in self.keys:
                out.setdefault(claim.base_ref, []).append(n)
        return out

    def branch_from(self, timeline: int) -> str:
        """``rollback from 10`` / ``fallback from t1:15`` / ``no valid claim``."""
        claim = self.claims.get(timeline)
        if claim is None:
            return "no valid claim (base unknown)" if timeline else "the first timeline"
        from ._common import label

        return f"{claim.reason} from {label(claim.base_ref)}"
