"""Export the model weights of a committed checkpoint as one ``.safetensors`` (or ``torch.save``)
file, streamed with bounded memory.

::

    from objckpt.training.export import export_safetensors

    export_safetensors("s3://bucket/runs/eta", "model.safetensors", step=2000, dtype="bfloat16")

    # safetensors.torch.load_file("model.safetensors") / AutoModel.from_pretrained(dir) read it

What is exported: one state entry (``entry=``, default ``"model"``) of

* a :class:`~objckpt.training.manager.CheckpointManager` checkpoint written at any world size --
  replicated entries are joined from every rank's replicated shards, per-rank entries read from
  rank 0's ``rank.bin`` (``rank=``);
* a DCP checkpoint (:func:`~objckpt.training.dcp.save_sharded`, e.g. by a 4-rank FSDP2 job) --
  every tensor is assembled at its global shape from the chunks the saving ranks held;
* a Lightning checkpoint (:class:`~objckpt.integrations.lightning.ObjckptCheckpointIO`),
  entry ``"state_dict"``.

Nested dicts are flattened with ``.`` (a module's ``state_dict`` keys stay as they are); values
that are not tensors are left out and listed in :attr:`ExportResult.skipped`.

**Bounded memory.** Nothing is materialised: the safetensors header is computed from the
checkpoint's metadata alone (the JSON headers of the objckpt containers, DCP's metadata shard),
written first, and then every tensor's bytes are copied from the store's byte stream to their
place in the file, chunk by chunk (``--dtype`` casts each chunk on the way). Peak memory is the
store's read window (a few chunks) plus the metadata, whatever the model's size; the one
exception is a tensor saved as a *non-contiguous view* into another tensor's storage (a
transposed slice of a fused buffer), which is gathered from its whole base tensor in memory.

**Verified.** CheckpointManager and Lightning shards are streamed whole through
:meth:`Reader.open_shard <objckpt.reader.Reader.open_shard>` (size and CRC32C of the whole object
checked at its end; the container header read up front must equal the verified one), so the
bytes read include the entries not exported (the optimizer's). DCP items are read with ranged
GETs of the model's items only, each checked against its own CRC32C recorded in the
(CRC32C-verified) metadata shard. The file is written under a temporary name next to ``out`` and
renamed into place only once every byte has been verified: a failed export leaves no file.

The ``torch`` format (:func:`export_torch`) goes through the same streamed safetensors file
(temporary, next to ``out``), memory-mapped, so ``torch.save`` reads the tensors from the page
cache rather than from the process's memory; it needs twice the disk space for a moment.

This module holds the public API, :class:`ExportPlan` and :func:`plan_export` (which picks the
checkpoint's layout); reading each layout's metadata into pieces is :mod:`._export_plan` (the
CheckpointManager and Lightning containers) and :mod:`._export_dcp` (DCP's metadata shard), reading
the sources and routing and writing the bytes :mod:`._export_io`.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import struct
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..coordination.roots import open_root
from ..errors import ConfigError, NoCheckpointError, SerializationError
from ..manifest import Manifest
from ..reader import Reader
from ..store import Store
from ._export_dcp import _plan_dcp
from ._export_io import (
    _COALESCE_GAP,
    SAFETENSORS_DTYPES,
    _copy_source,
    _pwrite_all,
    _remove,
    _Source,
    _temp_path,
    _Tensor,
)
from ._export_io import _Piece as _Piece  # re-exported ("as"): tests build pieces by hand
from ._export_io import _Router as _Router  # re-exported ("as"): tests route pieces by hand
from ._export_io import parse_dtype as parse_dtype  # re-exported ("as"): importable from here
from ._export_plan import _out_dtype as _out_dtype  # re-exported ("as"): tests call it
from ._export_plan import _plan_lightning, _plan_manager

__all__ = ["ExportResult", "SAFETENSORS_DTYPES", "export", "export_safetensors", "export_torch"]

log = logging.getLogger("objckpt.training.export")


#: bytes per ranged GET of a DCP item (the largest gap one GET spans is ``_export_io._COALESCE_GAP``)
DEFAULT_CHUNK = 8 * 1024 * 1024
#: the layouts this module reads
LAYOUT_MANAGER, LAYOUT_DCP, LAYOUT_LIGHTNING = "CheckpointManager", "DCP", "Lightning"
_LIGHTNING_SHARD = "lightning.ckpt"


@dataclass
class ExportResult:
    """What :func:`export_safetensors` wrote.

    Attributes:
        path: the file written.
        step, timeline, attempt: the checkpoint exported.
        layout: ``"CheckpointManager"``, ``"DCP"`` or ``"Lightning"``.
        entry: the state entry exported.
        world_size: ranks of the job that saved it.
        tensors: tensors written; ``data_bytes``: their bytes (the file is the header larger).
        read_bytes: bytes read from the store (verified).
        skipped: names of values in the entry that are not tensors (left out).
        format: ``"safetensors"`` or ``"torch"``.
    """

    path: str
    step: int
    timeline: int
    attempt: str
    layout: str
    entry: str
    world_size: int
    tensors: int
    data_bytes: int
    read_bytes: int
    skipped: list[str] = field(default_factory=list)
    format: str = "safetensors"

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# ------------------------------------------------------------------------------------ public API


def export_safetensors(
    uri_or_store: str | Store,
    out: str | os.PathLike[str],
    step: int | None = None,
    timeline: int | None = None,
    *,
    entry: str | None = None,
    strip_prefix: str | None = None,
    add_prefix: str | None = None,
    dtype: str | torch.dtype | None = None,
    rank: int = 0,
    metadata: Mapping[str, str] | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    progress: Callable[[int], None] | None = None,
    store_options: Mapping[str, Any] | None = None,
) -> ExportResult:
    """Write the weights of checkpoint ``step`` (default: the newest valid one) under the run root
    to ``out`` as a safetensors file (see the module docstring).

    Args:
        uri_or_store: run-root URI or :class:`~objckpt.store.Store`.
        out: the file to write (replaced atomically if it exists).
        step, timeline: the checkpoint; ``timeline`` picks one on another (abandoned) timeline.
        entry: the state entry holding the model (default ``"model"``, or ``"state_dict"`` for a
            Lightning checkpoint).
        strip_prefix: removed from every key that starts with it (``"_orig_mod."``, ``"model."``).
        add_prefix: put before every key (after ``strip_prefix``).
        dtype: cast floating-point tensors to this dtype (``"bfloat16"``, ``"float16"``, ...);
            integer and bool tensors are written as they are.
        rank: whose ``rank.bin`` holds a per-rank entry (CheckpointManager with ``replicated=()``).
        metadata: extra string pairs for the safetensors ``__metadata__``.
        chunk_size: bytes per ranged GET of DCP items.
        progress: called with the byte count of every chunk read from the store.
        store_options: options for :func:`~objckpt.store.open_store` when a URI is given.

    Raises:
        NoCheckpointError: no committed checkpoint (or not that step).
        ConfigError: no such entry, a dtype safetensors cannot hold, keys that collide after the
            prefix options, a checkpoint layout this function does not read.
        ChecksumMismatchError, ManifestError, SerializationError: the checkpoint is damaged;
            nothing is written.
        StoreError: the store could not be read (after the retry budget).
    """
    return _export(
        uri_or_store,
        step,
        timeline,
        lambda plan: plan.write_safetensors(out, metadata=metadata, progress=progress),
        store_options,
        entry=entry,
        strip_prefix=strip_prefix,
        add_prefix=add_prefix,
        dtype=dtype,
        rank=rank,
        chunk_size=chunk_size,
    )


def export_torch(
    uri_or_store: str | Store,
    out: str | os.PathLike[str],
    step: int | None = None,
    timeline: int | None = None,
    **options: Any,
) -> ExportResult:
    """As :func:`export_safetensors`, but ``out`` is a ``torch.save`` file of the flat state
    dict (``torch.load(out, weights_only=True)`` reads it). Same arguments."""
    store_options = options.pop("store_options", None)
    metadata = options.pop("metadata", None)
    progress = options.pop("progress", None)
    return _export(
        uri_or_store,
        step,
        timeline,
        lambda plan: plan.write_torch(out, metadata=metadata, progress=progress),
        store_options,
        **options,
    )


def _export(
    uri_or_store: str | Store,
    step: int | None,
    timeline: int | None,
    write: Callable[[ExportPlan], ExportResult],
    store_options: Mapping[str, Any] | None,
    **plan_options: Any,
) -> ExportResult:
    """Open the run root (closing it after if opened here), plan the export and ``write`` it."""
    store, owned = open_root(uri_or_store, store_options)
    try:
        return write(plan_export(store, step, timeline, **plan_options))
    finally:
        if owned:
            store.close()


def export(
    uri_or_store: str | Store,
    out: str | os.PathLike[str],
    step: int | None = None,
    timeline: int | None = None,
    *,
    format: str = "safetensors",  # noqa: A002 - the CLI's --format
    **options: Any,
) -> ExportResult:
    """:func:`export_safetensors` (``format="safetensors"``) or :func:`export_torch` (``"torch"``)."""
    if format == "safetensors":
        return export_safetensors(uri_or_store, out, step, timeline, **options)
    if format == "torch":
        return export_torch(uri_or_store, out, step, timeline, **options)
    raise ConfigError(f"unknown export format {format!r}; use 'safetensors' or 'torch'")


class ExportPlan:
    """The layout of the output file, computed from the checkpoint's metadata (nothing big is
    read): :func:`plan_export` builds it, :meth:`write_safetensors` streams it."""

    def __init__(
        self,
        store: Store,
        manifest: Manifest,
        layout_name: str,
        entry: str,
        tensors: list[_Tensor],
        sources: list[_Source],
        skipped: list[str],
        chunk_size: int,
    ) -> None:
        self.store = store
        self.manifest = manifest
        self.layout = layout_name
        self.entry = entry
        self.tensors = tensors
        self.sources = sources
        self.skipped = skipped
        self.chunk_size = chunk_size
        self.tensors.sort(key=lambda t: (t.order, t.name))
        offset = 0
        for t in self.tensors:
            t.offset = offset
            offset += t.nbytes
        self.data_bytes = offset

    @property
    def read_bytes(self) -> int:
        """Bytes this export reads from the store."""
        total = 0
        for s in self.sources:
            if s.whole:
                total += s.receipt.size
            else:
                total += sum(b - a for a, b in s.spans(_COALESCE_GAP, self.chunk_size))
        return total

    def header(self, metadata: Mapping[str, str] | None = None) -> bytes:
        """The safetensors prefix: 8-byte little-endian length, then the JSON header padded with
        spaces to a multiple of 8 bytes."""
        m = self.manifest
        meta = {
            "format": "pt",
            "objckpt.run": self.store.location,
            "objckpt.step": str(m.step),
            "objckpt.timeline": str(m.timeline),
            "objckpt.attempt": m.attempt,
            "objckpt.entry": self.entry,
        }
        for k, v in (metadata or {}).items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise ConfigError(f"safetensors metadata must map strings to strings, got {k!r}: {v!r}")
            meta[k] = v
        body: dict[str, Any] = {"__metadata__": meta}
        for t in self.tensors:
            body[t.name] = {
                "dtype": SAFETENSORS_DTYPES[t.out_dtype],
                "shape": list(t.shape),
                "data_offsets": [t.offset, t.offset + t.nbytes],
            }
        raw = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        return struct.pack("<Q", len(raw)) + raw

    def result(self, path: str, fmt: str) -> ExportResult:
        m = self.manifest
        return ExportResult(
            path=path,
            step=m.step,
            timeline=m.timeline,
            attempt=m.attempt,
            layout=self.layout,
            entry=self.entry,
            world_size=m.world_size,
            tensors=len(self.tensors),
            data_bytes=self.data_bytes,
            read_bytes=self.read_bytes,
            skipped=list(self.skipped),
            format=fmt,
        )

    # ---------------------------------------------------------------------------------- writing

    def write_safetensors(
        self,
        out: str | os.PathLike[str],
        *,
        metadata: Mapping[str, str] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> ExportResult:
        """Stream the tensors into ``out`` (atomically: a temporary file renamed at the end)."""
        path = os.fspath(out)
        tmp = _temp_path(path)
        try:
            self._write_file(tmp, metadata, progress)
            os.replace(tmp, path)
        except BaseException:
            _remove(tmp)
            raise
        log.info(
            "exported step %s (%s, entry %r) of %s to %s: %d tensors, %d bytes",
            self.manifest.label,
            self.layout,
            self.entry,
            self.store.location,
            path,
            len(self.tensors),
            self.data_bytes,
        )
        return self.result(path, "safetensors")

    def write_torch(
        self,
        out: str | os.PathLike[str],
        *,
        metadata: Mapping[str, str] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> ExportResult:
        """``torch.save`` of the flat state dict, from a memory-mapped streamed safetensors file."""
        path = os.fspath(out)
        staged = _temp_path(path) + ".safetensors"
        tmp = _temp_path(path)
        try:
            self._write_file(staged, metadata, progress)
            header_len = len(self.header(metadata))
            with open(staged, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if self.data_bytes else None
            try:
                state: dict[str, torch.Tensor] = {}
                for t in sorted(self.tensors, key=lambda t: t.name):
                    if t.numel == 0 or mm is None:
                        state[t.name] = torch.empty(t.shape, dtype=t.out_dtype)
                    else:
                        state[t.name] = torch.frombuffer(
                            mm, dtype=t.out_dtype, count=t.numel, offset=header_len + t.offset
                        ).reshape(t.shape)
                torch.save(state, tmp)
                del state
            finally:
                if mm is not None:
                    try:
                        mm.close()
                    except BufferError:  # a tensor still references it: closed when collected
                        pass
            os.replace(tmp, path)
        except BaseException:
            _remove(tmp)
            raise
        finally:
            _remove(staged)
        return self.result(path, "torch")

    def _write_file(
        self, path: str, metadata: Mapping[str, str] | None, progress: Callable[[int], None] | None
    ) -> None:
        if sys.byteorder != "little":
            raise ConfigError("safetensors export needs a little-endian machine")
        head = self.header(metadata)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, len(head) + self.data_bytes)
            _pwrite_all(fd, memoryview(head), 0)
            written = [0]

            def write(pos: int, data: memoryview) -> None:
                _pwrite_all(fd, data, len(head) + pos)
                written[0] += data.nbytes

            for source in self.sources:
                _copy_source(self.store, source, write, progress, self.chunk_size, self.manifest.label)
            if written[0] != self.data_bytes:  # every byte of the file is written exactly once
                raise SerializationError(
                    f"export of step {self.manifest.label}: wrote {written[0]} bytes of {self.data_bytes}"
                )
            os.fsync(fd)
        finally:
            os.close(fd)


# ------------------------------------------------------------------------------------- the plan


def plan_export(
    store: Store,
    step: int | None = None,
    timeline: int | None = None,
    *,
    entry: str | None = None,
    strip_prefix: str | None = None,
    add_prefix: str | None = None,
    dtype: str | torch.dtype | None = None,
    rank: int = 0,
    chunk_size: int = DEFAULT_CHUNK,
) -> ExportPlan:
    """Resolve the checkpoint and lay out the output file from its metadata (reads the manifest,
    the container headers or DCP's metadata shard; no tensor bytes)."""
    if chunk_size < 1:
        raise ConfigError(f"chunk_size must be positive, got {chunk_size}")
    cast = parse_dtype(dtype)
    reader = Reader(store)
    if step is None:
        manifest = reader.latest_valid()
        if manifest is None:
            raise NoCheckpointError(f"no valid committed checkpoint under {store.location}")
    else:
        manifest = reader.load(step, timeline)
    from .dedup import resolver_for
    from .shards import STATE_LAYOUTS

    resolver = resolver_for(store, manifest)  # the sizes of what a version-3 shard may reference
    topo = manifest.topology
    if topo.get("layout") in STATE_LAYOUTS:
        layout_name = LAYOUT_MANAGER
        tensors, sources, skipped, entry = _plan_manager(
            store, manifest, entry, rank, cast, strip_prefix, add_prefix, resolver
        )
    elif isinstance(manifest.metadata.get("dcp"), Mapping):
        layout_name = LAYOUT_DCP
        tensors, sources, skipped, entry = _plan_dcp(
            store, reader, manifest, entry, cast, strip_prefix, add_prefix
        )
    elif any(s.name == _LIGHTNING_SHARD for s in manifest.shards):
        layout_name = LAYOUT_LIGHTNING
        receipt = next(s for s in manifest.shards if s.name == _LIGHTNING_SHARD)
        tensors, sources, skipped, entry = _plan_lightning(
            store, receipt, manifest, entry, cast, strip_prefix, add_prefix, resolver
        )
    else:
        raise ConfigError(
            f"step {manifest.label} under {store.location} was not written by CheckpointManager, "
            f"save_sharded or the Lightning plug-in (layout {topo.get('layout') or topo.get('format')!r}); "
            "export reads those"
        )
    if not tensors:
        raise ConfigError(f"state entry {entry!r} of step {manifest.label} holds no tensors")
    return ExportPlan(store, manifest, layout_name, entry, tensors, sources, skipped, chunk_size)
