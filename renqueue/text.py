"""Text for a terminal: escaped, shortened, times as people read them. Pure.

``renqueue status``, ``audit``, ``dlq`` and ``ab`` print what tenants wrote
(ids, reasons, payloads): each string goes through :func:`printable` first,
so no escape sequence or bidirectional control reaches the terminal.
"""

from __future__ import annotations

import datetime
import math

__all__ = ["clock", "printable", "shorten"]


def printable(text: str) -> str:
    """``text`` with every non-printable character escaped as Python writes it
    (``\\x1b``, ``\\u202e``): safe to print to a terminal, on one line."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else _escaped(char) for char in text)


def _escaped(char: str) -> str:
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def shorten(text: str, limit: int) -> str:
    """``text``, cut to ``limit`` characters with ``...`` if it is longer."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def clock(at: float) -> str:
    """``at`` (Unix seconds) as an ISO 8601 time to the second in the local time
    zone, with its offset (``2026-12-07T05:31:07+01:00``); ``-`` for NaN, ``far
    future`` (``far past``) beyond a calendar's years."""
    if math.isnan(at):
        return "-"
    try:
        moment = datetime.datetime.fromtimestamp(at, tz=datetime.UTC).astimezone()
        return moment.isoformat(timespec="seconds")
    except (OverflowError, ValueError, OSError):
        return "far future" if at > 0 else "far past"
