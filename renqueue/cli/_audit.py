"""``audit``: one request's timeline from the event log, as a table."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

import click
import msgspec

from ..config import Config
from ._app import cli, command, globals_of, setup
from ._common import (
    NoSuchRequest,
    RequestIdName,
    TenantName,
    close,
    console,
    fitted,
    local_time,
    reach,
    rounded,
    table,
    text,
)

if TYPE_CHECKING:
    from ..schema import Event

#: Fields every event has, shown in their own columns or not at all.
_COMMON = ("v", "kind", "request_id", "tenant", "at")


@command(
    cli,
    "audit",
    short_help="One request's timeline from the event log.",
    epilog="Example: renqueue audit req-42 --tenant acme",
)
@click.argument("request_id", type=RequestIdName())
@click.option("--tenant", type=TenantName(), help="Tenant the request is for (default: any).")
@click.pass_context
def audit(ctx: click.Context, request_id: str, tenant: str | None) -> None:
    """Every event of REQUEST_ID, in log order: when (local time), what, and
    its details; --json prints one event per line, as logged."""
    config = setup(ctx)
    asyncio.run(_audit(config, request_id, tenant, as_json=globals_of(ctx).json))


async def _audit(config: Config, request_id: str, tenant: str | None, *, as_json: bool) -> None:
    from ..broker import EventLog

    nc = await reach(config, "renqueue-audit")
    try:
        events = await EventLog(nc.jetstream()).history(tenant or "*", request_id)
    finally:
        await close(nc)
    if not events:
        whose = "any tenant" if tenant is None else f"tenant {tenant!r}"
        raise NoSuchRequest(
            f"no request {request_id} is known for {whose}: no event names it",
            request_id=request_id,
            tenant=tenant,
        )
    if as_json:
        for event in events:
            print(json.dumps(msgspec.to_builtins(event)))
        return
    first = local_time(events[0].at, date=True)
    print(f"request {request_id}, first event {first}")
    print(timeline(events, header=True))


def timeline(
    events: Sequence[Event], *, header: bool, offsets: bool = True, indent: int = 0
) -> str:
    """Events as a table that fits the terminal (less ``indent``): local time,
    seconds since the first, the event, and its details, which wrap: never
    cut (a hostile field is shortened past 2,000 characters; ``--json`` has all)."""
    from rich.table import Column

    first = events[0].at
    rows = []
    for event in events:
        data = msgspec.to_builtins(event)
        kind = data["kind"]
        since = [f"{event.at - first:.3f}"] if offsets else []
        rows.append([local_time(event.at), *since, kind, details(kind, data)])
    titles = ["time", *(["+s"] if offsets else []), "event", "details"]
    out = console()
    numeric = [title == "+s" for title in titles]
    widths = fitted(titles, rows, numeric, out.width - indent, keep=[True] * (len(titles) - 1))
    if widths[-1] < _NARROWEST_DETAILS:
        return _stacked(titles, rows, numeric, widths, header=header, width=out.width - indent)
    grid = table(
        *(
            Column(title, justify="right" if right else "left", overflow="fold", width=width)
            for title, right, width in zip(titles, numeric, widths, strict=True)
        )
    )
    grid.show_header = header
    for row in rows:
        grid.add_row(*(text(cell) for cell in row))
    with out.capture() as captured:
        out.print(grid, width=out.width - indent)
    return "\n".join(line.rstrip() for line in captured.get().splitlines())


#: The narrowest details column worth a table: below it (a terminal 40 columns
#: wide), each event's details go under it, the terminal's whole width.
_NARROWEST_DETAILS: Final = 30


def _stacked(
    titles: Sequence[str],
    rows: Sequence[Sequence[str]],
    numeric: Sequence[bool],
    widths: Sequence[int],
    *,
    header: bool,
    width: int,
) -> str:
    """The timeline for a narrow terminal: each event's time, offset and kind
    on a line, its details wrapped under it (no word cut), two spaces in."""
    import textwrap

    def line(cells: Sequence[str]) -> str:
        return " ".join(
            cell.rjust(w) if right else cell.ljust(w)
            for cell, right, w in zip(cells, numeric, widths, strict=False)
        ).rstrip()

    lines = [line(titles[:-1])] if header else []
    for row in rows:
        lines.append(line(row[:-1]))
        lines += textwrap.wrap(
            row[-1],
            width=max(width, 12),
            initial_indent="  ",
            subsequent_indent="  ",
            break_on_hyphens=False,
        )
    return "\n".join(lines)


def details(kind: str, data: dict[str, Any]) -> str:
    """An event's fields for a person: rounded, no Python reprs, long text shortened."""
    from ..schema import parse_traceparent
    from ..text import shorten

    data = {k: v for k, v in data.items() if k not in _COMMON}
    if kind == "submitted":
        request = data.pop("request")
        trace = parse_traceparent(data.get("traceparent"))
        data = {
            "route": request["route"],
            "priority": request["priority"],
            "messages": len(request["messages"]),
            "trace": None if trace is None else trace.trace_id,
        }
    if kind == "completed" and isinstance(data.get("text"), str):
        data["text"] = shorten(data["text"], 60)
    return "  ".join(
        f"{key}={rounded(value, limit=2000)}"
        for key, value in data.items()
        # Attempts count from 1: 0 is an end that named no run (a router's).
        if value not in (None, "", [], {}) and not (key == "attempt" and value == 0)
    )
