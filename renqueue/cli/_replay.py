"""``replay``: the projection rebuilt from the event log, checked against the
live one (``--verify``), or simulated under another config (``--what-if``)."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import os
from typing import TYPE_CHECKING, Any

import click
import msgspec

from ..config import Config
from ..errors import RenQueueError
from ..text import shorten
from ._app import cli, command, globals_of, setup
from ._common import EXIT_DIFFERENT, EXIT_OK, PointInTime, close, guarded, reach

if TYPE_CHECKING:
    from ..coordination import Replayed, Verification


@command(
    cli,
    "replay",
    short_help="The projection rebuilt from the event log (--verify, --what-if FILE).",
    epilog="Examples: renqueue replay --verify; renqueue replay --what-if cheaper.toml --since 2h",
)
@click.option(
    "--verify",
    is_flag=True,
    help="Compare with the live projection and its views, field by field "
    "(exit 0 equal, 1 different, 2 cannot read).",
)
@click.option(
    "--what-if",
    metavar="FILE",
    help="Simulate the requests submitted in the window under this config and FILE's, "
    "beside what really happened: cost, deadlines met per level, share per backend.",
)
@click.option(
    "--since",
    type=PointInTime(),
    help="With --what-if: requests submitted at or after: a duration back from now "
    "or an ISO time (default: 1h).",
)
@click.option(
    "--until", type=PointInTime(), help="With --what-if: submitted before (default: now)."
)
@click.option("--seed", type=int, help="With --what-if: seed of the simulated draws (default: 0).")
@click.pass_context
def replay(
    ctx: click.Context,
    *,
    verify: bool,
    what_if: str | None,
    since: float | None,
    until: float | None,
    seed: int | None,
) -> int:
    """Rebuild the projection from the event log and print its summary; --verify
    compares it with the live one; --what-if FILE replays the recorded requests
    through the policy under this config and FILE's (docs/what-if.md)."""
    config = setup(ctx)
    as_json = globals_of(ctx).json
    if what_if is not None:
        if verify:
            raise RenQueueError("--what-if and --verify do not go together")
        window = _Window(since=since, until=until, seed=seed)
        return asyncio.run(guarded("replay", _what_if(config, what_if, window, as_json=as_json)))
    if since is not None or until is not None or seed is not None:
        raise RenQueueError("--since, --until and --seed go with --what-if")
    return asyncio.run(guarded("replay", _replay(config, verify=verify, as_json=as_json)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Window:
    """``--what-if``'s window (default: the last hour) and the seed of its draws."""

    since: float | None
    until: float | None
    seed: int | None


async def _replay(config: Config, *, verify: bool, as_json: bool) -> int:
    from ..coordination import replay_log
    from ..coordination import verify as verify_log
    from ..state import encode_state

    nc = await reach(config, "renqueue-replay")
    try:
        js = nc.jetstream()
        if not verify:
            replayed = await replay_log(js)
            if as_json:
                print(encode_state(replayed.state).decode())
            else:
                print("\n".join(_replay_summary(replayed)))
            return EXIT_OK
        found = await verify_log(js)
    finally:
        await close(nc)
    if as_json:
        print(json.dumps({"equal": found.equal, **msgspec.to_builtins(found)}))
    else:
        print("\n".join(_verification_lines(found)))
    return EXIT_OK if found.equal else EXIT_DIFFERENT


async def _what_if(config: Config, what_if: str, window: _Window, *, as_json: bool) -> int:
    """``replay --what-if FILE``: the requests submitted in the window, as they
    really went, and simulated under this config and FILE's (docs/what-if.md)."""
    from ..coordination import read_trace
    from ..sim import compare, load_what_if, render
    from ..text import printable

    other = load_what_if(what_if)
    now = datetime.datetime.now(tz=datetime.UTC).timestamp()
    since = now - 3600.0 if window.since is None else window.since
    until = now if window.until is None else window.until
    if until <= since:
        raise RenQueueError("--until must be after --since")
    nc = await reach(config, "renqueue-replay")
    try:
        trace = await read_trace(nc.jetstream(), since=since, until=until)
    finally:
        await close(nc)
    if not trace.arrivals:
        raise RenQueueError(
            f"no request was submitted between {_iso(since)} .. {_iso(until)}"
            f" ({trace.events} events read): nothing to replay; widen --since/--until"
        )
    seed = 0 if window.seed is None else window.seed
    title = printable(os.path.basename(what_if))[:40] or "what-if"
    comparison = compare(
        trace,
        [("this config (sim)", config), (f"{title} (sim)", other.config)],
        seed=seed,
        models=other.models,
    )
    if as_json:
        print(msgspec.json.encode(_what_if_json(trace, comparison, seed)).decode())
    else:
        print("\n".join(render(trace, comparison.columns, seed=seed)))
    return EXIT_OK


def _what_if_json(trace: Any, comparison: Any, seed: int) -> dict[str, Any]:
    return {
        "since": trace.since,
        "until": trace.until,
        "seed": seed,
        "events": trace.events,
        "dropped": trace.dropped,
        "columns": [
            {
                "title": column.title,
                "requests": column.summary.requests,
                "cost": column.summary.cost,
                "ended": column.summary.ended,
                "levels": {
                    name: {**msgspec.to_builtins(level), "attainment": level.attainment}
                    for name, level in column.summary.levels.items()
                },
                "share": {name: column.summary.share_of(name) for name in column.summary.share},
                "notes": list(column.notes),
            }
            for column in comparison.columns
        ],
    }


def _iso(at: float) -> str:
    when = datetime.datetime.fromtimestamp(at, tz=datetime.UTC)
    return when.isoformat(timespec="seconds").replace("+00:00", "Z")


def _verification_lines(found: Verification) -> list[str]:
    from ..text import printable

    at = f"{found.events} events, last_seq {found.last_seq}"
    if found.views_compared:
        views = f"views: {found.views} backend views compared"
    elif found.progress_seq is None:
        views = "views not compared: no progress mark (view.progress) stored"
    elif found.progress_seq < found.last_seq:
        views = (
            f"views not compared: progress {found.progress_seq} behind checkpoint {found.last_seq}"
        )
    elif found.progress_seq == found.last_seq:
        views = "views not compared: the projector kept writing while they were read"
    else:
        views = f"views not compared: progress {found.progress_seq}, checkpoint {found.last_seq}"
    if found.equal:
        return [f"equal ({at})", views]
    lines = [
        f"different: {len(found.differences)} field(s) differ from the log replayed ({at})",
        views,
        "",
    ]
    paths = [printable(d.path) for d in found.differences]
    width = min(60, max(len(path) for path in paths))
    lines.append(f"  {'field':<{width}}  {'live':>12}  rebuilt from the log")
    lines.extend(
        f"  {path:<{width}}  {_value(d.live):>12}  {_value(d.rebuilt)}"
        for path, d in zip(paths, found.differences, strict=True)
    )
    return lines


def _value(value: Any) -> str:
    if value is msgspec.UNSET:
        return "(absent)"
    return shorten(json.dumps(value), 80)


def _replay_summary(replayed: Replayed) -> list[str]:
    from ..text import clock, printable

    state = replayed.state
    ended = (
        " ".join(f"{printable(kind)}={n}" for kind, n in sorted(state.terminal.items())) or "none"
    )
    when = clock(state.log_time) if state.log_time else "-"
    lines = [
        f"Replayed {state.events} events (last_seq {state.last_seq}, log time {when});"
        f" skipped {state.skipped} undecodable, {state.mismatched} disagreeing with their subject",
        f"  submitted {state.submitted}; ended {ended}; in flight {state.in_flight_count};"
        f" spend ${state.spend:.6f}",
    ]
    gone = []
    if replayed.first_seq > 1:
        gone.append(
            f"it starts at sequence {replayed.first_seq} (those before expired, or were purged)"
        )
    if replayed.deleted:
        gone.append(f"{replayed.deleted} after its start were purged")
    if gone:
        lines.append(f"  not in this replay: {'; '.join(gone)}")
    lines += [
        "",
        f"  {'backend':<16} {'started':>8} {'done':>7} {'failed':>6} {'429s':>5}"
        f" {'tokens in':>10} {'tokens out':>10} {'spend $':>10} {'in flight':>9}",
    ]
    for name, b in sorted(state.backends.items()):
        lines.append(
            f"  {printable(name):<16} {b.calls_started:>8} {b.calls_completed:>7}"
            f" {b.calls_failed:>6} {b.rate_limited:>5} {b.tokens_in:>10} {b.tokens_out:>10}"
            f" {b.spend:>10.6f} {b.in_flight:>9}"
        )
    lines += ["", f"  {'tenant':<16} {'submitted':>9} {'spend $':>10}  ended"]
    for name, t in sorted(state.tenants.items()):
        ended = " ".join(f"{printable(k)}={n}" for k, n in sorted(t.terminal.items())) or "-"
        lines.append(f"  {printable(name):<16} {t.submitted:>9} {t.spend:>10.6f}  {ended}")
    return lines
