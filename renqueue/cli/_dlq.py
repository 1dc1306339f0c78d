"""``dlq``: the dead-letter stream: what failed for good, with why and the
request's history; requeue it as a new request, or purge it."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

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
    console,
    emit,
    fitted,
    guarded,
    local_time,
    reach,
    table,
    text,
)

if TYPE_CHECKING:
    from ..broker import DeadLetterFilter, DeadLetters

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Where:
    """The filters every ``dlq`` command but ``show`` takes."""

    tenant: str | None = None
    reason: str | None = None
    stage: str | None = None
    request_id: str | None = None
    since: float | None = None
    until: float | None = None

    def filter(self) -> DeadLetterFilter:
        from ..broker import DeadLetterFilter

        return DeadLetterFilter(
            tenant=self.tenant,
            reason=self.reason,
            stage=self.stage,
            since=self.since,
            until=self.until,
            request_id=self.request_id,
        )


def _run(ctx: click.Context, run: Callable[[Config, DeadLetters, Output], Awaitable[int]]) -> int:
    """Connect, run one ``dlq`` command's body on the dead letters, close."""
    config = setup(ctx)

    async def body() -> int:
        from ..broker import DeadLetters

        nc = await reach(config, "renqueue-dlq")
        try:
            return await run(config, DeadLetters(nc.jetstream()), Output(config))
        finally:
            await close(nc)

    return asyncio.run(guarded("dlq", body()))


@command(dlq, "list", short_help="Entries, newest last.", epilog="Example: renqueue dlq list")
@_filters(limit=100)
@click.pass_context
def list_(ctx: click.Context, /, limit: int, **where: Any) -> int:
    """The entries that match the filters, newest last: a table whose reasons
    wrap, never cut (--json: one per line)."""
    as_json = globals_of(ctx).json
    found = Where(**where).filter()
    return _run(ctx, lambda _c, dead, out: _dlq_list(dead, found, limit, out, as_json=as_json))


@command(dlq, "show", short_help="Entries with headers, payload and history.",
         epilog="Example: renqueue dlq show 12")  # fmt: skip
@click.argument("seq", type=POSITIVE, nargs=-1, required=True)
@click.pass_context
def show(ctx: click.Context, seq: tuple[int, ...]) -> int:
    """Each entry SEQ (a stream sequence): why, headers, payload, and the
    request's history as a timeline."""
    as_json = globals_of(ctx).json
    return _run(ctx, lambda _c, dead, out: _dlq_show(dead, seq, out, as_json=as_json))


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
def requeue(
    ctx: click.Context,
    /,
    seq: tuple[int, ...],
    limit: int | None,
    all_: bool,
    deadline: tuple[bool, float | None],
    **where: Any,
) -> int:
    """Submit the entries (by SEQ, or every match of the filters) again as new
    requests, with a fresh attempt budget."""
    as_json = globals_of(ctx).json
    pick = _Pick(seq=seq, where=_checked(seq, Where(**where)), limit=limit, all=all_)
    return _run(
        ctx,
        lambda config, dead, out: _dlq_requeue(dead, config, pick, deadline, out, as_json=as_json),
    )


@command(dlq, "purge", short_help="Delete entries (asks first).",
         epilog="Example: renqueue dlq purge 12 13 --yes")  # fmt: skip
@click.argument("seq", type=POSITIVE, nargs=-1)
@_filters(limit=None)
@click.option("--all", "all_", is_flag=True, help="Every entry.")
@click.option("--yes", is_flag=True, help="Do not ask.")
@click.pass_context
def purge(
    ctx: click.Context,
    /,
    seq: tuple[int, ...],
    limit: int | None,
    all_: bool,
    yes: bool,
    **where: Any,
) -> int:
    """Delete the entries (by SEQ, or every match of the filters)."""
    as_json = globals_of(ctx).json
    pick = _Pick(seq=seq, where=_checked(seq, Where(**where)), limit=limit, all=all_)
    return _run(ctx, lambda _c, dead, out: _dlq_purge(dead, pick, out, yes=yes, as_json=as_json))


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Pick:
    """What a requeue or purge acts on: sequences, or the filters' matches."""

    seq: tuple[int, ...]
    where: DeadLetterFilter
    limit: int | None
    all: bool


def _checked(seq: tuple[int, ...], where: Where) -> DeadLetterFilter:
    found = where.filter()
    if seq and not found.empty:
        raise ConfigError("give sequences or filters, not both", path="dlq arguments")
    return found


#: The longest reason a table shows (a hostile one may be megabytes); --json has it all.
_REASON_SHOWN = 2000


def _whole(value: str, limit: int = _REASON_SHOWN) -> str:
    """``value`` escaped, its whitespace runs made one space, cut only past ``limit``."""
    from ..text import printable

    flat = " ".join(printable(value).split())
    if len(flat) <= limit:
        return flat
    return f"{flat[:limit]}... ({len(flat) - limit} more characters: --json has them)"


async def _dlq_list(
    dead: DeadLetters, where: DeadLetterFilter, limit: int, out: Output, *, as_json: bool
) -> int:
    from ..broker import entry_json

    listing = await dead.find(where, limit=limit)
    if as_json:
        for entry in listing.entries:
            out.json(entry_json(entry))
        return EXIT_OK
    shown = len(listing.entries)
    summary = f"{listing.matched} of {listing.scanned} dead letters match"
    if shown < listing.matched:
        summary += f"; the newest {shown} shown (--limit)"
    if listing.unreadable:
        summary += f"; {listing.unreadable} unreadable, skipped"
    if not listing.entries:
        out.line(summary)
        return EXIT_OK
    titles = ("seq", "stored", "stage", "tenant", "request", "reason")
    rows = [
        (
            str(e.seq),
            _stored(e.time),
            _whole(e.stage, 16),
            _whole(e.tenant, 64),
            _whole(e.request_id, 256),
            out.clean(_whole(e.reason))
            + ("" if e.requeued is None else f"\nrequeued as {_whole(e.requeued.new_id, 256)}"),
        )
        for e in listing.entries
    ]
    _print_table(titles, rows, numeric=(True,), keep=(True, True, True))
    out.line(summary)
    return EXIT_OK


