"""Commit verification spread over the ranks (``SaveSession(verify="ranks")``, invariant 5).

After the receipts gather -- so after every rank's writes -- rank 0 broadcasts whether to list;
ranks ``0..min(W, 256)-1`` each LIST their slice of the attempt
(:func:`~objckpt.layout.verification_slices`) and a second gather brings the listings to rank 0,
which adds each to its lister's report for :class:`~objckpt.commit.Coordinator` to check against
every receipt. A slice holds other ranks' keys, hence the wait for every rank's writes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import layout
from ..store.base import ObjectMeta, Store
from .comm import Comm

__all__ = ["gather_listings", "list_slice", "listed_entry"]


def gather_listings(
    comm: Comm, reports: list[Any] | None, listing_report: Callable[[], dict[str, Any]], what: str
) -> list[Any] | None:
    """``verify="ranks"``, after the receipts gather (so after every rank's writes, which a
    slice holding other ranks' keys must see): each lister LISTs its slice and rank 0 adds
    the listing, or the failure to list, to that rank's report. Nobody lists when a rank
    already failed or abandoned the save: nothing will be committed."""
    go = None
    if comm.rank == 0:
        assert reports is not None
        go = all(isinstance(r, dict) and not r.get("error") and not r.get("abandoned") for r in reports)
    if not comm.broadcast(go, f"{what} verification"):
        return reports
    listings = comm.gather(listing_report(), f"{what} listings")
    if comm.rank != 0:
        return reports
    assert reports is not None and listings is not None
    merged: list[Any] = []
    for report, listing in zip(reports, listings, strict=True):
        if isinstance(listing, dict) and listing.get("error"):
            report = {**report, "error": listing["error"]}
        elif isinstance(listing, dict) and "listing" in listing:
            report = {**report, "listing": listing["listing"]}
        merged.append(report)
    return merged


def list_slice(
    store: Store, step: int, attempt: str, rank: int, world_size: int, *, spread: bool
) -> dict[str, Any]:
    """``rank``'s LIST of its verification slice (``{"listing": [...]}``), ``{}`` if it
    lists none, or ``{"error": ...}``: rank 0 then fails the commit naming ``rank``."""
    s = layout.verification_slice(step, attempt, world_size, rank, spread=spread)
    if s is None:
        return {}
    try:
        listing = []
        for m in store.list(s.prefix, start_after=s.after):
            if s.upto is not None and m.key > s.upto:
                break  # past the slice: the next lister's
            listing.append({"key": m.key, "size": m.size, "version": m.version, "crc32c": m.crc32c})
    except Exception as exc:  # noqa: BLE001 - reported: rank 0 fails the commit naming this rank
        return {"error": f"could not list its verification slice {s.prefix!r}: {exc}"}
    return {"listing": listing}


def listed_entry(d: Any) -> ObjectMeta:
    """One entry of a rank's listing of its verification slice (``verify="ranks"``)."""
    crc = d["crc32c"]
    if not isinstance(d["key"], str) or not isinstance(d["version"], str) or not isinstance(d["size"], int):
        raise TypeError(f"malformed entry {d!r}")
    return ObjectMeta(
        key=d["key"], size=d["size"], version=d["version"], crc32c=crc if isinstance(crc, str) else None
    )
