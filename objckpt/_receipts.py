"""Shard receipt and reference: the records a manifest keeps of every object its checkpoint
needs (pure: no I/O).

:class:`ShardReceipt` is what a rank reports for a shard it wrote; :class:`Reference` is an
object an ancestor committed that a checkpoint reuses. Both check every field when built
(``ValueError``) and in ``from_dict`` (:class:`~objckpt.errors.ManifestError`, for data read
from a store), against the limits defined here (:data:`MAX_OBJECT_SIZE`, ``MAX_PARTS``,
``MAX_WORLD_SIZE``). Import them from :mod:`objckpt.manifest`, which re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import layout
from ._crc import decode_crc32c
from ._json import SHA256_RE, Invalid, check_fields, dict_field, int_field, str_field
from .errors import ManifestError

#: no shard is larger than this (1 PiB); anything bigger is a corrupt or hostile manifest
MAX_OBJECT_SIZE = 2**50
MAX_PARTS = 1_000_000
MAX_WORLD_SIZE = 100_000  # ranks are 5 digits in the layout


# ---------------------------------------------------------------------------------- receipts


@dataclass(frozen=True)
class ShardReceipt:
    """What a rank reports for one shard it wrote (invariant 4).

    Attributes:
        key: the shard's key relative to the run root (``data/<step>-<attempt>/<rank>/<name>``).
        size: bytes.
        version: ETag (S3), generation (GCS), per-write token (file/memory) of the write.
        crc32c: base64 of the full-object CRC32C (big-endian), as S3/GCS report it.
        rank: the rank that wrote it.
        name: the shard's name inside the rank's prefix.
        parts: how many parts it was uploaded in (1 for a single request).
        sha256: optional hex SHA-256 of the content.

    Construction validates every field (``ValueError``); :meth:`from_dict` raises
    :class:`ManifestError` instead, for data read from a store.
    """

    key: str
    size: int
    version: str
    crc32c: str
    rank: int
    name: str
    parts: int = 1
    sha256: str | None = None

    def __post_init__(self) -> None:
        try:
            self._validate()
        except Invalid as exc:
            raise ValueError(f"invalid shard receipt {self.key!r}: {exc}") from None

    def _validate(self) -> None:
        str_field(self.key, "key")
        try:
            layout.validate_key_in_root(self.key)
        except ManifestError as exc:
            raise Invalid(str(exc)) from None
        int_field(self.size, "size", 0, MAX_OBJECT_SIZE)
        str_field(self.version, "version")
        if len(self.version) > 1024:
            raise Invalid("version token is absurdly long")
        str_field(self.crc32c, "crc32c")
        try:
            decode_crc32c(self.crc32c)
        except (ValueError, TypeError):
            raise Invalid(f"crc32c {self.crc32c!r} is not a base64 CRC32C digest") from None
        int_field(self.rank, "rank", 0, MAX_WORLD_SIZE - 1)
        str_field(self.name, "name")
        int_field(self.parts, "parts", 1, MAX_PARTS)
        if self.sha256 is not None and (not isinstance(self.sha256, str) or not SHA256_RE.match(self.sha256)):
            raise Invalid(f"sha256 {self.sha256!r} is not 64 lowercase hex digits")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "key": self.key,
            "size": self.size,
            "version": self.version,
            "crc32c": self.crc32c,
            "rank": self.rank,
            "name": self.name,
            "parts": self.parts,
        }
        if self.sha256 is not None:
            d["sha256"] = self.sha256
        return d

    @classmethod
    def from_dict(cls, d: Any, *, key: str = "") -> ShardReceipt:
        """Rebuild a receipt from :meth:`to_dict` output.

        Raises:
            ManifestError: wrong fields or values (``key`` names the object it came from).
        """
        try:
            return cls._from_dict(d)
        except (Invalid, ValueError) as exc:
            raise ManifestError(f"invalid shard receipt in {key!r}: {exc}", key=key) from None

    @classmethod
    def _from_dict(cls, d: Any) -> ShardReceipt:
        dict_field(d, "shard receipt")
        check_fields(
            d, ("key", "size", "version", "crc32c", "rank", "name", "parts"), ("sha256",), "shard receipt"
        )
        return cls(
            key=d["key"],
            size=d["size"],
            version=d["version"],
            crc32c=d["crc32c"],
            rank=d["rank"],
            name=d["name"],
            parts=d["parts"],
            sha256=d.get("sha256"),
        )


# ---------------------------------------------------------------------------------- references


@dataclass(frozen=True)
class Reference:
    """An object an ancestor committed that this checkpoint reuses instead of rewriting it
    (unchanged bytes: frozen layers, a rollback's base). Its identity is ``(origin, rank, name)``:
    shard ``name`` of ``rank`` in checkpoint ``origin`` -- the checkpoint whose manifest lists
    the object among its own shards. Shards that read bytes from it name it by that identity,
    never by key, so a copy to another run root (new keys) only rewrites the manifest.

    Attributes:
        key, size, version, crc32c: the object, as ``origin``'s receipt records it.
        origin_timeline, origin_step: the checkpoint that committed it.
        rank, name: its shard identity there.
    """

    key: str
    size: int
    version: str
    crc32c: str
    origin_timeline: int
    origin_step: int
    rank: int
    name: str

    @property
    def origin(self) -> tuple[int, int]:
        return (self.origin_timeline, self.origin_step)

    @property
    def identity(self) -> tuple[int, int, int, str]:
        return (self.origin_timeline, self.origin_step, self.rank, self.name)

    @classmethod
    def to(cls, receipt: ShardReceipt, origin: Any) -> Reference:
        """A reference to ``receipt``, a shard of manifest ``origin``."""
        return cls(
            receipt.key, receipt.size, receipt.version, receipt.crc32c, origin.timeline, origin.step,
            receipt.rank, receipt.name,
        )  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "size": self.size,
            "version": self.version,
            "crc32c": self.crc32c,
            "from": {"timeline": self.origin_timeline, "step": self.origin_step},
            "rank": self.rank,
            "name": self.name,
        }

    @classmethod
    def from_dict(cls, d: Any, *, key: str = "") -> Reference:
        """Raises ManifestError for data read from a store."""
        try:
            return cls._from_dict(d)
        except (Invalid, ValueError) as exc:
            raise ManifestError(f"invalid reference in {key!r}: {exc}", key=key) from None

    @classmethod
    def _from_dict(cls, d: Any) -> Reference:
        dict_field(d, "reference")
        check_fields(d, ("key", "size", "version", "crc32c", "from", "rank", "name"), (), "reference")
        origin = dict_field(d["from"], "reference origin")
        check_fields(origin, ("timeline", "step"), (), "reference origin")
        # a reference is a shard receipt of its origin: the same checks apply
        receipt = ShardReceipt._from_dict(
            {"key": d["key"], "size": d["size"], "version": d["version"], "crc32c": d["crc32c"],
             "rank": d["rank"], "name": d["name"], "parts": 1}
        )  # fmt: skip
        o_timeline = int_field(origin["timeline"], "reference timeline", 0, layout.MAX_TIMELINE)
        o_step = int_field(origin["step"], "reference step", 0, layout.MAX_STEP)
        parsed = layout.parse_shard_key(receipt.key)
        if parsed is None or parsed[0] != o_step or parsed[2:] != (receipt.rank, receipt.name):
            raise Invalid(
                f"reference key {receipt.key!r} is not shard {receipt.name!r} of rank {receipt.rank} at step {o_step}"
            )
        return cls(
            receipt.key, receipt.size, receipt.version, receipt.crc32c, o_timeline, o_step, receipt.rank,
            receipt.name,
        )  # fmt: skip
