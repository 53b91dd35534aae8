"""The one restore protocol: resolve on one rank -> broadcast -> stage -> agree -> apply
(invariants 10-13, 11b).

Every way of restoring (``CheckpointManager.restore``, ``load_sharded``, the plug-ins) goes
through :class:`RestoreSession`; the adapters only say how a rank *stages* a checkpoint
(download, verify and decode everything it needs, modifying nothing) and how it *applies* the
staged result. The session decides what must be the same on every rank:

1. A handshake: every rank asks for the same step (or the latest).
2. Rank 0 alone resolves (pointer, then ``manifests/``; never a scan of ``data/``) and broadcasts
   the manifest's bytes; every other rank validates them (schema, self-checksum) without a
   single request to the store, so resolution costs O(1) requests per job, not per rank.
3. Every rank stages the proposed checkpoint. What goes wrong is classified by the one damage
   rule, :func:`objckpt.errors.is_damage`: damage on any rank makes every rank fall back
   together to the next older committed checkpoint (loudly: a warning on every rank, a
   validation failure in the metrics); any other error -- an outage past the retry budget, a
   permission or configuration error, a policy refusal, a checkpoint that does not fit the
   live state -- is raised on every rank and never causes a fallback.
4. Every rank applies what it staged, and the ranks check that all restored the same step.

**Mirror** (``mirror=``, the second run root :mod:`.mirror` replicates every commit to): rank 0
consults it only when the primary cannot give the newest checkpoint, so a healthy primary costs
no request to the mirror:

* the primary's resolution (or the listing of its candidates) raises a store error that is not
  damage -- unreachable past its retry budget, permission, a missing bucket -- and the mirror is
  asked instead of raising (without a mirror that error is raised, as before);
* a checkpoint of the primary is damaged, or every candidate on the primary is used up: from then
  on the candidates of both roots are taken newest step first (the primary's at equal steps),
  so the mirror's intact copy of the very step that is damaged on the primary, or a newer one,
  wins over an older checkpoint of the primary. While the primary is reachable, a mirror
  checkpoint is a candidate only when the primary checkpoint it was copied from is on the
  primary's head line (never a step the primary has rolled back from).

Every rank then stages from the mirror's manifest (the proposal says which root it comes from,
and :attr:`RestoreSession.reader` is that root's reader: adapters stage through it), and the
restore says so loudly (a warning on every rank, ``Restored.source == "mirror"``, the metrics'
restore event). Where the next save continues on the primary is the primary checkpoint the
mirror's copy was made from (looked up on the primary when it is reachable); when the primary
cannot be read, the next save resolves the primary's head itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, SupportsInt, TypeVar, cast

from .. import layout
from ..errors import (
    DistributedError,
    NoCheckpointError,
    decode_error,
    describe,
    encode_error,
    is_damage,
    with_rank,
)
from ..history import Head
from ..manifest import Manifest
from ..metrics import CheckpointMetrics
from ..reader import Reader
from ..store.base import Store
from . import lineage
from ._restore_sources import _Sources
from .comm import Comm, agree
from .save import _check_same_root

__all__ = ["RestoreSession", "Restored"]

log = logging.getLogger("objckpt.restore")

T = TypeVar("T")


@dataclass
class Restored(Generic[T]):
    """What a restore produced on this rank.

    Attributes:
        manifest: the checkpoint restored (the same on every rank).
        value: what this rank's ``stage`` returned for it.
        fallbacks: ``(step, reason)`` of every newer checkpoint rejected as damaged first.
        source: ``"primary"``, or ``"mirror"`` when the checkpoint came from the mirror run root.
    """

    manifest: Manifest
    value: T
    fallbacks: list[tuple[int, str]] = field(default_factory=list)
    source: str = "primary"

    @property
    def step(self) -> int:
        return self.manifest.step


class RestoreSession:
    """Restores checkpoints from one run root on every rank of ``comm``.

    Args:
        store: the run root.
        comm: the job's communicator.
        metrics: fed with restores, validation failures and restarts; ``None`` costs nothing.
        label: how the adapter names a restore in messages.
        mirror: the mirror run root (every rank passes the same one, or none); consulted by
            rank 0 only when the primary cannot give a checkpoint (see the module doc).

    Attributes:
        reader: the reader of the run root the checkpoint being staged comes from (the
            primary's, or the mirror's for a checkpoint taken from the mirror): a ``stage``
            callback reads the manifest's shards through it.
    """

    def __init__(
        self,
        store: Store,
        comm: Comm,
        *,
        metrics: CheckpointMetrics | None = None,
        label: str = "restore",
        mirror: Store | None = None,
    ) -> None:
        self.store = store
        self.comm = comm
        self.metrics = metrics
        self.label = label
        self.mirror = mirror
        self.primary_reader = Reader(store)
        self.mirror_reader = Reader(mirror) if mirror is not None else None
        self.reader = self.primary_reader
        self.source = "primary"
        #: a non-damage error of the primary found just before (e.g. by the adapter's store
        #: check): the next restore asks the mirror without trying the primary again (once)
        self.primary_down: BaseException | None = None

    def restore(
        self,
        stage: Callable[[Manifest], T],
        apply: Callable[[Manifest, T], None] | None = None,
        *,
        step: int | None = None,
        error: BaseException | None = None,
    ) -> Restored[T] | None:
        """Restore the newest usable checkpoint (or ``step``) on every rank.

        Args:
            stage: this rank's download, verification and decoding of a checkpoint; it must not
                modify live state. Its exception decides what happens (see the module doc).
            apply: this rank's use of what ``stage`` returned (load it into the live objects);
                an exception here is raised on every rank (the state of the failing ranks may be
                partially loaded: that is why everything checkable is checked while staging).
            step: a specific step, never falling back (damage raises
                :class:`NoCheckpointError`); ``None``: the newest usable checkpoint.
            error: this rank could not prepare (e.g. an unsupported state value): every rank
                raises it before anything is read.

        Returns ``None`` when nothing is committed (nothing was modified).

        Raises (the same on every rank):
            NoCheckpointError: checkpoints exist but none is usable, or ``step`` is not.
            DistributedError: ranks asked for different steps, or did not all take part.
            Any non-damage error of ``stage`` or ``apply`` (prefixed with the failing rank).
        """
        comm = self.comm
        started = time.monotonic()
        hello = {
            "step": step,
            "root": self.store.location,
            "mirror": self.mirror.location if self.mirror is not None else None,
            "error": encode_error(error) if error is not None else None,
        }
        agree(comm, hello, _decide_handshake, f"{self.label} handshake", handshake=True)
        self.reader, self.source = self.primary_reader, "primary"

        sources = _Sources(self, step) if comm.rank == 0 else None
        fallbacks: list[tuple[int, str]] = []
        while True:
            manifest = self._propose(sources, step, fallbacks)
            if manifest is None:
                return None
            staged: T | None = None
            try:
                staged = stage(manifest)
                verdict: dict[str, object] = {"ok": True}
            except Exception as exc:  # noqa: BLE001 - classified, then agreed by every rank
                if is_damage(exc):
                    verdict = {"damaged": describe(exc)}
                else:
                    verdict = {"fatal": encode_error(exc)}
            outcome = agree(
                comm, verdict, _decide_staging, f"{self.label}(step={manifest.step}) verification"
            )
            if outcome.get("ok"):
                break
            damaged = outcome["damaged"]
            assert isinstance(damaged, dict)
            why = "; ".join(f"rank {r}: {m}" for r, m in sorted(damaged.items(), key=lambda kv: int(kv[0])))
            if self.metrics is not None:
                self.metrics.record_validation_failure(why, step=manifest.step, key=manifest.key)
            if step is not None and (self.mirror is None or self.source == "mirror"):
                # an explicit step: no fallback (but the mirror's copy of it, once)
                raise NoCheckpointError(
                    f"checkpoint step {manifest.step} is damaged (under {self.reader.store.location}): {why}"
                )
            log.warning(
                "rejecting checkpoint step %d (%s under %s): it is damaged; all ranks fall back to %s: %s",
                manifest.step,
                manifest.key,
                self.reader.store.location,
                "its copy on the mirror" if step is not None else "an older one",
                why,
            )
            fallbacks.append((manifest.step, why if self.source == "primary" else f"(mirror) {why}"))

        apply_error: dict[str, object] | None = None
        if apply is not None:
            try:
                apply(manifest, staged)  # type: ignore[arg-type]
            except Exception as exc:  # noqa: BLE001 - every rank raises below
                log.error("rank %d failed to apply checkpoint step %d: %s", comm.rank, manifest.step, exc)
                apply_error = encode_error(exc)
        agree(
            comm,
            {"step": manifest.step, "attempt": manifest.attempt, "error": apply_error},
            _decide_restored,
            f"{self.label}(step={manifest.step}) agreement",
        )
        head = sources.head if sources is not None else None
        if self.source == "mirror":
            self._record_mirror_position(manifest, sources, step)
        else:
            self._record_position(manifest, head, step, fallbacks)
        if self.metrics is not None:
            self.metrics.record_restore(
                manifest.step,
                manifest.attempt,
                seconds=time.monotonic() - started,
                fell_back_from=fallbacks[0][0] if fallbacks else None,
                source=self.source,
            )
            self.metrics.record_restart(step=manifest.step, reason="resumed from a checkpoint")
        if self.source == "mirror":
            log.warning(
                "RESTORED FROM THE MIRROR: checkpoint step %d was read from %s, not from the primary %s",
                manifest.step,
                self.reader.store.location,
                self.store.location,
            )
        else:
            log.info("restored checkpoint step %d from %s", manifest.step, self.store.location)
        return Restored(manifest, staged, fallbacks, self.source)  # type: ignore[arg-type]

    def _record_position(
        self, manifest: Manifest, head: Head | None, step: int | None, fallbacks: list[tuple[int, str]]
    ) -> None:
        """Where the next save continues (invariant T2), decided on rank 0 and sent to all:
        on the head's timeline when the head was restored, else on a new timeline (claimed by
        the first commit) whose base is what was restored."""
        decision: dict[str, object] = {}
        if self.comm.rank == 0:
            assert head is not None
            if manifest.key == head.key:
                decision = {"timeline": head.timeline}
            else:
                abandoned = [r for r in self.primary_reader.line() if r > manifest.ref]
                decision = {
                    "timeline": None,
                    "reason": "fallback" if step is None else "restore",
                    "abandons": [str(s) if t == 0 else f"t{t}:{s}" for t, s in abandoned],
                }
        decision = self.comm.broadcast(decision, f"{self.label}(step={manifest.step}) lineage")
        timeline = decision.get("timeline")
        lineage.record(
            self.store,
            lineage.Position(
                manifest,
                int(timeline) if isinstance(timeline, int) else None,
                str(decision.get("reason", "")),
                tuple(decision.get("abandons") or ()),  # type: ignore[arg-type]
                restored=True,
            ),
        )
        if timeline is None:
            log.info(
                "restored step %s, which is not the head of %s: the next save starts a new timeline from it",
                manifest.label,
                self.store.location,
            )

    def _record_mirror_position(self, manifest: Manifest, sources: _Sources | None, step: int | None) -> None:
        """After a restore from the mirror: the next save continues on the primary from the
        primary checkpoint the mirror's copy was made from, when rank 0 can read it there; else
        the next save resolves the primary's head itself (nothing recorded)."""
        from .mirror import source_checksum, source_ref

        found: Manifest | None = None
        decision: dict[str, object] = {"found": False}
        if self.comm.rank == 0:
            assert sources is not None
            src = source_ref(manifest)
            if sources.primary_down is None and src is not None:
                try:
                    candidate = self.primary_reader.load(src[1], src[0])
                    if source_checksum(manifest) in (None, candidate.checksum):
                        found = candidate
                except Exception as exc:  # noqa: BLE001 - only where the next save continues
                    log.warning("cannot find step %s on the primary %s: %s", src, self.store.location, exc)
            if found is not None:
                head = sources.head
                decision = {"found": True, "head": head is not None and found.key == head.key}
        decision = self.comm.broadcast(decision, f"{self.label}(step={manifest.step}) mirror lineage")
        if not decision.get("found"):
            lineage.forget(self.store)
            log.warning(
                "restored step %d from the mirror while the primary %s could not be read: the next save "
                "there continues from the primary's head as it resolves it then",
                manifest.step,
                self.store.location,
            )
            return
        body = self.comm.broadcast_bytes(
            found.encode() if found is not None else None, f"{self.label}(step={manifest.step}) primary base"
        )
        base = Manifest.decode(body, key=_key_of(body))
        if decision.get("head"):
            lineage.record(
                self.store, lineage.Position(base, base.timeline if step is None else None, restored=True)
            )
        else:
            lineage.record(
                self.store,
                lineage.Position(base, None, "fallback" if step is None else "restore", restored=True),
            )

    # ------------------------------------------------------------------ resolution (rank 0)

    def _propose(
        self, sources: _Sources | None, step: int | None, fallbacks: list[tuple[int, str]]
    ) -> Manifest | None:
        """Rank 0 resolves the next checkpoint to try (and the root it comes from) and sends its
        bytes; the others decode and validate them (no request to the store)."""
        comm = self.comm
        proposal: dict[str, object] = {}
        body: bytes | None = None
        if comm.rank == 0:
            assert sources is not None
            try:
                picked = sources.next(fallbacks)
                if picked is None:
                    proposal = {"none": True}
                else:
                    manifest, source = picked
                    body = manifest.encode()
                    proposal = {"step": manifest.step, "timeline": manifest.timeline, "source": source}
            except Exception as exc:  # noqa: BLE001 - raised on every rank
                proposal = {"error": encode_error(exc)}
        proposal = comm.broadcast(proposal, f"{self.label} proposal")
        if "error" in proposal:
            raise decode_error(proposal["error"])  # type: ignore[arg-type]
        if proposal.get("none"):
            return None
        target = int(proposal["step"])  # type: ignore[call-overload]
        timeline = int(proposal.get("timeline", 0))  # type: ignore[call-overload]
        source = str(proposal.get("source", "primary"))
        if source == "mirror":
            if self.mirror_reader is None:  # the handshake checked every rank has the same mirror
                raise DistributedError(f"rank {comm.rank} has no mirror to restore step {target} from")
            self.reader, self.source = self.mirror_reader, "mirror"
        else:
            self.reader, self.source = self.primary_reader, "primary"
        data = comm.broadcast_bytes(body, f"{self.label}(step={target}) manifest")
        # Every rank validates what it received (schema, keys, self-checksum): a manifest that
        # was corrupted on the way is refused, never used.
        return Manifest.decode(data, key=layout.manifest_key(target, timeline))


