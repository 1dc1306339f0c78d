"""``status``: each backend, priority level and tenant now."""

from __future__ import annotations

import asyncio
import datetime
import json
import sys
from typing import TYPE_CHECKING, Any

import click
import msgspec

from ..config import Config
from ..errors import NatsClosedError
from ._app import cli, command, globals_of, setup
from ._common import (
    EXIT_INTERRUPTED,
    INTERVAL,
    MIN_INTERVAL,
    close,
    console,
    emit,
    fitted,
    guarded,
    indented,
    one_line,
    reach,
    table,
    text,
)

if TYPE_CHECKING:
    from ..coordination import StatusReport


@command(
    cli,
    "status",
    short_help="Each backend, priority level and tenant now: health, quota, queues.",
    epilog="Example: renqueue status --watch --interval 1",
)
@click.option("--watch", is_flag=True, help="Redraw until Ctrl-C.")
@click.option(
    "--interval",
    type=INTERVAL,
    default=2.0,
    help=f"Seconds between redraws (at least {MIN_INTERVAL:g}).",
)
@click.pass_context
def status(ctx: click.Context, watch: bool, interval: float) -> None:
    """Each backend (health, load, quota), priority level (waiting, oldest)
    and tenant (spend) now, once or (--watch) redrawn; --json prints the
    report as one JSON document (one per line with --watch)."""
    config = setup(ctx)
    run = _status(config, watch=watch, interval=interval, as_json=globals_of(ctx).json)
    try:
        asyncio.run(guarded("status", run))
    except KeyboardInterrupt:
        if not watch:
            raise
        # Ctrl-C is how a watch ends: 130 as for any Ctrl-C, without a word.
        raise click.exceptions.Exit(EXIT_INTERRUPTED) from None


async def _status(config: Config, *, watch: bool, interval: float, as_json: bool) -> None:
    """Print the status once, or (``watch``) every ``interval`` seconds until Ctrl-C.

    A watch rides out what NATS fails to answer for a while (the server
    restarting, a timeout): it shows the error in place of that redraw and
    tries again at the next; only a connection closed for good ends it.
    """
    from ..coordination import read_status

    nc = await reach(config, "renqueue-status")
    try:
        js = nc.jetstream()
        clear = watch and not as_json and sys.stdout.isatty()
        while True:
            try:
                report = await read_status(js, config)
            except NatsClosedError:
                raise
            except Exception as exc:
                if not watch or nc.is_closed:
                    raise
                _show_error(exc, interval, as_json=as_json, clear=clear)
            else:
                _show(report, as_json=as_json, clear=clear)
            if not watch:
                return
            if not clear and not as_json:
                print()
            sys.stdout.flush()
            await asyncio.sleep(interval)
    finally:
        await close(nc)


def _show(report: StatusReport, *, as_json: bool, clear: bool) -> None:
    if as_json:
        print(msgspec.json.encode(report).decode())
        return
    if clear:
        print("\x1b[H\x1b[2J", end="")  # cursor home, clear the screen
    emit(*status_tables(report, console().width))


def status_tables(report: StatusReport, width: int) -> list[Any]:
    """The status as Rich renderables ``width`` columns wide at most: its
    heading, then each section (a heading line and an indented table whose
    text columns wrap; names and numbers keep their line)."""
    from rich.table import Column

    from ..coordination import NEAR_LIMIT, status_heading, status_sections

    first, *rest = status_heading(report)
    shown: list[Any] = [text(first), *(indented(text(line.strip())) for line in rest)]
    for section in status_sections(report):
        title = text(section.title)
        if section.title == NEAR_LIMIT:
            title.stylize("yellow")  # a store near its limit stands out
        shown += [text(""), title]
        if not section.columns:
            grid = table(Column(no_wrap=True), Column(overflow="fold"))
            grid.show_header = False
            for name, what in section.rows:
                grid.add_row(text(f"{name}:"), text(what))
            shown.append(indented(grid))
            continue
        if not section.rows:
            shown.append(text("  none yet"))
            continue
        widths = fitted(section.columns, section.rows, section.numeric, width - 2)
        if sum(widths) + len(widths) - 1 > width - 2:
            # Too narrow for the table: Rich would fold its names and numbers
            # a character a line (slots 32 read as 3 over 2). Each row as a
            # record instead: its name, then each column's title and value.
            grid = table(Column(no_wrap=True), Column(overflow="fold"))
            grid.show_header = False
            for name, *cells in section.rows:
                pairs = zip(section.columns[1:], cells, strict=True)
                grid.add_row(text(f"{name}:"), text("; ".join(f"{t} {c}" for t, c in pairs)))
            shown.append(indented(grid))
            continue
        columns = [
            Column(title, justify="right" if right else "left", overflow="fold", width=w)
            for title, right, w in zip(section.columns, section.numeric, widths, strict=True)
        ]
        grid = table(*columns)
        for row in section.rows:
            grid.add_row(*(text(cell) for cell in row))
        shown.append(indented(grid))
    return shown


def _show_error(exc: Exception, interval: float, *, as_json: bool, clear: bool) -> None:
    """A watch's redraw that could not read the status: one line (JSON: ``{"at", "error"}``)."""
    from ..text import printable

    now = datetime.datetime.now(tz=datetime.UTC)
    message = printable(one_line(exc))
    if as_json:
        print(json.dumps({"at": now.timestamp(), "error": message}))
        return
    if clear:
        print("\x1b[H\x1b[2J", end="")
    print(
        f"Ren-Queue status at {now.isoformat(timespec='seconds')}: cannot read it: {message}"
        f" (trying again every {interval:g} s; Ctrl-C to stop)"
    )
