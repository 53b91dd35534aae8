"""The one walker of nested containers (pure: no I/O, no torch).

State dicts nest ``dict`` / ``OrderedDict`` / ``list`` / ``tuple`` (and namedtuples) around
leaves (tensors, arrays, numbers). Everything that walks a state -- splitting replicated tensors
across ranks, digesting their layout, staging copies for asynchronous saves, moving a loaded
checkpoint to a device -- walks it here, so every walk agrees on what a container is:

* ``dict`` and its subclasses are containers; a plain ``dict`` is rebuilt as a ``dict``, a
  subclass as a shallow copy of the same type (an ``OrderedDict`` stays one). The ``_metadata``
  attribute ``nn.Module.state_dict()`` attaches (version info) is carried over, walked too.
* ``list`` and ``tuple`` are containers; a **namedtuple is rebuilt as the same namedtuple type**.
  (The pickle-free shard format stores every tuple as a plain tuple, so a namedtuple restored
  from a checkpoint comes back as a tuple: see ``objckpt.training.serialization``.)
* everything else is a leaf.

Leaves are visited depth-first in insertion order, the same order by :func:`map_tree` and
:func:`leaves`, so an index assigned while walking one is valid for the other.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["SCALARS", "is_namedtuple", "leaves", "map_tree"]


def is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def _metadata(obj: Any) -> dict[str, Any] | None:
    meta = getattr(obj, "_metadata", None)
    return meta if isinstance(meta, dict) else None


#: leaf types walked without a recursive call per element (a Python RNG state is a tuple of
#: 625 ints: its elements cost a call and a generator each otherwise, most of a small
#: ``save_async``'s fixed time); exact types only, so a subclass still takes the general path
SCALARS = frozenset({int, float, bool, str, bytes, type(None)})


def map_tree(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """``obj`` with every container rebuilt and every leaf replaced by ``leaf(value)``.

    Nothing in the result aliases a container of ``obj`` (the live state may mutate its lists
    and dicts while a rebuilt copy is being uploaded).
    """
    if isinstance(obj, dict):
        items = [(k, map_tree(v, leaf)) for k, v in obj.items()]
        meta = _metadata(obj)
        out: dict[Any, Any]
        if type(obj) is dict:
            out = OrderedDict(items) if meta is not None else dict(items)
        else:
            out = copy.copy(obj)
            out.clear()
            out.update(items)
        if meta is not None:
            out._metadata = map_tree(meta, leaf)  # type: ignore[attr-defined]
        return out
    if isinstance(obj, list):
        return [leaf(v) if type(v) in SCALARS else map_tree(v, leaf) for v in obj]
    if isinstance(obj, tuple):
        values = [leaf(v) if type(v) in SCALARS else map_tree(v, leaf) for v in obj]
        return type(obj)(*values) if is_namedtuple(obj) else tuple(values)
    return leaf(obj)


def leaves(obj: Any) -> Iterator[Any]:
    """Every leaf of ``obj``, depth-first, in the order :func:`map_tree` visits them."""
    if isinstance(obj, dict):
        for v in obj.values():
            yield from leaves(v)
        meta = _metadata(obj)
        if meta is not None:
            yield from leaves(meta)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            if type(v) in SCALARS:
                yield v
            else:
                yield from leaves(v)
    else:
        yield obj