def _key_of(body: bytes) -> str:
    import json

    obj = json.loads(body)
    return layout.manifest_key(int(obj["step"]), int(obj.get("timeline", 0)))


def _decide_handshake(hellos: list[dict[str, object]]) -> None:
    for rank, h in enumerate(hellos):
        if h.get("error"):
            exc = decode_error(h["error"])  # type: ignore[arg-type]
            raise with_rank(exc, rank) if rank else exc
    steps = {h["step"] for h in hellos}
    if len(steps) != 1:
        detail = ", ".join(f"rank {r}: {h['step']}" for r, h in enumerate(hellos))
        raise DistributedError(f"ranks asked to restore different steps ({detail})")
    _check_same_root(hellos)
    for rank, h in enumerate(hellos[1:], start=1):
        if h.get("mirror") != hellos[0].get("mirror"):
            raise DistributedError(
                f"rank {rank} restores with mirror {h.get('mirror')!r} but rank 0 with "
                f"{hellos[0].get('mirror')!r}: all ranks must be configured with the same mirror"
            )


def _decide_staging(results: list[dict[str, object]]) -> dict[str, object]:
    for rank, r in enumerate(results):
        if "fatal" in r:
            raise with_rank(decode_error(r["fatal"]), rank)  # type: ignore[arg-type]
    damaged = {str(rank): r["damaged"] for rank, r in enumerate(results) if "damaged" in r}
    if damaged:
        return {"damaged": damaged}
    return {"ok": True}


def _decide_restored(results: list[dict[str, object]]) -> int:
    failed = {rank: r["error"] for rank, r in enumerate(results) if r.get("error")}
    if failed:
        rank, err = min(failed.items())
        exc = decode_error(err)  # type: ignore[arg-type]
        raise with_rank(exc, rank)
    steps = {(r["step"], r["attempt"]) for r in results}
    if len(steps) != 1:
        detail = ", ".join(f"rank {i}: {r['step']}" for i, r in enumerate(results))
        raise DistributedError(f"ranks restored different checkpoints ({detail}); refusing to resume")
    # The reports cross the collective as plain dicts: "step" is each rank's manifest step.
    return int(cast(SupportsInt, results[0]["step"]))
