"""The names and layouts of CheckpointManager's shards (see :mod:`.shards`), shared by the write
side (:mod:`._state_write`) and the restore, export and dedup paths that find them again."""

from __future__ import annotations

import re

from ..manifest import Manifest, ShardReceipt

__all__ = [
    "RANK_SHARD",
    "REPLICATED_SHARD",
    "STATE_LAYOUT",
    "STATE_LAYOUTS",
    "replicated_piece",
    "replicated_receipts",
]

#: the layout every save writes: a rank's replicated share may be spread over several shards
STATE_LAYOUT = "objckpt.training/2"
#: the layouts a restore reads (``/1``: one ``replicated.bin`` per rank)
STATE_LAYOUTS = ("objckpt.training/1", STATE_LAYOUT)
REPLICATED_SHARD = "replicated.bin"
RANK_SHARD = "rank.bin"
_REPLICATED_PIECE = re.compile(r"replicated(?:\.([1-9][0-9]*))?\.bin\Z")


def replicated_piece(name: str) -> int | None:
    """The number of a replicated shard's piece (0 for ``replicated.bin``, ``k`` for
    ``replicated.<k>.bin``); None for any other shard."""
    m = _REPLICATED_PIECE.match(name)
    return None if m is None else int(m.group(1) or 0)


def replicated_receipts(manifest: Manifest) -> list[ShardReceipt]:
    """Every rank's replicated shards in ``manifest``, by rank then piece (rank 0's first piece,
    which holds the structure, first)."""
    numbered = [(s.rank, replicated_piece(s.name), s) for s in manifest.shards]
    pieces = [(rank, number, s) for rank, number, s in numbered if number is not None]
    return [s for _, _, s in sorted(pieces, key=lambda p: p[:2])]
