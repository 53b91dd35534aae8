"""``torch.distributed.checkpoint`` (DCP) storage on an objckpt store, through the commit protocol.

::

    from objckpt.training.dcp import ObjckptStorageWriter, ObjckptStorageReader

    dcp.save(state_dict, storage_writer=ObjckptStorageWriter("s3://bucket/run", step=200))
    dcp.load(state_dict, storage_reader=ObjckptStorageReader("s3://bucket/run"))  # latest step

    save_sharded(state_dict, "s3://bucket/run", step=200)   # same, errors as objckpt errors
    step = load_sharded(state_dict, "s3://bucket/run")      # latest valid step, with fallback

How a DCP save maps onto the protocol (``docs/PROTOCOL.md``):

* **One attempt id on every rank, no extra collective.** The coordinator draws a fresh id in
  ``prepare_global_plan`` and hands it to every rank inside its ``SavePlan.storage_data``, which
  DCP scatters anyway. A retried save is a new attempt with new keys (invariant 1), so a failed
  save can never touch the shards of a committed checkpoint, whatever the step.
* **Shards.** Each rank streams its items into ``dcp-NNNNN.bin`` shards under its own attempt
  prefix with :class:`~objckpt.writer.ShardWriter` (create-if-absent, multipart, bounded memory).
  Tensors are written as their raw bytes, zero-copy from contiguous CPU tensors; bytes items are
  the ``torch.save`` output DCP's planner produces. Every item's ``WriteResult.storage_data``
  records shard, offset, length, dtype, shape and the item's own CRC32C, plus the shard receipt.
* **Commit.** ``finish`` (coordinator only, called by DCP only after *every* rank's writes
  succeeded) writes DCP's ``Metadata`` as a JSON shard of rank 0 and calls
  :meth:`Coordinator.commit <objckpt.commit.Coordinator.commit>` with every rank's receipts: the
  manifest (create-if-absent) is the commit point, then the pointer moves by compare-and-swap.
* **Load.** Resolution goes through :class:`~objckpt.reader.Reader` (pointer + ``manifests/``,
  never a scan of ``data/``). DCP's metadata is decoded from JSON, never unpickled (invariant 12);
  bytes items are loaded with ``torch.load(weights_only=True)``. All ranks' resolved step is
  compared in ``prepare_global_plan`` (invariant 13) on the plans DCP gathers anyway.

Integrity of ranged reads: a shard's CRC32C covers the whole object, so it can only be checked on a
whole-shard read, and a rank resharding a checkpoint needs only some items of each shard (reading
whole shards would multiply traffic by up to the world size). So each item records its own CRC32C
in the (CRC32C-verified, manifest-referenced) metadata shard, and every item is fetched with a
ranged GET (adjacent items coalesced) and verified before use: manifest self-checksum -> metadata
shard CRC32C -> per-item CRC32C. An item's bytes are never used unverified.

Errors: DCP reports failures as ``CheckpointException``, a ``BaseException`` that ``except
Exception`` does not catch. :func:`save_sharded` / :func:`async_save_sharded` turn it into
:class:`~objckpt.errors.CommitError` (:class:`~objckpt.errors.CommitConflict` when another attempt
won the step), raised identically on every rank; :func:`load_sharded` re-raises the failing rank's
own exception. Calling ``dcp.save``/``dcp.load`` directly gives DCP's ``CheckpointException``.
"""

from __future__ import annotations

from ._metadata import (
    FORMAT_VERSION,
    MANIFEST_KEY,
    METADATA_SHARD,
    decode_metadata,
    encode_metadata,
)
from ._metadata import (
    _ItemLocation as _ItemLocation,
)
from ._metadata import (
    _ResolvedCheckpoint as _ResolvedCheckpoint,
)
from .api import async_save_sharded, commit_error_from, load_sharded, save_sharded
from .reader import ObjckptStorageReader
from .writer import ObjckptStorageWriter

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_KEY",
    "METADATA_SHARD",
    "ObjckptStorageReader",
    "ObjckptStorageWriter",
    "async_save_sharded",
    "commit_error_from",
    "decode_metadata",
    "encode_metadata",
    "load_sharded",
    "save_sharded",
]
