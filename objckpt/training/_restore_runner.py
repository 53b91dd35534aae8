"""Restore and rollback on this rank: ``CheckpointManager.restore`` and ``rollback`` run here.

:class:`RestoreRunner` is separate from the manager for the same reason as
:class:`~._save_runner.SaveRunner`: the manager is the user-facing facade (options, documentation,
the in-flight save to settle first), this holds what one restore does on this rank around the
restore session's protocol (:class:`~objckpt.coordination.RestoreSession`): check the live
objects before any collective, stage the checkpoint (:func:`.shards.stage`), check the run
identity and apply it (:func:`.shards.apply`); and what a rollback does: rank 0's claim of the new
timeline, the base manifest shared with every rank, and the lineage record.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..coordination.comm import Comm
from ..coordination.restore import RestoreSession
from ..manifest import Manifest
from ..reader import Reader
from ..store import Store
from . import shards
from ._manager_checks import check_identity
from ._save_errors import SaveErrorPolicy, commit_time
from .state import RestoreReport, classify

__all__ = ["RestoreRunner"]


def _key_of(body: bytes) -> str:
    from .. import layout

    obj = json.loads(body)
    return layout.manifest_key(int(obj["step"]), int(obj.get("timeline", 0)))


class RestoreRunner:
    """Runs this rank's part of every restore and rollback, over ``restores`` (its primary store
    and communicator); ``reader`` reads the primary for a rollback's base manifest.

    ``errors`` learns every restored checkpoint (the last valid one); ``config_hash`` is this
    run's, compared with the restored checkpoint's.
    """

    def __init__(
        self,
        restores: RestoreSession,
        reader: Reader,
        errors: SaveErrorPolicy,
        *,
        replicated_read: str | None,
        config_hash: str | None,
    ) -> None:
        self.restores = restores
        self.store: Store = restores.store
        self.comm: Comm = restores.comm
        self.reader = reader
        self.errors = errors
        self.rank = self.comm.rank
        self.world_size = self.comm.world_size
        self.replicated_read = replicated_read
        self.config_hash = config_hash
        #: (step, reason) of every checkpoint a restore rejected and fell back from
        self.fallbacks: list[tuple[int, str]] = []
        #: what the last restore loaded on this rank (missing/unexpected keys, elastic mapping)
        self.last_restore: RestoreReport | None = None

    def restore(self, state: Mapping[str, Any], *, step: int | None, strict: bool) -> int | None:
        """``CheckpointManager.restore`` once no save is in flight (see there): the restored
        step, or None when the run root holds no checkpoint."""
        prep_error: Exception | None = None
        try:
            for name, obj in state.items():
                classify(name, obj)
        except Exception as exc:  # noqa: BLE001 - every rank raises the same error
            prep_error = exc

        def stage(manifest: Manifest) -> shards.Staged:
            # the session's reader: the primary's, or the mirror's when the checkpoint comes from it
            reader = self.restores.reader
            return shards.stage(
                reader,
                manifest,
                state,
                rank=self.rank,
                world_size=self.world_size,
                strict=strict,
                comm=self.comm,
                replicated_read=self.replicated_read or shards.default_replicated_read(reader.store),
            )

        def apply(manifest: Manifest, staged: shards.Staged) -> None:
            check_identity(manifest, self.config_hash)
            self.last_restore = shards.apply(state, staged, rank=self.rank)

        restored = self.restores.restore(stage, apply, step=step, error=prep_error)
        if restored is None:
            return None
        self.fallbacks.extend(restored.fallbacks)
        self.errors.last_valid = (restored.step, commit_time(restored.manifest))
        return restored.step

    def rollback(self, step: int, *, timeline: int | None) -> int:
        """``CheckpointManager.rollback`` once no save is in flight (see there): the new timeline."""
        from ..coordination import lineage
        from ..coordination.comm import agree
        from ..timelines import rollback

        def decide(_: list[Any]) -> dict[str, Any]:
            claim = rollback(self.store, step, timeline=timeline)
            return {"timeline": claim.timeline}

        outcome = agree(self.comm, None, decide, f"rollback(step={step})", handshake=True)
        base = self.reader.load(step, timeline) if self.rank == 0 else None
        body = self.comm.broadcast_bytes(
            base.encode() if base is not None else None, f"rollback(step={step}) base"
        )
        base = Manifest.decode(body, key=_key_of(body))
        lineage.record(self.store, lineage.Position(base, int(outcome["timeline"])))
        return int(outcome["timeline"])
