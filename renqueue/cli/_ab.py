"""``ab``: A/B splits: each arm's figures; an operator's move of a split's traffic."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Literal

import click
import msgspec

from ..config import Config
from ._app import CONTEXT, cli, command, global_options, globals_of, setup
from ._common import close, guarded, reach


@cli.group(
    "ab",
    context_settings=CONTEXT,
    short_help="A/B splits: status, promote, rollback, resume.",
    epilog="Example: renqueue ab promote chat-small candidate --reason 'cheaper, as good'",
)
@global_options
def ab() -> None:
    """A route's A/B split ([routes.<name>.ab]): each arm's figures, and an
    operator's move of its traffic, logged as an ab event every router follows.
    Exit codes: 0 done (also when the split is already there), 2 an error."""


def _who(f: Any) -> Any:
    f = click.option("--by", help="Who (default: $USER@host).")(f)
    return click.option("--reason", default="", help="Why (kept in the event).")(f)


def _json(ctx: click.Context) -> bool:
    return globals_of(ctx).json


@command(ab, "status", short_help="Each split's state and per-arm figures.",
         epilog="Example: renqueue ab status chat-small")  # fmt: skip
@click.argument("route", required=False)
@click.pass_context
def status(ctx: click.Context, route: str | None) -> None:
    """Each split (or ROUTE's): its state and each arm's figures."""
    config = setup(ctx)
    asyncio.run(guarded("ab", _status(config, route, as_json=_json(ctx))))


@command(ab, "promote", short_help="Send all of a split's traffic to one arm.",
         epilog="Example: renqueue ab promote chat-small candidate")  # fmt: skip
@click.argument("route")
@click.argument("arm")
@_who
@click.pass_context
def promote(ctx: click.Context, route: str, arm: str, by: str | None, reason: str) -> None:
    """Send all of ROUTE's traffic to ARM."""
    _move(ctx, _Move(route=route, action="promote", arm=arm, by=by, reason=reason))


@command(ab, "rollback", short_help="Send all of a split's traffic to its control.",
         epilog="Example: renqueue ab rollback chat-small")  # fmt: skip
@click.argument("route")
@_who
@click.pass_context
def rollback(ctx: click.Context, route: str, by: str | None, reason: str) -> None:
    """Send all of ROUTE's traffic to its control arm."""
    _move(ctx, _Move(route=route, action="rollback", arm=None, by=by, reason=reason))


@command(ab, "resume", short_help="Split a rolled-back or promoted split by weight again.",
         epilog="Example: renqueue ab resume chat-small")  # fmt: skip
@click.argument("route")
@_who
@click.pass_context
def resume(ctx: click.Context, route: str, by: str | None, reason: str) -> None:
    """Split ROUTE's traffic by its arms' weights again."""
    _move(ctx, _Move(route=route, action="resume", arm=None, by=by, reason=reason))


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Move:
    """An operator's move of a split's traffic, as asked on the command line."""

    route: str
    action: Literal["promote", "rollback", "resume"]
    arm: str | None
    by: str | None
    reason: str


async def _status(config: Config, route: str | None, *, as_json: bool) -> None:
    """``renqueue ab status`` (see :mod:`renqueue.coordination`)."""
    from ..coordination import read_splits, render_splits

    nc = await reach(config, "renqueue-ab")
    try:
        reports = await read_splits(nc.jetstream(), config, route)
    finally:
        await close(nc)
    if as_json:
        print(msgspec.json.encode(reports).decode())
    else:
        print("\n".join(render_splits(reports)))


def _move(ctx: click.Context, move: _Move) -> None:
    from ..coordination import planned_move

    config = setup(ctx)
    # A move the config cannot make fails before connecting.
    planned_move(config, move.route, move.action, move.arm)
    asyncio.run(guarded("ab", _moved(config, move)))


async def _moved(config: Config, move: _Move) -> None:
    """``renqueue ab promote|rollback|resume`` (see :mod:`renqueue.coordination`)."""
    from ..coordination import move_split
    from ..text import printable

    nc = await reach(config, "renqueue-ab")
    try:
        event, shown = await move_split(
            nc.jetstream(),
            config,
            move.route,
            move.action,
            arm=move.arm,
            operator=move.by or _operator(),
            reason=move.reason,
        )
    finally:
        await close(nc)
    route = printable(move.route)
    if event is None:
        where = "live" if shown is None or shown.state == "live" else shown.state
        arm = "" if shown is None or not shown.arm else f" ({printable(shown.arm)})"
        print(f"A/B split {route} is {where}{arm} already: nothing logged")
        return
    done = {"live": "resumed", "rolled_back": "rolled back", "promoted": "promoted"}[event.state]
    to = f" to {printable(event.arm)}" if event.arm else ""
    print(f"A/B split {route} {done}{to} (logged as an ab event, by {printable(event.operator)})")
    if shown is None:
        print(
            "the projection has not shown it yet (is a projector running?): routers follow it "
            "once it does"
        )


def _operator() -> str:
    """Who runs the command: ``$USER@host`` (for the ``ab`` event's ``operator``)."""
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"[:200]
