"""The one tree walker (``objckpt.tree``): ``map_tree`` and ``leaves`` agree on every leaf and its
order, call ``leaf`` once per leaf (scalar leaves too, which take a shortcut without recursion),
rebuild every container without aliasing it, and keep namedtuple and dict subclass types."""

from __future__ import annotations

import random
from collections import OrderedDict, namedtuple

from hypothesis import given
from hypothesis import strategies as st

from objckpt.tree import SCALARS, leaves, map_tree

Pair = namedtuple("Pair", "a b")


class Opaque:
    """A leaf that is not a scalar (as a tensor is): walked through the general path."""

    def __init__(self, n: int) -> None:
        self.n = n


class Flag(int):
    """An ``int`` subclass: not an exact scalar type, so it takes the general path."""


_leaf = st.one_of(
    st.integers(),
    st.floats(allow_nan=False),
    st.booleans(),
    st.text(max_size=3),
    st.binary(max_size=3),
    st.none(),
    st.integers(0, 9).map(Opaque),
    st.integers(0, 9).map(Flag),
)
_trees = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.tuples(inner, inner).map(lambda t: Pair(*t)),
        st.dictionaries(st.text(max_size=2), inner, max_size=3),
        st.dictionaries(st.text(max_size=2), inner, max_size=3).map(OrderedDict),
    ),
    max_leaves=20,
)


def _containers(obj: object) -> list[object]:
    if isinstance(obj, dict):
        return [obj, *(c for v in obj.values() for c in _containers(v))]
    if isinstance(obj, (list, tuple)):
        return [obj, *(c for v in obj for c in _containers(v))]
    return []


class Mapped:
    """What the test's ``leaf`` returns: a leaf again (not a container), numbered by call."""

    def __init__(self, i: int) -> None:
        self.i = i


@given(_trees)
def test_map_tree_calls_leaf_once_per_leaf_in_the_order_leaves_yields_them(tree: object) -> None:
    seen: list[object] = []

    def leaf(value: object) -> object:
        seen.append(value)
        return Mapped(len(seen) - 1)

    out = map_tree(tree, leaf)
    expected = list(leaves(tree))
    assert len(seen) == len(expected)
    assert all(a is b for a, b in zip(seen, expected, strict=True))
    # every leaf of the result is what leaf() returned for it, in the same place of the order
    assert [m.i for m in leaves(out)] == list(range(len(expected)))


@given(_trees)
def test_map_tree_rebuilds_every_mutable_container_and_keeps_every_type(tree: object) -> None:
    out = map_tree(tree, lambda v: v)
    before, after = _containers(tree), _containers(out)
    assert [type(c) for c in before] == [type(c) for c in after]
    mutable_after = {id(c) for c in after if isinstance(c, (dict, list))}
    assert mutable_after.isdisjoint(id(c) for c in before)


def test_a_python_rng_state_is_walked_leaf_by_leaf() -> None:
    """``random.getstate()`` (a tuple of 625 ints), the case the scalar shortcut is for: every
    int is still given to ``leaf``, and an int subclass still is, through the general path."""
    state = random.getstate()
    calls: list[object] = []
    out = map_tree({"python": state, "flag": [Flag(3)]}, lambda v: calls.append(v) or v)
    assert len(calls) == 2 + len(state[1]) + 1 == len(list(leaves({"python": state, "flag": [Flag(3)]})))
    assert out["python"] == state and type(out["flag"][0]) is Flag
    assert int in SCALARS and Flag not in SCALARS
