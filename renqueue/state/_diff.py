"""Differences between two projections, field by field.

:func:`diff_states` compares a live projection (the checkpoint in KV) with one
rebuilt from the log (:func:`~renqueue.coordination.rebuild`): design property 4 says
they are equal at the same sequence, so every :class:`Difference` is a fact
the fold did not produce, or an event the replay could not see. Each names a
leaf by its dotted path, the way an operator would look it up in the JSON
(``backends.groq.quota.spend.slots[3].tokens``), with both values; a key or
list item only one side has is one difference holding that side's whole
value. :func:`diff_values` compares any two values the same way (a backend's
view against the rebuilt backend, say). Pure functions, no I/O.
"""

from __future__ import annotations

import re
from typing import Any, Final

import msgspec
from msgspec import UNSET, Struct, UnsetType

from ._fold import ProjectionState

__all__ = ["Difference", "diff_states", "diff_values"]

#: Keys written bare in a path; any other key is quoted (``tenants["a.b"]``).
_BARE_KEY: Final = re.compile(r"[A-Za-z0-9_:\-]+")
#: What a mapping or sequence holds at a key or index it does not have.
_ABSENT: Final = object()


class Difference(Struct, frozen=True, kw_only=True):
    """One leaf (or a whole key or item one side lacks) that differs.

    ``live`` or ``rebuilt`` is :data:`msgspec.UNSET` (left out of the JSON)
    when that side has no such key or item. Values are plain JSON-able data
    (:func:`msgspec.to_builtins`).
    """

    path: str
    live: Any | UnsetType = UNSET
    rebuilt: Any | UnsetType = UNSET


def diff_states(live: ProjectionState, rebuilt: ProjectionState) -> list[Difference]:
    """Every difference between two projections, in field order (keys sorted)."""
    return diff_values(live, rebuilt)


def diff_values(live: object, rebuilt: object, path: str = "") -> list[Difference]:
    """Every difference between two values (structs compared field by field,
    mappings by key, sequences by index), each named under ``path``."""
    found: list[Difference] = []
    _walk(live, rebuilt, path, found)
    return found


def _key(path: str, key: object) -> str:
    text = str(key)
    if _BARE_KEY.fullmatch(text):
        return f"{path}.{text}" if path else text
    return f"{path}[{msgspec.json.encode(text).decode()}]"


def _walk(live: object, rebuilt: object, path: str, found: list[Difference]) -> None:
    if isinstance(live, Struct) and type(live) is type(rebuilt):
        for name in live.__struct_fields__:
            _walk(getattr(live, name), getattr(rebuilt, name), _key(path, name), found)
    elif isinstance(live, dict) and isinstance(rebuilt, dict):
        for key in sorted(live.keys() | rebuilt.keys(), key=str):
            _item(live.get(key, _ABSENT), rebuilt.get(key, _ABSENT), _key(path, key), found)
    elif isinstance(live, list | tuple) and isinstance(rebuilt, list | tuple):
        for index in range(max(len(live), len(rebuilt))):
            _item(
                live[index] if index < len(live) else _ABSENT,
                rebuilt[index] if index < len(rebuilt) else _ABSENT,
                f"{path}[{index}]",
                found,
            )
    elif type(live) is not type(rebuilt) or live != rebuilt:
        # Different types (a struct against None, 1 against 1.0) differ too:
        # the two sides must be the same JSON.
        found.append(Difference(path=path, live=_plain(live), rebuilt=_plain(rebuilt)))


def _item(live: object, rebuilt: object, path: str, found: list[Difference]) -> None:
    """An item of a mapping or a sequence, which one side may lack (``_ABSENT``)."""
    if rebuilt is _ABSENT:
        found.append(Difference(path=path, live=_plain(live)))
    elif live is _ABSENT:
        found.append(Difference(path=path, rebuilt=_plain(rebuilt)))
    else:
        _walk(live, rebuilt, path, found)


def _plain(value: object) -> Any:
    return msgspec.to_builtins(value)
