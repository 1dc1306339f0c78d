"""``dlq``: the dead-letter stream: what failed for good, with why and the
request's history; requeue it as a new request, or purge it."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, TypeVar

import click
import msgspec

from ..config import Config
from ..errors import ConfigError
from ._app import CONTEXT, cli, command, global_options, globals_of, setup
from ._audit import timeline
from ._common import (
    EXIT_OK,
    EXIT_SOME_FAILED,
    POSITIVE,
    NewDeadline,
    Output,
    PointInTime,
    close,
    guarded,
    reach,
)

_F = TypeVar("_F", bound=Callable[..., Any])


@cli.group(
    "dlq",
    context_settings=CONTEXT,
    short_help="The dead-letter stream: list, show, requeue, purge.",
    epilog="Example: renqueue dlq list --tenant acme --since 1h",
)
@global_options
def dlq() -> None:
    """What failed for good, with why and the request's history. Exit codes:
    0 done, 1 some entries failed, 2 cannot read."""


def _filters(*, limit: int | None) -> Callable[[_F], _F]:
    def add(f: _F) -> _F:
        for option in reversed(
            (
                click.option("--tenant", help="Only this tenant's."),
                click.option(
                    "--reason", help="Only those whose reason starts with this (its error type)."
                ),
                click.option("--stage", help="Only this stage's (requests, dispatch)."),
                click.option("--id", "request_id", help="Only this request's."),
                click.option(
                    "--since",
                    type=PointInTime(),
                    help="Stored at or after: a duration back from now (1h) or an ISO time.",
                ),
                click.option("--until", type=PointInTime(), help="Stored before (as --since)."),
                click.option(
                    "--limit",
                    type=POSITIVE,
                    default=limit,
                    show_default=limit is not None,
                    help="At most this many, the newest" + ("" if limit else " (default: all)."),
                ),
            )
        ):
            f = option(f)
        return f

    return add


def _run(ctx: click.Context, command_name: str, **options: Any) -> int:
    config = setup(ctx)
    options.setdefault("seq", ())
    args = SimpleNamespace(json=globals_of(ctx).json, dlq_command=command_name, **options)
    return asyncio.run(guarded("dlq", _dlq(config, args)))


@command(dlq, "list", short_help="Entries, newest last.", epilog="Example: renqueue dlq list")
@_filters(limit=100)
@click.pass_context
def list_(ctx: click.Context, /, **options: Any) -> int:
    """The entries that match the filters, newest last (--json: one per line)."""
    return _run(ctx, "list", **options)


@command(dlq, "show", short_help="Entries with headers, payload and history.",
         epilog="Example: renqueue dlq show 12")  # fmt: skip
@click.argument("seq", type=POSITIVE, nargs=-1, required=True)
@click.pass_context
def show(ctx: click.Context, /, **options: Any) -> int:
    """Each entry SEQ (a stream sequence): why, headers, payload, and the
    request's history as a timeline."""
    return _run(ctx, "show", **options)


@command(
    dlq,
    "requeue",
    short_help="Submit each again as a new request (<id>-dlq<seq>): idempotent.",
    epilog="Example: renqueue dlq requeue --reason rate_limited --deadline 10m",
)
@click.argument("seq", type=POSITIVE, nargs=-1)
@_filters(limit=None)
@click.option("--all", "all_", is_flag=True, help="Every entry.")
@click.option(
    "--deadline",
    type=NewDeadline(),
    default="keep",
    help="keep (the original's budget, counted from now), none, or a duration from now (60s).",
)
@click.pass_context
def requeue(ctx: click.Context, /, **options: Any) -> int:
    """Submit the entries (by SEQ, or every match of the filters) again as new
    requests, with a fresh attempt budget."""
    options["all"] = options.pop("all_")
    return _run(ctx, "requeue", **options)


@command(dlq, "purge", short_help="Delete entries (asks first).",
         epilog="Example: renqueue dlq purge 12 13 --yes")  # fmt: skip
@click.argument("seq", type=POSITIVE, nargs=-1)
@_filters(limit=None)
@click.option("--all", "all_", is_flag=True, help="Every entry.")
@click.option("--yes", is_flag=True, help="Do not ask.")
@click.pass_context
def purge(ctx: click.Context, /, **options: Any) -> int:
    """Delete the entries (by SEQ, or every match of the filters)."""
    options["all"] = options.pop("all_")
    return _run(ctx, "purge", **options)


async def _dlq(config: Config, args: Any) -> int:
    """``renqueue dlq list|show|requeue|purge`` (see :mod:`renqueue.broker._dlq`)."""
    from ..broker import DeadLetters

    where = _dlq_filter(args)
    if getattr(args, "seq", None) and not where.empty:
        raise ConfigError("give sequences or filters, not both", path="dlq arguments")
    out = Output(config)
    nc = await reach(config, "renqueue-dlq")
    try:
        dead = DeadLetters(nc.jetstream())
        if args.dlq_command == "list":
            return await _dlq_list(dead, where, args, out)
        if args.dlq_command == "show":
            return await _dlq_show(dead, args, out)
        if args.dlq_command == "requeue":
            return await _dlq_requeue(dead, config, where, args, out)
        return await _dlq_purge(dead, where, args, out)
    finally:
        await close(nc)


