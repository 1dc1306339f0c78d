"""What the commands share: exit codes, the NATS URL, closing, one-line errors,
redacted output, Rich consoles and the option types."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import math
import sys
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar

import click
import msgspec

from ..config import Config
from ..errors import ConfigError, ConnectionFailedError, RenQueueError

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Column, Table
    from rich.text import Text

    from ..broker import Connection

_T = TypeVar("_T")

#: Exit codes (docs/cli.md): done, usage or config, the request failed or was
#: rejected, NATS unreachable or ``--wait`` ran out.
EXIT_OK, EXIT_ERROR, EXIT_UNSUCCESSFUL, EXIT_WAIT_TIMEOUT = 0, 2, 3, 4
#: Also 4: NATS cannot be reached (or was lost) within the command's bound.
EXIT_UNREACHABLE = 4
#: Ctrl-C (SIGINT), as a shell reports a process it ended (128 + 2).
EXIT_INTERRUPTED = 130
#: stdout's reader went away (a closed pipe): as a process SIGPIPE ended (128 + 13).
EXIT_PIPE_CLOSED = 141
#: ``replay --verify``: the live projection differs from the log's.
EXIT_DIFFERENT = 1
#: ``dlq``: some of the entries asked for could not be shown, requeued or purged.
EXIT_SOME_FAILED = 1
#: The shortest ``status --interval`` (seconds): each redraw reads every consumer.
MIN_INTERVAL = 0.2


class WaitTimeout(RenQueueError):
    """``--wait`` ran out before the request ended (exit 4)."""


class Unreachable(ConnectionFailedError):
    """NATS could not be reached, or the connection was lost, within ``--wait`` (exit 4)."""


class Interrupted(RenQueueError):
    """Ctrl-C (SIGINT): the command stopped where it was (exit 130)."""


class NoSuchRequest(RenQueueError):
    """``cancel`` or ``audit`` of an id no ``submitted`` event names for the
    tenant (exit 3, as a request that did not succeed): nothing is recorded."""

    def __init__(self, message: str, *, request_id: str, tenant: str | None) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.tenant = tenant


class UnexpectedError(RenQueueError):
    """An error a reading command did not expect, as one line (exit 2)."""


async def guarded(command: str, run: Awaitable[_T]) -> _T:
    """``run`` with any error that is not a Ren-Queue one turned into one line.

    ``status``, ``replay``, ``dlq`` and ``ab`` read what others wrote (a damaged
    or forged checkpoint, a log cut short): whatever they meet, they end with
    exit 2 and a line on stderr, never a traceback.
    """
    try:
        return await run
    except (RenQueueError, BrokenPipeError):
        raise
    except Exception as exc:
        from ..text import printable

        raise UnexpectedError(f"{command}: unexpected error: {printable(one_line(exc))}") from exc


def with_nats(config: Config, url: str | None) -> Config:
    if url:
        return msgspec.structs.replace(config, nats=msgspec.structs.replace(config.nats, url=url))
    return config


def client_url(config: Config) -> str:
    from ..broker import resolve_nats_url

    url = resolve_nats_url(config)
    if url is None:
        raise ConfigError(
            "no NATS URL: give --nats or RENQUEUE_NATS_URL, or start `renqueue up` first",
            path="$.nats.url",
        )
    return url


async def reach(config: Config, name: str) -> Connection:
    """A client command's connection: at once a one-line error (exit 4) when
    nothing listens at the URL, rather than retrying it for the connect bound."""
    from ..broker import connect

    return await connect(client_url(config), name=name, config=config.nats, refused_is_final=True)


def one_line(exc: BaseException) -> str:
    """An error as one line: its message, or its type when it has none or is not ours."""
    text = " ".join(str(exc).split())
    if isinstance(exc, RenQueueError):
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def close(nc: Connection) -> None:
    """Drain ``nc``, or close it if it cannot drain (reconnecting, or too slow)."""
    try:
        await asyncio.wait_for(nc.drain(), 5.0)
    except Exception:  # noqa: BLE001 - whatever the connection's state, it ends closed
        if not nc.is_closed:
            with contextlib.suppress(Exception):
                await nc.close()


#: A table's width when the output is not a terminal (a file, a pipe, a test)
#: and ``$COLUMNS`` does not say.
TABLE_WIDTH = 120


def console(*, width: int | None = None) -> Console:
    """A Rich console on stdout: ``width``, else ``$COLUMNS``, else the terminal's
    width, else :data:`TABLE_WIDTH` when piped; no markup or colours guessed
    from the text (a name in brackets is a name)."""
    import os

    from rich.console import Console

    if width is None and not os.environ.get("COLUMNS", "").isdigit() and not sys.stdout.isatty():
        width = TABLE_WIDTH

    class PipeAware(Console):
        def on_broken_pipe(self) -> None:
            # Rich would exit 1 here; ``main`` ends a closed pipe as it does for print.
            raise BrokenPipeError

    return PipeAware(
        file=sys.stdout, width=width, highlight=False, soft_wrap=False, markup=False, emoji=False
    )


def emit(*renderables: Any, indent: int = 0) -> None:
    """Print Rich renderables on stdout (:func:`console`), each line without
    the spaces Rich pads it with, ``indent`` spaces in."""
    out = console()
    with out.capture() as captured:
        for renderable in renderables:
            out.print(indented(renderable, indent) if indent else renderable)
    for line in captured.get().splitlines():
        print(line.rstrip())


def table(*columns: Column | str, title: str | None = None) -> Table:
    """A table for a person: no box, a header, a space between columns."""
    from rich.table import Table

    return Table(
        *columns,
        box=None,
        pad_edge=False,
        show_edge=False,
        title=title,
        title_justify="left",
        title_style="",
        header_style="",
        padding=(0, 1, 0, 0),
    )


def fitted(
    titles: Sequence[str],
    rows: Sequence[Sequence[str]],
    numeric: Sequence[bool],
    width: int,
    *,
    keep: Sequence[bool] = (),
) -> list[int]:
    """Column widths for a table ``width`` wide (one space between columns):
    numbers, the first column and those ``keep`` says whole (a name longer
    than 32 folds); the other text columns wrap, the last taking what is left."""
    count = len(titles)
    natural = [
        max([len(titles[n]), *(len(line) for row in rows for line in row[n].split("\n"))])
        for n in range(count)
    ]
    whole = [
        n == 0 or (n < len(numeric) and numeric[n]) or (n < len(keep) and keep[n])
        for n in range(count)
    ]
    widths = [min(natural[n], 32) if whole[n] else natural[n] for n in range(count)]
    left = width - (count - 1) - sum(w for w, fixed in zip(widths, whole, strict=True) if fixed)
    # The last column (the reason, the details) is the one to read: it gets
    # what it holds, or at least 24, and the other text columns what is left
    # (each at least 8, a short one what it needs, the long ones the rest).
    last = count - 1
    others = sorted((n for n in range(last) if not whole[n]), key=natural.__getitem__)
    if not whole[last]:
        left -= min(natural[last], 24)
    for index, n in enumerate(others):
        widths[n] = max(8, min(natural[n], left // (len(others) - index)))
        left -= widths[n]
    if not whole[last]:
        widths[last] = max(8, min(natural[last], left + min(natural[last], 24)))
    return widths


def indented(renderable: Any, by: int = 2) -> Any:
    from rich.padding import Padding

    return Padding(renderable, (0, 0, 0, by))


def text(value: str) -> Text:
    """A cell as it is (no markup read in it)."""
    from rich.text import Text

    return Text(value)


def local_time(at: float, *, date: bool = False) -> str:
    """``at`` (Unix seconds) in the local time zone, to the millisecond; with
    ``date``, the day first and the zone's name after."""
    when = datetime.datetime.fromtimestamp(at).astimezone()
    clock = when.strftime("%H:%M:%S.") + f"{when.microsecond // 1000:03d}"
    return f"{when:%Y-%m-%d} {clock} {when:%Z}" if date else clock


