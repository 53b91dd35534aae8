"""Shared helpers of the reliability suite (chaos, crash matrix) and ``scripts/reliability.py``.

Everything here drives the public protocol API exactly as a training job would (``ShardWriter``
per rank, ``Coordinator.commit`` on rank 0, ``Reader`` to restore), with deterministic payloads,
so every check can be "the bytes restored are the bytes saved for that step", bit for bit.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import urllib.parse
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from objckpt._retry import RetryPolicy
from objckpt.commit import Coordinator
from objckpt.errors import IntegrityError, NoCheckpointError, StoreError
from objckpt.layout import DATA_PREFIX, new_attempt_id, parse_shard_key
from objckpt.manifest import Manifest
from objckpt.reader import Reader
from objckpt.store import Store, open_store
from objckpt.writer import ShardWriter

log = logging.getLogger("objckpt.tests.reliability")

KiB = 1024
MiB = 1024 * KiB

#: Retries for tests: many quick tries, so a 10% fault rate never exhausts them, and no test
#: sleeps for long. The deadline bounds every request loop.
FAST_RETRY = RetryPolicy(deadline=90.0, max_attempts=20, initial_backoff=0.01, max_backoff=0.25)

#: a grace period and a "now" beyond it, for GC runs that must sweep what a crash left
GRACE = timedelta(hours=6)


def after_grace() -> datetime:
    return datetime.now(timezone.utc) + GRACE + timedelta(hours=1)


Payloads = dict[int, dict[str, bytes]]  # rank -> shard name -> bytes


def payloads(
    step: int,
    world_size: int,
    *,
    small: int = 3 * KiB,
    big: int = 0,
    big_ranks: tuple[int, ...] = (0,),
    salt: str = "",
) -> Payloads:
    """Deterministic shard contents of ``step``: every rank a small ``meta.bin`` and
    ``state.bin``; ranks in ``big_ranks`` also a ``big.bin`` of ``big`` bytes (multipart when
    ``big`` exceeds the store's part size). Distinct per (step, rank, name, salt), so a shard of
    another step -- or, with a ``salt``, of another attempt of the same step -- never compares
    equal."""
    out: Payloads = {}
    for rank in range(world_size):
        rng = random.Random(f"{step}/{rank}/{salt}")
        shards = {
            "meta.bin": f"step={step} rank={rank} salt={salt}\n".encode() + rng.randbytes(64),
            "state.bin": rng.randbytes(small),
        }
        if big and rank in big_ranks:
            shards["big.bin"] = rng.randbytes(big)
        out[rank] = shards
    return out


def write_rank(
    store: Store, step: int, attempt: str, rank: int, shards: Mapping[str, bytes], *, chunk: int = 1 * MiB
) -> list[Any]:
    """One rank's part of a save; big shards are fed as an iterable of chunks (streamed)."""
    writer = ShardWriter(store, step=step, attempt=attempt, rank=rank)
    for name in sorted(shards, key=lambda n: (n == "big.bin", n)):  # the big one last
        data = shards[name]
        if len(data) > chunk:
            writer.write(name, (data[i : i + chunk] for i in range(0, len(data), chunk)))
        else:
            writer.write(name, data)
    return writer.receipts


def save(
    store: Store,
    step: int,
    p: Payloads,
    *,
    attempt: str | None = None,
    threads: bool = True,
    coordinator: Coordinator | None = None,
) -> Manifest:
    """A whole save: every rank writes (one thread per rank), rank 0 commits.

    A rank's exception travels to the coordinator as its report, as in the torch layer, so a
    failing rank turns into a ``CommitError`` naming it rather than a hang.
    """
    attempt = attempt or new_attempt_id()
    world = len(p)
    reports: dict[int, Any] = {}

    def run(rank: int) -> None:
        try:
            reports[rank] = write_rank(store, step, attempt, rank, p[rank])
        except Exception as exc:  # noqa: BLE001 - reported to the coordinator
            reports[rank] = exc

    if threads and world > 1:
        ts = [threading.Thread(target=run, args=(r,), name=f"rank-{r}") for r in range(world)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    else:
        for r in range(world):
            run(r)
    coord = coordinator or Coordinator(store, world_size=world)
    return coord.commit(
        step, attempt, reports, progress={"global_step": step}, run={"config_hash": "reliability"}
    )


@dataclass
class Restored:
    manifest: Manifest
    shards: Payloads
    rejected: list[str] = field(default_factory=list)  # "step N: why" for each checkpoint skipped

    @property
    def step(self) -> int:
        return self.manifest.step


def restore(store: Store) -> Restored:
    """What a restarting job gets: the newest checkpoint that validates AND whose every shard
    downloads with the right size and CRC32C, falling back along ``Reader.candidates()``.

    A checkpoint is used whole or not at all: a shard failing verification rejects the whole
    step (logged with its reason) and the next candidate is tried.

    Raises:
        NoCheckpointError: nothing valid.
    """
    reader = Reader(store)
    rejected: list[str] = []
    for m in reader.candidates():
        try:
            shards: Payloads = {}
            for r in m.shards:
                shards.setdefault(r.rank, {})[r.name] = reader.read_shard(r)
        except (IntegrityError, StoreError) as exc:
            why = f"step {m.step}: {exc}"
            log.warning("rejecting checkpoint %s; falling back to its parent %s", why, m.parent)
            rejected.append(why)
            continue
        return Restored(m, shards, rejected)
    raise NoCheckpointError(f"no valid checkpoint in {store.location} (rejected: {rejected})")


def keys_under(store: Store, prefix: str) -> list[str]:
    return [m.key for m in store.list(prefix)]


def attempt_keys(store: Store, step: int, attempt: str) -> list[str]:
    """The attempt's keys in either layout (spread shard keys lie under several prefixes)."""
    return [k for k in keys_under(store, DATA_PREFIX) if (parse_shard_key(k) or ())[:2] == (step, attempt)]


# ---------------------------------------------------------------------------------- backends


@dataclass
class Leg:
    """One backend the matrix runs on: opens fresh, empty run roots (by URI, for subprocesses)."""

    name: str
    uri_for: Callable[[str], str]  # unique prefix -> run-root URI (options in the query)
    atomic_conditionals: bool = True
    #: smallest non-final multipart part the server accepts (LocalStack, like S3: 5 MiB)
    min_part_size: int = 64 * KiB
    extra: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def new_root(self, **options: Any) -> tuple[str, Store]:
        prefix = f"rel-{uuid.uuid4().hex[:10]}"
        uri = self.uri_for(prefix)
        if options:
            uri += ("&" if "?" in uri else "?") + urllib.parse.urlencode(options)
        return uri, open_store(uri, retry=FAST_RETRY)


def file_leg(root: str) -> Leg:
    os.makedirs(root, exist_ok=True)
    return Leg("file", lambda prefix: f"file://{root}/{prefix}")


def s3_leg(name: str, server: Any, bucket: str, *, min_part_size: int = 64 * KiB) -> Leg:
    """An S3 leg on a running ``MotoServer``/``LocalStackServer`` (bucket created here)."""
    from objckpt.testing.s3_servers import create_bucket

    create_bucket(server.endpoint_url, bucket)
    opts = dict(server.store_options)
    atomic = opts.get("conditional_writes", "atomic") == "atomic"
    return Leg(
        name,
        lambda prefix: server.uri(bucket, prefix),
        atomic_conditionals=atomic,
        min_part_size=min_part_size,
        extra={"server": server, "bucket": bucket},
    )


def localstack_unavailable() -> str | None:
    """Why LocalStack cannot run here, or None."""
    from objckpt.testing.s3_servers import LOCALSTACK_INSTALL_HINT, LocalStackServer

    if os.environ.get("OBJCKPT_SKIP_LOCALSTACK") == "1":
        return "OBJCKPT_SKIP_LOCALSTACK=1"
    if not LocalStackServer.available():
        return f"LocalStack is not installed (run: {LOCALSTACK_INSTALL_HINT})"
    return None


# ---------------------------------------------------------------------------------- report sections

_SECTION = "<!-- section:{name} (written by {script}; rerun it to update) -->"
_END = "<!-- /section:{name} -->"


def report_sections(text: str) -> dict[str, str]:
    """The generated sections of RELIABILITY.md (soak, leak), each with its markers, by name: what
    ``scripts/reliability.py`` keeps when it rewrites the rest of the file."""
    import re

    out = {}
    for m in re.finditer(r"<!-- section:([a-z0-9-]+) .*?-->.*?<!-- /section:\1 -->\n?", text, re.S):
        out[m.group(1)] = m.group(0)
    return out


def write_report_section(path: str, name: str, script: str, body: str) -> None:
    """Replace section ``name`` of the report at ``path`` with ``body`` (markdown), or append it."""
    import re

    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        text = "# objckpt reliability matrix\n\n"
    block = f"{_SECTION.format(name=name, script=script)}\n{body.rstrip()}\n{_END.format(name=name)}\n"
    pattern = re.compile(
        rf"<!-- section:{re.escape(name)} .*?-->.*?<!-- /section:{re.escape(name)} -->\n?", re.S
    )
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + block
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