def _dlq_filter(args: Any) -> Any:
    from ..broker import DeadLetterFilter

    return DeadLetterFilter(
        tenant=getattr(args, "tenant", None),
        reason=getattr(args, "reason", None),
        stage=getattr(args, "stage", None),
        since=getattr(args, "since", None),
        until=getattr(args, "until", None),
        request_id=getattr(args, "request_id", None),
    )


async def _dlq_list(dead: Any, where: Any, args: Any, out: Output) -> int:
    from ..broker import entry_json, render_listing

    listing = await dead.find(where, limit=args.limit)
    if args.json:
        for entry in listing.entries:
            out.json(entry_json(entry))
        return EXIT_OK
    for line in render_listing(listing):
        out.line(line)
    return EXIT_OK


async def _dlq_show(dead: Any, args: Any, out: Output) -> int:
    from ..broker import DeadLetterError, entry_json, render_entry

    failed = False
    for index, seq in enumerate(args.seq):
        try:
            entry = await dead.get(seq)
        except DeadLetterError as exc:
            out.error(str(exc))
            failed = True
            continue
        entry = entry.with_mark(await dead.requeued_as(entry))
        history = await dead.history(entry)
        if args.json:
            out.json(entry_json(entry, history))
            continue
        if index:
            out.line("")
        for line in render_entry(entry, ()):
            if not line.startswith("history: no events"):
                out.line(line)
        if not history:
            out.line("history: no events logged for this request")
            continue
        out.line(f"history ({len(history)} events):")
        for line in timeline(history, header=False, offsets=False).splitlines():
            out.line(f"  {line.rstrip()}")
    return EXIT_SOME_FAILED if failed else EXIT_OK


async def _dlq_select(dead: Any, where: Any, args: Any, out: Output) -> tuple[list[Any], bool]:
    """The entries a requeue or purge acts on: by sequence, or every match of
    the filters (``--all``: every entry); whether some sequence named none."""
    from ..broker import DeadLetterError

    if args.seq:
        entries, failed = [], False
        for seq in dict.fromkeys(args.seq):
            try:
                entries.append(await dead.get(seq))
            except DeadLetterError as exc:
                out.error(str(exc))
                failed = True
        return entries, failed
    if where.empty and not args.all:
        raise ConfigError(
            "name the entries: sequences, a filter (--tenant, --reason, --stage, --since, "
            "--until, --id), or --all",
            path="dlq arguments",
        )
    return (await dead.find(where, limit=args.limit)).entries, False


async def _dlq_requeue(dead: Any, config: Config, where: Any, args: Any, out: Output) -> int:
    from ..broker import DeadLetterError
    from ..text import clock, printable

    entries, failed = await _dlq_select(dead, where, args, out)
    keep_budget, budget = args.deadline
    # Checked as admission will check it, when there is a config to check against.
    check = config if config.routes else None
    for entry in entries:
        try:
            done = await dead.requeue(entry, budget=budget, keep_budget=keep_budget, config=check)
        except DeadLetterError as exc:
            failed = True
            if args.json:
                out.json({"seq": entry.seq, "ok": False, "error": str(exc)})
            out.error(f"dead letter {entry.seq}: {exc}")
            continue
        if args.json:
            out.json({"seq": entry.seq, "ok": True, **msgspec.to_builtins(done)})
            continue
        deadline = "no deadline" if done.deadline is None else f"deadline {clock(done.deadline)}"
        verb = "already requeued" if done.already else "requeued"
        out.line(
            printable(
                f"dead letter {entry.seq}: {verb} as {done.new_id} "
                f"(tenant {done.tenant}, {deadline})"
            )
        )
    if not entries and not args.json:
        out.line("no dead letters match")
    return EXIT_SOME_FAILED if failed else EXIT_OK


async def _dlq_purge(dead: Any, where: Any, args: Any, out: Output) -> int:
    from ..broker import DeadLetterError

    entries, failed = await _dlq_select(dead, where, args, out)
    if not entries:
        if not args.json:
            out.line("no dead letters match; nothing purged")
        return EXIT_SOME_FAILED if failed else EXIT_OK
    if not args.yes:
        noun = "dead letter" if len(entries) == 1 else "dead letters"
        print(f"Purge {len(entries)} {noun}? [y/N] ", end="", file=sys.stderr, flush=True)
        answer = await asyncio.to_thread(sys.stdin.readline)
        if not sys.stdin.isatty():
            print(file=sys.stderr)  # the answer was not echoed: end the prompt's line
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing purged", file=sys.stderr)
            return EXIT_SOME_FAILED if failed else EXIT_OK
    purged = 0
    for entry in entries:
        try:
            await dead.purge(entry)
        except DeadLetterError as exc:
            failed = True
            out.error(str(exc))
            continue
        purged += 1
        if args.json:
            out.json({"seq": entry.seq, "purged": True})
    if not args.json:
        out.line(f"purged {purged} dead letter{'' if purged == 1 else 's'}")
    return EXIT_SOME_FAILED if failed else EXIT_OK
