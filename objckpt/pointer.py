"""The ``LATEST`` pointer and the claim of a timeline (pure: no I/O).

The **pointer** names the head: the newest committed checkpoint of the newest timeline. It is a
hint that makes resolution O(1); readers roll forward past it (a lost pointer update loses
nothing) and never trust it over the manifests. It is ordered by ``(timeline, step)``: after a
rollback it names the new timeline while its manifest key is still the base's (the base is the
head of a timeline that has no commit of its own yet).

A **timeline claim** (``timelines/<n>.json``, written create-if-absent, so two claims of one
number cannot both succeed) says where timeline ``n`` continues from: its base checkpoint.
Timeline 0 is implicit and has no claim.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import layout
from ._json import (
    Invalid,
    canonical_json,
    check_created_at,
    check_fields,
    check_format,
    check_self_checksum,
    int_field,
    load_json,
    sha256_of,
    str_field,
    utc_now,
)
from .errors import ManifestError

__all__ = [
    "POINTER_FORMAT",
    "POINTER_FORMAT_VERSION",
    "TIMELINE_FORMAT",
    "TIMELINE_FORMAT_VERSION",
    "Pointer",
    "TimelineClaim",
]

POINTER_FORMAT = "objckpt.pointer"
#: version 2 adds the timeline (version 1 pointers are read as timeline 0)
POINTER_FORMAT_VERSION = 2
TIMELINE_FORMAT = "objckpt.timeline"
TIMELINE_FORMAT_VERSION = 1

_POINTER_FIELDS_V1 = ("format", "format_version", "step", "manifest", "attempt", "checksum")
_POINTER_FIELDS_V2 = (*_POINTER_FIELDS_V1, "timeline")


@dataclass(frozen=True)
class Pointer:
    """``LATEST``: names the head checkpoint. A hint, never the source of truth.

    Attributes:
        timeline: the head's timeline (the newest); ``step``: the head's step.
        manifest_key: the head's manifest (on ``timeline``, or on an older one when the head is
            the base of a timeline without commits of its own).
        attempt: the head's attempt id.
    """

    step: int
    manifest_key: str
    attempt: str
    timeline: int = 0

    def __post_init__(self) -> None:
        try:
            self._validate()
        except Invalid as exc:
            raise ValueError(f"invalid pointer: {exc}") from None

    def _validate(self) -> None:
        int_field(self.step, "step", 0, layout.MAX_STEP)
        int_field(self.timeline, "timeline", 0, layout.MAX_TIMELINE)
        try:
            layout.check_attempt_id(self.attempt)
        except ValueError as exc:
            raise Invalid(str(exc)) from None
        parsed = layout.parse_manifest_key(self.manifest_key)
        if parsed is None or parsed[1] != self.step or parsed[0] > self.timeline:
            raise Invalid(
                f"manifest key {self.manifest_key!r} is not step {self.step}'s manifest on timeline "
                f"{self.timeline} or an older one"
            )

    @property
    def ref(self) -> tuple[int, int]:
        return (self.timeline, self.step)

    @classmethod
    def for_manifest(cls, manifest: Any, *, timeline: int | None = None) -> Pointer:
        """The pointer to ``manifest`` as the head of ``timeline`` (default: its own)."""
        return cls(
            step=manifest.step,
            manifest_key=manifest.key,
            attempt=manifest.attempt,
            timeline=manifest.timeline if timeline is None else timeline,
        )

    def encode(self) -> bytes:
        body = {
            "format": POINTER_FORMAT,
            "format_version": POINTER_FORMAT_VERSION,
            "timeline": self.timeline,
            "step": self.step,
            "manifest": self.manifest_key,
            "attempt": self.attempt,
        }
        return canonical_json({**body, "checksum": sha256_of(body)})

    @classmethod
    def decode(cls, data: bytes, *, key: str = layout.POINTER_KEY) -> Pointer:
        """Parse and validate a pointer.

        Raises:
            ManifestError: not JSON, unknown format/version, bad field, or checksum mismatch.
        """
        obj = load_json(data, key, "pointer")
        try:
            version = check_format(obj, POINTER_FORMAT, (1, 2), "pointer")
            check_fields(obj, _POINTER_FIELDS_V1 if version == 1 else _POINTER_FIELDS_V2, (), "pointer")
            check_self_checksum(obj)
            if not isinstance(obj["manifest"], str):
                raise Invalid("manifest must be a string")
            layout.validate_key_in_root(obj["manifest"])
            p = cls.__new__(cls)
            object.__setattr__(p, "step", obj["step"])
            object.__setattr__(p, "manifest_key", obj["manifest"])
            object.__setattr__(p, "attempt", obj["attempt"])
            object.__setattr__(p, "timeline", obj.get("timeline", 0))
            p._validate()
            return p
        except (Invalid, ManifestError) as exc:
            raise ManifestError(f"invalid pointer {key!r}: {exc}", key=key) from None


_CLAIM_FIELDS = ("format", "format_version", "timeline", "base", "reason", "created_at", "checksum")
_BASE_FIELDS = ("timeline", "step", "attempt", "manifest")


@dataclass(frozen=True)
class TimelineClaim:
    """``timelines/<timeline>.json``: timeline ``timeline`` continues from its base checkpoint.

    Attributes:
        timeline: the claimed number (>= 1).
        base_timeline, base_step, base_attempt: the checkpoint it continues from (older).
        reason: why it was claimed (``rollback``, ``restore``, ``fallback``, ``quarantine``).
        created_at: ISO-8601 UTC time of the claim: when the older branch was abandoned.
    """

    timeline: int
    base_timeline: int
    base_step: int
    base_attempt: str
    reason: str = "rollback"
    created_at: str = ""
    checksum: str = ""

    @property
    def key(self) -> str:
        return layout.timeline_key(self.timeline)

    @property
    def base_ref(self) -> tuple[int, int]:
        return (self.base_timeline, self.base_step)

    @property
    def base_key(self) -> str:
        return layout.manifest_key(self.base_step, self.base_timeline)

    @classmethod
    def create(cls, *, timeline: int, base: Any, reason: str) -> TimelineClaim:
        """The claim of ``timeline`` continuing from manifest ``base``.

        Raises:
            ValueError: ``timeline`` is 0 or not newer than the base's timeline, a bad reason.
        """
        body = {
            "format": TIMELINE_FORMAT,
            "format_version": TIMELINE_FORMAT_VERSION,
            "timeline": timeline,
            "base": {
                "timeline": base.timeline,
                "step": base.step,
                "attempt": base.attempt,
                "manifest": base.key,
            },
            "reason": reason,
            "created_at": utc_now(),
        }
        body["checksum"] = sha256_of(body)
        try:
            return cls._from_obj(body, expected_key=None)
        except Invalid as exc:
            raise ValueError(f"invalid claim of timeline {timeline!r}: {exc}") from None

    def encode(self) -> bytes:
        return canonical_json(self._body() | {"checksum": self.checksum})

    def _body(self) -> dict[str, Any]:
        return {
            "format": TIMELINE_FORMAT,
            "format_version": TIMELINE_FORMAT_VERSION,
            "timeline": self.timeline,
            "base": {
                "timeline": self.base_timeline,
                "step": self.base_step,
                "attempt": self.base_attempt,
                "manifest": self.base_key,
            },
            "reason": self.reason,
            "created_at": self.created_at,
        }

    @classmethod
    def decode(cls, data: bytes, *, key: str) -> TimelineClaim:
        """Parse and validate a claim read from ``key``.

        Raises:
            ManifestError: naming ``key`` and the reason.
        """
        obj = load_json(data, key, "timeline claim")
        try:
            return cls._from_obj(obj, expected_key=key)
        except (Invalid, ManifestError) as exc:
            raise ManifestError(f"invalid timeline claim {key!r}: {exc}", key=key) from None

    @classmethod
    def _from_obj(cls, obj: Mapping[str, Any], *, expected_key: str | None) -> TimelineClaim:
        check_format(obj, TIMELINE_FORMAT, TIMELINE_FORMAT_VERSION, "timeline claim")
        check_fields(obj, _CLAIM_FIELDS, (), "timeline claim")
        timeline = int_field(obj["timeline"], "timeline", 1, layout.MAX_TIMELINE)
        if expected_key is not None and expected_key != layout.timeline_key(timeline):
            raise Invalid(f"it is stored at {expected_key!r} but claims timeline {timeline}")
        base = obj["base"]
        if not isinstance(base, dict):
            raise Invalid("base must be an object")
        check_fields(base, _BASE_FIELDS, (), "timeline base")
        b_timeline = int_field(base["timeline"], "base timeline", 0, layout.MAX_TIMELINE)
        b_step = int_field(base["step"], "base step", 0, layout.MAX_STEP)
        if b_timeline >= timeline:
            raise Invalid(f"base timeline {b_timeline} is not older than timeline {timeline}")
        try:
            attempt = layout.check_attempt_id(base["attempt"])
        except ValueError as exc:
            raise Invalid(str(exc)) from None
        if base["manifest"] != layout.manifest_key(b_step, b_timeline):
            raise Invalid(f"base manifest {base['manifest']!r} is not the key of its timeline and step")
        reason = str_field(obj["reason"], "reason")
        if len(reason) > 200:
            raise Invalid("reason is absurdly long")
        created_at = check_created_at(obj["created_at"])
        checksum = check_self_checksum(obj)
        return cls(timeline, b_timeline, b_step, attempt, reason, created_at, checksum)