def rounded(value: Any, *, limit: int = 80) -> str:
    """A value for a person: floats rounded, sequences and mappings spelled
    out without Python's quotes and brackets, text past ``limit`` shortened."""
    from ..text import printable, shorten

    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".") if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return "; ".join(
            f"{k}: {rounded(v, limit=limit)}" for k, v in value.items() if v not in (None, "", [])
        )
    if isinstance(value, list | tuple):
        return ", ".join(rounded(v, limit=limit) for v in value) or "-"
    return shorten(printable(" ".join(str(value).split())), limit)


class Output:
    """Lines to stdout and stderr with every configured API key redacted (a
    reason that echoes one, however it got there, never prints it)."""

    def __init__(self, config: Config) -> None:
        self._secrets: list[str] = []
        for backend in config.backends.values():
            with contextlib.suppress(ConfigError):
                key = backend.api_key()
                if key is not None and len(key.reveal()) >= 8:
                    self._secrets.append(key.reveal())

    def clean(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "[redacted]")
        return text

    def line(self, text: str) -> None:
        print(self.clean(text))

    def json(self, value: object) -> None:
        print(self.clean(json.dumps(value)))

    def error(self, text: str) -> None:
        print(self.clean(f"renqueue: {text}"), file=sys.stderr)


# ------------------------------------------------------------------ option types


