"""``ab``: A/B splits: each arm's figures; an operator's move of a split's traffic."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

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


def _run(ctx: click.Context, command_name: str, **options: Any) -> None:
    config = setup(ctx)
    args = SimpleNamespace(json=globals_of(ctx).json, ab_command=command_name, **options)
    asyncio.run(guarded("ab", _ab(config, args)))


@command(ab, "status", short_help="Each split's state and per-arm figures.",
         epilog="Example: renqueue ab status chat-small")  # fmt: skip
@click.argument("route", required=False)
@click.pass_context
def status(ctx: click.Context, route: str | None) -> None:
    """Each split (or ROUTE's): its state and each arm's figures."""
    _run(ctx, "status", route=route)


@command(ab, "promote", short_help="Send all of a split's traffic to one arm.",
         epilog="Example: renqueue ab promote chat-small candidate")  # fmt: skip
@click.argument("route")
@click.argument("arm")
@_who
@click.pass_context
def promote(ctx: click.Context, /, **options: Any) -> None:
    """Send all of ROUTE's traffic to ARM."""
    _run(ctx, "promote", **options)


@command(ab, "rollback", short_help="Send all of a split's traffic to its control.",
         epilog="Example: renqueue ab rollback chat-small")  # fmt: skip
@click.argument("route")
@_who
@click.pass_context
def rollback(ctx: click.Context, /, **options: Any) -> None:
    """Send all of ROUTE's traffic to its control arm."""
    _run(ctx, "rollback", **options)


@command(ab, "resume", short_help="Split a rolled-back or promoted split by weight again.",
         epilog="Example: renqueue ab resume chat-small")  # fmt: skip
@click.argument("route")
@_who
@click.pass_context
def resume(ctx: click.Context, /, **options: Any) -> None:
    """Split ROUTE's traffic by its arms' weights again."""
    _run(ctx, "resume", **options)


async def _ab(config: Config, args: Any) -> None:
    """``renqueue ab status|promote|rollback|resume`` (see :mod:`renqueue.coordination`)."""
    from ..coordination import move_split, planned_move, read_splits, render_splits

    if args.ab_command != "status":  # a move the config cannot make fails before connecting
        planned_move(config, args.route, args.ab_command, getattr(args, "arm", None))
    nc = await reach(config, "renqueue-ab")
    try:
        js = nc.jetstream()
        if args.ab_command == "status":
            reports = await read_splits(js, config, args.route)
            if args.json:
                print(msgspec.json.encode(reports).decode())
            else:
                print("\n".join(render_splits(reports)))
            return
        event, shown = await move_split(
            js,
            config,
            args.route,
            args.ab_command,
            arm=getattr(args, "arm", None),
            operator=args.by or _operator(),
            reason=args.reason,
        )
    finally:
        await close(nc)
    from ..text import printable

    route = printable(args.route)
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
