"""What ``CheckpointManager`` checks about its run: the run roots and the run identity.

At construction every rank checks the run root (and the mirror) with one cheap request each and
all ranks decide alike what to raise or log (:func:`check_roots`). Every save records the run's
identity in its manifest (:func:`run_identity`: the world size and, when given, the config hash
-- see :func:`hash_config` -- and dataset snapshot); a restore compares the restored
checkpoint's with this run's (:func:`check_identity`). These are separate from the manager because they are
self-contained decisions on plain values (stores, a communicator, manifests): the manager only
wires their results in.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

from ..coordination.comm import Comm
from ..errors import encode_error
from ..manifest import Manifest
from ..store import Store

__all__ = ["check_identity", "check_roots", "hash_config", "run_identity"]

log = logging.getLogger("objckpt.training")


def check_roots(
    comm: Comm, primary: Store, mirror: Store | None, *, check: bool | str
) -> BaseException | None:
    """With ``check`` (``True`` or ``"write"``; ``False``: nothing, None), one cheap request per root on every rank (a probe write too when asked, rank 0 only);
    decided on every rank alike. Raised: any problem of the primary without a mirror, and
    configuration problems (missing bucket, permissions) of either root. With a mirror, a
    primary that is unreachable past its retry budget is logged loudly instead: the first
    restore then goes to the mirror without waiting for the primary again.

    Returns the primary's error when it is down but the mirror stands in, else None. A collective
    (the handshake and one gather/broadcast on ``comm``); the caller releases what it opened when
    this raises.
    """
    if not check:
        return None
    from ..coordination.comm import agree
    from ..errors import TransientError, decode_error, with_rank

    write = check == "write"
    report: dict[str, Any] = {}
    for name, store in (("primary", primary), ("mirror", mirror)):
        if store is None:
            continue
        try:
            store.check(write=write and comm.rank == 0)
        except Exception as exc:  # noqa: BLE001 - decided by every rank alike
            report[name] = encode_error(exc)
    mirrored = mirror is not None

    def decide(results: list[dict[str, Any]]) -> dict[str, Any]:
        down: dict[str, Any] | None = None
        for name in ("primary", "mirror"):
            for rank, result in enumerate(results):
                if name not in result:
                    continue
                exc = decode_error(result[name])
                if mirrored and isinstance(exc, TransientError):
                    if name == "primary" and down is None:
                        down = result[name]
                    continue  # the other root can stand in
                raise with_rank(exc, rank) if rank else exc
        mirror_down = next((r["mirror"] for r in results if "mirror" in r), None)
        if down is not None and mirror_down is not None:
            raise decode_error(down)  # neither root answers
        return {"primary_down": down, "mirror_down": mirror_down}

    outcome = agree(comm, report, decide, "store check", handshake=True)
    if outcome.get("mirror_down"):
        log.error(
            "the mirror run root %s is unreachable (%s): checkpoints are not mirrored until it is back",
            mirror.location if mirror is not None else "",
            decode_error(outcome["mirror_down"]),
        )
    if outcome.get("primary_down"):
        down = decode_error(outcome["primary_down"])
        log.error(
            "THE PRIMARY RUN ROOT %s IS UNREACHABLE (%s); the first restore reads the mirror %s, saves go "
            "to the primary (and fail until it is back)",
            primary.location,
            down,
            mirror.location if mirror is not None else "",
        )
        return down
    return None


def hash_config(config: Any) -> str:
    """A stable SHA-256 of a JSON-able config (sorted keys), for ``config_hash=``."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def run_identity(world_size: int, config_hash: str | None, dataset_snapshot: str | None) -> dict[str, Any]:
    """The run identity every manifest records (``config_hash``/``dataset_snapshot`` when given)."""
    identity: dict[str, Any] = {"world_size": world_size}
    if config_hash is not None:
        identity["config_hash"] = config_hash
    if dataset_snapshot is not None:
        identity["dataset_snapshot"] = dataset_snapshot
    return identity


def check_identity(manifest: Manifest, config_hash: str | None) -> None:
    """Warn when ``manifest`` was written under another config hash than ``config_hash``."""
    saved = manifest.run.get("config_hash")
    if config_hash is not None and saved is not None and saved != config_hash:
        log.warning(
            "restoring step %d written under config hash %s, this run's is %s",
            manifest.step,
            saved,
            config_hash,
        )