class PointInTime(click.ParamType[float]):
    """``--since``/``--until``: a duration back from now (``90s``, ``1h``, ``2d``)
    or an ISO 8601 time (UTC unless it names its offset)."""

    name = "WHEN"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, float):
            return value
        from ..config import parse_duration

        try:
            return datetime.datetime.now(tz=datetime.UTC).timestamp() - parse_duration(value)
        except ValueError:
            pass
        try:
            when = datetime.datetime.fromisoformat(value)
        except ValueError:
            self.fail(
                f"must be a duration back from now (30m, 1h, 2d) or an ISO time, got {value!r}",
                param,
                ctx,
            )
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.UTC)
        return when.timestamp()


class NewDeadline(click.ParamType[tuple[bool, float | None]]):
    """``--deadline``: ``(keep the original's budget, else this many seconds or None)``."""

    name = "keep|none|DURATION"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, tuple):
            return value
        from ..config import parse_duration

        if value == "keep":
            return True, None
        if value == "none":
            return False, None
        try:
            return False, parse_duration(value)
        except ValueError:
            self.fail(f"must be keep, none or a duration (60s, 10m), got {value!r}", param, ctx)


class _Named(click.ParamType[str]):
    """A tenant name or request id as the schema allows one (letters, digits,
    ``-`` and ``_``): refused before connecting otherwise, so that ``*`` or
    ``>`` cannot name every tenant's or request's subjects, and no escape
    sequence is echoed back. The pattern is the schema's own."""

    def __init__(self, name: str, what: str, longest: int, kind: Any) -> None:
        self.name = name
        self._what = what
        self._longest = longest
        self._kind = kind

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            return msgspec.convert(value, self._kind)
        except msgspec.ValidationError:
            self.fail(
                f"{self._what} is 1 to {self._longest} letters, digits, - and _, got {value!r}",
                param,
                ctx,
            )


def TenantName() -> click.ParamType[str]:
    """A tenant name (``[A-Za-z0-9_-]{1,64}``)."""
    from ..schema import Name

    return _Named("TENANT", "a tenant name", 64, Name)


def RequestIdName() -> click.ParamType[str]:
    """A request id (``[A-Za-z0-9_-]{1,128}``)."""
    from ..schema import RequestId

    return _Named("REQUEST_ID", "a request id", 128, RequestId)


POSITIVE = click.IntRange(min=1)


class Finite(click.FloatRange):
    """A :class:`click.FloatRange` that refuses ``nan`` and ``inf`` too (a
    range lets ``nan`` through: every comparison with it is false)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"must be a finite number, got {value!r}", param, ctx)
        return number


#: Seconds: more than 0, finite (``--wait``).
SECONDS = Finite(min=0, min_open=True)


class Interval(click.ParamType[float]):
    """``status --interval``: seconds, at least :data:`MIN_INTERVAL`, finite."""

    name = "SECONDS"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        try:
            seconds = float(value)
        except ValueError:
            seconds = math.nan
        if not MIN_INTERVAL <= seconds < math.inf:
            self.fail(
                f"must be a number of seconds, at least {MIN_INTERVAL:g}, got {value!r}",
                param,
                ctx,
            )
        return seconds


INTERVAL = Interval()


#: The most a command waits for its connection to close: a server that hangs
#: (stopped, not gone) would hold a flush for ever, and ``--wait`` bounds all.
CLOSE_WITHIN: Final = 1.0


async def close_client(client: Any) -> None:
    """Close a :class:`~renqueue.Client` within :data:`CLOSE_WITHIN` seconds,
    then its connection within half that: a lost or hung server cannot hold
    the command (what it sent is acked already; the process ends next)."""
    try:
        await asyncio.wait_for(client.close(), CLOSE_WITHIN)
    except Exception:  # noqa: BLE001 - whatever the connection's state, it ends closed
        if not client.nc.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.nc.close(), CLOSE_WITHIN / 2)