def _stored(at: float) -> str:
    """When an entry was stored, short (local time, to the second)."""
    import datetime

    if not at:
        return "-"
    return f"{datetime.datetime.fromtimestamp(at).astimezone():%m-%d %H:%M:%S}"


def _print_table(
    titles: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    numeric: Sequence[bool] = (),
    keep: Sequence[bool] = (),
    header: bool = True,
    indent: int = 0,
) -> None:
    """Rows as a table that fits the terminal: names and numbers whole, text wrapped."""
    from rich.table import Column

    shown = console()
    right = [n < len(numeric) and numeric[n] for n in range(len(titles))]
    widths = fitted(titles, rows, right, shown.width - indent, keep=keep)
    grid = table(
        *(
            Column(title, justify="right" if r else "left", overflow="fold", width=w)
            for title, r, w in zip(titles, right, widths, strict=True)
        )
    )
    grid.show_header = header
    for row in rows:
        grid.add_row(*(text(cell) for cell in row))
    emit(grid, indent=indent)


async def _dlq_show(dead: DeadLetters, seqs: Sequence[int], out: Output, *, as_json: bool) -> int:
    from ..broker import DeadLetterError, entry_fields, entry_json
    from ..text import printable

    failed = False
    for index, seq in enumerate(seqs):
        try:
            entry = await dead.get(seq)
        except DeadLetterError as exc:
            out.error(str(exc))
            failed = True
            continue
        entry = entry.with_mark(await dead.requeued_as(entry))
        history = await dead.history(entry)
        if as_json:
            out.json(entry_json(entry, history))
            continue
        if index:
            out.line("")
        stored = local_time(entry.time, date=True) if entry.time else "-"
        out.line(f"dead letter {entry.seq} on {printable(entry.subject)}, stored {stored}")
        fields = [(key, out.clean(_whole(value))) for key, value in entry_fields(entry)]
        _print_table(("", ""), fields, header=False, indent=2)
        out.line("  headers")
        headers = [
            (f"{printable(k)}:", out.clean(_whole(v))) for k, v in sorted(entry.headers.items())
        ]
        if headers:
            _print_table(("", ""), headers, header=False, indent=4)
        if not history:
            out.line("history: no events logged for this request")
            continue
        out.line(f"history ({len(history)} events):")
        for line in timeline(history, header=False, offsets=False, indent=2).splitlines():
            out.line(f"  {line.rstrip()}")
    return EXIT_SOME_FAILED if failed else EXIT_OK


async def _dlq_select(dead: DeadLetters, pick: _Pick, out: Output) -> tuple[list[Any], bool]:
    """The entries a requeue or purge acts on: by sequence, or every match of
    the filters (``--all``: every entry); whether some sequence named none."""
    from ..broker import DeadLetterError

    if pick.seq:
        entries, failed = [], False
        for seq in dict.fromkeys(pick.seq):
            try:
                entries.append(await dead.get(seq))
            except DeadLetterError as exc:
                out.error(str(exc))
                failed = True
        return entries, failed
    if pick.where.empty and not pick.all:
        raise ConfigError(
            "name the entries: sequences, a filter (--tenant, --reason, --stage, --since, "
            "--until, --id), or --all",
            path="dlq arguments",
        )
    return (await dead.find(pick.where, limit=pick.limit)).entries, False


async def _dlq_requeue(
    dead: DeadLetters,
    config: Config,
    pick: _Pick,
    deadline: tuple[bool, float | None],
    out: Output,
    *,
    as_json: bool,
) -> int:
    from ..broker import DeadLetterError
    from ..text import clock, printable

    entries, failed = await _dlq_select(dead, pick, out)
    keep_budget, budget = deadline
    # Checked as admission will check it, when there is a config to check against.
    check = config if config.routes else None
    for entry in entries:
        try:
            done = await dead.requeue(entry, budget=budget, keep_budget=keep_budget, config=check)
        except DeadLetterError as exc:
            failed = True
            if as_json:
                out.json({"seq": entry.seq, "ok": False, "error": str(exc)})
            out.error(f"dead letter {entry.seq}: {exc}")
            continue
        if as_json:
            out.json({"seq": entry.seq, "ok": True, **msgspec.to_builtins(done)})
            continue
        ends = "no deadline" if done.deadline is None else f"deadline {clock(done.deadline)}"
        verb = "already requeued" if done.already else "requeued"
        out.line(
            printable(
                f"dead letter {entry.seq}: {verb} as {done.new_id} (tenant {done.tenant}, {ends})"
            )
        )
    if not entries and not as_json:
        out.line("no dead letters match")
    return EXIT_SOME_FAILED if failed else EXIT_OK


async def _dlq_purge(
    dead: DeadLetters, pick: _Pick, out: Output, *, yes: bool, as_json: bool
) -> int:
    from ..broker import DeadLetterError

    entries, failed = await _dlq_select(dead, pick, out)
    if not entries:
        if not as_json:
            out.line("no dead letters match; nothing purged")
        return EXIT_SOME_FAILED if failed else EXIT_OK
    if not yes:
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
        if as_json:
            out.json({"seq": entry.seq, "purged": True})
    if not as_json:
        out.line(f"purged {purged} dead letter{'' if purged == 1 else 's'}")
    return EXIT_SOME_FAILED if failed else EXIT_OK
